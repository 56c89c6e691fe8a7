// Host functions of the CUDA backend for jax_ep/cuda.py: allocate each GPU's
// communication buffer once, wire peers (peer access in one process, CUDA IPC across
// processes), register the domain the FFI handlers use, read the device error records,
// and expose the launch presets and buffer sizes. None of these run inside a jitted
// program.
#include <cuda_runtime_api.h>
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "kernels/common/configs.h"
#include "kernels/cuda/cuda_kernels.h"
#include "kernels/common/low_latency_math.h"
#include "kernels/cuda/intranode_buffer.h"
#include "kernels/cuda/low_latency_kernels.h"
#include "xla_ffi/cuda/cuda_handlers.h"
#include "xla_ffi/cuda/cuda_registrations.h"
#include "xla_ffi/cuda/cuda_state.h"
#include "xla_ffi/common/layout_dicts.h"

namespace nb = nanobind;

namespace jax_ep {
namespace {

void Check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string("jax_ep: ") + what + ": " + cudaGetErrorString(e));
}

// Restores the calling thread's current device on scope exit.
class DeviceGuard {
 public:
  explicit DeviceGuard(int ordinal) {
    if (cudaGetDevice(&prev_) != cudaSuccess) prev_ = -1;
    Check(cudaSetDevice(ordinal), "cudaSetDevice");
  }
  ~DeviceGuard() {
    if (prev_ >= 0) cudaSetDevice(prev_);
  }

 private:
  int prev_ = -1;
};

std::mutex g_mu;
std::map<int, std::pair<uintptr_t, size_t>> g_buffers;              // ordinal -> (ptr, bytes)
std::map<std::pair<int, std::string>, uintptr_t> g_ipc_opened;     // (ordinal, handle) -> ptr

// area_bytes: dispatch, combine, gather, and optionally the low-latency area, which
// follows the three (kernels/cuda/low_latency_kernels.h).
AreaConfig Areas(const std::vector<uint64_t>& area_bytes) {
  if (area_bytes.size() != kNumOpKinds && area_bytes.size() != kNumOpKinds + 1)
    throw std::invalid_argument(
        "jax_ep: area_bytes must list dispatch, combine and gather bytes (and optionally the "
        "low-latency area's)");
  AreaConfig a;
  for (int k = 0; k < kNumOpKinds; ++k) a.bytes[k] = area_bytes[k];
  return a;
}
size_t LowLatencyBytes(const std::vector<uint64_t>& area_bytes) {
  return area_bytes.size() > kNumOpKinds ? AlignUp(area_bytes[kNumOpKinds], kAreaAlign) : 0;
}

int DeviceCount() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

// Allocates (once) and zeroes the buffer of `ordinal`; returns (pointer, IPC handle or b"").
nb::tuple AllocBuffer(int ordinal, std::vector<uint64_t> area_bytes) {
  const size_t total = Areas(area_bytes).total() + LowLatencyBytes(area_bytes);
  std::lock_guard<std::mutex> lock(g_mu);
  std::string merr;
  if (!AllocateErrorMirror(&merr)) throw std::runtime_error("jax_ep: " + merr);
  DeviceGuard guard(ordinal);
  auto it = g_buffers.find(ordinal);
  if (it != g_buffers.end() && it->second.second < total) {
    throw std::runtime_error(
        "jax_ep: the communication buffer of GPU " + std::to_string(ordinal) + " was allocated with " +
        std::to_string(it->second.second) + " bytes; this setup needs " + std::to_string(total) +
        ". Buffers are allocated once per process: call jax_ep.cuda.setup with the largest sizes first");
  }
  if (it == g_buffers.end()) {
    void* p = nullptr;
    Check(cudaMalloc(&p, total), "cudaMalloc of the communication buffer");
    Check(cudaMemset(p, 0, total), "cudaMemset of the communication buffer");
    Check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    it = g_buffers.emplace(ordinal, std::make_pair(reinterpret_cast<uintptr_t>(p), total)).first;
  }
  void* p = reinterpret_cast<void*>(it->second.first);
  cudaIpcMemHandle_t h;
  std::string handle;
  if (cudaIpcGetMemHandle(&h, p) == cudaSuccess) {
    handle.assign(reinterpret_cast<const char*>(&h), sizeof(h));
  } else {
    cudaGetLastError();
  }
  return nb::make_tuple(it->second.first, nb::bytes(handle.data(), handle.size()));
}

bool EnablePeerAccess(int ordinal, int peer) {
  if (ordinal == peer) return true;
  int can = 0;
  Check(cudaDeviceCanAccessPeer(&can, ordinal, peer), "cudaDeviceCanAccessPeer");
  if (!can) return false;
  DeviceGuard guard(ordinal);
  const cudaError_t e = cudaDeviceEnablePeerAccess(peer, 0);
  if (e == cudaErrorPeerAccessAlreadyEnabled) {
    cudaGetLastError();
    return true;
  }
  Check(e, "cudaDeviceEnablePeerAccess");
  return true;
}

uintptr_t OpenIpcHandle(int ordinal, nb::bytes handle) {
  if (handle.size() != sizeof(cudaIpcMemHandle_t))
    throw std::invalid_argument("jax_ep: a CUDA IPC handle has " + std::to_string(sizeof(cudaIpcMemHandle_t)) + " bytes");
  const std::string key(handle.c_str(), handle.size());
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = g_ipc_opened.find({ordinal, key});
  if (it != g_ipc_opened.end()) return it->second;
  DeviceGuard guard(ordinal);
  cudaIpcMemHandle_t h;
  std::memcpy(&h, key.data(), sizeof(h));
  void* p = nullptr;
  Check(cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess), "cudaIpcOpenMemHandle");
  const uintptr_t v = reinterpret_cast<uintptr_t>(p);
  g_ipc_opened[{ordinal, key}] = v;
  return v;
}

// Unmaps every peer buffer this process opened through CUDA IPC (each mapping holds the
// exporting process's allocation alive and takes address space until closed) and forgets
// the domains that pointed into them, after the GPUs finished what used them. Called at
// interpreter exit (jax_ep.cuda registers it) and by tests; returns the failures.
std::vector<std::string> CloseIpcHandles() {
  std::lock_guard<std::mutex> lock(g_mu);
  std::vector<std::string> errs;
  int prev = -1;
  if (cudaGetDevice(&prev) != cudaSuccess) prev = -1;
  for (const auto& [key, ptr] : g_ipc_opened) {
    const int ordinal = key.first;
    if (cudaSetDevice(ordinal) != cudaSuccess) {
      errs.push_back("cudaSetDevice(" + std::to_string(ordinal) + "): " + cudaGetErrorString(cudaGetLastError()));
      continue;
    }
    ClearCudaDomain(ordinal);
    cudaError_t e = cudaDeviceSynchronize();
    if (e == cudaSuccess) e = cudaIpcCloseMemHandle(reinterpret_cast<void*>(ptr));
    if (e != cudaSuccess) {
      errs.push_back("closing a peer buffer of GPU " + std::to_string(ordinal) + ": " + cudaGetErrorString(e));
      cudaGetLastError();
    }
  }
  g_ipc_opened.clear();
  if (prev >= 0) cudaSetDevice(prev);
  return errs;
}

// ll_shape: empty, or (max_tokens, topk, num_experts, row_bytes) of the low-latency area
// whose size is area_bytes[3].
void SetDomain(int ordinal, int rank, int group, int num_ranks, std::vector<uint64_t> peers,
               std::vector<uint64_t> area_bytes, std::vector<int64_t> ll_shape) {
  if (num_ranks < 1 || num_ranks > kMaxRanks)
    throw std::invalid_argument("jax_ep: the intranode GPU path supports 1 to 32 ranks per group");
  if (static_cast<int>(peers.size()) != num_ranks)
    throw std::invalid_argument("jax_ep: peers must list one buffer pointer per rank");
  if (rank < 0 || rank >= num_ranks) throw std::invalid_argument("jax_ep: rank out of range");
  if (ordinal < 0 || ordinal >= kMaxCudaDevices) throw std::invalid_argument("jax_ep: device ordinal out of range");
  CudaDomain d;
  d.rank = rank;
  d.group = group;
  d.num_ranks = num_ranks;
  for (int r = 0; r < kMaxRanks; ++r) d.peers.base[r] = r < num_ranks ? reinterpret_cast<char*>(peers[r]) : nullptr;
  d.areas = Areas(area_bytes);
  if (LowLatencyBytes(area_bytes) > 0) {
    if (ll_shape.size() != 4)
      throw std::invalid_argument("jax_ep: a low-latency area needs (max_tokens, topk, "
                                  "num_experts, row_bytes)");
    LowLatencyArea& ll = d.ll;
    ll.offset = d.areas.total();
    ll.bytes = LowLatencyBytes(area_bytes);
    ll.max_tokens = static_cast<int>(ll_shape[0]);
    ll.topk = static_cast<int>(ll_shape[1]);
    ll.num_experts = static_cast<int>(ll_shape[2]);
    ll.row_bytes = static_cast<size_t>(ll_shape[3]);
    if (ll.max_tokens < 1 || ll.topk < 1 || ll.num_experts < num_ranks ||
        ll.num_experts % num_ranks != 0 || ll.num_experts > 1024 || ll_shape[3] < 1)
      throw std::invalid_argument("jax_ep: low-latency area: max_tokens, topk >= 1, num_experts "
                                  "a multiple of the ranks (at most 1024), row_bytes >= 1");
    const size_t need = LowLatencyLayout::Make(num_ranks, ll.max_tokens, ll.row_bytes, ll.topk,
                                               ll.num_experts).bytes;
    if (need > ll.bytes)
      throw std::invalid_argument("jax_ep: the low-latency area needs " + std::to_string(need) +
                                  " bytes, got " + std::to_string(ll.bytes));
  }
  CudaDomain old;
  if (GetCudaDomain(ordinal, &old)) {
    bool same = old.rank == d.rank && old.group == d.group && old.num_ranks == d.num_ranks;
    same = same && old.ll.offset == d.ll.offset && old.ll.bytes == d.ll.bytes &&
           old.ll.max_tokens == d.ll.max_tokens && old.ll.topk == d.ll.topk &&
           old.ll.num_experts == d.ll.num_experts && old.ll.row_bytes == d.ll.row_bytes;
    for (int r = 0; r < num_ranks && same; ++r) same = old.peers.base[r] == d.peers.base[r];
    for (int k = 0; k < kNumOpKinds && same; ++k) same = old.areas.bytes[k] == d.areas.bytes[k];
    if (!same)
      throw std::runtime_error(
          "jax_ep: GPU " + std::to_string(ordinal) +
          " already belongs to another EP group; one group per GPU and process (compiled programs keep its buffers)");
    return;
  }
  {
    DeviceGuard guard(ordinal);
    RankHeader id{};
    id.rank = rank;
    id.group = group;
    id.num_ranks = num_ranks;
    id.magic = kHeaderMagic;
    Check(cudaMemcpy(d.peers.base[rank], &id, 4 * sizeof(int32_t), cudaMemcpyHostToDevice),
          "writing the buffer header");
  }
  SetCudaDomain(ordinal, d);
}

// Only the GPUs this process used for EP work: synchronizing every visible GPU would wait
// for unrelated work and create contexts on GPUs the process never touches.
constexpr const char* kOutOfStep =
    "; the EP buffers are out of step: EP calls on this GPU move no data (empty outputs) "
    "until jax_ep.cuda.reset() (collective), which check_errors does not replace";

std::vector<std::string> CheckErrors(bool clear) {
  std::vector<std::string> out;
  for (int i : DevicesInUse()) {
    DeviceGuard guard(i);
    Check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    ErrorRecord rec{};
    Check(ReadLayoutError(&rec, clear), "reading the layout error record");
    if (rec.code != kErrNone) out.push_back(DescribeError(rec, i));
    ErrorRecord failure{};  // read first: clearing the record below clears it too
    Check(ReadIntranodeFailure(&failure), "reading the intranode failed state");
    rec = ErrorRecord{};
    Check(ReadIntranodeError(&rec, clear), "reading the intranode error record");
    if (rec.code != kErrNone) out.push_back(DescribeError(rec, i));
    // A protocol error behind an earlier bad id or foreign handle (the one that emptied
    // the outputs since), or one an earlier check_errors() cleared the record of: the
    // failed state outlives the record until reset().
    if (failure.code != kErrNone && !IsProtocolError(rec.code))
      out.push_back(DescribeError(failure, i));
    if (failure.code != kErrNone) out.back() += kOutOfStep;
    rec = ErrorRecord{};
    Check(ReadLowLatencyError(&rec, clear), "reading the low-latency error record");
    if (rec.code != kErrNone) out.push_back(DescribeError(rec, i));
    int32_t ll_failed = 0;
    Check(ReadLowLatencyFailed(&ll_failed), "reading the low-latency failed state");
    if (ll_failed != 0) {
      if (!IsProtocolError(rec.code))
        out.push_back("jax_ep: low-latency mode: an earlier protocol error (timeout, call "
                      "mismatch or failed peer) [GPU " + std::to_string(i) + "]");
      out.back() += kOutOfStep;
    }
  }
  if (out.empty()) {
    const std::string m = PendingMirrorError();
    if (!m.empty()) out.push_back(m);
  }
  if (clear) ClearErrorMirror();
  return out;
}

// This process's half of jax_ep.cuda.reset(): waits for its GPUs, re-zeroes the protocol
// state of its own buffer headers (identity kept) and of the harness's, and clears the
// device and host error records. Python runs it between two barriers of all processes,
// so no peer still writes into a header and none starts a call before all are zero.
std::vector<int> Reset() {
  const std::vector<int> used = DevicesInUse();
  for (int i : used) {
    DeviceGuard guard(i);
    Check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    CudaDomain d;
    if (GetCudaDomain(i, &d)) {
      Check(cudaMemset(d.peers.base[d.rank] + kHeaderIdentityBytes, 0,
                       sizeof(RankHeader) - kHeaderIdentityBytes),
            "clearing the buffer header");
      if (d.ll.bytes > 0)
        Check(ClearLowLatencyHeader(d.peers.base[d.rank] + d.ll.offset),
              "clearing the low-latency header");
    }
    Check(ResetHarnessBuffers(i), "clearing the harness headers");
    ErrorRecord rec{};
    Check(ReadLayoutError(&rec, true), "clearing the layout error record");
    Check(ReadIntranodeError(&rec, true), "clearing the intranode error record");
    Check(ReadLowLatencyError(&rec, true), "clearing the low-latency error record");
    // The headers are zero again: the failed state can go.
    Check(ClearIntranodeFailure(), "clearing the intranode failed state");
    Check(ClearLowLatencyFailure(), "clearing the low-latency failed state");
    Check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  }
  ClearErrorMirror();
  return used;
}

nb::dict AreaBytes(int num_ranks, int64_t tokens, int64_t capacity, uint64_t row_bytes, int topk) {
  (void)tokens;  // the areas no longer depend on them; kept for callers
  (void)capacity;
  return IntranodeAreaDict(num_ranks, row_bytes, topk);
}

int64_t LowLatencyStageRow(int e, int64_t p, std::vector<int32_t> per_expert) {
  if (e < 0 || e > static_cast<int>(per_expert.size()))
    throw std::invalid_argument("jax_ep: e outside the per-expert list");
  return ll_stage_row(per_expert.data(), 1, e, p);
}

// The text check_errors() gives for a device error record (for tests of the messages).
std::string DescribeRecord(int code, int rank, int a, int b, int c, int d, int ordinal) {
  ErrorRecord e{};
  e.code = code;
  e.rank = rank;
  e.a = a;
  e.b = b;
  e.c = c;
  e.d = d;
  return DescribeError(e, ordinal);
}

}  // namespace

void DefineCudaBindings(void* module) {
  nb::module_ m = nb::borrow<nb::module_>(nb::handle(static_cast<PyObject*>(module)));
  m.def("cuda_device_count", &DeviceCount, "Number of visible CUDA devices (0 without a driver).");
  m.def("cuda_alloc_buffer", &AllocBuffer, nb::arg("ordinal"), nb::arg("area_bytes"),
        "Allocates (once) the communication buffer of a GPU; returns (pointer, IPC handle).");
  m.def("cuda_enable_peer_access", &EnablePeerAccess, nb::arg("ordinal"), nb::arg("peer"));
  m.def("cuda_open_ipc_handle", &OpenIpcHandle, nb::arg("ordinal"), nb::arg("handle"));
  m.def("cuda_close_ipc_handles", &CloseIpcHandles,
        "Closes every peer buffer opened through CUDA IPC and forgets the domains using them; "
        "returns the failures.");
  m.def("cuda_set_domain", &SetDomain, nb::arg("ordinal"), nb::arg("rank"), nb::arg("group"),
        nb::arg("num_ranks"), nb::arg("peers"), nb::arg("area_bytes"),
        nb::arg("ll_shape") = std::vector<int64_t>{});
  m.def("cuda_describe_error", &DescribeRecord, nb::arg("code"), nb::arg("rank"), nb::arg("a"),
        nb::arg("b"), nb::arg("c"), nb::arg("d"), nb::arg("ordinal") = 0,
        "The message check_errors() gives for a device error record.");
  m.def("cuda_ll_layout", &LowLatencyLayoutDict, nb::arg("num_ranks"), nb::arg("max_tokens"),
        nb::arg("row_bytes"), nb::arg("topk"), nb::arg("num_experts"),
        "Offsets and bytes of the low-latency area (kernels/cuda/low_latency_layout.h).");
  m.def("cuda_ll_slot", &ll_slot, nb::arg("e"), nb::arg("s"), nb::arg("p"), nb::arg("num_ranks"),
        nb::arg("max_tokens"), "Owner's slot index (kernels/common/low_latency_math.h).");
  m.def("cuda_ll_stage_row", &LowLatencyStageRow, nb::arg("e"), nb::arg("p"),
        nb::arg("per_expert"), "Stage row (kernels/common/low_latency_math.h).");
  m.def("cuda_ll_epoch_from_low", &ll_epoch_from_low, nb::arg("seq"), nb::arg("low"),
        "Full epoch from its low 31 bits (kernels/common/low_latency_math.h).");
  m.def("cuda_ll_call_tag", &ll_call_tag, nb::arg("call_site"), nb::arg("kind"), nb::arg("S"),
        nb::arg("K"), nb::arg("M"), nb::arg("row_bytes"), nb::arg("E"),
        "Tag of a low-latency call (kernels/common/low_latency_math.h).");
  m.def("cuda_check_errors", &CheckErrors, nb::arg("clear") = true,
        "Synchronizes the GPUs in use and returns the device error messages (cleared by default).");
  m.def("cuda_reset", &Reset,
        "Re-zeroes this process's buffer headers and error records; returns the GPUs reset.");
  m.def("cuda_devices_in_use", &DevicesInUse, "Device ordinals this process used for EP work.");
  m.def("cuda_presets", &IntranodePresetList, "The intranode launch presets (kernels/common/configs.h).");
  m.def("cuda_area_bytes", &AreaBytes, nb::arg("num_ranks"), nb::arg("tokens"), nb::arg("capacity"),
        nb::arg("row_bytes"), nb::arg("topk"),
        "Communication-buffer bytes each op kind needs for these shapes.");
}

}  // namespace jax_ep
