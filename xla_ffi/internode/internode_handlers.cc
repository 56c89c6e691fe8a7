// XLA FFI handlers of the internode (NVSHMEM) backend, platform CUDA:
//
//   jax_ep_internode_dispatch(x[T,H], topk_idx[T,K] s32, topk_weights[T,K] f32)
//     -> recv_x[C,H], recv_topk_idx[C,K] s32, recv_topk_weights[C,K] f32,
//        num_recv[] s32, num_dropped[] s32, num_recv_tokens_per_expert[E/R] s32,
//        src_rank[C] s32, src_index[C] s32, counts[R,R] s32, send_slot[T,R] s32
//     attrs: num_experts, num_ranks, rank, capacity, num_ports, qps_per_port, chunk_bytes
//   jax_ep_internode_combine(y[C,H], counts[R,R] s32, send_slot[T,R] s32) -> out[T,H]
//     attrs: num_ranks, rank, capacity, topk, num_ports, qps_per_port, chunk_bytes,
//     gpus_per_node (the node size of combine's summation order,
//     kernels/common/combine_order.h)
//   jax_ep_internode_gather(g[T,H], counts[R,R] s32, send_slot[T,R] s32) -> out[C,H]
//     attrs: as combine but gpus_per_node (combine's transpose: out[i] =
//     g_{src_rank[i]}[src_index[i]])
//
// The EP group is every NVSHMEM PE (one process per GPU, see jax_ep.nvshmem_bootstrap).
// Every call also carries a `call_site` attribute (unique per traced call, so XLA never
// merges two of them); the device protocol checks sequence and configuration per call.
//
// No handler synchronises with the host: value errors (bad ids, a peer's error, a
// timeout, a mismatched call) land in a sticky error record in mapped host memory that
// every later call reads first and returns. So the handlers are command-buffer (CUDA
// graph) compatible.
#include <string>

#include "kernels/internode/internode_kernels.h"
#include "xla/ffi/api/ffi.h"
#include "xla_ffi/internode/internode_args.h"
#include "xla_ffi/cuda/cuda_registrations.h"
#include "xla_ffi/common/ffi_helpers.h"
#include "xla_ffi/common/ffi_table.h"
#include "xla_ffi/internode/handler_helpers.h"
#include "kernels/common/nvtx.h"

namespace ffi = xla::ffi;

namespace jax_ep {
namespace {

using internode_ffi::FromString;

// The sticky error of an earlier call (read from mapped host memory, no sync).
ffi::Error Pending() { return internode_ffi::Pending(internode::PendingError()); }

// The checks every handler shares, and the Dims they fill (internode_args.h, shared with
// the emulated GPU's driver).
ffi::Error BaseDims(int64_t R, int64_t rank, int64_t T, int64_t H, int64_t K, int64_t C,
                    int64_t num_ports, int64_t qps_per_port, int64_t chunk_bytes,
                    int64_t call_site, internode::Dims* d) {
  const std::string m =
      internode::CallDims(R, rank, T, H, K, C, num_ports, qps_per_port, chunk_bytes, call_site,
                          static_cast<int64_t>(TimeoutSeconds() * 1e9), d);
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
                        int64_t qps_per_port, int64_t chunk_bytes, int64_t call_site) {
  JEP_NVTX_RANGE("jax_ep.internode.dispatch");
  FloatKind elem;
  if (!FloatKindOf(x.element_type(), &elem)) return Invalid("x must be float32, bfloat16 or float16");
  if (x.dimensions().size() != 2) return Invalid("x must be [tokens, hidden], got " + Dims(x.dimensions()));
  const int64_t T = x.dimensions()[0], H = x.dimensions()[1];
  if (topk_idx.dimensions().size() != 2 || topk_idx.dimensions()[0] != T)
    return Invalid("topk_idx must be [tokens, k] with tokens = x.shape[0], got " +
                   Dims(topk_idx.dimensions()));
  const int64_t K = topk_idx.dimensions()[1];
  const int64_t R = num_ranks, C = capacity;
  internode::Dims d;
  ffi::Error e =
      BaseDims(R, rank, T, H, K, C, num_ports, qps_per_port, chunk_bytes, call_site, &d);
  if (e.failure()) return e;
  const std::string em = internode::CallExperts(num_experts, &d);
  if (!em.empty()) return Invalid(em);
  const int64_t el = d.experts_per_rank;
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
  internode::DispatchOut out{recv_x->untyped_data(), recv_idx->typed_data(),
                             recv_w->typed_data(),   num_recv->typed_data(),
                             num_dropped->typed_data(), per_expert->typed_data(),
                             src_rank->typed_data(), src_index->typed_data(),
                             counts->typed_data(),   send_slot->typed_data()};
  return FromString(internode::Dispatch(stream, d, elem, x.untyped_data(), topk_idx.typed_data(),
                                        topk_weights.typed_data(), out));
}

// Combine (y[C, H] -> out[T, H]) and its transpose, gather (g[T, H] -> out[C, H]): the
// same operands and attributes, with the input's and the output's shapes swapped.
template <bool kGather>
ffi::Error HandleCallImpl(cudaStream_t stream, ffi::AnyBuffer a, ffi::Buffer<ffi::S32> counts,
                          ffi::Buffer<ffi::S32> send_slot, ffi::Result<ffi::AnyBuffer> out,
                          int64_t num_ranks, int64_t rank, int64_t capacity, int64_t topk,
                          int64_t num_ports, int64_t qps_per_port, int64_t chunk_bytes,
                          int64_t call_site, int64_t gpus_per_node) {
  JEP_NVTX_RANGE("jax_ep.internode.combine_or_gather");
  const std::string name = kGather ? "g" : "y";
  FloatKind elem;
  if (!FloatKindOf(a.element_type(), &elem))
    return Invalid(name + " must be float32, bfloat16 or float16");
  if (a.dimensions().size() != 2)
    return Invalid(name + (kGather ? " must be [tokens, hidden], got "
                                   : " must be [capacity, hidden], got ") +
                   Dims(a.dimensions()));
  const int64_t R = num_ranks, C = capacity, H = a.dimensions()[1];
  if (send_slot.dimensions().size() != 2 || send_slot.dimensions()[1] != R)
    return Invalid("handle.send_slot must be [tokens, num_ranks], got " +
                   Dims(send_slot.dimensions()));
  const int64_t T = send_slot.dimensions()[0];
  if (topk < 1) return Invalid("topk must be >= 1");
  internode::Dims d;  // topk sizes the rows this rank sends (T * min(K, R))
  ffi::Error e =
      BaseDims(R, rank, T, H, topk, C, num_ports, qps_per_port, chunk_bytes, call_site, &d);
  if (e.failure()) return e;
  if (!kGather && (gpus_per_node < 1 || R % gpus_per_node != 0))
    return Invalid("gpus_per_node (combine's node size) must be >= 1 and divide num_ranks=" +
                   std::to_string(R) + ", got " + std::to_string(gpus_per_node));
  d.gpus_per_node = static_cast<int>(gpus_per_node);
  JEP_EXPECT_SHAPE(name.c_str(), a, kGather ? T : C, H);
  JEP_EXPECT_SHAPE("handle.counts", counts, R, R);
  JEP_EXPECT_SHAPE("out", *out, kGather ? C : T, H);
  if (out->element_type() != a.element_type()) return Invalid("out must have " + name + "'s dtype");
  const auto call = kGather ? internode::Gather : internode::Combine;
  return FromString(call(stream, d, elem, a.untyped_data(), counts.typed_data(),
                         send_slot.typed_data(), out->untyped_data()));
}

ffi::Error CombineImpl(cudaStream_t stream, ffi::AnyBuffer y, ffi::Buffer<ffi::S32> counts,
                       ffi::Buffer<ffi::S32> send_slot, ffi::Result<ffi::AnyBuffer> out,
                       int64_t num_ranks, int64_t rank, int64_t capacity, int64_t topk,
                       int64_t num_ports, int64_t qps_per_port, int64_t chunk_bytes,
                       int64_t call_site, int64_t gpus_per_node) {
  return HandleCallImpl<false>(stream, y, counts, send_slot, out, num_ranks, rank, capacity,
                               topk, num_ports, qps_per_port, chunk_bytes, call_site,
                               gpus_per_node);
}

ffi::Error GatherImpl(cudaStream_t stream, ffi::AnyBuffer g, ffi::Buffer<ffi::S32> counts,
                      ffi::Buffer<ffi::S32> send_slot, ffi::Result<ffi::AnyBuffer> out,
                      int64_t num_ranks, int64_t rank, int64_t capacity, int64_t topk,
                      int64_t num_ports, int64_t qps_per_port, int64_t chunk_bytes,
                      int64_t call_site) {
  return HandleCallImpl<true>(stream, g, counts, send_slot, out, num_ranks, rank, capacity,
                              topk, num_ports, qps_per_port, chunk_bytes, call_site, 0);
}

}  // namespace

// The handlers of JEP_INTERNODE_TARGETS (xla_ffi/common/op_tables.h).
JEP_INTERNODE_TARGETS(JEP_FFI_DEFINE_TARGET)

void AddInternodeRegistrations(const RegisterFn& add) {
  JEP_INTERNODE_TARGETS(JEP_FFI_ADD_TARGET)
  AddHierarchicalRegistrations(add);  // the hierarchical mode's targets
}

}  // namespace jax_ep
