// The internode kernels' host launchers, all three modes in one place: what the host code
// (kernels/internode/nvshmem_host.cu, hierarchical_host.cu, low_latency_host.cu) calls to
// queue a call's kernels, and the per-call geometry it hands them. The kernel files define
// the launchers beside their kernels (internode_kernels.cu, hierarchical_kernels.cu,
// low_latency_kernels.cu); the host files start NVSHMEM, own the buffers, check a call
// and build its geometry, and decode the sticky error record. The public host API of each
// mode is its own header (internode_kernels.h, hierarchical_kernels.h,
// low_latency_kernels.h); this one is for the internode sources only (NVSHMEM types are
// reachable through it).
//
// A launcher queues kernels on `stream` and never waits for the device; one that returns
// a string returns "" or the launch's error.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "kernels/common/dtype_convert.h"
#include "kernels/cuda/launch.cuh"
#include "kernels/internode/hierarchical_kernels.h"
#include "kernels/internode/hierarchical_layout.h"
#include "kernels/internode/internode_kernels.h"
#include "kernels/internode/internode_layout.h"
#include "kernels/internode/low_latency_kernels.h"
#include "kernels/internode/low_latency_wire.h"
#include "kernels/internode/wire_protocol.h"

namespace jax_ep {

// The current GPU's SMs, found once: 132 where CUDA cannot say, and on the emulated GPU
// (its grids are cut as on an H100/H200). Every mode's SM budget starts from it.
inline int DeviceSms() {
#if defined(JAX_EP_EMU)
  return 132;
#else
  static int sms = 0;
  if (sms == 0) {
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess ||
        sms < 1)
      sms = 132;
    cudaGetLastError();  // not sticky; the launch must not report it
  }
  return sms;
#endif
}

// ---- direct mode (internode_kernels.cu; host side nvshmem_host.cu) -------------------------
namespace internode {

// The transport the current GPU's internode runtime was started on (nvshmem_host.cu).
enum class TransportKind : int { kNvshmem = 0, kNccl = 1 };
TransportKind ActiveTransport();
// True where this build has the NCCL GIN instantiations (JAX_EP_WITH_NCCL).
bool BuiltWithNccl();

constexpr int kMaxRanks = 1024;

// The call counter (its parity picks the heap half; the header's seq) and the count of
// RDMA CTAs that have posted all their puts this call (the NVLink CTAs' gate); the
// kernels advance and reset them, the host zeroes them at start-up (nvshmem_host.cu).
JEP_DEVICE_EXTERN unsigned long long g_call_counter;
JEP_DEVICE_EXTERN unsigned long long g_rdma_posted;

// One call's dimensions, transport settings and error words, as the kernels read them.
struct Geometry {
  int R, rank, T, H, K, C, E, el;
  int64_t xrow;    // H * x bytes
  int64_t xmeta;   // offset of the int32 metadata in a dispatch row
  int64_t yrow;    // H * y bytes
  int64_t ds, cs;  // row strides on the wire
  int P, Q, num_qps;
  int G;  // combine's node size (combine_order.h), clamped to [1, R]
  int64_t chunk;
  int64_t timeout_ns;
  int32_t cfg[wire::kNumCfgFields];
  uint32_t hash;
  wire::ErrorRecord* err;
  int32_t* bad;
};

// "" or "jax_ep internode: <what>: <CUDA's error>".
std::string CudaErr(cudaError_t e, const char* what);

// The launchers, declared once per transport: namespace via_nvshmem (the kernel file built
// over NVSHMEM) and via_nccl (its *_nccl.cu twin, built over NCCL GIN, where the build has
// NCCL); the host code calls the unqualified ones, which take the current GPU's transport
// (ActiveTransport, kernels/internode/transport_dispatch.cu).
#define JEP_INTERNODE_DIRECT_LAUNCHERS                                                       \
  /* Row offsets from the handle's counts (combine and gather, before their launch). */    \
  void LaunchPrefix(cudaStream_t stream, const Geometry& g, const int32_t* counts,          \
                    char* heap, int64_t half_bytes, const HeapLayout& L, int64_t* scratch); \
  /* heap/hb: the symmetric heap and its half size; scratch: [3R + 1] device prefixes. */   \
  std::string LaunchDispatch(cudaStream_t stream, const Geometry& g, const HeapLayout& L,   \
                             char* heap, int64_t hb, int64_t* scratch, const void* x,       \
                             const int32_t* topk_idx, const float* topk_weights,            \
                             const DispatchOut& out);                                       \
  std::string LaunchCombine(cudaStream_t stream, const Geometry& g, const HeapLayout& L,    \
                            char* heap, int64_t hb, int64_t* scratch, FloatKind elem,       \
                            const void* y, const int32_t* counts, const int32_t* send_slot, \
                            void* out);                                                     \
  std::string LaunchGather(cudaStream_t stream, const Geometry& g, const HeapLayout& L,     \
                           char* heap, int64_t hb, int64_t* scratch, const void* src,       \
                           const int32_t* counts, const int32_t* send_slot, void* out);     \
  /* One warp puts 4 KiB to this rank through the transport; *ok (device) = 1 if it */      \
  /* arrived. */                                                                            \
  void LaunchSelfPut(char* area, uint64_t* sig, int* ok);

JEP_INTERNODE_DIRECT_LAUNCHERS
namespace via_nvshmem {
JEP_INTERNODE_DIRECT_LAUNCHERS
}  // namespace via_nvshmem
namespace via_nccl {
JEP_INTERNODE_DIRECT_LAUNCHERS
}  // namespace via_nccl

}  // namespace internode

// ---- hierarchical mode (hierarchical_kernels.cu; host side hierarchical_host.cu) -----------
namespace hier {

constexpr int kMaxRanks = 1024;
constexpr int kMaxNodes = 256;
// Wait kinds of this mode in the shared error record (beside wire::SigKind).
constexpr int kKindCredit = 16;  // RDMA ring credit from the stream's reader
constexpr int kKindNvl = 17;     // NVLink ring head or tail
constexpr int kKindRow = 18;     // a row arrived out of order (qp: the ring or stream)
constexpr int kKindNoPeer = 19;  // a GPU of the node has no NVSHMEM peer pointer
constexpr int kKindSource = 20;  // a source block of this rank's combine (qp: the block)
constexpr int kKindPart = 21;    // a forwarder or pusher part (qp: the part)

struct Geo {
  int R, rank, G, N, node, local;
  int T, H, K, C, E, el;
  int64_t prow;     // payload bytes per row
  int64_t dmeta;    // offset of the 4 metadata words in a dispatch-pattern row
  int64_t cmeta;    // offset of the metadata words in a combine row
  int64_t stride;   // ring row stride (Layout::row_stride)
  int P, Qpp, nq;
  int64_t timeout_ns;
  uint32_t hash;
  int32_t cfg[wire::kNumCfgFields];
  wire::ErrorRecord* err;
  int32_t* bad;
  unsigned long long* counter;
  char* heap;
  int64_t half_bytes;
  int64_t region;  // offset of the hierarchical region in a half
  Layout L;
  int64_t rdma_ring_bytes, nvl_ring_bytes;
};

// The dispatch pattern's outputs (dispatch: the receive side; gather: x only).
struct Outs {
  char* x;              // [C, prow] rows (dispatch recv_x, gather out)
  int32_t* idx;         // dispatch only
  float* w;
  int32_t* per_expert;
  int32_t* src_rank;
  int32_t* src_index;
};

// "" or "jax_ep internode (hierarchical): <what>: <CUDA's error>".
std::string CudaErr(cudaError_t e, const char* what);

#define JEP_INTERNODE_HIER_LAUNCHERS                                                         \
  /* Dispatch and gather share the path: x or g rows, routed by topk_idx or the handle. */ \
  std::string RunDispatchPattern(cudaStream_t stream, const Geo& g, const char* payload,    \
                                 const int32_t* topk_idx, const float* topk_w,              \
                                 const int32_t* send_slot_in, int32_t* send_slot_out,       \
                                 const Outs& out, bool gather, int32_t* num_recv,           \
                                 int32_t* num_dropped, int32_t* counts_out,                 \
                                 const internode::SharedRuntime& rt);                       \
  /* The header exchange, then the cooperative combine kernel (source, forwarders, */       \
  /* pushers). */                                                                           \
  std::string LaunchCombine(cudaStream_t stream, const Geo& g, FloatKind elem, const void* y, \
                            const int32_t* counts, const int32_t* send_slot,                \
                            const int32_t* src_index, void* out);

JEP_INTERNODE_HIER_LAUNCHERS  // the current GPU's transport (transport_dispatch.cu)
namespace via_nvshmem {
JEP_INTERNODE_HIER_LAUNCHERS
}  // namespace via_nvshmem
namespace via_nccl {
JEP_INTERNODE_HIER_LAUNCHERS
}  // namespace via_nccl

}  // namespace hier

// ---- low-latency mode (low_latency_kernels.cu; host side low_latency_host.cu) --------------
namespace ll_internode {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

// Epochs started per op on this PE (send halves); the receive half reads its epoch from
// the send half's token. Zeroed by Init (low_latency_host.cu).
JEP_DEVICE_EXTERN unsigned long long g_ll_epoch[llwire::kNumOps];

struct G {
  int R, rank, E, el, M, S, K, P, Q, nq;
  int64_t H, row_bytes, rpd, ds_put, meta_off, cs_put;
  int64_t x_row_bytes;  // x's rows (row_bytes is the message's: with fp8, an FP8 message)
  int64_t timeout_ns;
  int op;
  int fp8;              // CallDims::fp8
  int32_t cfg[llwire::kNumCfgFields];
  uint32_t hash;
  wire::ErrorRecord* err;
  char* area;
  llwire::Area A;
  FloatKind elem;
};

// "" or "jax_ep internode low-latency: <what>: <CUDA's error>".
std::string CudaErr(cudaError_t e, const char* what);
// Blocks for `warps` warps of `kernel` (kThreads threads) at `num_ranks` ranks, at most the
// low-latency mode's SMs (configs.h InternodeModeSms); `cache`: the kernel's blocks per
// SM, found once.
int GridBlocks(const void* kernel, int* cache, int64_t warps, int num_ranks);

#define JEP_INTERNODE_LL_LAUNCHERS                                                           \
  std::string LaunchDispatchSend(cudaStream_t stream, const G& g, const void* x,            \
                                 const int32_t* topk_idx, int32_t* token);                  \
  std::string LaunchDispatchRecv(cudaStream_t stream, const G& g, const int32_t* token,     \
                                 const DispatchRecvOut& out);                               \
  std::string LaunchCombineSend(cudaStream_t stream, const G& g, const void* y,             \
                                const int32_t* first_row, const int32_t* row_count,         \
                                int32_t* token);                                            \
  std::string LaunchCombineRecv(cudaStream_t stream, const G& g, const int32_t* token,      \
                                const int32_t* topk_idx, const float* topk_weights, void* out);

JEP_INTERNODE_LL_LAUNCHERS  // the current GPU's transport (transport_dispatch.cu)
namespace via_nvshmem {
JEP_INTERNODE_LL_LAUNCHERS
}  // namespace via_nvshmem
namespace via_nccl {
JEP_INTERNODE_LL_LAUNCHERS
}  // namespace via_nccl

}  // namespace ll_internode
}  // namespace jax_ep
