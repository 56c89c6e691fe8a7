// _jax_ep_emu: the CUDA backend's handlers and kernels compiled for the emulated GPU
// (kernels/emu). Python drives R virtual GPUs through it (jax_ep/_src/emu.py): set up a
// group, enqueue one handler call per rank, synchronize, read the outputs back.
#include <nanobind/nanobind.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/common/settings.h"
#include "kernels/emu/emu_control.h"
#include "kernels/emu/nvshmem_emu.h"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/peer_transport.cuh"
#include "kernels/internode/device_copy.cuh"
#include "xla_ffi/common/layout_bindings.h"
#include "xla_ffi/cuda/cuda_handlers.h"
#include "xla_ffi/emu/emu_call.h"

namespace nb = nanobind;

namespace jax_ep {
namespace emu_driver {

std::vector<uint64_t> SetupGroup(int num_ranks, int group, std::vector<uint64_t> area_bytes,
                                 std::vector<int64_t> ll_shape);
void BindCudaHostFunctions(void* module);

std::vector<Invoker>& Invokers() {
  static std::vector<Invoker> v;
  return v;
}
RegisterInvoker::RegisterInvoker(Invoker f) { Invokers().push_back(std::move(f)); }

int64_t CallArgs::attr(const std::string& k) const {
  auto it = attrs.find(k);
  if (it == attrs.end()) throw std::invalid_argument("jax_ep emu: op " + op + " needs attribute " + k);
  return it->second;
}
xla::ffi::Span<const int64_t> CallArgs::array_attr(const std::string& k) const {
  auto it = array_attrs.find(k);
  if (it == array_attrs.end()) return {};
  return xla::ffi::Span<const int64_t>(it->second.data(), it->second.size());
}

namespace {

struct DType {
  const char* name;
  XLA_FFI_DataType id;
  size_t bytes;
};
constexpr DType kDTypes[] = {
    {"f32", XLA_FFI_DataType_F32, 4},   {"bf16", XLA_FFI_DataType_BF16, 2},
    {"f16", XLA_FFI_DataType_F16, 2},   {"s32", XLA_FFI_DataType_S32, 4},
    {"pred", XLA_FFI_DataType_PRED, 1}, {"u8", XLA_FFI_DataType_U8, 1},
    {"s8", XLA_FFI_DataType_S8, 1},     {"f8e4m3fn", XLA_FFI_DataType_F8E4M3FN, 1},
    {"f8e5m2", XLA_FFI_DataType_F8E5M2, 1},
};
const DType& FindDType(const std::string& n) {
  for (const DType& d : kDTypes)
    if (n == d.name) return d;
  throw std::invalid_argument("jax_ep emu: unknown dtype " + n);
}

// One buffer on a virtual GPU (a separate allocation).
struct DevBuf {
  std::vector<int64_t> dims;
  XLA_FFI_Buffer b{};
  size_t bytes = 0;
  int dev = 0;
  DevBuf(int d, const DType& t, std::vector<int64_t> shape, const std::string* init) : dims(std::move(shape)), dev(d) {
    size_t n = 1;
    for (int64_t x : dims) {
      if (x < 0) throw std::invalid_argument("jax_ep emu: negative dimension");
      n *= static_cast<size_t>(x);
    }
    bytes = n * t.bytes;
    if (init != nullptr && init->size() != bytes)
      throw std::invalid_argument("jax_ep emu: an input has " + std::to_string(init->size()) +
                                  " bytes, its shape needs " + std::to_string(bytes));
    void* p = nullptr;
    cudaSetDevice(d);
    cudaMalloc(&p, bytes);
    // Outputs start as garbage, as XLA's do: a kernel that leaves one unwritten shows.
    // Filled directly, not by cudaMemcpy / cudaMemset (which drain the device first): the
    // allocation is new, so no queued work can see it, and calls enqueued one after
    // another on a GPU stay queued until synchronize runs them all in one scheduler run.
    if (p != nullptr && init != nullptr) std::memcpy(p, init->data(), bytes);
    else if (p != nullptr) std::memset(p, 0xA5, bytes);
    b.struct_size = XLA_FFI_Buffer_STRUCT_SIZE;
    b.dtype = t.id;
    b.data = p;
    b.rank = static_cast<int64_t>(dims.size());
    b.dims = dims.data();
  }
  ~DevBuf() { cudaFree(b.data); }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
};

struct Call {
  CallArgs args;
  std::vector<std::unique_ptr<DevBuf>> in, out;
  std::string error;
};
std::map<int64_t, std::unique_ptr<Call>>& Calls() {
  static std::map<int64_t, std::unique_ptr<Call>> c;
  return c;
}
int64_t g_next_call = 1;
double g_timeout_s = 0.05;
std::vector<cudaStream_t> g_streams;

void Configure(int num_devices, uint64_t seed, int resident_blocks, double timeout_s,
               bool weak_stores, double quantum_ns, double drain_prob, double stay_prob,
               double preempt_prob, double preempt_ns, double idle_after_ns, int connections) {
  if (num_devices < 1 || num_devices > 64) throw std::invalid_argument("jax_ep emu: num_devices must be in [1, 64]");
  if (resident_blocks < 0)
    throw std::invalid_argument("jax_ep emu: resident_blocks must be >= 1, or 0 (from each kernel's ptxas usage)");
  if (!(timeout_s > 0)) throw std::invalid_argument("jax_ep emu: timeout_s must be > 0");
  if (!(preempt_prob >= 0 && preempt_prob < 1) || !(preempt_ns >= 0))
    throw std::invalid_argument("jax_ep emu: preempt_prob must be in [0, 1) and preempt_ns >= 0");
  if (!(idle_after_ns >= 0))
    throw std::invalid_argument("jax_ep emu: idle_after_ns must be >= 0 (0: no idle fast-forward)");
  // 0: as the driver, CUDA_DEVICE_MAX_CONNECTIONS (jax_ep.config's hardware_queues,
  // read once from the environment; the driver's default 8).
  if (connections == 0) connections = settings().hardware_queues;
  if (connections < 1 || connections > 32)
    throw std::invalid_argument("jax_ep emu: connections (CUDA_DEVICE_MAX_CONNECTIONS) must be in [1, 32], got " +
                                std::to_string(connections));
  Calls().clear();
  // The last configuration's streams go: the scheduler visits every stream at every step,
  // so streams kept from earlier emulators would slow every later run. The harness's rank
  // streams too, and before the reset, which numbers the streams left in creation order:
  // so every emulator's streams take the same hardware queues (each GPU's default stream,
  // its call stream, then the harness's rank streams).
  int made = 0;
  cudaGetDeviceCount(&made);
  for (int d = 0; d < made; ++d) ReleaseHarnessStreams(d);
  for (cudaStream_t s : g_streams) cudaStreamDestroy(s);
  emu::Config c;
  c.connections = connections;
  c.num_devices = num_devices;
  c.seed = seed;
  c.resident_blocks = resident_blocks;
  c.weak_stores = weak_stores;
  c.quantum_ns = quantum_ns;
  c.drain_prob = drain_prob;
  c.stay_prob = stay_prob;
  c.preempt_prob = preempt_prob;
  c.preempt_ns = preempt_ns;
  c.max_virtual_ns = std::max(60e9, timeout_s * 1e9 * 50);
  // A waiter sees a change at most 1/50 of the kernels' timeout late in an idle stretch.
  c.idle_after_ns = idle_after_ns;
  c.idle_sleep_max_ns = timeout_s * 1e9 / 50;
  emu::configure(c);
  g_timeout_s = timeout_s;
  g_streams.clear();
  for (int d = 0; d < num_devices; ++d) {
    cudaSetDevice(d);
    cudaStream_t s;
    cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    g_streams.push_back(s);
  }
  cudaSetDevice(0);
}

using InSpec = std::tuple<nb::bytes, std::vector<int64_t>, std::string>;
using OutSpec = std::pair<std::vector<int64_t>, std::string>;

int64_t Enqueue(const std::string& op, int ordinal, std::vector<InSpec> inputs,
                std::vector<OutSpec> outputs, std::map<std::string, int64_t> attrs,
                std::map<std::string, std::vector<int64_t>> array_attrs) {
  if (ordinal < 0 || ordinal >= static_cast<int>(g_streams.size()))
    throw std::invalid_argument("jax_ep emu: ordinal outside the configured virtual GPUs");
  auto c = std::make_unique<Call>();
  for (auto& [data, shape, dt] : inputs) {
    const std::string s(data.c_str(), data.size());
    c->in.push_back(std::make_unique<DevBuf>(ordinal, FindDType(dt), shape, &s));
  }
  for (auto& [shape, dt] : outputs)
    c->out.push_back(std::make_unique<DevBuf>(ordinal, FindDType(dt), shape, nullptr));
  CallArgs& a = c->args;
  a.op = op;
  a.ordinal = ordinal;
  a.stream = g_streams[ordinal];
  for (auto& b : c->in) a.in.push_back(&b->b);
  for (auto& b : c->out) a.out.push_back(&b->b);
  a.attrs = std::move(attrs);
  a.array_attrs = std::move(array_attrs);
  // The handlers read the timeout setting when they launch: the emulator's timeout (in
  // virtual seconds) holds for this launch only, and the module's own setting (from
  // jax_ep.config) comes back after.
  const double saved_timeout = settings().timeout_s;
  mutable_settings().timeout_s = g_timeout_s;
  cudaSetDevice(ordinal);
  bool known = false;
  for (const Invoker& f : Invokers()) {
    c->error = f(a, &known);
    if (known) break;
  }
  cudaSetDevice(0);
  mutable_settings().timeout_s = saved_timeout;
  if (!known) throw std::invalid_argument("jax_ep emu: unknown op " + op);
  const int64_t id = g_next_call++;
  Calls()[id] = std::move(c);
  return id;
}

// Runs every virtual GPU until all streams are empty; returns the emulator's own faults.
std::vector<std::string> Synchronize() {
  for (size_t d = 0; d < g_streams.size(); ++d) {
    cudaSetDevice(static_cast<int>(d));
    cudaDeviceSynchronize();
  }
  cudaSetDevice(0);
  cudaGetLastError();
  return emu::take_faults();
}

std::pair<std::string, std::vector<nb::bytes>> Result(int64_t id) {
  auto it = Calls().find(id);
  if (it == Calls().end()) throw std::invalid_argument("jax_ep emu: no such call");
  std::unique_ptr<Call> c = std::move(it->second);
  Calls().erase(it);
  std::vector<nb::bytes> outs;
  for (auto& b : c->out) {
    std::string s(b->bytes, '\0');
    cudaSetDevice(b->dev);
    cudaMemcpy(s.data(), b->b.data, b->bytes, cudaMemcpyDeviceToHost);
    outs.emplace_back(s.data(), s.size());
  }
  cudaSetDevice(0);
  return {c->error, outs};
}

// ---- counter probe: a known access pattern for the counters' own tests ----
// Virtual GPU 0 copies n bytes from its memory into virtual GPU 1's (mode 0: the 16-byte
// load/store helpers of peer_transport.cuh; mode 1: devcopy::CopyBytes, whose width follows
// the alignment), then every thread fences at system scope and thread 0 releases a flag
// that one thread of GPU 1 acquires.
__global__ void ProbeCopyKernel(char* dst, const char* src, int64_t n, uint64_t* flag, int mode) {
  const int t = static_cast<int>(threadIdx.x), stride = static_cast<int>(blockDim.x);
  if (mode == 0) {  // block b: the b-th of gridDim.x contiguous shares of the 16-byte vectors
    const int64_t nv = n / 16, b = blockIdx.x, nb = gridDim.x;
    for (int64_t i = nv * b / nb + t; i < nv * (b + 1) / nb; i += stride)
      jax_ep::peer::store16(dst + 16 * i, jax_ep::peer::load_nc16(src + 16 * i));
  } else {
    jax_ep::devcopy::CopyBytes(dst, src, n, t, stride);
  }
  __threadfence_system();
  if (t == 0 && blockIdx.x == 0) jax_ep::peer::signal(flag, 1);
}
__global__ void ProbeWaitKernel(const uint64_t* flag) {
  if (threadIdx.x == 0)
    while (jax_ep::peer::load_acquire(flag) < 1) {
    }
}

void CounterProbe(int mode, int64_t n, int threads, int src_offset, int dst_offset, int blocks) {
  if (mode < 0 || mode > 1) throw std::invalid_argument("counter_probe: mode must be 0 or 1");
  if (blocks < 1 || blocks > 64 || (mode == 1 && blocks != 1))
    throw std::invalid_argument("counter_probe: blocks in [1, 64], and 1 in mode 1");
  if (n < 0 || threads < 1 || threads > 1024 || src_offset < 0 || src_offset > 15 ||
      dst_offset < 0 || dst_offset > 15)
    throw std::invalid_argument("counter_probe: n >= 0, threads in [1, 1024], offsets in [0, 15]");
  void *src = nullptr, *dst = nullptr;
  cudaSetDevice(0);
  cudaMalloc(&src, static_cast<size_t>(n) + 16);
  cudaMemset(src, 7, static_cast<size_t>(n) + 16);
  cudaSetDevice(1);
  const size_t dbytes = static_cast<size_t>(n) + 16 + 64;
  cudaMalloc(&dst, dbytes);
  cudaMemset(dst, 0, dbytes);
  emu::mark_peer_memory(dst, dbytes);
  auto* flag = reinterpret_cast<uint64_t*>(static_cast<char*>(dst) + ((n + 16 + 7) / 8) * 8);
  cudaSetDevice(0);
  JEP_LAUNCH(ProbeCopyKernel, blocks, threads, 0, nullptr)
  (static_cast<char*>(dst) + dst_offset, static_cast<const char*>(src) + src_offset, n, flag, mode);
  cudaSetDevice(1);
  JEP_LAUNCH(ProbeWaitKernel, 1, 32, 0, nullptr)(flag);
  Synchronize();
  cudaSetDevice(1);
  cudaFree(dst);
  cudaSetDevice(0);
  cudaFree(src);
}

// Test-only (tests/emu/test_sanitizer_emu.py): one thread of virtual GPU 0 stores a byte at
// offset `at` of an n-byte buffer of virtual GPU 1 through a peer pointer; at >= n is a
// planted out-of-bounds peer write, which AddressSanitizer must report (cudaMalloc gives
// each buffer its own allocation of exactly n bytes).
__global__ void PeerStoreKernel(char* peer, int64_t at) { peer[at] = 1; }

void PeerStoreProbe(int64_t n, int64_t at) {
  if (n < 1 || at < 0 || at > n + 64)
    throw std::invalid_argument("peer_store_probe: n >= 1 and 0 <= at <= n + 64");
  void* buf = nullptr;
  cudaSetDevice(1);
  cudaMalloc(&buf, static_cast<size_t>(n));
  cudaSetDevice(0);
  JEP_LAUNCH(PeerStoreKernel, 1, 1, 0, nullptr)(static_cast<char*>(buf), at);
  Synchronize();
  cudaFree(buf);
}

}  // namespace
}  // namespace emu_driver
}  // namespace jax_ep

NB_MODULE(_jax_ep_emu, m) {
  using namespace jax_ep::emu_driver;
  m.doc() = "The CUDA kernels and handlers of jax_ep, compiled for the emulated GPU.";
  jax_ep::AddSettingsBindings(m);  // this module's own copy of the settings
  m.def("configure", &Configure, nb::arg("num_devices") = 8, nb::arg("seed") = 1,
        nb::arg("resident_blocks") = 0, nb::arg("timeout_s") = 0.05,
        nb::arg("weak_stores") = true, nb::arg("quantum_ns") = 100.0,
        nb::arg("drain_prob") = 0.002, nb::arg("stay_prob") = 0.9,
        nb::arg("preempt_prob") = 0.0, nb::arg("preempt_ns") = 0.0,
        nb::arg("idle_after_ns") = 250e3, nb::arg("connections") = 0,
        "Resets the virtual GPUs: count, scheduler seed, co-residency limit, the kernels' "
        "timeout in virtual seconds, weak visibility of peer stores, preemption of blocks "
        "(each step parks the block that ran with chance preempt_prob, for preempt_ns), "
        "idle fast-forward (sleeps lengthen after idle_after_ns of virtual time in which "
        "threads only polled; 0: off), hardware queues per GPU (connections, 1 to 32; 0: "
        "CUDA_DEVICE_MAX_CONNECTIONS, else 8, as the driver).");
  m.def("num_connections", [] { return emu::config().connections; },
        "The hardware queues of each virtual GPU (configure's connections).");
  m.def("shared_by_pointer", [] { return emu::shared_by_pointer(); },
        "True where a change of block points this thread's TLS entry at the block's "
        "__shared__ image; false where it copies the image (JAX_EP_EMU_TLS_COPY set, or "
        "AddressSanitizer).");
  m.def("num_streams", [] { return emu::num_streams(); },
        "The streams of every virtual GPU (each GPU's default one included).");
  m.def("resident_limit",
        [](const std::string& kernel, int threads, size_t dynamic_smem) {
          return emu::resident_limit(kernel.c_str(), threads, dynamic_smem);
        },
        nb::arg("kernel"), nb::arg("threads"), nb::arg("dynamic_smem") = 0,
        "Blocks of the kernel one virtual GPU holds at once at this launch configuration "
        "(0: it cannot launch), under the current configuration.");
  m.def("occupancy_registers", [](const std::string& k) { return emu::occupancy_registers(k.c_str()); },
        nb::arg("kernel"), "The kernel's registers per thread in the occupancy table (-1: absent).");
  m.def("occupancy_fallbacks", [] { return emu::occupancy_fallbacks(); },
        "Kernels launched so far that the occupancy table lacks (they took the fallback limit).");
  m.def("setup_group", &SetupGroup, nb::arg("num_ranks"), nb::arg("group"),
        nb::arg("area_bytes"), nb::arg("ll_shape") = std::vector<int64_t>{},
        "Allocates a communication buffer on each of the first num_ranks virtual GPUs and "
        "registers them as one EP group (jax_ep.cuda.setup's work).");
  m.def("enqueue", &Enqueue, nb::arg("op"), nb::arg("ordinal"), nb::arg("inputs"),
        nb::arg("outputs"), nb::arg("attrs"),
        nb::arg("array_attrs") = std::map<std::string, std::vector<int64_t>>{},
        "Runs one handler on a virtual GPU's stream: inputs are (bytes, shape, dtype), "
        "outputs (shape, dtype). Returns a call id for result().");
  m.def("nvshmem_set_fabric", &nvshmem_emu::set_fabric, nb::arg("text"),
        "The emulated NVSHMEM world's node and PEs' environments (nvshmem_emu.h); '' or "
        "the error.");
  m.def("nvshmem_port_names", &nvshmem_emu::port_names,
        "The name of each wire port id in the emulated NVSHMEM's put log.");
  m.def("synchronize", &Synchronize, "Runs the virtual GPUs until idle; returns emulator faults.");
  m.def("result", &Result, nb::arg("call"), "(handler error or '', output bytes) of a call.");
  m.def(
      "counters",
      [](int device) { return device < 0 ? emu::counters() : emu::device_counters(device); },
      nb::arg("device") = -1,
      "What the kernels did since the last reset (counted by the emulated GPU, not "
      "measured): summed over the virtual GPUs, or those of one (device >= 0).");
  m.def("num_counted_devices", [] { return emu::num_counted_devices(); },
        "Virtual GPUs that have counters (device indices for counters(device)).");
  m.def("reset_counters", [] { emu::reset_counters(); });
  m.def("peer_store_probe", &PeerStoreProbe, nb::arg("n"), nb::arg("at"),
        "Test-only: virtual GPU 0 stores one byte at offset `at` of an n-byte buffer on GPU 1 "
        "(at >= n: an out-of-bounds peer write for the sanitizer job).");
  m.def("counter_probe", &CounterProbe, nb::arg("mode"), nb::arg("n"), nb::arg("threads") = 32,
        nb::arg("src_offset") = 0, nb::arg("dst_offset") = 0, nb::arg("blocks") = 1,
        "A known access pattern for the counters' tests: virtual GPU 0 copies n bytes into "
        "GPU 1's memory (mode 0: 16-byte helpers, `blocks` blocks each a contiguous share; "
        "1: devcopy::CopyBytes, one block), each thread fences at system scope, thread 0 of "
        "block 0 releases a flag GPU 1 acquires.");
  BindCudaHostFunctions(m.ptr());
}
