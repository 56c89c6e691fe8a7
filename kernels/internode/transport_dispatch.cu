// The internode launchers the host code calls: each runs the kernels built over the
// transport the current GPU's runtime was started on (api.cuh ActiveTransport), NVSHMEM's
// (namespace via_nvshmem) or NCCL GIN's (via_nccl, where the build has NCCL).
// JEP_DISPATCH_HIER_ONLY: the hierarchical mode's alone (a second build of that mode,
// xla_ffi/internode/emu_hier_small_rings.cc).
#include "kernels/internode/api.cuh"

namespace jax_ep {
#undef JEP_VIA

#if defined(JAX_EP_WITH_NCCL)
#define JEP_VIA(ns_call)                                                               \
  (internode::ActiveTransport() == internode::TransportKind::kNccl ? via_nccl::ns_call \
                                                                    : via_nvshmem::ns_call)
#else
#define JEP_VIA(ns_call) via_nvshmem::ns_call
#endif

#if !defined(JEP_DISPATCH_HIER_ONLY)
namespace internode {

#if defined(JAX_EP_WITH_NCCL)
bool BuiltWithNccl() { return true; }
#else
bool BuiltWithNccl() { return false; }
#endif

void LaunchPrefix(cudaStream_t stream, const Geometry& g, const int32_t* counts, char* heap,
                  int64_t half_bytes, const HeapLayout& L, int64_t* scratch) {
  JEP_VIA(LaunchPrefix(stream, g, counts, heap, half_bytes, L, scratch));
}
std::string LaunchDispatch(cudaStream_t stream, const Geometry& g, const HeapLayout& L,
                           char* heap, int64_t hb, int64_t* scratch, const void* x,
                           const int32_t* topk_idx, const float* topk_weights,
                           const DispatchOut& out) {
  return JEP_VIA(LaunchDispatch(stream, g, L, heap, hb, scratch, x, topk_idx, topk_weights, out));
}
std::string LaunchCombine(cudaStream_t stream, const Geometry& g, const HeapLayout& L,
                          char* heap, int64_t hb, int64_t* scratch, FloatKind elem,
                          const void* y, const int32_t* counts, const int32_t* send_slot,
                          void* out) {
  return JEP_VIA(
      LaunchCombine(stream, g, L, heap, hb, scratch, elem, y, counts, send_slot, out));
}
std::string LaunchGather(cudaStream_t stream, const Geometry& g, const HeapLayout& L,
                         char* heap, int64_t hb, int64_t* scratch, const void* src,
                         const int32_t* counts, const int32_t* send_slot, void* out) {
  return JEP_VIA(LaunchGather(stream, g, L, heap, hb, scratch, src, counts, send_slot, out));
}
void LaunchSelfPut(char* area, uint64_t* sig, int* ok) { JEP_VIA(LaunchSelfPut(area, sig, ok)); }

}  // namespace internode
#endif  // !JEP_DISPATCH_HIER_ONLY

namespace hier {

std::string RunDispatchPattern(cudaStream_t stream, const Geo& g, const char* payload,
                               const int32_t* topk_idx, const float* topk_w,
                               const int32_t* send_slot_in, int32_t* send_slot_out,
                               const Outs& out, bool gather, int32_t* num_recv,
                               int32_t* num_dropped, int32_t* counts_out,
                               const internode::SharedRuntime& rt) {
  return JEP_VIA(RunDispatchPattern(stream, g, payload, topk_idx, topk_w, send_slot_in,
                                    send_slot_out, out, gather, num_recv, num_dropped,
                                    counts_out, rt));
}
std::string LaunchCombine(cudaStream_t stream, const Geo& g, FloatKind elem, const void* y,
                          const int32_t* counts, const int32_t* send_slot,
                          const int32_t* src_index, void* out) {
  return JEP_VIA(LaunchCombine(stream, g, elem, y, counts, send_slot, src_index, out));
}

}  // namespace hier

#if !defined(JEP_DISPATCH_HIER_ONLY)
namespace ll_internode {

std::string LaunchDispatchSend(cudaStream_t stream, const G& g, const void* x,
                               const int32_t* topk_idx, int32_t* token) {
  return JEP_VIA(LaunchDispatchSend(stream, g, x, topk_idx, token));
}
std::string LaunchDispatchRecv(cudaStream_t stream, const G& g, const int32_t* token,
                               const DispatchRecvOut& out) {
  return JEP_VIA(LaunchDispatchRecv(stream, g, token, out));
}
std::string LaunchCombineSend(cudaStream_t stream, const G& g, const void* y,
                              const int32_t* first_row, const int32_t* row_count,
                              int32_t* token) {
  return JEP_VIA(LaunchCombineSend(stream, g, y, first_row, row_count, token));
}
std::string LaunchCombineRecv(cudaStream_t stream, const G& g, const int32_t* token,
                              const int32_t* topk_idx, const float* topk_weights, void* out) {
  return JEP_VIA(LaunchCombineRecv(stream, g, token, topk_idx, topk_weights, out));
}

}  // namespace ll_internode
#endif  // !JEP_DISPATCH_HIER_ONLY
}  // namespace jax_ep
