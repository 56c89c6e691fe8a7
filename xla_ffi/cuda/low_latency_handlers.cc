// Low-latency mode on CUDA, through the virtual-rank harness: R ranks' buffers share one
// allocation on this GPU and every phase is launched for each rank before the next phase
// of any (kernels/cuda/low_latency_kernels.h). The send and receive halves are separate
// custom calls; a small token array orders them. Shapes are validated on the host; value
// errors (ids, a foreign handle, a missing arrival) go to the sticky device record. The
// buffer is allocated on first use (and grown), which synchronizes: these targets are not
// registered as command-buffer compatible.
#include "xla_ffi/cuda/low_latency_handlers.h"

#include <cuda_runtime_api.h>

#include <mutex>
#include <string>

#include "kernels/cuda/low_latency_kernels.h"
#include "xla_ffi/common/ffi_helpers.h"
#include "xla_ffi/cuda/cuda_state.h"

namespace ffi = xla::ffi;

namespace jax_ep {
namespace {

ffi::Error CudaFailed(const char* what, cudaError_t e) {
  return ffi::Error(ffi::ErrorCode::kInternal,
                    std::string("jax_ep.low_latency: ") + what + ": " + cudaGetErrorString(e));
}

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
  return ffi::Error::Success();
}

std::string CheckConfig(int64_t R, int64_t E, int64_t M, int64_t K) {
  if (R < 1 || E % R != 0) return "num_experts must be a positive multiple of the ranks";
  if (M < 1 || K < 1) return "max_tokens and topk must be >= 1";
  if (E > 1024) return "num_experts above 1024 is not supported on GPU";
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
  a.S = static_cast<int>(S);
  a.K = static_cast<int>(K);
  a.H = H;
  if (ffi::Error e = Buffers(stream, ordinal, static_cast<int>(R), &a); e.failure()) return e;
  cudaError_t ce = cudaMemsetAsync(token->typed_data(), 0, R * sizeof(int32_t), stream);
  if (ce != cudaSuccess) return CudaFailed("token", ce);
  return Launch({kLLDispatchPlan, kLLDispatchPush}, static_cast<int>(R), stream, [&](int r) {
    LowLatencyArgs b = a;
    b.me = r;
    b.x = static_cast<const char*>(x.untyped_data()) + r * S * rb;
    b.topk_idx = topk_idx.typed_data() + r * S * K;
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
  if (!err.empty()) return Invalid(err);
  LowLatencyArgs a{};
  const size_t rb = static_cast<size_t>(H) * ffi::ByteWidth(recv_x->element_type());
  a.L = LowLatencyLayout::Make(static_cast<int>(R), static_cast<int>(M), rb,
                               static_cast<int>(topk_max), static_cast<int>(num_experts));
  a.H = H;
  if (ffi::Error e = Buffers(stream, ordinal, static_cast<int>(R), &a); e.failure()) return e;
  const int64_t blk = el * R * M;
  return Launch({kLLDispatchRecv}, static_cast<int>(R), stream, [&](int r) {
    LowLatencyArgs b = a;
    b.me = r;
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
  a.H = H;
  if (ffi::Error e = Buffers(stream, ordinal, static_cast<int>(R), &a); e.failure()) return e;
  cudaError_t ce = cudaMemsetAsync(token->typed_data(), 0, R * sizeof(int32_t), stream);
  if (ce != cudaSuccess) return CudaFailed("token", ce);
  const int64_t blk = el * R * M;
  return Launch({kLLCombinePlan, kLLCombinePush}, static_cast<int>(R), stream, [&](int r) {
    LowLatencyArgs b = a;
    b.me = r;
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
  auto id = topk_idx.dimensions();
  auto od = out->dimensions();
  if (id.size() != 3) return Invalid("harness topk_idx must be [R, S, K], got " + Dims(id));
  if (od.size() != 3) return Invalid("harness out must be [R, S, H], got " + Dims(od));
  const int64_t R = id[0], S = id[1], K = id[2], H = od[2];
  std::string err = CheckConfig(R, num_experts, max_tokens, topk_max);
  if (err.empty()) err = ExpectShape("topk_weights", topk_w.dimensions(), {R, S, K});
  if (err.empty()) err = ExpectShape("out", od, {R, S, H});
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
  a.S = static_cast<int>(S);
  a.K = static_cast<int>(K);
  a.H = H;
  a.kind = kind;
  if (ffi::Error e = Buffers(stream, ordinal, static_cast<int>(R), &a); e.failure()) return e;
  return Launch({kLLCombineRecvPlan, kLLCombineRecv}, static_cast<int>(R), stream, [&](int r) {
    LowLatencyArgs b = a;
    b.me = r;
    b.topk_idx = topk_idx.typed_data() + r * S * K;
    b.topk_w = topk_w.typed_data() + r * S * K;
    b.out = static_cast<char*>(out->untyped_data()) + r * S * rb;
    return b;
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER(kDispatchSend, DispatchSendImpl,
                       ffi::Ffi::Bind()
                           .Ctx<ffi::PlatformStream<cudaStream_t>>()
                           .Ctx<ffi::DeviceOrdinal>()
                           .Arg<ffi::AnyBuffer>()
                           .Arg<ffi::Buffer<ffi::S32>>()
                           .Ret<ffi::Buffer<ffi::S32>>()
                           .Attr<int64_t>("num_experts")
                           .Attr<int64_t>("max_tokens")
                           .Attr<int64_t>("topk_max"));

XLA_FFI_DEFINE_HANDLER(kDispatchRecv, DispatchRecvImpl,
                       ffi::Ffi::Bind()
                           .Ctx<ffi::PlatformStream<cudaStream_t>>()
                           .Ctx<ffi::DeviceOrdinal>()
                           .Arg<ffi::Buffer<ffi::S32>>()
                           .Ret<ffi::AnyBuffer>()
                           .Ret<ffi::Buffer<ffi::S32>>()
                           .Ret<ffi::Buffer<ffi::S32>>()
                           .Ret<ffi::Buffer<ffi::S32>>()
                           .Ret<ffi::Buffer<ffi::S32>>()
                           .Ret<ffi::Buffer<ffi::S32>>()
                           .Attr<int64_t>("num_experts")
                           .Attr<int64_t>("max_tokens")
                           .Attr<int64_t>("topk_max"));

XLA_FFI_DEFINE_HANDLER(kCombineSend, CombineSendImpl,
                       ffi::Ffi::Bind()
                           .Ctx<ffi::PlatformStream<cudaStream_t>>()
                           .Ctx<ffi::DeviceOrdinal>()
                           .Arg<ffi::AnyBuffer>()
                           .Arg<ffi::Buffer<ffi::S32>>()
                           .Arg<ffi::Buffer<ffi::S32>>()
                           .Ret<ffi::Buffer<ffi::S32>>()
                           .Attr<int64_t>("num_experts")
                           .Attr<int64_t>("max_tokens")
                           .Attr<int64_t>("topk_max"));

XLA_FFI_DEFINE_HANDLER(kCombineRecv, CombineRecvImpl,
                       ffi::Ffi::Bind()
                           .Ctx<ffi::PlatformStream<cudaStream_t>>()
                           .Ctx<ffi::DeviceOrdinal>()
                           .Arg<ffi::Buffer<ffi::S32>>()
                           .Arg<ffi::Buffer<ffi::S32>>()
                           .Arg<ffi::Buffer<ffi::F32>>()
                           .Ret<ffi::AnyBuffer>()
                           .Attr<int64_t>("num_experts")
                           .Attr<int64_t>("max_tokens")
                           .Attr<int64_t>("topk_max"));

void AddLowLatencyCudaRegistrations(const RegisterFn& add) {
  add("jax_ep_ll_harness_dispatch_send", reinterpret_cast<void*>(kDispatchSend));
  add("jax_ep_ll_harness_dispatch_recv", reinterpret_cast<void*>(kDispatchRecv));
  add("jax_ep_ll_harness_combine_send", reinterpret_cast<void*>(kCombineSend));
  add("jax_ep_ll_harness_combine_recv", reinterpret_cast<void*>(kCombineRecv));
}

}  // namespace jax_ep
