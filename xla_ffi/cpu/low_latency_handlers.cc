// Low-latency mode on CPU. The send halves only stage (copy into fixed-size outputs that
// stay alive until the matching receive half, whatever XLA schedules in between); the
// receive halves meet the peers of the EP group through the in-process rendezvous and
// pull from the peers' staged buffers. Value errors found in a send half (bad ids, a
// foreign handle) are reported by the receive half on every rank at once, so no rank
// waits for a peer that already failed.
#include "xla_ffi/cpu/low_latency_handlers.h"

#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "kernels/common/fp8_quant.h"
#include "kernels/common/low_latency_math.h"
#include "kernels/cpu/cpu_rendezvous.h"
#include "kernels/cpu/low_latency_kernels.h"
#include "xla_ffi/cpu/cpu_exchange.h"
#include "xla_ffi/common/ffi_helpers.h"

namespace ffi = xla::ffi;

namespace jax_ep {
namespace {

std::string CheckGroup(int64_t E, int64_t R, int64_t M) {
  if (R < 1 || E % R != 0) return "num_experts must be a positive multiple of num_ranks";
  if (M < 1) return "max_tokens_per_rank must be >= 1";
  return {};
}

// ------------------------------- dispatch --------------------------------

// Stages x's rows as they are (fp8 < 0) or, with fp8 = round_scale (0 or 1), as the FP8
// messages the CUDA send kernels put on the wire (kernels/common/fp8_quant.h), one pass.
ffi::Error DispatchSend(ffi::AnyBuffer x, ffi::Buffer<ffi::S32> topk_idx,
                        ffi::Result<ffi::AnyBuffer> stage_x,
                        ffi::ResultBuffer<ffi::S32> stage_idx,
                        ffi::ResultBuffer<ffi::S32> expert_count, int64_t num_experts,
                        int64_t num_ranks, int64_t max_tokens, int fp8) {
  auto xd = x.dimensions();
  auto id = topk_idx.dimensions();
  if (xd.size() != 2) return Invalid("x must be [S, H], got " + Dims(xd));
  if (id.size() != 2) return Invalid("topk_idx must be [S, K], got " + Dims(id));
  const int64_t S = xd[0], H = xd[1], K = id[1];
  FloatKind kind = FloatKind::kF32;
  std::string err = CheckGroup(num_experts, num_ranks, max_tokens);
  if (err.empty()) err = ExpectShape("topk_idx", id, {S, K});
  if (err.empty() && fp8 >= 0 && (H % kFp8Block != 0 || !FloatKindOf(x.element_type(), &kind)))
    err = "fp8 needs x float32, bfloat16 or float16 with H a multiple of 128";
  const int64_t width = fp8 >= 0 ? static_cast<int64_t>(ll_fp8_msg_bytes(H)) : H;
  if (err.empty()) err = ExpectShape("stage_x", stage_x->dimensions(), {S, width});
  if (err.empty()) err = ExpectShape("stage_idx", stage_idx->dimensions(), {S, K});
  if (err.empty()) err = ExpectShape("expert_count", expert_count->dimensions(), {num_experts});
  if (!err.empty()) return Invalid(err);
  if (fp8 >= 0) {
    const size_t xb = static_cast<size_t>(H) * ffi::ByteWidth(x.element_type());
    for (int64_t t = 0; t < S; ++t)
      fp8_quantize_row(kind, static_cast<const char*>(x.untyped_data()) + t * xb, H, fp8 != 0,
                       static_cast<uint8_t*>(stage_x->untyped_data()) + t * width);
  } else {
    std::memcpy(stage_x->untyped_data(), x.untyped_data(), x.size_bytes());
  }
  std::memcpy(stage_idx->typed_data(), topk_idx.typed_data(), topk_idx.size_bytes());
  const int32_t* idx = topk_idx.typed_data();
  // Bad ids are reported by the receive half (see top); count only valid ones here.
  if (CheckLowLatencyIds(idx, static_cast<int>(S), static_cast<int>(K),
                         static_cast<int>(num_experts)).empty()) {
    ExpertCountsCpu(idx, static_cast<int>(S), static_cast<int>(K),
                    static_cast<int>(num_experts), expert_count->typed_data());
  } else {
    std::memset(expert_count->typed_data(), 0, expert_count->size_bytes());
  }
  return ffi::Error::Success();
}

ffi::Error DispatchSendImpl(ffi::AnyBuffer x, ffi::Buffer<ffi::S32> topk_idx,
                            ffi::Result<ffi::AnyBuffer> stage_x,
                            ffi::ResultBuffer<ffi::S32> stage_idx,
                            ffi::ResultBuffer<ffi::S32> expert_count, int64_t num_experts,
                            int64_t num_ranks, int64_t max_tokens, int64_t call_site) {
  return DispatchSend(x, topk_idx, stage_x, stage_idx, expert_count, num_experts, num_ranks,
                      max_tokens, -1);
}

ffi::Error DispatchSendFp8Impl(ffi::AnyBuffer x, ffi::Buffer<ffi::S32> topk_idx,
                               ffi::Result<ffi::AnyBuffer> stage_x,
                               ffi::ResultBuffer<ffi::S32> stage_idx,
                               ffi::ResultBuffer<ffi::S32> expert_count, int64_t num_experts,
                               int64_t num_ranks, int64_t max_tokens, int64_t call_site,
                               int64_t round_scale) {
  return DispatchSend(x, topk_idx, stage_x, stage_idx, expert_count, num_experts, num_ranks,
                      max_tokens, round_scale != 0 ? 1 : 0);
}

// Receive half of a dispatch: rows of the staged width into recv_x, or with fp8 the staged
// FP8 messages split into recv_x (float8_e4m3fn) and recv_scales.
ffi::Future DispatchRecv(ffi::RunId run_id, ffi::AnyBuffer stage_x,
                         ffi::Buffer<ffi::S32> stage_idx, ffi::Buffer<ffi::S32> expert_count,
                         ffi::Buffer<ffi::S32> rank_buf, ffi::Buffer<ffi::S32> group_buf,
                         ffi::Result<ffi::AnyBuffer> recv_x, float* recv_scales,
                         ffi::Span<const int64_t> scales_dims,
                         ffi::ResultBuffer<ffi::S32> recv_count,
                         ffi::ResultBuffer<ffi::S32> src_rank,
                         ffi::ResultBuffer<ffi::S32> src_index,
                         ffi::ResultBuffer<ffi::S32> first_row,
                         ffi::ResultBuffer<ffi::S32> row_count, int64_t num_experts,
                         int64_t num_ranks, int64_t max_tokens, int64_t call_site, bool fp8) {
  auto xd = stage_x.dimensions();
  auto id = stage_idx.dimensions();
  auto rd = recv_x->dimensions();
  if (xd.size() != 2) return Failed(Invalid("staged x must be [S, H], got " + Dims(xd)));
  if (id.size() != 2) return Failed(Invalid("staged topk_idx must be [S, K], got " + Dims(id)));
  const int64_t S = xd[0], W = xd[1], K = id[1], R = num_ranks, M = max_tokens,
                E = num_experts;
  // Elements per received row: the staged width, or with fp8 recv_x's H (W is then the
  // message's bytes).
  const int64_t H = fp8 ? (rd.size() == 3 ? rd[2] : 0) : W;
  std::string err = CheckGroup(E, R, M);
  const int64_t el = err.empty() ? E / R : 1;
  if (err.empty()) err = ExpectShape("staged topk_idx", id, {S, K});
  if (err.empty()) err = ExpectShape("expert_count", expert_count.dimensions(), {E});
  if (err.empty()) err = ExpectShape("recv_x", rd, {el, R * M, H});
  if (err.empty() && fp8 && recv_x->element_type() != ffi::DataType::F8E4M3FN)
    err = "recv_x must be float8_e4m3fn with fp8";
  if (err.empty() && fp8 && (H % kFp8Block != 0 || W != static_cast<int64_t>(ll_fp8_msg_bytes(H))))
    err = "the staged FP8 messages must be [S, ll_fp8_msg_bytes(H)] for H a multiple of 128";
  if (err.empty() && fp8)
    err = ExpectShape("recv_scales", scales_dims, {el, R * M, H / kFp8Block});
  if (err.empty()) err = ExpectShape("recv_count", recv_count->dimensions(), {el});
  if (err.empty()) err = ExpectShape("src_rank", src_rank->dimensions(), {el, R * M});
  if (err.empty()) err = ExpectShape("src_index", src_index->dimensions(), {el, R * M});
  if (err.empty()) err = ExpectShape("first_row", first_row->dimensions(), {el, R});
  if (err.empty()) err = ExpectShape("row_count", row_count->dimensions(), {el, R});
  if (!err.empty()) return Failed(Invalid(err));
  const size_t rb = fp8 ? static_cast<size_t>(W)
                        : static_cast<size_t>(W) * ffi::ByteWidth(stage_x.element_type());
  LowLatencyShape s{static_cast<int>(R), static_cast<int>(E), static_cast<int>(M),
                    static_cast<int>(S), static_cast<int>(K), W, rb};
  PeerBuffers mine;
  mine.in[0] = stage_x.untyped_data();
  mine.in[1] = stage_idx.typed_data();
  mine.in[2] = expert_count.typed_data();
  mine.meta[0] = S;
  mine.meta[1] = W;
  mine.meta[2] = K;
  mine.meta[3] = static_cast<int64_t>(stage_x.element_type());
  mine.meta[4] = M;
  mine.meta[5] = E;
  mine.error = CheckLowLatencyIds(stage_idx.typed_data(), static_cast<int>(S),
                                  static_cast<int>(K), static_cast<int>(E));
  const int rank = Scalar(rank_buf);
  struct Outs {
    void* x;
    float* scales;
    int32_t *count, *src_rank, *src_index, *first, *rows;
  } o{recv_x->untyped_data(), recv_scales, recv_count->typed_data(), src_rank->typed_data(),
      src_index->typed_data(), first_row->typed_data(), row_count->typed_data()};
  const int64_t blk_rows = el * R * M;
  return Exchange(
      run_id, call_site, rank, Scalar(group_buf), static_cast<int>(R), std::move(mine),
      [=](const std::vector<PeerBuffers>& peers) -> std::string {
        std::vector<const void*> px(R);
        std::vector<const int32_t*> pi(R), pc(R);
        for (int j = 0; j < R; ++j) {
          px[j] = peers[j].in[0];
          pi[j] = static_cast<const int32_t*>(peers[j].in[1]);
          pc[j] = static_cast<const int32_t*>(peers[j].in[2]);
        }
        if (!fp8) {
          LowLatencyDispatchRecvCpu(rank, s, px.data(), pi.data(), pc.data(), o.x, o.count,
                                    o.src_rank, o.src_index, o.first, o.rows);
          return {};
        }
        // The messages as they arrived (rows past the counts zero), then split.
        std::vector<uint8_t> msgs(static_cast<size_t>(blk_rows) * rb);
        LowLatencyDispatchRecvCpu(rank, s, px.data(), pi.data(), pc.data(), msgs.data(),
                                  o.count, o.src_rank, o.src_index, o.first, o.rows);
        const int64_t nb = H / kFp8Block;
        for (int64_t i = 0; i < blk_rows; ++i) {
          const uint8_t* m = msgs.data() + i * rb;
          std::memcpy(static_cast<uint8_t*>(o.x) + i * H, m, static_cast<size_t>(H));
          std::memcpy(o.scales + i * nb, m + ll_fp8_scales_off(H), static_cast<size_t>(nb) * 4);
        }
        return {};
      },
      "jax_ep.low_latency");
}

ffi::Future DispatchRecvImpl(ffi::RunId run_id, ffi::AnyBuffer stage_x,
                             ffi::Buffer<ffi::S32> stage_idx,
                             ffi::Buffer<ffi::S32> expert_count, ffi::Buffer<ffi::S32> rank_buf,
                             ffi::Buffer<ffi::S32> group_buf, ffi::Result<ffi::AnyBuffer> recv_x,
                             ffi::ResultBuffer<ffi::S32> recv_count,
                             ffi::ResultBuffer<ffi::S32> src_rank,
                             ffi::ResultBuffer<ffi::S32> src_index,
                             ffi::ResultBuffer<ffi::S32> first_row,
                             ffi::ResultBuffer<ffi::S32> row_count, int64_t num_experts,
                             int64_t num_ranks, int64_t max_tokens, int64_t call_site) {
  return DispatchRecv(run_id, stage_x, stage_idx, expert_count, rank_buf, group_buf, recv_x,
                      nullptr, {}, recv_count, src_rank, src_index, first_row, row_count,
                      num_experts, num_ranks, max_tokens, call_site, false);
}

ffi::Future DispatchRecvFp8Impl(ffi::RunId run_id, ffi::AnyBuffer stage_x,
                                ffi::Buffer<ffi::S32> stage_idx,
                                ffi::Buffer<ffi::S32> expert_count,
                                ffi::Buffer<ffi::S32> rank_buf, ffi::Buffer<ffi::S32> group_buf,
                                ffi::Result<ffi::AnyBuffer> recv_x,
                                ffi::ResultBuffer<ffi::F32> recv_scales,
                                ffi::ResultBuffer<ffi::S32> recv_count,
                                ffi::ResultBuffer<ffi::S32> src_rank,
                                ffi::ResultBuffer<ffi::S32> src_index,
                                ffi::ResultBuffer<ffi::S32> first_row,
                                ffi::ResultBuffer<ffi::S32> row_count, int64_t num_experts,
                                int64_t num_ranks, int64_t max_tokens, int64_t call_site) {
  return DispatchRecv(run_id, stage_x, stage_idx, expert_count, rank_buf, group_buf, recv_x,
                      recv_scales->typed_data(), recv_scales->dimensions(), recv_count,
                      src_rank, src_index, first_row, row_count, num_experts, num_ranks,
                      max_tokens, call_site, true);
}

// -------------------------------- combine --------------------------------

ffi::Error CombineSendImpl(ffi::AnyBuffer y, ffi::Buffer<ffi::S32> first_row,
                           ffi::Buffer<ffi::S32> row_count, ffi::Result<ffi::AnyBuffer> stage,
                           ffi::ResultBuffer<ffi::S32> status, int64_t num_ranks,
                           int64_t max_tokens, int64_t rows_per_dest, int64_t call_site) {
  auto yd = y.dimensions();
  if (yd.size() != 3) return Invalid("y must be [E_local, R * M, H], got " + Dims(yd));
  const int64_t el = yd[0], H = yd[2], R = num_ranks, M = max_tokens;
  std::string err = ExpectShape("y", yd, {el, R * M, H});
  if (err.empty()) err = ExpectShape("handle.first_row", first_row.dimensions(), {el, R});
  if (err.empty()) err = ExpectShape("handle.row_count", row_count.dimensions(), {el, R});
  if (err.empty()) err = ExpectShape("stage", stage->dimensions(), {R, rows_per_dest, H});
  if (err.empty()) err = ExpectShape("status", status->dimensions(), {});
  if (!err.empty()) return Invalid(err);
  LowLatencyShape s{static_cast<int>(R), static_cast<int>(el * R), static_cast<int>(M), 0, 0,
                    H, static_cast<size_t>(H) * ffi::ByteWidth(y.element_type())};
  // A foreign handle is reported by the receive half on every rank (see top).
  status->typed_data()[0] =
      LowLatencyCombineStageCpu(s, y.untyped_data(), first_row.typed_data(),
                                row_count.typed_data(), rows_per_dest, stage->untyped_data())
              .empty()
          ? 0
          : 1;
  return ffi::Error::Success();
}

ffi::Future CombineRecvImpl(ffi::RunId run_id, ffi::AnyBuffer stage,
                            ffi::Buffer<ffi::S32> status, ffi::Buffer<ffi::S32> topk_idx,
                            ffi::Buffer<ffi::F32> topk_weights, ffi::Buffer<ffi::S32> rank_buf,
                            ffi::Buffer<ffi::S32> group_buf, ffi::Result<ffi::AnyBuffer> out,
                            int64_t num_experts, int64_t num_ranks, int64_t max_tokens,
                            int64_t call_site) {
  auto sd = stage.dimensions();
  auto id = topk_idx.dimensions();
  if (sd.size() != 3) return Failed(Invalid("stage must be [R, rows, H], got " + Dims(sd)));
  if (id.size() != 2) return Failed(Invalid("topk_idx must be [S, K], got " + Dims(id)));
  const int64_t R = num_ranks, rpd = sd[1], H = sd[2], S = id[0], K = id[1], E = num_experts,
                M = max_tokens;
  std::string err = CheckGroup(E, R, M);
  if (err.empty()) err = ExpectShape("stage", sd, {R, rpd, H});
  if (err.empty()) err = ExpectShape("topk_weights", topk_weights.dimensions(), {S, K});
  if (err.empty()) err = ExpectShape("out", out->dimensions(), {S, H});
  if (!err.empty()) return Failed(Invalid(err));
  FloatKind kind;
  if (!FloatKindOf(stage.element_type(), &kind))
    return Failed(Invalid("y must be float32, bfloat16 or float16"));
  LowLatencyShape s{static_cast<int>(R), static_cast<int>(E), static_cast<int>(M),
                    static_cast<int>(S), static_cast<int>(K), H,
                    static_cast<size_t>(H) * ffi::ByteWidth(stage.element_type())};
  PeerBuffers mine;
  mine.in[0] = stage.untyped_data();
  mine.meta[0] = rpd;
  mine.meta[1] = H;
  mine.meta[2] = K;
  mine.meta[3] = static_cast<int64_t>(stage.element_type());
  mine.meta[4] = M;
  mine.meta[5] = S;
  mine.error = CheckLowLatencyIds(topk_idx.typed_data(), static_cast<int>(S),
                                  static_cast<int>(K), static_cast<int>(E));
  if (mine.error.empty() && Scalar(status) != 0)
    mine.error = "jax_ep.low_latency: handle.first_row/row_count do not fit y; the handle "
                 "does not belong to this call";
  const int rank = Scalar(rank_buf);
  const int32_t* idx = topk_idx.typed_data();
  const float* w = topk_weights.typed_data();
  void* out_data = out->untyped_data();
  return Exchange(
      run_id, call_site, rank, Scalar(group_buf), static_cast<int>(R), std::move(mine),
      [=](const std::vector<PeerBuffers>& peers) -> std::string {
        std::vector<const void*> ps(R);
        for (int j = 0; j < R; ++j) ps[j] = peers[j].in[0];
        LowLatencyCombineRecvCpu(rank, kind, s, rpd, ps.data(), idx, w, out_data);
        return {};
      },
      "jax_ep.low_latency");
}

}  // namespace

// The handlers of JEP_CPU_LL_TARGETS (xla_ffi/common/op_tables.h).
JEP_CPU_LL_TARGETS(JEP_FFI_DEFINE_TARGET)

}  // namespace jax_ep
