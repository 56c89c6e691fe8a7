// XLA FFI handlers of the internode (NVSHMEM) low-latency mode, platform CUDA
// (kernels/internode/low_latency_kernels.h). The send and receive halves are separate
// custom calls; the send half's token (int32[2]: the epoch) is the receive half's operand:
//
//   jax_ep_internode_ll_dispatch_send(x[S,H] any 1/2/4-byte type, topk_idx[S,K] s32)
//     -> token[2] s32
//     attrs: num_experts, num_ranks, rank, max_tokens, num_ports, qps_per_port, call_site
//   jax_ep_internode_ll_dispatch_recv(token[2] s32)
//     -> recv_x[E/R, R*M, H] (x's dtype), recv_count[E/R], src_rank[E/R, R*M],
//        src_index[E/R, R*M], first_row[E/R, R], row_count[E/R, R] (s32)
//     attrs: as the send (the config hash to check comes in the token)
//   jax_ep_internode_ll_combine_send(y[E/R, R*M, H], first_row[E/R, R] s32,
//                                    row_count[E/R, R] s32) -> token[2] s32
//     attrs: num_experts, num_ranks, rank, max_tokens, rows_per_dest, num_ports,
//            qps_per_port, call_site
//   jax_ep_internode_ll_combine_recv(token[2] s32, topk_idx[S,K] s32, topk_weights[S,K] f32)
//     -> out[S,H] (y's dtype)
//     attrs: num_experts, num_ranks, rank, max_tokens, num_ports, qps_per_port, call_site
//
//   jax_ep_internode_ll_dispatch_send_fp8(x[S,H] f32/bf16/f16, topk_idx[S,K] s32)
//     -> token[2] s32; attrs: as dispatch_send, and round_scale. The send kernel casts
//     each row to FP8 (kernels/common/fp8_quant.h) and puts one message per (token, expert)
//   jax_ep_internode_ll_dispatch_recv_fp8(token[2] s32)
//     -> recv_x[E/R, R*M, H] float8_e4m3fn, recv_scales[E/R, R*M, H/128] f32, then as
//        dispatch_recv
//
// No handler allocates or synchronises with the host (the area is allocated once at
// start, errors go to the sticky record every later internode call returns first), so
// all four are command-buffer compatible.
#include <string>

#include "kernels/common/fp8_quant.h"
#include "kernels/internode/low_latency_kernels.h"
#include "xla/ffi/api/ffi.h"
#include "xla_ffi/common/ffi_helpers.h"
#include "xla_ffi/common/ffi_table.h"
#include "xla_ffi/internode/handler_helpers.h"
#include "xla_ffi/internode/low_latency_handlers.h"
#include "kernels/common/nvtx.h"

namespace ffi = xla::ffi;

namespace jax_ep {
namespace {

using internode_ffi::FromString;

// Rows move as raw bytes: any element type of 1, 2 or 4 bytes (float8 and float32 scale
// rows too, sent as plain rows).
bool RowDtype(ffi::DataType t, ll_internode::CallDims* d) {
  const size_t w = ffi::ByteWidth(t);
  if (w != 1 && w != 2 && w != 4) return false;
  d->elem_bytes = static_cast<int>(w);
  d->dtype_code = static_cast<int>(t);
  return true;
}

// Checks shared by the four targets; the sticky error of an earlier call comes first.
ffi::Error BaseDims(int64_t E, int64_t R, int64_t rank, int64_t M, int64_t num_ports,
                    int64_t qps_per_port, int64_t call_site, ll_internode::CallDims* d) {
  if (ffi::Error e = internode_ffi::Pending(ll_internode::PendingError()); e.failure()) return e;
  if (R < 1) return Invalid("num_ranks must be >= 1");
  if (rank < 0 || rank >= R) return Invalid("rank is outside [0, num_ranks)");
  if (E < 1 || E % R != 0) return Invalid("num_experts must be a positive multiple of num_ranks");
  if (M < 1) return Invalid("max_tokens must be >= 1");
  if (num_ports < 1) return Invalid("num_ports must be >= 1");
  if (qps_per_port < 1) return Invalid("qps_per_port must be >= 1");
  d->E = static_cast<int>(E);
  d->R = static_cast<int>(R);
  d->rank = static_cast<int>(rank);
  d->M = static_cast<int>(M);
  d->num_ports = static_cast<int>(num_ports);
  d->qps_per_port = static_cast<int>(qps_per_port);
  d->call_site = call_site;
  d->timeout_ns = static_cast<int64_t>(TimeoutSeconds() * 1e9);
  return ffi::Error::Success();
}

ffi::Error DispatchSendImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> idx,
                            ffi::Result<ffi::Buffer<ffi::S32>> token, int64_t num_experts,
                            int64_t num_ranks, int64_t rank, int64_t max_tokens,
                            int64_t num_ports, int64_t qps_per_port, int64_t call_site) {
  JEP_NVTX_RANGE("jax_ep.internode.low_latency.dispatch_send");
  ll_internode::CallDims d;
  ffi::Error e = BaseDims(num_experts, num_ranks, rank, max_tokens, num_ports, qps_per_port,
                          call_site, &d);
  if (e.failure()) return e;
  if (!RowDtype(x.element_type(), &d))
    return Invalid("x must have a 1, 2 or 4-byte element type (float32, bfloat16, float16, "
                   "float8, scales), got another");
  if (x.dimensions().size() != 2)
    return Invalid("x must be [tokens, hidden], got " + Dims(x.dimensions()));
  d.S = static_cast<int>(x.dimensions()[0]);
  d.H = x.dimensions()[1];
  if (idx.dimensions().size() != 2 || idx.dimensions()[0] != d.S)
    return Invalid("topk_idx must be [tokens, k] with tokens = x.shape[0], got " +
                   Dims(idx.dimensions()));
  d.K = static_cast<int>(idx.dimensions()[1]);
  JEP_EXPECT_SHAPE("token", *token, 2);
  return FromString(ll_internode::DispatchSend(stream, d, x.untyped_data(), idx.typed_data(),
                                               token->typed_data()));
}

ffi::Error DispatchRecvImpl(cudaStream_t stream, ffi::Buffer<ffi::S32> token,
                            ffi::Result<ffi::AnyBuffer> recv_x,
                            ffi::Result<ffi::Buffer<ffi::S32>> recv_count,
                            ffi::Result<ffi::Buffer<ffi::S32>> src_rank,
                            ffi::Result<ffi::Buffer<ffi::S32>> src_index,
                            ffi::Result<ffi::Buffer<ffi::S32>> first_row,
                            ffi::Result<ffi::Buffer<ffi::S32>> row_count, int64_t num_experts,
                            int64_t num_ranks, int64_t rank, int64_t max_tokens,
                            int64_t num_ports, int64_t qps_per_port, int64_t call_site) {
  JEP_NVTX_RANGE("jax_ep.internode.low_latency.dispatch_recv");
  ll_internode::CallDims d;
  ffi::Error e = BaseDims(num_experts, num_ranks, rank, max_tokens, num_ports, qps_per_port,
                          call_site, &d);
  if (e.failure()) return e;
  d.S = 0;
  d.K = 1;
  if (!RowDtype(recv_x->element_type(), &d))
    return Invalid("recv_x must have a 1, 2 or 4-byte element type");
  const int64_t el = num_experts / num_ranks, RM = num_ranks * max_tokens;
  if (recv_x->dimensions().size() != 3)
    return Invalid("recv_x must be [E_local, R * M, H], got " + Dims(recv_x->dimensions()));
  d.H = recv_x->dimensions()[2];
  JEP_EXPECT_SHAPE("token", token, 2);
  JEP_EXPECT_SHAPE("recv_x", *recv_x, el, RM, d.H);
  JEP_EXPECT_SHAPE("recv_count", *recv_count, el);
  JEP_EXPECT_SHAPE("src_rank", *src_rank, el, RM);
  JEP_EXPECT_SHAPE("src_index", *src_index, el, RM);
  JEP_EXPECT_SHAPE("first_row", *first_row, el, num_ranks);
  JEP_EXPECT_SHAPE("row_count", *row_count, el, num_ranks);
  ll_internode::DispatchRecvOut out{recv_x->untyped_data(), recv_count->typed_data(),
                                    src_rank->typed_data(), src_index->typed_data(),
                                    first_row->typed_data(), row_count->typed_data()};
  return FromString(ll_internode::DispatchRecv(stream, d, token.typed_data(), out));
}

// FP8 dispatch: x (float32, bfloat16, float16; H a multiple of 128) cast to FP8 in the
// send kernel, one message per (token, expert) holding the values and the scales.
ffi::Error DispatchSendFp8Impl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> idx,
                               ffi::Result<ffi::Buffer<ffi::S32>> token, int64_t num_experts,
                               int64_t num_ranks, int64_t rank, int64_t max_tokens,
                               int64_t num_ports, int64_t qps_per_port, int64_t call_site,
                               int64_t round_scale) {
  JEP_NVTX_RANGE("jax_ep.internode.low_latency.dispatch_send_fp8");
  ll_internode::CallDims d;
  ffi::Error e = BaseDims(num_experts, num_ranks, rank, max_tokens, num_ports, qps_per_port,
                          call_site, &d);
  if (e.failure()) return e;
  if (!FloatKindOf(x.element_type(), &d.elem) || !RowDtype(x.element_type(), &d))
    return Invalid("x must be float32, bfloat16 or float16 for an FP8 dispatch");
  if (x.dimensions().size() != 2 || x.dimensions()[1] % kFp8Block != 0)
    return Invalid("x must be [tokens, hidden] with hidden a multiple of 128, got " +
                   Dims(x.dimensions()));
  d.S = static_cast<int>(x.dimensions()[0]);
  d.H = x.dimensions()[1];
  d.fp8 = round_scale != 0 ? 2 : 1;
  if (idx.dimensions().size() != 2 || idx.dimensions()[0] != d.S)
    return Invalid("topk_idx must be [tokens, k] with tokens = x.shape[0], got " +
                   Dims(idx.dimensions()));
  d.K = static_cast<int>(idx.dimensions()[1]);
  JEP_EXPECT_SHAPE("token", *token, 2);
  return FromString(ll_internode::DispatchSend(stream, d, x.untyped_data(), idx.typed_data(),
                                               token->typed_data()));
}

ffi::Error DispatchRecvFp8Impl(cudaStream_t stream, ffi::Buffer<ffi::S32> token,
                               ffi::Result<ffi::AnyBuffer> recv_x,
                               ffi::Result<ffi::Buffer<ffi::F32>> recv_scales,
                               ffi::Result<ffi::Buffer<ffi::S32>> recv_count,
                               ffi::Result<ffi::Buffer<ffi::S32>> src_rank,
                               ffi::Result<ffi::Buffer<ffi::S32>> src_index,
                               ffi::Result<ffi::Buffer<ffi::S32>> first_row,
                               ffi::Result<ffi::Buffer<ffi::S32>> row_count,
                               int64_t num_experts, int64_t num_ranks, int64_t rank,
                               int64_t max_tokens, int64_t num_ports, int64_t qps_per_port,
                               int64_t call_site) {
  JEP_NVTX_RANGE("jax_ep.internode.low_latency.dispatch_recv_fp8");
  ll_internode::CallDims d;
  ffi::Error e = BaseDims(num_experts, num_ranks, rank, max_tokens, num_ports, qps_per_port,
                          call_site, &d);
  if (e.failure()) return e;
  d.S = 0;
  d.K = 1;
  d.fp8 = 1;  // the message layout; round_scale only matters to the send
  if (recv_x->element_type() != ffi::DataType::F8E4M3FN || !RowDtype(recv_x->element_type(), &d))
    return Invalid("recv_x must be float8_e4m3fn for an FP8 dispatch");
  const int64_t el = num_experts / num_ranks, RM = num_ranks * max_tokens;
  if (recv_x->dimensions().size() != 3 || recv_x->dimensions()[2] % kFp8Block != 0)
    return Invalid("recv_x must be [E_local, R * M, H] with H a multiple of 128, got " +
                   Dims(recv_x->dimensions()));
  d.H = recv_x->dimensions()[2];
  JEP_EXPECT_SHAPE("token", token, 2);
  JEP_EXPECT_SHAPE("recv_x", *recv_x, el, RM, d.H);
  JEP_EXPECT_SHAPE("recv_scales", *recv_scales, el, RM, d.H / kFp8Block);
  JEP_EXPECT_SHAPE("recv_count", *recv_count, el);
  JEP_EXPECT_SHAPE("src_rank", *src_rank, el, RM);
  JEP_EXPECT_SHAPE("src_index", *src_index, el, RM);
  JEP_EXPECT_SHAPE("first_row", *first_row, el, num_ranks);
  JEP_EXPECT_SHAPE("row_count", *row_count, el, num_ranks);
  ll_internode::DispatchRecvOut out{recv_x->untyped_data(), recv_count->typed_data(),
                                    src_rank->typed_data(), src_index->typed_data(),
                                    first_row->typed_data(), row_count->typed_data(),
                                    recv_scales->typed_data()};
  return FromString(ll_internode::DispatchRecv(stream, d, token.typed_data(), out));
}

ffi::Error CombineSendImpl(cudaStream_t stream, ffi::AnyBuffer y, ffi::Buffer<ffi::S32> first_row,
                           ffi::Buffer<ffi::S32> row_count,
                           ffi::Result<ffi::Buffer<ffi::S32>> token, int64_t num_experts,
                           int64_t num_ranks, int64_t rank, int64_t max_tokens,
                           int64_t rows_per_dest, int64_t num_ports, int64_t qps_per_port,
                           int64_t call_site) {
  JEP_NVTX_RANGE("jax_ep.internode.low_latency.combine_send");
  ll_internode::CallDims d;
  ffi::Error e = BaseDims(num_experts, num_ranks, rank, max_tokens, num_ports, qps_per_port,
                          call_site, &d);
  if (e.failure()) return e;
  if (!FloatKindOf(y.element_type(), &d.elem) || !RowDtype(y.element_type(), &d))
    return Invalid("y must be float32, bfloat16 or float16");
  const int64_t el = num_experts / num_ranks, RM = num_ranks * max_tokens;
  if (y.dimensions().size() != 3)
    return Invalid("y must be [E_local, R * M, H], got " + Dims(y.dimensions()));
  d.H = y.dimensions()[2];
  if (rows_per_dest < 1) return Invalid("rows_per_dest must be >= 1");
  d.rows_per_dest = rows_per_dest;
  JEP_EXPECT_SHAPE("y", y, el, RM, d.H);
  JEP_EXPECT_SHAPE("handle.first_row", first_row, el, num_ranks);
  JEP_EXPECT_SHAPE("handle.row_count", row_count, el, num_ranks);
  JEP_EXPECT_SHAPE("token", *token, 2);
  return FromString(ll_internode::CombineSend(stream, d, y.untyped_data(), first_row.typed_data(),
                                              row_count.typed_data(), token->typed_data()));
}

ffi::Error CombineRecvImpl(cudaStream_t stream, ffi::Buffer<ffi::S32> token,
                           ffi::Buffer<ffi::S32> idx, ffi::Buffer<ffi::F32> w,
                           ffi::Result<ffi::AnyBuffer> out, int64_t num_experts,
                           int64_t num_ranks, int64_t rank, int64_t max_tokens,
                           int64_t num_ports, int64_t qps_per_port, int64_t call_site) {
  JEP_NVTX_RANGE("jax_ep.internode.low_latency.combine_recv");
  ll_internode::CallDims d;
  ffi::Error e = BaseDims(num_experts, num_ranks, rank, max_tokens, num_ports, qps_per_port,
                          call_site, &d);
  if (e.failure()) return e;
  if (!FloatKindOf(out->element_type(), &d.elem) || !RowDtype(out->element_type(), &d))
    return Invalid("out must be float32, bfloat16 or float16");
  if (idx.dimensions().size() != 2)
    return Invalid("topk_idx must be [tokens, k], got " + Dims(idx.dimensions()));
  d.S = static_cast<int>(idx.dimensions()[0]);
  d.K = static_cast<int>(idx.dimensions()[1]);
  if (out->dimensions().size() != 2)
    return Invalid("out must be [tokens, hidden], got " + Dims(out->dimensions()));
  d.H = out->dimensions()[1];
  JEP_EXPECT_SHAPE("token", token, 2);
  JEP_EXPECT_SHAPE("topk_weights", w, d.S, d.K);
  JEP_EXPECT_SHAPE("out", *out, d.S, d.H);
  return FromString(ll_internode::CombineRecv(stream, d, token.typed_data(), idx.typed_data(),
                                              w.typed_data(), out->untyped_data()));
}

}  // namespace

// The handlers of JEP_INTERNODE_LL_TARGETS (xla_ffi/common/op_tables.h), and their registration.
JEP_FFI_DEFINE_TARGETS_WITH_ADDER(JEP_INTERNODE_LL_TARGETS, AddInternodeLowLatencyRegistrations)

}  // namespace jax_ep
