// Low-latency mode on CUDA (kernels/cuda/low_latency_kernels.h), two kinds of targets:
//
// Real ranks, jax_ep_ll_{dispatch,combine}_{send,recv} (the CPU's names and operands, so
// the lowering is shared): each GPU is one rank of the group jax_ep.cuda.setup wired, and
// the kernels work in the low-latency area of the group's buffers (setup(...,
// max_tokens_per_rank=M, num_experts=E)). The send halves push rows straight into the
// peers' areas, so their staging outputs are placeholders: stage_x and the combine stage
// are never written (jax_ep lowers them with zero rows on GPUs, [0, H] and [R, 0, H]; the
// CPU's full shapes are accepted too), stage_idx[0, 0] and combine's status carry the
// send's epoch to the receive half (31 bits), and dispatch_send's tokens per expert are
// real (a foreign handle goes to the device record, not to status). Shapes are
// checked on the host against the area; nothing allocates or synchronizes, so these
// targets are command-buffer (CUDA graph) compatible. Value errors (ids, handles, a
// missing peer, a peer with other shapes) go to the sticky device record that
// jax_ep.cuda.check_errors() reads.
//
// Harness, jax_ep_ll_harness_*: R virtual ranks whose buffers share one allocation on
// this GPU, every phase launched for each rank before the next phase of any; a small
// token array orders the halves and carries each rank's epoch (token[r]), so two pairs
// XLA interleaves (send, send, recv, recv) still receive their own epochs. The buffer is
// allocated on first use (and grown), which synchronizes: these targets are not
// command-buffer compatible.
#include "xla_ffi/cuda/low_latency_handlers.h"

#include <cuda_runtime_api.h>

#include <mutex>
#include <sstream>
#include <string>

#include "kernels/common/configs.h"
#include "kernels/common/fp8_quant.h"
#include "kernels/cuda/low_latency_kernels.h"
#include "xla_ffi/common/ffi_helpers.h"
#include "xla_ffi/common/ffi_table.h"
#include "xla_ffi/cuda/cuda_state.h"
#include "kernels/common/nvtx.h"

namespace ffi = xla::ffi;

namespace jax_ep {
namespace {

ffi::Error CudaFailed(const char* what, cudaError_t e) {
  return ffi::Error(ffi::ErrorCode::kInternal,
                    std::string("jax_ep.low_latency: ") + what + ": " + cudaGetErrorString(e));
}

// Blocks one low-latency kernel may use on this GPU: the EP SM budget (JAX_EP_NUM_SMS,
// else the GPU's SMs less the reserve) at the blocks per SM the kernels' resources allow,
// so their grids stay resident beside other work.
int LLMaxBlocks(int ordinal) { return EpSmBudget(DeviceSmCount(ordinal)) * kLLBlocksPerSm; }

struct LLHarness {
  char* base = nullptr;
  size_t per_rank = 0;
  int num_ranks = 0;
};

std::mutex& Mu() {
  static std::mutex mu;
  return mu;
}
LLHarness* Harnesses() {
  static LLHarness h[kMaxCudaDevices];
  return h;
}

// Fills a.peers with R buffers of at least a.L.bytes each (zeroed when first made).
ffi::Error Buffers(cudaStream_t stream, int ordinal, int R, LowLatencyArgs* a) {
  if (ordinal < 0 || ordinal >= kMaxCudaDevices) return Invalid("device ordinal out of range");
  if (R < 1 || R > kMaxRanks) return Invalid("the harness runs 1 to 32 ranks");
  std::string merr;
  AllocateErrorMirror(&merr);  // best effort
  std::lock_guard<std::mutex> lock(Mu());
  LLHarness& h = Harnesses()[ordinal];
  const size_t need = AlignUp(a->L.bytes, kAreaAlign);
  if (h.base == nullptr || h.num_ranks != R || h.per_rank < need) {
    if (h.base != nullptr) {
      cudaError_t e = cudaStreamSynchronize(stream);
      if (e == cudaSuccess) e = cudaFree(h.base);
      if (e != cudaSuccess) return CudaFailed("harness buffer release", e);
      h.base = nullptr;
    }
    void* p = nullptr;
    cudaError_t e = cudaMalloc(&p, need * R);
    if (e == cudaSuccess) e = cudaMemsetAsync(p, 0, need * R, stream);
    if (e != cudaSuccess) return CudaFailed("harness buffer allocation", e);
    h.base = static_cast<char*>(p);
    h.per_rank = need;
    h.num_ranks = R;
  }
  for (int r = 0; r < kMaxRanks; ++r) a->peers.base[r] = r < R ? h.base + r * h.per_rank : nullptr;
  a->host_err = ErrorMirror(ordinal);
  a->timeout_ns = KernelTimeoutNs();
  a->max_blocks = LLMaxBlocks(ordinal);
  return ffi::Error::Success();
}

std::string CheckConfig(int64_t R, int64_t E, int64_t M, int64_t K) {
  if (R < 1 || E % R != 0) return "num_experts must be a positive multiple of the ranks";
  if (M < 1 || K < 1) return "max_tokens and topk must be >= 1";
  if (E > kLLMaxExperts)
    return "num_experts above " + std::to_string(kLLMaxExperts) + " is not supported on GPU";
  return {};
}

// Launches `phases` for every rank r in turn, phase by phase; `at(r)` gives rank r's args.
template <typename At>
ffi::Error Launch(std::initializer_list<int> phases, int R, cudaStream_t stream, At at) {
  for (int phase : phases) {
    for (int r = 0; r < R; ++r) {
      const cudaError_t e = LaunchLowLatencyPhase(phase, at(r), stream);
      if (e != cudaSuccess) return CudaFailed("kernel launch", e);
    }
  }
  return ffi::Error::Success();
}

// ------------------------------- dispatch --------------------------------

ffi::Error DispatchSendImpl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer x,
                            ffi::Buffer<ffi::S32> topk_idx, ffi::ResultBuffer<ffi::S32> token,
                            int64_t num_experts, int64_t max_tokens, int64_t topk_max) {
  JEP_NVTX_RANGE("jax_ep.low_latency.dispatch_send");
  auto xd = x.dimensions();
  auto id = topk_idx.dimensions();
  if (xd.size() != 3) return Invalid("harness x must be [R, S, H], got " + Dims(xd));
  const int64_t R = xd[0], S = xd[1], H = xd[2];
  if (id.size() != 3) return Invalid("harness topk_idx must be [R, S, K], got " + Dims(id));
  const int64_t K = id[2];
  std::string err = CheckConfig(R, num_experts, max_tokens, topk_max);
  if (err.empty()) err = ExpectShape("topk_idx", id, {R, S, K});
  if (err.empty() && S * K > max_tokens * topk_max)
    err = "staged slots S * K exceed max_tokens * topk (the buffers' size)";
  if (err.empty()) err = ExpectShape("token", token->dimensions(), {R});
  if (!err.empty()) return Invalid(err);
  LowLatencyArgs a{};
  const size_t rb = static_cast<size_t>(H) * ffi::ByteWidth(x.element_type());
  a.L = LowLatencyLayout::Make(static_cast<int>(R), static_cast<int>(max_tokens), rb,
                               static_cast<int>(topk_max), static_cast<int>(num_experts));
  a.M = a.L.M;
  a.row_bytes = a.L.row_bytes;
  a.S = static_cast<int>(S);
  a.K = static_cast<int>(K);
  a.H = H;
  if (ffi::Error e = Buffers(stream, ordinal, static_cast<int>(R), &a); e.failure()) return e;
  return Launch({kLLDispatchSend}, static_cast<int>(R), stream, [&](int r) {
    LowLatencyArgs b = a;
    b.me = r;
    b.x = static_cast<const char*>(x.untyped_data()) + r * S * rb;
    b.topk_idx = topk_idx.typed_data() + r * S * K;
    b.epoch_out = token->typed_data() + r;
    return b;
  });
}

ffi::Error DispatchRecvImpl(cudaStream_t stream, int32_t ordinal, ffi::Buffer<ffi::S32> token,
                            ffi::Result<ffi::AnyBuffer> recv_x,
                            ffi::ResultBuffer<ffi::S32> recv_count,
                            ffi::ResultBuffer<ffi::S32> src_rank,
                            ffi::ResultBuffer<ffi::S32> src_index,
                            ffi::ResultBuffer<ffi::S32> first_row,
                            ffi::ResultBuffer<ffi::S32> row_count, int64_t num_experts,
                            int64_t max_tokens, int64_t topk_max) {
  JEP_NVTX_RANGE("jax_ep.low_latency.dispatch_recv");
  auto rd = recv_x->dimensions();
  if (rd.size() != 4) return Invalid("harness recv_x must be [R, E_local, R * M, H]");
  const int64_t R = rd[0], H = rd[3], M = max_tokens;
  std::string err = CheckConfig(R, num_experts, M, topk_max);
  const int64_t el = err.empty() ? num_experts / R : 1;
  if (err.empty()) err = ExpectShape("recv_x", rd, {R, el, R * M, H});
  if (err.empty()) err = ExpectShape("recv_count", recv_count->dimensions(), {R, el});
  if (err.empty()) err = ExpectShape("src_rank", src_rank->dimensions(), {R, el, R * M});
  if (err.empty()) err = ExpectShape("src_index", src_index->dimensions(), {R, el, R * M});
  if (err.empty()) err = ExpectShape("first_row", first_row->dimensions(), {R, el, R});
  if (err.empty()) err = ExpectShape("row_count", row_count->dimensions(), {R, el, R});
  if (err.empty()) err = ExpectShape("token", token.dimensions(), {R});
  if (!err.empty()) return Invalid(err);
  LowLatencyArgs a{};
  const size_t rb = static_cast<size_t>(H) * ffi::ByteWidth(recv_x->element_type());
  a.L = LowLatencyLayout::Make(static_cast<int>(R), static_cast<int>(M), rb,
                               static_cast<int>(topk_max), static_cast<int>(num_experts));
  a.M = a.L.M;
  a.row_bytes = a.L.row_bytes;
  a.H = H;
  if (ffi::Error e = Buffers(stream, ordinal, static_cast<int>(R), &a); e.failure()) return e;
  const int64_t blk = el * R * M;
  return Launch({kLLDispatchRecv}, static_cast<int>(R), stream, [&](int r) {
    LowLatencyArgs b = a;
    b.me = r;
    b.epoch_in = token.typed_data() + r;
    b.recv_x = static_cast<char*>(recv_x->untyped_data()) + r * blk * rb;
    b.recv_count = recv_count->typed_data() + r * el;
    b.src_rank = src_rank->typed_data() + r * blk;
    b.src_index = src_index->typed_data() + r * blk;
    b.first_row = first_row->typed_data() + r * el * R;
    b.row_count = row_count->typed_data() + r * el * R;
    return b;
  });
}

// -------------------------------- combine --------------------------------

ffi::Error CombineSendImpl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer y,
                           ffi::Buffer<ffi::S32> first_row, ffi::Buffer<ffi::S32> row_count,
                           ffi::ResultBuffer<ffi::S32> token, int64_t num_experts,
                           int64_t max_tokens, int64_t topk_max) {
  JEP_NVTX_RANGE("jax_ep.low_latency.combine_send");
  auto yd = y.dimensions();
  if (yd.size() != 4) return Invalid("harness y must be [R, E_local, R * M, H], got " + Dims(yd));
  const int64_t R = yd[0], H = yd[3], M = max_tokens;
  std::string err = CheckConfig(R, num_experts, M, topk_max);
  const int64_t el = err.empty() ? num_experts / R : 1;
  if (err.empty()) err = ExpectShape("y", yd, {R, el, R * M, H});
  if (err.empty()) err = ExpectShape("first_row", first_row.dimensions(), {R, el, R});
  if (err.empty()) err = ExpectShape("row_count", row_count.dimensions(), {R, el, R});
  if (err.empty()) err = ExpectShape("token", token->dimensions(), {R});
  if (!err.empty()) return Invalid(err);
  LowLatencyArgs a{};
  const size_t rb = static_cast<size_t>(H) * ffi::ByteWidth(y.element_type());
  a.L = LowLatencyLayout::Make(static_cast<int>(R), static_cast<int>(M), rb,
                               static_cast<int>(topk_max), static_cast<int>(num_experts));
  a.M = a.L.M;
  a.row_bytes = a.L.row_bytes;
  a.H = H;
  if (ffi::Error e = Buffers(stream, ordinal, static_cast<int>(R), &a); e.failure()) return e;
  const int64_t blk = el * R * M;
  return Launch({kLLCombineSend}, static_cast<int>(R), stream, [&](int r) {
    LowLatencyArgs b = a;
    b.me = r;
    b.epoch_out = token->typed_data() + r;
    b.y = static_cast<const char*>(y.untyped_data()) + r * blk * rb;
    b.first_row = const_cast<int32_t*>(first_row.typed_data()) + r * el * R;
    b.row_count = const_cast<int32_t*>(row_count.typed_data()) + r * el * R;
    return b;
  });
}

ffi::Error CombineRecvImpl(cudaStream_t stream, int32_t ordinal, ffi::Buffer<ffi::S32> token,
                           ffi::Buffer<ffi::S32> topk_idx, ffi::Buffer<ffi::F32> topk_w,
                           ffi::Result<ffi::AnyBuffer> out, int64_t num_experts,
                           int64_t max_tokens, int64_t topk_max) {
  JEP_NVTX_RANGE("jax_ep.low_latency.combine_recv");
  auto id = topk_idx.dimensions();
  auto od = out->dimensions();
  if (id.size() != 3) return Invalid("harness topk_idx must be [R, S, K], got " + Dims(id));
  if (od.size() != 3) return Invalid("harness out must be [R, S, H], got " + Dims(od));
  const int64_t R = id[0], S = id[1], K = id[2], H = od[2];
  std::string err = CheckConfig(R, num_experts, max_tokens, topk_max);
  if (err.empty()) err = ExpectShape("topk_weights", topk_w.dimensions(), {R, S, K});
  if (err.empty()) err = ExpectShape("out", od, {R, S, H});
  if (err.empty()) err = ExpectShape("token", token.dimensions(), {R});
  if (err.empty() && S * K > max_tokens * topk_max)
    err = "slots S * K exceed max_tokens * topk (the buffers' size)";
  FloatKind kind;
  if (err.empty() && !FloatKindOf(out->element_type(), &kind))
    err = "y must be float32, bfloat16 or float16";
  if (!err.empty()) return Invalid(err);
  LowLatencyArgs a{};
  const size_t rb = static_cast<size_t>(H) * ffi::ByteWidth(out->element_type());
  a.L = LowLatencyLayout::Make(static_cast<int>(R), static_cast<int>(max_tokens), rb,
                               static_cast<int>(topk_max), static_cast<int>(num_experts));
  a.M = a.L.M;
  a.row_bytes = a.L.row_bytes;
  a.S = static_cast<int>(S);
  a.K = static_cast<int>(K);
  a.H = H;
  a.kind = kind;
  if (ffi::Error e = Buffers(stream, ordinal, static_cast<int>(R), &a); e.failure()) return e;
  return Launch({kLLCombineRecvPlan, kLLCombineRecv}, static_cast<int>(R), stream, [&](int r) {
    LowLatencyArgs b = a;
    b.me = r;
    b.epoch_in = token.typed_data() + r;
    b.topk_idx = topk_idx.typed_data() + r * S * K;
    b.topk_w = topk_w.typed_data() + r * S * K;
    b.out = static_cast<char*>(out->untyped_data()) + r * S * rb;
    return b;
  });
}

// ------------------------------ real ranks -------------------------------
// One GPU = one rank of the group jax_ep.cuda.setup registered; the low-latency area of
// its buffers holds the slots, counts and stages (sized once for the largest shapes).

constexpr const char* kSetupHint =
    "call jax_ep.cuda.setup(mesh, axis_name, ..., max_tokens_per_rank=M, num_experts=E) "
    "(its low-latency option) before jitting";

// This GPU's domain, with a low-latency area for an EP group of R ranks and E experts.
ffi::Error RankDomain(int ordinal, int64_t R, int64_t E, CudaDomain* d) {
  if (!GetCudaDomain(ordinal, d)) {
    std::ostringstream s;
    s << "jax_ep.low_latency: no communication buffer on GPU " << ordinal << "; " << kSetupHint;
    return Invalid(s.str());
  }
  std::ostringstream s;
  if (d->num_ranks != R) {
    s << "jax_ep.low_latency: GPU " << ordinal << " was set up for an EP group of "
      << d->num_ranks << " ranks, but the op has num_ranks=" << R;
  } else if (d->ll.bytes == 0) {
    s << "jax_ep.low_latency: GPU " << ordinal << " has no low-latency area; " << kSetupHint;
  } else if (d->ll.num_experts != E) {
    s << "jax_ep.low_latency: num_experts=" << E << " but the low-latency area of GPU "
      << ordinal << " was set up for num_experts=" << d->ll.num_experts << "; " << kSetupHint;
  } else if (E > kLLMaxExperts) {
    s << "jax_ep.low_latency: num_experts above " << kLLMaxExperts << " is not supported on GPU";
  }
  if (!s.str().empty()) return Invalid(s.str());
  return ffi::Error::Success();
}

// What the area holds against what a call needs; "" if it fits.
std::string FitsArea(const CudaDomain& d, int64_t M, size_t row_bytes, int64_t slots,
                     int64_t rows_per_dest) {
  const LowLatencyArea& a = d.ll;
  std::ostringstream s;
  if (M > a.max_tokens)
    s << "max_tokens_per_rank=" << M << " exceeds the " << a.max_tokens << " of the area";
  else if (row_bytes > a.row_bytes)
    s << "rows of " << row_bytes << " bytes exceed the area's " << a.row_bytes
      << " (setup's hidden and dtype)";
  else if (slots > static_cast<int64_t>(a.max_tokens) * a.topk)
    s << "staged slots S * K = " << slots << " exceed the area's max_tokens_per_rank * topk = "
      << static_cast<int64_t>(a.max_tokens) * a.topk;
  else if (rows_per_dest > ll_rows_per_dest(a.max_tokens, a.topk, a.num_experts / d.num_ranks))
    s << "combine rows per source " << rows_per_dest << " exceed the area's "
      << ll_rows_per_dest(a.max_tokens, a.topk, a.num_experts / d.num_ranks);
  if (s.str().empty()) return {};
  return "jax_ep.low_latency: " + s.str() + "; pass larger sizes to jax_ep.cuda.setup "
         "(max_tokens_per_rank, topk, hidden, dtype; see jax_ep.cuda.buffer_bytes)";
}

// Kernel arguments of this GPU's rank: the area's fixed layout and every rank's area.
LowLatencyArgs RankArgs(const CudaDomain& d, int ordinal) {
  LowLatencyArgs a{};
  a.L = LowLatencyLayout::Make(d.num_ranks, d.ll.max_tokens, d.ll.row_bytes, d.ll.topk,
                               d.ll.num_experts);
  for (int r = 0; r < kMaxRanks; ++r)
    a.peers.base[r] = r < d.num_ranks ? d.peers.base[r] + d.ll.offset : nullptr;
  a.me = d.rank;
  a.expect_group = d.group;
  a.host_err = ErrorMirror(ordinal);
  a.timeout_ns = KernelTimeoutNs();
  a.max_blocks = LLMaxBlocks(ordinal);
  return a;
}

// The op kind and the rows' element type, folded into a call tag: ranks whose calls
// differ only in dtype (bfloat16 and float16 rows have the same size) never mix.
int TagKind(int op, ffi::DataType t) { return op | (static_cast<int>(t) << 4); }

ffi::Error LaunchRank(std::initializer_list<int> phases, const LowLatencyArgs& a,
                      cudaStream_t stream) {
  for (int phase : phases) {
    const cudaError_t e = LaunchLowLatencyPhase(phase, a, stream);
    if (e != cudaSuccess) return CudaFailed("kernel launch", e);
  }
  return ffi::Error::Success();
}

// FP8 mode of a dispatch (LowLatencyArgs::fp8) from the call's round_scale attribute.
int Fp8Mode(bool fp8, int64_t round_scale) { return fp8 ? (round_scale != 0 ? 2 : 1) : 0; }

// Send half of a dispatch; with fp8 (1 or 2) each row goes as one FP8 message of
// ll_fp8_msg_bytes(H) bytes cast in the kernel, and stage_x is that message's [*, bytes].
ffi::Error RankDispatchSend(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer x,
                            ffi::Buffer<ffi::S32> topk_idx, ffi::Result<ffi::AnyBuffer> stage_x,
                            ffi::ResultBuffer<ffi::S32> stage_idx,
                            ffi::ResultBuffer<ffi::S32> expert_count, int64_t num_experts,
                            int64_t num_ranks, int64_t max_tokens, int64_t call_site, int fp8) {
  JEP_NVTX_RANGE("jax_ep.low_latency.dispatch_send");
  auto xd = x.dimensions();
  auto id = topk_idx.dimensions();
  if (xd.size() != 2) return Invalid("x must be [S, H], got " + Dims(xd));
  if (id.size() != 2) return Invalid("topk_idx must be [S, K], got " + Dims(id));
  const int64_t S = xd[0], H = xd[1], K = id[1];
  FloatKind kind = FloatKind::kF32;
  std::string err = ExpectShape("topk_idx", id, {S, K});
  if (err.empty() && S * K < 1) err = "x and topk_idx need at least one token and one slot";
  if (err.empty() && fp8 != 0 && (H % kFp8Block != 0 || !FloatKindOf(x.element_type(), &kind)))
    err = "fp8 needs x float32, bfloat16 or float16 with H a multiple of 128";
  const int64_t rb = fp8 != 0 ? static_cast<int64_t>(ll_fp8_msg_bytes(H))
                              : H * static_cast<int64_t>(ffi::ByteWidth(x.element_type()));
  const int64_t width = fp8 != 0 ? rb : H;
  // Never written here: the zero-row placeholder, or the CPU's [S, H] ([S, bytes] with fp8).
  if (err.empty() && !HasShape(stage_x->dimensions(), {0, width}))
    err = ExpectShape("stage_x", stage_x->dimensions(), {S, width});
  if (err.empty()) err = ExpectShape("stage_idx", stage_idx->dimensions(), {S, K});
  if (err.empty()) err = ExpectShape("expert_count", expert_count->dimensions(), {num_experts});
  if (!err.empty()) return Invalid(err);
  CudaDomain d;
  if (ffi::Error e = RankDomain(ordinal, num_ranks, num_experts, &d); e.failure()) return e;
  err = FitsArea(d, max_tokens, static_cast<size_t>(rb), S * K, 0);
  if (!err.empty()) return Invalid(err);
  LowLatencyArgs a = RankArgs(d, ordinal);
  a.M = static_cast<int>(max_tokens);
  a.row_bytes = static_cast<size_t>(rb);
  a.S = static_cast<int>(S);
  a.K = static_cast<int>(K);
  a.H = H;
  a.kind = kind;
  a.fp8 = fp8;
  // FP8 sends tag as their own op kind (and round_scale), so a rank never mixes them with
  // rows of x's dtype.
  a.tag = ll_call_tag(call_site, TagKind(fp8 != 0 ? 1 + fp8 : 0, x.element_type()), S, K,
                      max_tokens, rb, num_experts);
  a.x = x.untyped_data();
  a.topk_idx = topk_idx.typed_data();
  a.expert_count = expert_count->typed_data();
  a.epoch_out = stage_idx->typed_data();
  return LaunchRank({kLLDispatchSend}, a, stream);
}

ffi::Error RankDispatchSendImpl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer x,
                                ffi::Buffer<ffi::S32> topk_idx,
                                ffi::Result<ffi::AnyBuffer> stage_x,
                                ffi::ResultBuffer<ffi::S32> stage_idx,
                                ffi::ResultBuffer<ffi::S32> expert_count, int64_t num_experts,
                                int64_t num_ranks, int64_t max_tokens, int64_t call_site) {
  return RankDispatchSend(stream, ordinal, x, topk_idx, stage_x, stage_idx, expert_count,
                          num_experts, num_ranks, max_tokens, call_site, 0);
}

ffi::Error RankDispatchSendFp8Impl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer x,
                                   ffi::Buffer<ffi::S32> topk_idx,
                                   ffi::Result<ffi::AnyBuffer> stage_x,
                                   ffi::ResultBuffer<ffi::S32> stage_idx,
                                   ffi::ResultBuffer<ffi::S32> expert_count, int64_t num_experts,
                                   int64_t num_ranks, int64_t max_tokens, int64_t call_site,
                                   int64_t round_scale) {
  return RankDispatchSend(stream, ordinal, x, topk_idx, stage_x, stage_idx, expert_count,
                          num_experts, num_ranks, max_tokens, call_site,
                          Fp8Mode(true, round_scale));
}

// Receive half of a dispatch. Rows of row_bytes bytes into recv_x (its element width
// `x_bytes`); with fp8, messages split into recv_x's H FP8 values and recv_scales.
ffi::Error RankDispatchRecv(cudaStream_t stream, int32_t ordinal, int64_t stage_width,
                            ffi::Buffer<ffi::S32> stage_idx, ffi::Buffer<ffi::S32> expert_count,
                            ffi::Buffer<ffi::S32> rank_buf, ffi::Buffer<ffi::S32> group_buf,
                            ffi::Result<ffi::AnyBuffer> recv_x, void* recv_scales,
                            ffi::Span<const int64_t> scales_dims,
                            ffi::ResultBuffer<ffi::S32> recv_count,
                            ffi::ResultBuffer<ffi::S32> src_rank,
                            ffi::ResultBuffer<ffi::S32> src_index,
                            ffi::ResultBuffer<ffi::S32> first_row,
                            ffi::ResultBuffer<ffi::S32> row_count, int64_t num_experts,
                            int64_t num_ranks, int64_t max_tokens, bool fp8) {
  JEP_NVTX_RANGE("jax_ep.low_latency.dispatch_recv");
  const int64_t R = num_ranks, M = max_tokens, E = num_experts;
  if (R < 1 || E % R != 0) return Invalid("num_experts must be a positive multiple of num_ranks");
  const int64_t el = E / R;
  auto rd = recv_x->dimensions();
  const int64_t H = fp8 ? (rd.size() == 3 ? rd[2] : 0) : stage_width;
  std::string err = ExpectShape("expert_count", expert_count.dimensions(), {E});
  if (err.empty() && stage_idx.element_count() < 1)
    err = "staged topk_idx must hold the send half's epoch (at least one entry)";
  if (err.empty()) err = ExpectShape("recv_x", rd, {el, R * M, H});
  if (err.empty() && fp8 && recv_x->element_type() != ffi::DataType::F8E4M3FN)
    err = "recv_x must be float8_e4m3fn with fp8";
  if (err.empty() && fp8 && (H % kFp8Block != 0 ||
                             stage_width != static_cast<int64_t>(ll_fp8_msg_bytes(H))))
    err = "the staged FP8 messages must be [S, ll_fp8_msg_bytes(H)] for H a multiple of 128";
  if (err.empty() && fp8)
    err = ExpectShape("recv_scales", scales_dims, {el, R * M, H / kFp8Block});
  if (err.empty()) err = ExpectShape("recv_count", recv_count->dimensions(), {el});
  if (err.empty()) err = ExpectShape("src_rank", src_rank->dimensions(), {el, R * M});
  if (err.empty()) err = ExpectShape("src_index", src_index->dimensions(), {el, R * M});
  if (err.empty()) err = ExpectShape("first_row", first_row->dimensions(), {el, R});
  if (err.empty()) err = ExpectShape("row_count", row_count->dimensions(), {el, R});
  if (!err.empty()) return Invalid(err);
  CudaDomain d;
  if (ffi::Error e = RankDomain(ordinal, R, E, &d); e.failure()) return e;
  const size_t rb = fp8 ? ll_fp8_msg_bytes(H)
                        : static_cast<size_t>(H) * ffi::ByteWidth(recv_x->element_type());
  err = FitsArea(d, M, rb, 0, 0);
  if (!err.empty()) return Invalid(err);
  LowLatencyArgs a = RankArgs(d, ordinal);
  a.M = static_cast<int>(M);
  a.row_bytes = rb;
  a.H = H;
  a.fp8 = fp8 ? 1 : 0;
  a.rank_in = rank_buf.typed_data();
  a.group_in = group_buf.typed_data();
  a.epoch_in = stage_idx.typed_data();
  a.recv_x = recv_x->untyped_data();
  a.recv_scales = recv_scales;
  a.recv_count = recv_count->typed_data();
  a.src_rank = src_rank->typed_data();
  a.src_index = src_index->typed_data();
  a.first_row = first_row->typed_data();
  a.row_count = row_count->typed_data();
  return LaunchRank({kLLDispatchRecv}, a, stream);
}

ffi::Error RankDispatchRecvImpl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer stage_x,
                                ffi::Buffer<ffi::S32> stage_idx,
                                ffi::Buffer<ffi::S32> expert_count,
                                ffi::Buffer<ffi::S32> rank_buf, ffi::Buffer<ffi::S32> group_buf,
                                ffi::Result<ffi::AnyBuffer> recv_x,
                                ffi::ResultBuffer<ffi::S32> recv_count,
                                ffi::ResultBuffer<ffi::S32> src_rank,
                                ffi::ResultBuffer<ffi::S32> src_index,
                                ffi::ResultBuffer<ffi::S32> first_row,
                                ffi::ResultBuffer<ffi::S32> row_count, int64_t num_experts,
                                int64_t num_ranks, int64_t max_tokens, int64_t call_site) {
  auto xd = stage_x.dimensions();
  if (xd.size() != 2) return Invalid("staged x must be [S, H], got " + Dims(xd));
  if (stage_x.element_type() != recv_x->element_type())
    return Invalid("recv_x must have the staged x's dtype");
  return RankDispatchRecv(stream, ordinal, xd[1], stage_idx, expert_count, rank_buf, group_buf,
                          recv_x, nullptr, {}, recv_count, src_rank, src_index, first_row,
                          row_count, num_experts, num_ranks, max_tokens, false);
}

ffi::Error RankDispatchRecvFp8Impl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer stage_x,
                                   ffi::Buffer<ffi::S32> stage_idx,
                                   ffi::Buffer<ffi::S32> expert_count,
                                   ffi::Buffer<ffi::S32> rank_buf,
                                   ffi::Buffer<ffi::S32> group_buf,
                                   ffi::Result<ffi::AnyBuffer> recv_x,
                                   ffi::ResultBuffer<ffi::F32> recv_scales,
                                   ffi::ResultBuffer<ffi::S32> recv_count,
                                   ffi::ResultBuffer<ffi::S32> src_rank,
                                   ffi::ResultBuffer<ffi::S32> src_index,
                                   ffi::ResultBuffer<ffi::S32> first_row,
                                   ffi::ResultBuffer<ffi::S32> row_count, int64_t num_experts,
                                   int64_t num_ranks, int64_t max_tokens, int64_t call_site) {
  auto xd = stage_x.dimensions();
  if (xd.size() != 2) return Invalid("staged FP8 messages must be [S, bytes], got " + Dims(xd));
  return RankDispatchRecv(stream, ordinal, xd[1], stage_idx, expert_count, rank_buf, group_buf,
                          recv_x, recv_scales->untyped_data(), recv_scales->dimensions(),
                          recv_count, src_rank, src_index, first_row, row_count, num_experts,
                          num_ranks, max_tokens, true);
}

ffi::Error RankCombineSendImpl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer y,
                               ffi::Buffer<ffi::S32> first_row, ffi::Buffer<ffi::S32> row_count,
                               ffi::Result<ffi::AnyBuffer> stage,
                               ffi::ResultBuffer<ffi::S32> status, int64_t num_ranks,
                               int64_t max_tokens, int64_t rows_per_dest, int64_t call_site) {
  JEP_NVTX_RANGE("jax_ep.low_latency.combine_send");
  auto yd = y.dimensions();
  if (yd.size() != 3) return Invalid("y must be [E_local, R * M, H], got " + Dims(yd));
  const int64_t el = yd[0], H = yd[2], R = num_ranks, M = max_tokens;
  std::string err = ExpectShape("y", yd, {el, R * M, H});
  if (err.empty()) err = ExpectShape("handle.first_row", first_row.dimensions(), {el, R});
  if (err.empty()) err = ExpectShape("handle.row_count", row_count.dimensions(), {el, R});
  // Never written here: the zero-row placeholder, or the CPU's [R, rows_per_dest, H].
  if (err.empty() && !HasShape(stage->dimensions(), {R, 0, H}))
    err = ExpectShape("stage", stage->dimensions(), {R, rows_per_dest, H});
  if (err.empty() && rows_per_dest < 1) err = "rows_per_dest must be >= 1";
  if (err.empty()) err = ExpectShape("status", status->dimensions(), {});
  if (!err.empty()) return Invalid(err);
  CudaDomain d;
  if (ffi::Error e = RankDomain(ordinal, R, el * R, &d); e.failure()) return e;
  const size_t rb = static_cast<size_t>(H) * ffi::ByteWidth(y.element_type());
  err = FitsArea(d, M, rb, 0, rows_per_dest);
  if (!err.empty()) return Invalid(err);
  LowLatencyArgs a = RankArgs(d, ordinal);
  a.M = static_cast<int>(M);
  a.row_bytes = rb;
  a.H = H;
  a.tag = ll_call_tag(call_site, TagKind(1, y.element_type()), rows_per_dest, 0, M,
                      static_cast<int64_t>(rb), el * R);
  a.rows_per_dest = rows_per_dest;
  a.y = y.untyped_data();
  a.first_row = const_cast<int32_t*>(first_row.typed_data());
  a.row_count = const_cast<int32_t*>(row_count.typed_data());
  a.epoch_out = status->typed_data();
  return LaunchRank({kLLCombineSend}, a, stream);
}

ffi::Error RankCombineRecvImpl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer stage,
                               ffi::Buffer<ffi::S32> status, ffi::Buffer<ffi::S32> topk_idx,
                               ffi::Buffer<ffi::F32> topk_weights, ffi::Buffer<ffi::S32> rank_buf,
                               ffi::Buffer<ffi::S32> group_buf, ffi::Result<ffi::AnyBuffer> out,
                               int64_t num_experts, int64_t num_ranks, int64_t max_tokens,
                               int64_t call_site) {
  JEP_NVTX_RANGE("jax_ep.low_latency.combine_recv");
  auto sd = stage.dimensions();
  auto id = topk_idx.dimensions();
  if (sd.size() != 3) return Invalid("stage must be [R, rows, H], got " + Dims(sd));
  if (id.size() != 2) return Invalid("topk_idx must be [S, K], got " + Dims(id));
  // rpd: 0 for the zero-row placeholder (the send half checked the call's rows then).
  const int64_t R = num_ranks, rpd = sd[1], H = sd[2], S = id[0], K = id[1];
  std::string err = ExpectShape("stage", sd, {R, rpd, H});
  if (err.empty()) err = ExpectShape("topk_weights", topk_weights.dimensions(), {S, K});
  if (err.empty()) err = ExpectShape("out", out->dimensions(), {S, H});
  if (err.empty() && status.element_count() < 1)
    err = "status must hold the send half's epoch (one entry)";
  FloatKind kind;
  if (err.empty() && !FloatKindOf(stage.element_type(), &kind))
    err = "y must be float32, bfloat16 or float16";
  if (!err.empty()) return Invalid(err);
  CudaDomain d;
  if (ffi::Error e = RankDomain(ordinal, R, num_experts, &d); e.failure()) return e;
  const size_t rb = static_cast<size_t>(H) * ffi::ByteWidth(stage.element_type());
  err = FitsArea(d, max_tokens, rb, S * K, rpd);
  if (!err.empty()) return Invalid(err);
  LowLatencyArgs a = RankArgs(d, ordinal);
  a.M = static_cast<int>(max_tokens);
  a.row_bytes = rb;
  a.S = static_cast<int>(S);
  a.K = static_cast<int>(K);
  a.H = H;
  a.kind = kind;
  a.rank_in = rank_buf.typed_data();
  a.group_in = group_buf.typed_data();
  a.epoch_in = status.typed_data();
  a.topk_idx = topk_idx.typed_data();
  a.topk_w = topk_weights.typed_data();
  a.out = out->untyped_data();
  return LaunchRank({kLLCombineRecvPlan, kLLCombineRecv}, a, stream);
}

}  // namespace

// The handlers of JEP_CUDA_LL_TARGETS (xla_ffi/common/op_tables.h), and their registration.
JEP_FFI_DEFINE_TARGETS_WITH_ADDER(JEP_CUDA_LL_TARGETS, AddLowLatencyCudaRegistrations)

}  // namespace jax_ep
