// Host side of the internode (NVSHMEM) direct mode and of the runtime every internode mode
// shares: NVSHMEM start-up and shutdown (unique id, init or adoption, the symmetric heap,
// the explicit QP handles and their order), the checks and geometry of a call, the
// per-call host code of dispatch, combine and gather (no host synchronisation: they queue
// the launchers of kernels/internode/internode_kernels.cu, declared in
// kernels/internode/api.cuh), the decoding of the sticky error record, and the device
// self-put check. The runtime state is one per process on a GPU, one per virtual GPU on
// the emulated GPU.
#include <dlfcn.h>

#include <cstdlib>
#include <cstring>
#include <string>

#include "kernels/common/settings.h"
#include "kernels/common/combine_order.h"
#include "kernels/common/dtype_convert.h"
#include "kernels/common/layout_math.h"
#include "kernels/internode/api.cuh"
#include "kernels/internode/internode_kernels.h"
#include "kernels/internode/internode_layout.h"
#include "kernels/internode/low_latency_wire.h"
#include "kernels/internode/transport_nvshmem.cuh"
#include "kernels/internode/wire_protocol.h"
#if defined(JAX_EP_WITH_NCCL)
#include "kernels/internode/nccl_host.h"
#endif

namespace jax_ep {
namespace transport {
JEP_DEVICE_GLOBAL int g_nvshmem_num_qp_handles = 0;
JEP_DEVICE_GLOBAL int g_nvshmem_qp_handles[kMaxQps];
}  // namespace transport

namespace internode {

// The device words the host resets at start-up (declared in kernels/internode/api.cuh).
JEP_DEVICE_GLOBAL unsigned long long g_call_counter = 0;
JEP_DEVICE_GLOBAL unsigned long long g_rdma_posted = 0;

std::string CudaErr(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return {};
  return std::string("jax_ep internode: ") + what + ": " + cudaGetErrorString(e);
}

namespace {

struct RuntimeState {
  bool initialized = false;
  bool adopted = false;  // NVSHMEM was already running; we did not start it
  int rank = 0;
  int world = 0;
  size_t heap_bytes = 0;
  size_t half_bytes = 0;  // bytes per parity half
  char* heap = nullptr;
  int64_t* scratch = nullptr;       // [3R + 1] device prefixes
  int32_t* bad = nullptr;           // device [4]: flag, token, slot, value
  wire::ErrorRecord* err = nullptr; // mapped host memory (sticky)
  int num_qps = 0;                  // logical QPs asked for
  int num_handles = 0;              // explicit QP handles created (0: fallback)
  int handles[transport::kMaxQps] = {};
  int created[transport::kMaxQps] = {};  // in creation order; SetQpOrder permutes from it
  std::string qp_path = "none";
  TransportKind transport = TransportKind::kNvshmem;
};
// One per GPU: a process may drive several (NCCL's one process per host), and on the
// emulated GPU the host code of every rank runs in one process, each rank with its own
// current device.
RuntimeState g_rt_of[64];
RuntimeState& Rt() {
#if defined(JAX_EP_EMU)
  return g_rt_of[emu::current_device() & 63];
#else
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) dev = 0;
  return g_rt_of[dev & 63];
#endif
}

const char* NotStarted() {
  return "jax_ep internode: the internode transport is not started on this GPU; call "
         "jax_ep.nvshmem_bootstrap.initialize(...) or jax_ep.nccl_bootstrap.initialize(...) "
         "before jit";
}

std::string MakeGeometry(const Dims& d, int op, FloatKind elem, int x_bytes, int y_bytes,
                         Geometry* g, HeapLayout* L) {
  if (!Rt().initialized) return NotStarted();
  if (d.num_ranks != Rt().world || d.rank != Rt().rank)
    return std::string("jax_ep internode: the EP group must be all ") +
           (Rt().transport == TransportKind::kNccl ? "ranks of the NCCL world ("
                                                   : "NVSHMEM PEs (") +
           std::to_string(Rt().world) + " GPUs); got rank " + std::to_string(d.rank) +
           " of " + std::to_string(d.num_ranks) + ", this GPU is rank " +
           std::to_string(Rt().rank);
  if (d.num_ranks > kMaxRanks) return "jax_ep internode: more than 1024 ranks";
  const int qps = d.num_ports * d.qps_per_port;
  if (d.num_ports < 1 || d.qps_per_port < 1 || qps > transport::kMaxQps || d.chunk_bytes < 1)
    return "jax_ep internode: bad transport config (ports, QPs per port, chunk bytes)";
  if (qps != Rt().num_qps)
    return "jax_ep internode: the call asks for " + std::to_string(qps) +
           " QPs per peer but the transport was started with " +
           std::to_string(Rt().num_qps) +
           "; trace with the TransportConfig given to the bootstrap's initialize";
  g->R = d.num_ranks;
  g->rank = d.rank;
  g->T = d.tokens;
  g->H = d.hidden;
  g->K = d.topk;
  g->C = d.capacity;
  g->E = d.num_experts;
  g->el = d.experts_per_rank;
  g->xrow = static_cast<int64_t>(d.hidden) * x_bytes;
  g->xmeta = dispatch_meta_offset(g->xrow);
  g->yrow = static_cast<int64_t>(d.hidden) * y_bytes;
  g->ds = dispatch_row_stride(g->xrow, d.topk);
  g->cs = combine_row_stride(g->yrow);
  g->P = d.num_ports;
  g->Q = d.qps_per_port;
  g->num_qps = qps;
  g->G = combine_node_size(d.num_ranks, d.gpus_per_node);
  g->chunk = wire_chunk_bytes(d.chunk_bytes);
  g->timeout_ns = d.timeout_ns > 0 ? d.timeout_ns : DefaultTimeoutNs();
  g->cfg[wire::kCfgOp] = op;
  g->cfg[wire::kCfgRanks] = d.num_ranks;
  g->cfg[wire::kCfgTokens] = d.tokens;
  g->cfg[wire::kCfgHidden] = d.hidden;
  g->cfg[wire::kCfgTopk] = d.topk;
  g->cfg[wire::kCfgCapacity] = d.capacity;
  g->cfg[wire::kCfgDtype] = static_cast<int32_t>(elem);
  g->cfg[wire::kCfgNumQps] = qps;
  g->cfg[wire::kCfgCallSite] = static_cast<int32_t>(d.call_site);
  g->hash = wire::config_hash(g->cfg);
  g->err = Rt().err;
  g->bad = Rt().bad;
  *L = heap_layout(d.num_ranks, d.tokens, d.capacity, d.hidden, d.topk, x_bytes, y_bytes);
  if (static_cast<size_t>(L->total) > Rt().half_bytes)
    return "jax_ep internode: the NVSHMEM heap is too small for this call (needs " +
           std::to_string(2 * L->total) + " bytes plus slack, has " +
           std::to_string(Rt().heap_bytes) +
           "); initialise with the largest tokens/capacity/hidden/topk the program uses";
  return {};
}

const char* OpName(int op) {
  switch (op) {
    case wire::kOpDispatch: return "dispatch";
    case wire::kOpCombine: return "combine";
    case wire::kOpGather: return "gather";
    default: return "an internode call";
  }
}

const char* KindName(int kind) {
  switch (kind) {
    case wire::kSigHeader: return "header";
    case wire::kSigCounts: return "count row";
    case wire::kSigDispatch: return "dispatch/gather data";
    case wire::kSigCombine: return "combine data";
    default: return "?";
  }
}

std::string CfgText(const int32_t* c) {
  static const char* kNames[wire::kNumCfgFields] = {"op", "R", "T", "H", "K", "C", "dtype",
                                                    "qps", "call_site"};
  std::string out = "(";
  for (int i = 0; i < wire::kNumCfgFields; ++i) {
    if (i) out += ", ";
    out += kNames[i];
    out += "=";
    out += i == wire::kCfgOp ? std::string(OpName(c[i])) : std::to_string(c[i]);
  }
  return out + ")";
}
// Start of a handle-driven call (combine, gather): geometry and layout for rows of
// `elem` (they travel through the back and cstage regions; dispatch's regions, sized by
// x, are unused), then the row prefixes from the handle's counts.
std::string BeginHandleCall(cudaStream_t stream, const Dims& d, int op, FloatKind elem,
                            const int32_t* counts, Geometry* g, HeapLayout* L) {
  std::string e = MakeGeometry(d, op, elem, 0, FloatKindBytes(elem), g, L);
  if (!e.empty()) return e;
  LaunchPrefix(stream, *g, counts, Rt().heap, static_cast<int64_t>(Rt().half_bytes), *L,
               Rt().scratch);
  return {};
}

}  // namespace

int Version() {
  return NVSHMEM_VENDOR_MAJOR_VERSION * 10000 + NVSHMEM_VENDOR_MINOR_VERSION * 100 +
         NVSHMEM_VENDOR_PATCH_VERSION;
}

namespace {
// A symbol of the NVSHMEM host library already loaded with the extension, or null.
// Entry points newer than the oldest supported NVSHMEM are reached only this way, so the
// extension has no undefined reference to them and loads with any libnvshmem_host.so.3.
void* HostSymbol(const char* name) {
#if defined(JAX_EP_EMU)
  return nvshmem_emu::host_symbol(name);
#endif
  static void* lib = dlopen("libnvshmem_host.so.3", RTLD_NOLOAD | RTLD_LAZY);
  void* p = lib != nullptr ? dlsym(lib, name) : nullptr;
  return p != nullptr ? p : dlsym(RTLD_DEFAULT, name);
}

using QpHandle = int;  // nvshmemx_qp_handle_t in 3.8
// NVSHMEMX_QP_DEFAULT (device_host_transport/nvshmem_constants.h): what nvshmemx_qp_create
// returns for every handle when the remote transport has no custom QPs (init.cu).
constexpr QpHandle kQpDefault = 1;
using QpCreateFn = int (*)(int, QpHandle**);
using VersionFn = void (*)(int*, int*, int*);
}  // namespace

bool QpApiAvailable() {
#if JAX_EP_NVSHMEM_QP_API
  return HostSymbol("nvshmemx_qp_create") != nullptr;
#else
  return false;
#endif
}

int RuntimeVersion() {
  auto fn = reinterpret_cast<VersionFn>(HostSymbol("nvshmemx_vendor_get_version_info"));
  if (fn == nullptr) return -1;
  int major = 0, minor = 0, patch = 0;
  fn(&major, &minor, &patch);
  return major * 10000 + minor * 100 + patch;
}

int InitStatus() {
  using StatusFn = int (*)();
  auto fn = reinterpret_cast<StatusFn>(HostSymbol("nvshmemx_init_status"));
  return fn == nullptr ? -1 : fn();
}

bool Initialized() { return Rt().initialized; }
TransportKind ActiveTransport() { return Rt().transport; }
size_t HeapBytes() { return Rt().heap_bytes; }

TransportInfo TransportState() {
  TransportInfo t;
  t.initialized = Rt().initialized;
  t.adopted = Rt().adopted;
  t.num_qps = Rt().num_qps;
  t.qp_path = Rt().qp_path;
  for (int i = 0; i < Rt().num_handles; ++i) t.handles.push_back(Rt().handles[i]);
  return t;
}

std::string SetQpOrder(const std::vector<int>& order) {
  const int n = Rt().num_handles;
  if (n == 0) return "jax_ep internode: no explicit QP handles to order (fallback path)";
  if (static_cast<int>(order.size()) != n)
    return "jax_ep internode: QP order has " + std::to_string(order.size()) +
           " entries, expected one per handle (" + std::to_string(n) + ")";
  // A permutation of the creation order: logical QP q takes the handle created order[q]-th.
  // Always from the creation order, so applying it twice is applying it once.
  std::vector<bool> seen(n, false);
  for (int i : order) {
    if (i < 0 || i >= n || seen[i])
      return "jax_ep internode: QP order is not a permutation of [0, " + std::to_string(n) + ")";
    seen[i] = true;
  }
  int permuted[transport::kMaxQps] = {};
  for (int q = 0; q < n; ++q) permuted[q] = Rt().created[order[q]];
  const std::string e = CudaErr(
      cudaMemcpyToSymbol(transport::g_nvshmem_qp_handles, permuted, sizeof(int) * n),
      "QP handles");
  if (!e.empty()) return e;
  for (int q = 0; q < n; ++q) Rt().handles[q] = permuted[q];
  return {};
}

namespace {

// What every transport's runtime holds beside its heap: the cleared heap halves, the
// prefixes' scratch, the bad-id note, the mapped error record.
std::string AllocCallState(int world) {
  std::string e = CudaErr(cudaMemset(Rt().heap, 0, 2 * Rt().half_bytes), "clear heap");
  if (e.empty())
    e = CudaErr(cudaMalloc(&Rt().scratch, sizeof(int64_t) * (3 * world + 1)), "scratch");
  if (e.empty()) e = CudaErr(cudaMalloc(&Rt().bad, sizeof(int32_t) * 4), "bad-id note");
  if (e.empty()) e = CudaErr(cudaMemset(Rt().bad, 0, sizeof(int32_t) * 4), "bad-id note");
  void* rec = nullptr;
  if (e.empty())
    e = CudaErr(cudaHostAlloc(&rec, sizeof(wire::ErrorRecord),
                              cudaHostAllocMapped | cudaHostAllocPortable), "error record");
  if (!e.empty()) return e;
  std::memset(rec, 0, sizeof(wire::ErrorRecord));
  Rt().err = static_cast<wire::ErrorRecord*>(rec);
  return {};
}

std::string ZeroDeviceWords() {
  const unsigned long long zero = 0;
  std::string e = CudaErr(cudaMemcpyToSymbol(g_call_counter, &zero, sizeof(zero)),
                          "call counter");
  if (e.empty()) e = CudaErr(cudaMemcpyToSymbol(g_rdma_posted, &zero, sizeof(zero)), "posts");
  return e;
}

}  // namespace

std::string UniqueId(std::string* out) {
  nvshmemx_uniqueid_t id = NVSHMEMX_UNIQUEID_INITIALIZER;
  if (nvshmemx_get_uniqueid(&id) != 0) return "jax_ep internode: nvshmemx_get_uniqueid failed";
  out->assign(reinterpret_cast<const char*>(&id), sizeof(id));
  return {};
}

std::string Init(int rank, int world, const std::string& unique_id, size_t heap_bytes,
                 int num_qps, bool use_qp_api, bool adopt) {
  if (Rt().initialized) return "jax_ep internode: the internode transport is already started";
  if (num_qps < 1 || num_qps > transport::kMaxQps)
    return "jax_ep internode: num_qps must be in [1, " + std::to_string(transport::kMaxQps) + "]";
  if (heap_bytes <= static_cast<size_t>(kHeapSlackBytes))
    return "jax_ep internode: heap_bytes is smaller than the reserved slack";
  std::string e = CudaErr(cudaFree(nullptr), "CUDA context");
  if (!e.empty()) return e;
  const int status = InitStatus();
  const bool running = status >= NVSHMEM_STATUS_IS_INITIALIZED;
  if (running && !adopt)
    return "jax_ep internode: NVSHMEM is already initialised in this process (XLA starts it "
           "for its own kernels); its settings were fixed then. Start jax_ep's NVSHMEM "
           "before anything else uses it, or set the NVSHMEM_* variables of "
           "TransportConfig.nvshmem_env() in the environment before the process starts "
           "and pass adopt=True";
  if (!running) {
    nvshmemx_uniqueid_t id = NVSHMEMX_UNIQUEID_INITIALIZER;
    if (unique_id.size() != sizeof(id))
      return "jax_ep internode: unique id has " + std::to_string(unique_id.size()) +
             " bytes, expected " + std::to_string(sizeof(id));
    std::memcpy(&id, unique_id.data(), sizeof(id));
    nvshmemx_init_attr_t attr = NVSHMEMX_INIT_ATTR_INITIALIZER;
    if (nvshmemx_set_attr_uniqueid_args(rank, world, &id, &attr) != 0)
      return "jax_ep internode: nvshmemx_set_attr_uniqueid_args failed";
    if (nvshmemx_init_attr(NVSHMEMX_INIT_WITH_UNIQUEID, &attr) != 0)
      return "jax_ep internode: nvshmemx_init_attr failed";
  }
  if (nvshmem_my_pe() != rank || nvshmem_n_pes() != world)
    return "jax_ep internode: NVSHMEM PE " + std::to_string(nvshmem_my_pe()) + "/" +
           std::to_string(nvshmem_n_pes()) + " does not match process " +
           std::to_string(rank) + "/" + std::to_string(world);
  Rt().half_bytes = static_cast<size_t>(heap_half_bytes(static_cast<int64_t>(heap_bytes)));
  Rt().heap = static_cast<char*>(nvshmem_malloc(2 * Rt().half_bytes));
  if (Rt().heap == nullptr) return "jax_ep internode: nvshmem_malloc of the heap failed";
  e = AllocCallState(world);
  if (!e.empty()) return e;
  // One explicit QP handle per logical QP: the plan's QP is the QP on the wire.
  Rt().num_handles = 0;
  Rt().qp_path = "fallback: NVSHMEM's own QP choice (no nvshmemx_qp_create)";
  if (use_qp_api) {
    auto create = reinterpret_cast<QpCreateFn>(
        QpApiAvailable() ? HostSymbol("nvshmemx_qp_create") : nullptr);
    if (create == nullptr)
      return "jax_ep internode: the QP API was asked for but this NVSHMEM host library has "
             "no nvshmemx_qp_create (NVSHMEM >= 3.8 needed); the bootstrap falls back to one "
             "port when it is absent";
    QpHandle* arr = nullptr;
    if (create(num_qps, &arr) != 0 || arr == nullptr)
      return "jax_ep internode: nvshmemx_qp_create(" + std::to_string(num_qps) + ") failed";
    // Each logical QP must be one QP on the wire: the protocols order a chunk's data before
    // its signal per QP, and fence_qp orders one QP. A default handle is routed to the
    // QP of the calling CTA (IBGDA's RC map), and shared handles mix logical QPs, so
    // counts could overtake their rows: refuse rather than run.
    static_assert(kQpDefault == NVSHMEMX_QP_DEFAULT, "NVSHMEM's default QP handle moved");
    for (int i = 0; i < num_qps; ++i) {
      bool shared = arr[i] == kQpDefault;
      for (int j = 0; j < i && !shared; ++j) shared = arr[j] == arr[i];
      if (shared)
        return "jax_ep internode: nvshmemx_qp_create(" + std::to_string(num_qps) +
               ") returned " + (arr[i] == kQpDefault ? std::string("NVSHMEMX_QP_DEFAULT")
                                                     : "a repeated handle") +
               " for QP " + std::to_string(i) + ": this NVSHMEM transport has no custom "
               "QPs (only IBGDA has them), and default QPs are chosen per CTA, which the "
               "internode protocols cannot order. Fix: NVSHMEM_IB_ENABLE_IBGDA=1 (and "
               "NVSHMEM_REMOTE_TRANSPORT=ibgda if set)";
    }
    for (int i = 0; i < num_qps; ++i) Rt().handles[i] = Rt().created[i] = arr[i];
    e = CudaErr(cudaMemcpyToSymbol(transport::g_nvshmem_qp_handles, Rt().handles,
                                   sizeof(int) * num_qps), "QP handles");
    if (!e.empty()) return e;
    Rt().num_handles = num_qps;
    Rt().qp_path = "qp_api: one nvshmemx_qp_create handle per planned QP";
  }
  e = CudaErr(cudaMemcpyToSymbol(transport::g_nvshmem_num_qp_handles, &Rt().num_handles,
                                 sizeof(int)), "QP handles");
  if (!e.empty()) return e;
  e = ZeroDeviceWords();
  if (!e.empty()) return e;
  e = CudaErr(cudaDeviceSynchronize(), "init");
  if (!e.empty()) return e;
  nvshmem_barrier_all();
  Rt().initialized = true;
  Rt().adopted = running;
  Rt().rank = rank;
  Rt().world = world;
  Rt().heap_bytes = heap_bytes;
  Rt().num_qps = num_qps;
  return {};
}

// The runtime of the current GPU over NCCL GIN, after nccl_host::Start gave it its window
// (the heap) and device communicators: the same call state as over NVSHMEM.
std::string InitOverNccl(int num_qps, size_t heap_bytes) {
  if (Rt().initialized) return "jax_ep internode: the internode transport is already started";
#if !defined(JAX_EP_WITH_NCCL)
  (void)num_qps;
  return "jax_ep internode: this build has no NCCL transport (the nvidia-nccl-cu13 headers "
         "were missing at build time: pip install 'nvidia-nccl-cu13>=2.30,<3' and rebuild)";
#else
  if (!nccl_host::Started())
    return "jax_ep internode: NCCL is not started on this GPU (nccl_host::Start)";
  if (num_qps < 1 || num_qps > transport::kMaxQps)
    return "jax_ep internode: num_qps must be in [1, " + std::to_string(transport::kMaxQps) + "]";
  if (heap_bytes == 0) heap_bytes = nccl_host::HeapBytes();
  if (heap_bytes > nccl_host::HeapBytes())
    return "jax_ep internode: heap_bytes exceeds the NCCL window (" +
           std::to_string(nccl_host::HeapBytes()) + " bytes)";
  if (heap_bytes <= static_cast<size_t>(kHeapSlackBytes))
    return "jax_ep internode: heap_bytes is smaller than the reserved slack";
  Rt().half_bytes = static_cast<size_t>(heap_half_bytes(static_cast<int64_t>(heap_bytes)));
  Rt().heap = nccl_host::Heap();
  std::string e = AllocCallState(nccl_host::World());
  if (e.empty()) e = ZeroDeviceWords();
  if (e.empty()) e = CudaErr(cudaDeviceSynchronize(), "init");
  if (!e.empty()) return e;
  Rt().initialized = true;
  Rt().rank = nccl_host::Rank();
  Rt().world = nccl_host::World();
  Rt().heap_bytes = heap_bytes;
  Rt().num_qps = num_qps;
  Rt().qp_path = "nccl: one GIN context per planned QP";
  Rt().transport = TransportKind::kNccl;
  return {};
#endif
}

std::string SymmetricArea(size_t bytes, char** out) {
  *out = nullptr;
  if (!Rt().initialized) return NotStarted();
  if (Rt().transport == TransportKind::kNccl) {
#if defined(JAX_EP_WITH_NCCL)
    const size_t used = 2 * Rt().half_bytes, window = nccl_host::HeapBytes();
    if (used + bytes > window)
      return "jax_ep internode: the low-latency area needs " + std::to_string(bytes) +
             " bytes past the heap halves but the NCCL window has " +
             std::to_string(window - used) +
             "; start with jax_ep.nccl_bootstrap.initialize(low_latency=...)";
    *out = Rt().heap + used;
    return {};
#endif
  }
  *out = static_cast<char*>(nvshmem_malloc(bytes));
  if (*out == nullptr)
    return "jax_ep internode low-latency: nvshmem_malloc of " + std::to_string(bytes) +
           " bytes failed (NVSHMEM_SYMMETRIC_SIZE too small?)";
  return {};
}

void SymmetricAreaFree(char* p) {
  if (p != nullptr && Rt().transport == TransportKind::kNvshmem) nvshmem_free(p);
}

void TransportBarrier() {
  if (Rt().transport == TransportKind::kNvshmem) nvshmem_barrier_all();
}

std::string StartOverNccl(const std::vector<int>& ordinals, const std::vector<int>& ranks,
                          int world, const std::string& uid, size_t heap_bytes, int num_qps,
                          int gpus_per_node, const std::vector<int64_t>& low_latency) {
#if !defined(JAX_EP_WITH_NCCL)
  (void)ordinals, (void)ranks, (void)world, (void)uid, (void)gpus_per_node, (void)low_latency;
  return InitOverNccl(num_qps, heap_bytes);  // says what this build lacks
#else
  if (!low_latency.empty() && low_latency.size() != 4)
    return "jax_ep internode: low_latency must be {max_tokens, row_bytes, topk, num_experts}";
  // The low-latency area lives in the window past the heap halves (SymmetricArea).
  size_t window = heap_bytes;
  if (!low_latency.empty()) {
    const int64_t area = llwire::area_layout(world, static_cast<int>(low_latency[0]),
                                             low_latency[1], static_cast<int>(low_latency[2]),
                                             static_cast<int>(low_latency[3])).total;
    window += static_cast<size_t>((area + (2 << 20) - 1) / (2 << 20) * (2 << 20));
  }
  std::string e = nccl_host::Start(ordinals, ranks, world, uid, window, num_qps,
                                   gpus_per_node);
  if (!e.empty()) return e;
  int dev = 0;
  e = CudaErr(cudaGetDevice(&dev), "current device");
  for (size_t i = 0; i < ordinals.size() && e.empty(); ++i) {
    e = CudaErr(cudaSetDevice(ordinals[i]), "set device");
    if (e.empty()) e = InitOverNccl(num_qps, heap_bytes);
    if (e.empty() && !low_latency.empty())
      e = ll_internode::Init(world, static_cast<int>(low_latency[0]), low_latency[1],
                             static_cast<int>(low_latency[2]), static_cast<int>(low_latency[3]));
    if (!e.empty())
      e = "jax_ep internode: GPU " + std::to_string(ordinals[i]) + " (rank " +
          std::to_string(ranks[i]) + "): " + e;
  }
  cudaSetDevice(dev);
  return e;
#endif
}

std::string FinishOverNccl(const std::vector<int>& ordinals) {
#if !defined(JAX_EP_WITH_NCCL)
  (void)ordinals;
  return {};
#else
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) {  // no GPU: no runtime was made, nor anything
    cudaGetLastError();
    return nccl_host::Finish(ordinals);
  }
  std::string e;
  for (size_t i = 0; i < ordinals.size() && e.empty(); ++i) {
    e = CudaErr(cudaSetDevice(ordinals[i]), "set device");
    if (e.empty()) e = ll_internode::Finalize();
    if (e.empty()) e = Finalize();
  }
  cudaSetDevice(dev);
  if (!e.empty()) return e;
  return nccl_host::Finish(ordinals);
#endif
}

// Collective: every PE must call it. Never called at exit (see jax_ep.nvshmem_bootstrap).
// Over NCCL only this GPU's call state goes; nccl_host::Finish frees the window.
std::string Finalize() {
  if (!Rt().initialized) return {};
  cudaDeviceSynchronize();
  const bool nccl = Rt().transport == TransportKind::kNccl;
  if (!nccl) {
    nvshmem_barrier_all();
    nvshmem_free(Rt().heap);
  }
  cudaFree(Rt().scratch);
  cudaFree(Rt().bad);
  cudaFreeHost(Rt().err);
  if (!nccl && !Rt().adopted) nvshmem_finalize();
  Rt() = RuntimeState{};
  return {};
}

std::string PendingError() {
  if (Rt().err == nullptr) return {};
  const volatile wire::ErrorRecord* r = Rt().err;
  const int code = r->code;
  if (code == wire::kErrNone) return {};
  // The low-latency mode shares the record with its own field meanings (op past
  // kErrOpBase): name it rather than decode it as a direct-mode record.
  if (r->op >= llwire::kErrOpBase)
    return "jax_ep internode: an earlier internode low-latency call failed on this rank "
           "(error code " + std::to_string(code) + ", peer " + std::to_string(r->peer) +
           "; its own call reported the details). The internode transport stays failed for "
           "the life of this process; restart the job.";
  std::string m = "jax_ep internode: ";
  const int op = r->op, peer = r->peer, kind = r->kind, qp = r->qp;
  const unsigned long long expected = r->expected, seen = r->seen;
  int32_t mine[wire::kNumCfgFields], theirs[wire::kNumCfgFields];
  for (int i = 0; i < wire::kNumCfgFields; ++i) {
    mine[i] = r->mine[i];
    theirs[i] = r->theirs[i];
  }
  switch (code) {
    case wire::kErrTimeout:
      m += std::string(OpName(op)) + " timed out (JAX_EP_TIMEOUT_S) waiting for rank " +
           std::to_string(peer) + ": " + KindName(kind) + " signal on QP " +
           std::to_string(qp) + " holds " + std::to_string(seen) + " of " +
           std::to_string(expected) +
           "; that rank skipped the call, failed earlier, or is slower than the timeout";
      break;
    case wire::kErrMismatch:
      m += std::string(OpName(op)) + ": rank " + std::to_string(peer) +
           " is in another call: this rank seq " + std::to_string(r->my_seq) + " " +
           CfgText(mine) + ", rank " + std::to_string(peer) + " seq " +
           std::to_string(r->peer_seq) + " " + CfgText(theirs) +
           "; every rank must make the same EP calls with the same shapes in the same order";
      break;
    case wire::kErrPeerFailed:
      m += std::string(OpName(op)) + ": rank " + std::to_string(peer) +
           " reported an error in this call (e.g. topk_idx out of range there); every rank "
           "fails it";
      break;
    case wire::kErrBadId:
      m += std::string(OpName(op)) + ": topk_idx[" + std::to_string(peer) + ", " +
           std::to_string(qp) + "] = " + std::to_string(static_cast<long long>(seen)) +
           " is outside [-1, " + std::to_string(expected) + ")";
      break;
    case wire::kErrExtraSignal:
      m += std::string(OpName(op)) + ": rank " + std::to_string(peer) + " signalled " +
           std::to_string(seen) + " times on " + KindName(kind) + " QP " +
           std::to_string(qp) + ", expected " + std::to_string(expected);
      break;
    default:
      m += "an error is being recorded (code " + std::to_string(code) + ")";
  }
  return m + " [rank " + std::to_string(static_cast<int>(r->rank)) +
         "]. The internode transport stays failed for the life of this process (the "
         "peers' signal words are out of step); restart the job.";
}

std::string Dispatch(cudaStream_t stream, const Dims& d, FloatKind elem, const void* x,
                     const int32_t* topk_idx, const float* topk_weights,
                     const DispatchOut& out) {
  Geometry g;
  HeapLayout L;
  // Each call lays out its own half; combine's regions (sized by y) are unused here.
  std::string e = MakeGeometry(d, wire::kOpDispatch, elem, FloatKindBytes(elem), 0, &g, &L);
  if (!e.empty()) return e;
  e = CudaErr(cudaMemsetAsync(out.recv_per_expert, 0, sizeof(int32_t) * d.experts_per_rank,
                              stream), "clear expert counts");
  if (e.empty())
    e = CudaErr(cudaMemsetAsync(Rt().bad, 0, sizeof(int32_t) * 4, stream), "clear bad ids");
  if (!e.empty()) return e;
  return LaunchDispatch(stream, g, L, Rt().heap, static_cast<int64_t>(Rt().half_bytes),
                        Rt().scratch, x, topk_idx, topk_weights, out);
}

std::string Combine(cudaStream_t stream, const Dims& d, FloatKind elem, const void* y,
                    const int32_t* counts, const int32_t* send_slot, void* out) {
  Geometry g;
  HeapLayout L;
  const std::string e = BeginHandleCall(stream, d, wire::kOpCombine, elem, counts, &g, &L);
  if (!e.empty()) return e;
  return LaunchCombine(stream, g, L, Rt().heap, static_cast<int64_t>(Rt().half_bytes),
                       Rt().scratch, elem, y, counts, send_slot, out);
}

std::string Gather(cudaStream_t stream, const Dims& d, FloatKind elem, const void* src,
                   const int32_t* counts, const int32_t* send_slot, void* out) {
  Geometry g;
  HeapLayout L;
  const std::string e = BeginHandleCall(stream, d, wire::kOpGather, elem, counts, &g, &L);
  if (!e.empty()) return e;
  return LaunchGather(stream, g, L, Rt().heap, static_cast<int64_t>(Rt().half_bytes),
                      Rt().scratch, src, counts, send_slot, out);
}

std::string SharedState(SharedRuntime* out) {
  if (!Rt().initialized) return NotStarted();
  void* counter = nullptr;
  const std::string e = CudaErr(cudaGetSymbolAddress(&counter, g_call_counter), "call counter");
  if (!e.empty()) return e;
  out->heap = Rt().heap;
  out->half_bytes = Rt().half_bytes;
  out->err = Rt().err;
  out->bad = Rt().bad;
  out->call_counter = static_cast<unsigned long long*>(counter);
  out->rank = Rt().rank;
  out->world = Rt().world;
  out->num_qps = Rt().num_qps;
  return {};
}

std::string SelfPutCheck(bool* ok) {
  *ok = false;
  if (!Rt().initialized) return "jax_ep internode: NVSHMEM is not initialised";
  if (Rt().half_bytes < 8192 + 256) return "jax_ep internode: heap too small for the check";
  std::string e = CudaErr(cudaDeviceSynchronize(), "self put");
  // Uses the data area of the half the next call would use, then clears it again.
  unsigned long long counter = 0;
  if (e.empty()) e = CudaErr(cudaMemcpyFromSymbol(&counter, g_call_counter, sizeof(counter)),
                             "call counter");
  if (!e.empty()) return e;
  const HeapLayout L = heap_layout(Rt().world, 0, 1, 0, 1, 0, 0);
  char* area = Rt().heap + (counter & 1ull) * Rt().half_bytes + L.recv;
  if (static_cast<size_t>(L.recv) + 8192 + 256 > Rt().half_bytes)
    return "jax_ep internode: heap too small for the check";
  uint64_t* sig = reinterpret_cast<uint64_t*>(area + 8192);
  int* dok = Rt().bad;  // reused as the result cell, cleared below
  LaunchSelfPut(area, sig, dok);
  int host = 0;
  e = CudaErr(cudaMemcpy(&host, dok, sizeof(int), cudaMemcpyDeviceToHost), "self put");
  if (e.empty()) e = CudaErr(cudaMemset(area, 0, 8192 + 256), "self put cleanup");
  if (e.empty()) e = CudaErr(cudaMemset(dok, 0, sizeof(int)), "self put cleanup");
  if (!e.empty()) return e;
  *ok = host == 1;
  return {};
}

}  // namespace internode
}  // namespace jax_ep
