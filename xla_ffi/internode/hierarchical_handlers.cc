// XLA FFI handlers of the hierarchical internode mode, platform CUDA
// (kernels/internode/hierarchical_kernels.h). Same operands, results and attributes as the
// direct mode's targets (xla_ffi/internode/internode_handlers.cc), plus `gpus_per_node`:
//
//   jax_ep_internode_hier_dispatch(x[T,H], topk_idx[T,K] s32, topk_weights[T,K] f32)
//     -> the direct dispatch's ten results (recv rows, counts[R,R], send_slot[T,R], ...)
//   jax_ep_internode_hier_combine(y[C,H], counts[R,R] s32, send_slot[T,R] s32,
//                                 src_index[C] s32) -> out[T,H]
//     src_index is the dispatch handle's: it orders the rows a node's forwarder merges.
//   jax_ep_internode_hier_gather(g[T,H], counts[R,R] s32, send_slot[T,R] s32) -> out[C,H]
//
// No handler synchronises with the host; errors go to the sticky record both modes share
// and are returned by the next call of either mode. Command-buffer compatible.
#include <string>

#include "kernels/internode/hierarchical_kernels.h"
#include "kernels/internode/hierarchical_layout.h"
#include "xla/ffi/api/ffi.h"
#include "xla_ffi/common/ffi_helpers.h"
#include "xla_ffi/common/ffi_table.h"
#include "xla_ffi/internode/handler_helpers.h"
#include "xla_ffi/cuda/cuda_registrations.h"
#include "xla_ffi/internode/internode_args.h"
#include "kernels/common/nvtx.h"

namespace ffi = xla::ffi;

namespace jax_ep {
namespace {

using internode_ffi::FromString;

ffi::Error Pending() { return internode_ffi::Pending(hier::PendingError()); }

// The Dims every handler fills, from internode_args.h (shared with the emulated GPU's
// driver), then the sticky error of an earlier call.
ffi::Error HierDimsOf(int64_t R, int64_t rank, int64_t T, int64_t H, int64_t K, int64_t C,
                      int64_t num_ports, int64_t qps_per_port, int64_t chunk_bytes,
                      int64_t gpus_per_node, int64_t call_site, hier::HierDims* hd) {
  std::string m =
      internode::CallDims(R, rank, T, H, K, C, num_ports, qps_per_port, chunk_bytes, call_site,
                          static_cast<int64_t>(TimeoutSeconds() * 1e9), &hd->base);
  if (m.empty()) m = internode::CallNodeSize(gpus_per_node, hd);
  if (!m.empty()) return Invalid(m);
  return Pending();
}

ffi::Error DispatchImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> topk_idx,
                        ffi::Buffer<ffi::F32> topk_weights, ffi::Result<ffi::AnyBuffer> recv_x,
                        ffi::Result<ffi::Buffer<ffi::S32>> recv_idx,
                        ffi::Result<ffi::Buffer<ffi::F32>> recv_w,
                        ffi::Result<ffi::Buffer<ffi::S32>> num_recv,
                        ffi::Result<ffi::Buffer<ffi::S32>> num_dropped,
                        ffi::Result<ffi::Buffer<ffi::S32>> per_expert,
                        ffi::Result<ffi::Buffer<ffi::S32>> src_rank,
                        ffi::Result<ffi::Buffer<ffi::S32>> src_index,
                        ffi::Result<ffi::Buffer<ffi::S32>> counts,
                        ffi::Result<ffi::Buffer<ffi::S32>> send_slot, int64_t num_experts,
                        int64_t num_ranks, int64_t rank, int64_t capacity, int64_t num_ports,
                        int64_t qps_per_port, int64_t chunk_bytes, int64_t call_site,
                        int64_t gpus_per_node) {
  JEP_NVTX_RANGE("jax_ep.internode.hierarchical.dispatch");
  FloatKind elem;
  if (!FloatKindOf(x.element_type(), &elem))
    return Invalid("x must be float32, bfloat16 or float16");
  if (x.dimensions().size() != 2)
    return Invalid("x must be [tokens, hidden], got " + Dims(x.dimensions()));
  const int64_t T = x.dimensions()[0], H = x.dimensions()[1];
  if (topk_idx.dimensions().size() != 2 || topk_idx.dimensions()[0] != T)
    return Invalid("topk_idx must be [tokens, k] with tokens = x.shape[0], got " +
                   Dims(topk_idx.dimensions()));
  const int64_t K = topk_idx.dimensions()[1];
  const int64_t R = num_ranks, C = capacity;
  hier::HierDims hd;
  ffi::Error e = HierDimsOf(R, rank, T, H, K, C, num_ports, qps_per_port, chunk_bytes,
                            gpus_per_node, call_site, &hd);
  if (e.failure()) return e;
  const std::string em = internode::CallExperts(num_experts, &hd.base);
  if (!em.empty()) return Invalid(em);
  const int64_t el = hd.base.experts_per_rank;
  JEP_EXPECT_SHAPE("topk_weights", topk_weights, T, K);
  JEP_EXPECT_SHAPE("recv_x", *recv_x, C, H);
  if (recv_x->element_type() != x.element_type()) return Invalid("recv_x must have x's dtype");
  JEP_EXPECT_SHAPE("recv_topk_idx", *recv_idx, C, K);
  JEP_EXPECT_SHAPE("recv_topk_weights", *recv_w, C, K);
  JEP_EXPECT_SHAPE("num_recv", *num_recv);
  JEP_EXPECT_SHAPE("num_dropped", *num_dropped);
  JEP_EXPECT_SHAPE("num_recv_tokens_per_expert", *per_expert, el);
  JEP_EXPECT_SHAPE("src_rank", *src_rank, C);
  JEP_EXPECT_SHAPE("src_index", *src_index, C);
  JEP_EXPECT_SHAPE("counts", *counts, R, R);
  JEP_EXPECT_SHAPE("send_slot", *send_slot, T, R);
  internode::DispatchOut out{recv_x->untyped_data(),    recv_idx->typed_data(),
                             recv_w->typed_data(),      num_recv->typed_data(),
                             num_dropped->typed_data(), per_expert->typed_data(),
                             src_rank->typed_data(),    src_index->typed_data(),
                             counts->typed_data(),      send_slot->typed_data()};
  return FromString(hier::Dispatch(stream, hd, elem, x.untyped_data(), topk_idx.typed_data(),
                                   topk_weights.typed_data(), out));
}

// Shape checks shared by combine and gather.
ffi::Error HandleDims(bool gather, ffi::AnyBuffer a, ffi::Buffer<ffi::S32> counts,
                      ffi::Buffer<ffi::S32> send_slot, ffi::Result<ffi::AnyBuffer>& out,
                      int64_t num_ranks, int64_t rank, int64_t capacity, int64_t topk,
                      int64_t num_ports, int64_t qps_per_port, int64_t chunk_bytes,
                      int64_t call_site, int64_t gpus_per_node, FloatKind* elem,
                      hier::HierDims* hd) {
  const std::string name = gather ? "g" : "y";
  if (!FloatKindOf(a.element_type(), elem))
    return Invalid(name + " must be float32, bfloat16 or float16");
  if (a.dimensions().size() != 2)
    return Invalid(name + (gather ? " must be [tokens, hidden], got "
                                  : " must be [capacity, hidden], got ") +
                   Dims(a.dimensions()));
  const int64_t R = num_ranks, C = capacity, H = a.dimensions()[1];
  if (send_slot.dimensions().size() != 2 || send_slot.dimensions()[1] != R)
    return Invalid("handle.send_slot must be [tokens, num_ranks], got " +
                   Dims(send_slot.dimensions()));
  const int64_t T = send_slot.dimensions()[0];
  if (topk < 1) return Invalid("topk must be >= 1");
  ffi::Error e = HierDimsOf(R, rank, T, H, topk, C, num_ports, qps_per_port, chunk_bytes,
                            gpus_per_node, call_site, hd);
  if (e.failure()) return e;
  JEP_EXPECT_SHAPE(name.c_str(), a, gather ? T : C, H);
  JEP_EXPECT_SHAPE("handle.counts", counts, R, R);
  JEP_EXPECT_SHAPE("out", *out, gather ? C : T, H);
  if (out->element_type() != a.element_type())
    return Invalid("out must have " + name + "'s dtype");
  return ffi::Error::Success();
}

ffi::Error CombineImpl(cudaStream_t stream, ffi::AnyBuffer y, ffi::Buffer<ffi::S32> counts,
                       ffi::Buffer<ffi::S32> send_slot, ffi::Buffer<ffi::S32> src_index,
                       ffi::Result<ffi::AnyBuffer> out, int64_t num_ranks, int64_t rank,
                       int64_t capacity, int64_t topk, int64_t num_ports, int64_t qps_per_port,
                       int64_t chunk_bytes, int64_t call_site, int64_t gpus_per_node) {
  JEP_NVTX_RANGE("jax_ep.internode.hierarchical.combine");
  FloatKind elem;
  hier::HierDims hd;
  ffi::Error e = HandleDims(false, y, counts, send_slot, out, num_ranks, rank, capacity, topk,
                            num_ports, qps_per_port, chunk_bytes, call_site, gpus_per_node,
                            &elem, &hd);
  if (e.failure()) return e;
  JEP_EXPECT_SHAPE("handle.src_index", src_index, capacity);
  return FromString(hier::Combine(stream, hd, elem, y.untyped_data(), counts.typed_data(),
                                  send_slot.typed_data(), src_index.typed_data(),
                                  out->untyped_data()));
}

ffi::Error GatherImpl(cudaStream_t stream, ffi::AnyBuffer g, ffi::Buffer<ffi::S32> counts,
                      ffi::Buffer<ffi::S32> send_slot, ffi::Result<ffi::AnyBuffer> out,
                      int64_t num_ranks, int64_t rank, int64_t capacity, int64_t topk,
                      int64_t num_ports, int64_t qps_per_port, int64_t chunk_bytes,
                      int64_t call_site, int64_t gpus_per_node) {
  JEP_NVTX_RANGE("jax_ep.internode.hierarchical.gather");
  FloatKind elem;
  hier::HierDims hd;
  ffi::Error e = HandleDims(true, g, counts, send_slot, out, num_ranks, rank, capacity, topk,
                            num_ports, qps_per_port, chunk_bytes, call_site, gpus_per_node,
                            &elem, &hd);
  if (e.failure()) return e;
  return FromString(hier::Gather(stream, hd, elem, g.untyped_data(), counts.typed_data(),
                                 send_slot.typed_data(), out->untyped_data()));
}

}  // namespace

// The handlers of JEP_INTERNODE_HIER_TARGETS (xla_ffi/common/op_tables.h), and their registration.
JEP_FFI_DEFINE_TARGETS_WITH_ADDER(JEP_INTERNODE_HIER_TARGETS, AddHierarchicalRegistrations)

}  // namespace jax_ep
