// CUDA FFI handlers: validate shapes and attributes on the host (static shapes, so no
// device value is ever read here), then launch the kernels on XLA's stream. Nothing in
// a call synchronizes with the host, so the collective handlers are registered as
// command-buffer (CUDA graph) compatible.
//
// Errors that depend on values (ids outside [-1, E), a foreign handle, a missing peer)
// are found on the device. Kernels then treat the bad entries as unused, finish the
// protocol so no peer hangs, and record the error in a sticky per-GPU record that is
// mirrored to mapped host memory. Every later jax_ep CUDA call in the process fails with
// that message until jax_ep.cuda.check_errors() reads and clears it.
#include "xla_ffi/cuda_handlers.h"

#include <cuda_runtime_api.h>

#include <mutex>
#include <sstream>
#include <string>

#include "kernels/configs.h"
#include "kernels/cuda_kernels.h"
#include "kernels/intranode_buffer.h"
#include "xla_ffi/cuda_state.h"
#include "xla_ffi/ffi_helpers.h"

namespace ffi = xla::ffi;

namespace jax_ep {
namespace {

ffi::Error CudaFailed(const char* what, cudaError_t e) {
  return ffi::Error(ffi::ErrorCode::kInternal,
                    std::string("jax_ep: ") + what + ": " + cudaGetErrorString(e));
}

bool ElemKindOf(ffi::DataType t, ElemKind* k) {
  switch (t) {
    case ffi::DataType::F32: *k = ElemKind::kF32; return true;
    case ffi::DataType::BF16: *k = ElemKind::kBF16; return true;
    case ffi::DataType::F16: *k = ElemKind::kF16; return true;
    default: return false;
  }
}

// A sticky device error from an earlier call fails every later call (see top).
ffi::Error PendingError() {
  const std::string msg = PendingMirrorError();
  if (msg.empty()) return ffi::Error::Success();
  return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                    msg + " (reported by an earlier call; jax_ep.cuda.check_errors() clears it)");
}

ffi::Error Domain(int ordinal, int64_t num_ranks, CudaDomain* d) {
  if (!GetCudaDomain(ordinal, d)) {
    std::ostringstream s;
    s << "no communication buffer on GPU " << ordinal
      << "; call jax_ep.cuda.setup(mesh, axis_name) before running EP ops on GPUs";
    return Invalid(s.str());
  }
  if (d->num_ranks != num_ranks) {
    std::ostringstream s;
    s << "GPU " << ordinal << " was set up for an EP group of " << d->num_ranks
      << " ranks, but the op has num_ranks=" << num_ranks;
    return Invalid(s.str());
  }
  return ffi::Error::Success();
}

ffi::Error CheckArea(const CudaDomain& d, int kind, size_t need, const char* what) {
  if (need <= d.areas.bytes[kind]) return ffi::Error::Success();
  std::ostringstream s;
  s << what << " needs " << need << " bytes of communication buffer but jax_ep.cuda.setup "
    << "reserved " << d.areas.bytes[kind] << "; pass larger sizes to setup (see "
    << "jax_ep.cuda.buffer_bytes)";
  return Invalid(s.str());
}

CommonArgs MakeCommon(const CudaDomain& d, int kind, const int32_t* rank_in,
                      const int32_t* group_in, int ordinal) {
  CommonArgs c{};
  c.peers = d.peers;
  c.area_off = d.areas.offset(kind);
  c.me = d.rank;
  c.num_ranks = d.num_ranks;
  c.expect_group = d.group;
  c.rank_in = rank_in;
  c.group_in = group_in;
  c.host_err = ErrorMirror(ordinal);
  c.timeout_ns = KernelTimeoutNs();
  return c;
}

// ------------------------------- layout --------------------------------

ffi::Error LayoutImpl(cudaStream_t stream, int32_t ordinal, ffi::Buffer<ffi::S32> topk_idx,
                      ffi::ResultBuffer<ffi::S32> per_rank, ffi::ResultBuffer<ffi::S32> per_expert,
                      ffi::ResultBuffer<ffi::PRED> in_rank, int64_t num_experts,
                      int64_t num_ranks) {
  auto d = topk_idx.dimensions();
  if (d.size() != 2) return Invalid("topk_idx must be [T, K], got " + Dims(d));
  if (num_ranks < 1 || num_experts % num_ranks != 0)
    return Invalid("num_experts must be a positive multiple of num_ranks");
  if (num_ranks > 4096) return Invalid("num_ranks above 4096 is not supported on GPU");
  if (ffi::Error e = PendingError(); e.failure()) return e;
  const cudaError_t err =
      LaunchLayout(stream, topk_idx.typed_data(), static_cast<int>(d[0]), static_cast<int>(d[1]),
                   static_cast<int>(num_experts), static_cast<int>(num_ranks),
                   per_rank->typed_data(), per_expert->typed_data(), in_rank->typed_data(),
                   ErrorMirror(ordinal));
  if (err != cudaSuccess) return CudaFailed("layout kernel launch", err);
  return ffi::Error::Success();
}

// ------------------------------- dispatch -------------------------------

struct DispatchShapes {
  int64_t T, H, K, R, C, E;
  size_t row_bytes;
};

std::string ValidateDispatch(ffi::AnyBuffer x, ffi::Span<const int64_t> id,
                             ffi::Span<const int64_t> wd, ffi::Span<const int64_t> rxd,
                             ffi::Span<const int64_t> srd, int64_t num_experts, int64_t R,
                             int64_t C, DispatchShapes* s) {
  auto xd = x.dimensions();
  if (xd.size() != 2) return "x must be [T, H], got " + Dims(xd);
  if (id.size() != 2) return "topk_idx must be [T, K], got " + Dims(id);
  s->T = xd[0];
  s->H = xd[1];
  s->K = id[1];
  s->R = R;
  s->C = C;
  s->E = num_experts;
  s->row_bytes = static_cast<size_t>(s->H) * ffi::ByteWidth(x.element_type());
  std::string err = ExpectShape("topk_idx", id, {s->T, s->K});
  if (err.empty()) err = ExpectShape("topk_weights", wd, {s->T, s->K});
  if (err.empty()) err = ExpectShape("recv_x", rxd, {C, s->H});
  if (err.empty()) err = ExpectShape("send_row", srd, {s->T, R});
  if (!err.empty()) return err;
  if (R < 1 || num_experts % R != 0) return "num_experts must be a multiple of num_ranks";
  if (C < 1) return "capacity must be >= 1";
  if (R > kMaxRanks) return "num_ranks above 32 is not supported by the intranode GPU path";
  return {};
}

DispatchArgs MakeDispatchArgs(const DispatchShapes& s) {
  DispatchArgs a{};
  a.T = static_cast<int>(s.T);
  a.K = static_cast<int>(s.K);
  a.C = static_cast<int>(s.C);
  a.E = static_cast<int>(s.E);
  a.experts_per_rank = static_cast<int>(s.E / s.R);
  a.row_bytes = s.row_bytes;
  return a;
}

ffi::Error DispatchImpl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer x,
                        ffi::Buffer<ffi::S32> topk_idx, ffi::Buffer<ffi::F32> topk_weights,
                        ffi::Buffer<ffi::S32> rank_buf, ffi::Buffer<ffi::S32> group_buf,
                        ffi::Result<ffi::AnyBuffer> recv_x, ffi::ResultBuffer<ffi::S32> recv_idx,
                        ffi::ResultBuffer<ffi::F32> recv_w, ffi::ResultBuffer<ffi::S32> num_recv,
                        ffi::ResultBuffer<ffi::S32> num_dropped,
                        ffi::ResultBuffer<ffi::S32> recv_per_expert,
                        ffi::ResultBuffer<ffi::S32> src_rank, ffi::ResultBuffer<ffi::S32> src_index,
                        ffi::ResultBuffer<ffi::S32> send_row, int64_t num_experts,
                        int64_t num_ranks, int64_t capacity, int64_t call_site) {
  DispatchShapes s{};
  std::string err = ValidateDispatch(x, topk_idx.dimensions(), topk_weights.dimensions(),
                                     recv_x->dimensions(), send_row->dimensions(), num_experts,
                                     num_ranks, capacity, &s);
  if (!err.empty()) return Invalid(err);
  if (ffi::Error e = PendingError(); e.failure()) return e;
  CudaDomain dom;
  if (ffi::Error e = Domain(ordinal, num_ranks, &dom); e.failure()) return e;
  const int R = static_cast<int>(num_ranks);
  if (ffi::Error e = CheckArea(dom, kOpDispatch,
                               DispatchAreaBytes(R, s.T, s.C, s.row_bytes, static_cast<int>(s.K)),
                               "dispatch");
      e.failure())
    return e;
  DispatchArgs a = MakeDispatchArgs(s);
  a.c = MakeCommon(dom, kOpDispatch, rank_buf.typed_data(), group_buf.typed_data(), ordinal);
  a.x = x.untyped_data();
  a.topk_idx = topk_idx.typed_data();
  a.topk_w = topk_weights.typed_data();
  a.recv_x = recv_x->untyped_data();
  a.recv_idx = recv_idx->typed_data();
  a.recv_w = recv_w->typed_data();
  a.num_recv = num_recv->typed_data();
  a.num_dropped = num_dropped->typed_data();
  a.recv_per_expert = recv_per_expert->typed_data();
  a.src_rank = src_rank->typed_data();
  a.src_index = src_index->typed_data();
  a.send_row = send_row->typed_data();
  const IntranodePreset& p = SelectIntranodePreset(R);
  for (int phase = 0; phase < kNumPhases; ++phase) {
    const cudaError_t e = LaunchDispatchPhase(phase, a, p, stream);
    if (e != cudaSuccess) return CudaFailed("dispatch kernel launch", e);
  }
  return ffi::Error::Success();
}

// ------------------------------- combine --------------------------------

std::string ValidateCombine(ffi::AnyBuffer y, ffi::Span<const int64_t> sd,
                            ffi::Span<const int64_t> od, int64_t R, ElemKind* kind) {
  auto yd = y.dimensions();
  if (yd.size() != 2) return "y must be [C, H], got " + Dims(yd);
  if (sd.size() != 2 || sd[1] != R) return "handle.send_row must be [T, R], got " + Dims(sd);
  std::string err = ExpectShape("out", od, {sd[0], yd[1]});
  if (!err.empty()) return err;
  if (!ElemKindOf(y.element_type(), kind)) return "y must be float32, bfloat16 or float16";
  if (R < 1 || R > kMaxRanks) return "num_ranks must be in [1, 32] on the intranode GPU path";
  return {};
}

ffi::Error CombineImpl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer y,
                       ffi::Buffer<ffi::S32> send_row, ffi::Buffer<ffi::S32> rank_buf,
                       ffi::Buffer<ffi::S32> group_buf, ffi::Result<ffi::AnyBuffer> out,
                       int64_t num_ranks, int64_t call_site) {
  ElemKind kind = ElemKind::kF32;
  std::string err = ValidateCombine(y, send_row.dimensions(), out->dimensions(), num_ranks, &kind);
  if (!err.empty()) return Invalid(err);
  if (ffi::Error e = PendingError(); e.failure()) return e;
  CudaDomain dom;
  if (ffi::Error e = Domain(ordinal, num_ranks, &dom); e.failure()) return e;
  const int64_t C = y.dimensions()[0], H = y.dimensions()[1], T = send_row.dimensions()[0];
  const size_t row_bytes = static_cast<size_t>(H) * ffi::ByteWidth(y.element_type());
  const int R = static_cast<int>(num_ranks);
  if (ffi::Error e = CheckArea(dom, kOpCombine, CombineAreaBytes(R, T, C, row_bytes), "combine");
      e.failure())
    return e;
  CombineArgs a{};
  a.c = MakeCommon(dom, kOpCombine, rank_buf.typed_data(), group_buf.typed_data(), ordinal);
  a.T = static_cast<int>(T);
  a.C = static_cast<int>(C);
  a.H = static_cast<int>(H);
  a.kind = kind;
  a.row_bytes = row_bytes;
  a.y = y.untyped_data();
  a.send_row = send_row.typed_data();
  a.out = out->untyped_data();
  const IntranodePreset& p = SelectIntranodePreset(R);
  for (int phase = 0; phase < kNumPhases; ++phase) {
    const cudaError_t e = LaunchCombinePhase(phase, a, p, stream);
    if (e != cudaSuccess) return CudaFailed("combine kernel launch", e);
  }
  return ffi::Error::Success();
}

// ------------------------------- gather ---------------------------------

std::string ValidateGather(ffi::AnyBuffer g, ffi::Span<const int64_t> srd,
                           ffi::Span<const int64_t> sid, ffi::Span<const int64_t> od, int64_t R) {
  auto gd = g.dimensions();
  if (gd.size() != 2) return "cotangent must be [T, H], got " + Dims(gd);
  if (srd.size() != 1) return "handle.src_rank must be [C], got " + Dims(srd);
  const int64_t C = srd[0];
  std::string err = ExpectShape("handle.src_index", sid, {C});
  if (err.empty()) err = ExpectShape("out", od, {C, gd[1]});
  if (!err.empty()) return err;
  if (R < 1 || R > kMaxRanks) return "num_ranks must be in [1, 32] on the intranode GPU path";
  return {};
}

ffi::Error GatherImpl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer g,
                      ffi::Buffer<ffi::S32> src_rank, ffi::Buffer<ffi::S32> src_index,
                      ffi::Buffer<ffi::S32> rank_buf, ffi::Buffer<ffi::S32> group_buf,
                      ffi::Result<ffi::AnyBuffer> out, int64_t num_ranks, int64_t call_site) {
  std::string err = ValidateGather(g, src_rank.dimensions(), src_index.dimensions(),
                                   out->dimensions(), num_ranks);
  if (!err.empty()) return Invalid(err);
  if (ffi::Error e = PendingError(); e.failure()) return e;
  CudaDomain dom;
  if (ffi::Error e = Domain(ordinal, num_ranks, &dom); e.failure()) return e;
  const int64_t T = g.dimensions()[0], H = g.dimensions()[1], C = src_rank.dimensions()[0];
  const size_t row_bytes = static_cast<size_t>(H) * ffi::ByteWidth(g.element_type());
  const int R = static_cast<int>(num_ranks);
  if (ffi::Error e = CheckArea(dom, kOpGather, GatherLayout::Make(R, T, C, row_bytes).bytes,
                               "combine's transpose (gather)");
      e.failure())
    return e;
  GatherArgs a{};
  a.c = MakeCommon(dom, kOpGather, rank_buf.typed_data(), group_buf.typed_data(), ordinal);
  a.T = static_cast<int>(T);
  a.C = static_cast<int>(C);
  a.row_bytes = row_bytes;
  a.g = g.untyped_data();
  a.src_rank = src_rank.typed_data();
  a.src_index = src_index.typed_data();
  a.out = out->untyped_data();
  const IntranodePreset& p = SelectIntranodePreset(R);
  for (int phase = 0; phase < kNumPhases; ++phase) {
    const cudaError_t e = LaunchGatherPhase(phase, a, p, stream);
    if (e != cudaSuccess) return CudaFailed("gather kernel launch", e);
  }
  return ffi::Error::Success();
}

// ------------------------- virtual-rank harness --------------------------
// R ranks' buffers live in one allocation on one GPU; the same kernels run for each
// rank, launched phase by phase (all ranks' plan kernels, then all push kernels, then all
// finish kernels), so no kernel waits for one launched after it.

struct HarnessBuffers {
  char* base = nullptr;
  size_t per_rank = 0;
  int num_ranks = 0;
};

std::mutex& HarnessMu() {
  static std::mutex mu;
  return mu;
}
HarnessBuffers* Harness() {
  static HarnessBuffers h[kMaxCudaDevices];
  return h;
}

// Returns the buffers for R ranks of at least `area` bytes past the header each, and
// the area layout (the op's area starts right after the header).
ffi::Error HarnessSetup(cudaStream_t stream, int ordinal, int R, int kind, size_t area,
                        PeerTable* peers, AreaConfig* areas) {
  if (ordinal < 0 || ordinal >= kMaxCudaDevices) return Invalid("device ordinal out of range");
  std::string merr;
  AllocateErrorMirror(&merr);  // best effort; check_errors() also reads the device records
  std::lock_guard<std::mutex> lock(HarnessMu());
  HarnessBuffers& h = Harness()[ordinal];
  const size_t need = AlignUp(kHeaderBytes + area, kAreaAlign);
  if (h.base == nullptr || h.num_ranks != R || h.per_rank < need) {
    if (h.base != nullptr) {
      cudaError_t e = cudaStreamSynchronize(stream);
      if (e == cudaSuccess) e = cudaFree(h.base);
      if (e != cudaSuccess) return CudaFailed("harness buffer release", e);
      h.base = nullptr;
    }
    const size_t per_rank = need > h.per_rank ? need : h.per_rank;
    void* p = nullptr;
    cudaError_t e = cudaMalloc(&p, per_rank * R);
    if (e != cudaSuccess) return CudaFailed("harness buffer allocation", e);
    e = cudaMemsetAsync(p, 0, per_rank * R, stream);
    if (e != cudaSuccess) return CudaFailed("harness buffer clear", e);
    h.base = static_cast<char*>(p);
    h.per_rank = per_rank;
    h.num_ranks = R;
  }
  for (int r = 0; r < kMaxRanks; ++r) peers->base[r] = r < R ? h.base + r * h.per_rank : nullptr;
  for (int k = 0; k < kNumOpKinds; ++k) areas->bytes[k] = k == kind ? area : 0;
  return ffi::Error::Success();
}

CommonArgs HarnessCommon(const PeerTable& peers, const AreaConfig& areas, int kind, int R,
                         int ordinal, int me) {
  CommonArgs c{};
  c.peers = peers;
  c.area_off = areas.offset(kind);
  c.me = me;
  c.num_ranks = R;
  c.expect_group = -1;
  c.rank_in = nullptr;
  c.group_in = nullptr;
  c.host_err = ErrorMirror(ordinal);
  c.timeout_ns = KernelTimeoutNs();
  return c;
}

ffi::Error HarnessDispatchImpl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer x,
                               ffi::Buffer<ffi::S32> topk_idx, ffi::Buffer<ffi::F32> topk_weights,
                               ffi::Result<ffi::AnyBuffer> recv_x,
                               ffi::ResultBuffer<ffi::S32> recv_idx,
                               ffi::ResultBuffer<ffi::F32> recv_w,
                               ffi::ResultBuffer<ffi::S32> num_recv,
                               ffi::ResultBuffer<ffi::S32> num_dropped,
                               ffi::ResultBuffer<ffi::S32> recv_per_expert,
                               ffi::ResultBuffer<ffi::S32> src_rank,
                               ffi::ResultBuffer<ffi::S32> src_index,
                               ffi::ResultBuffer<ffi::S32> send_row, int64_t num_experts,
                               int64_t capacity) {
  auto xd = x.dimensions();
  if (xd.size() != 3) return Invalid("harness x must be [R, T, H], got " + Dims(xd));
  const int64_t R = xd[0], T = xd[1], H = xd[2];
  auto id = topk_idx.dimensions();
  if (id.size() != 3) return Invalid("harness topk_idx must be [R, T, K], got " + Dims(id));
  const int64_t K = id[2], C = capacity;
  std::string err = ExpectShape("topk_idx", id, {R, T, K});
  if (err.empty()) err = ExpectShape("topk_weights", topk_weights.dimensions(), {R, T, K});
  if (err.empty()) err = ExpectShape("recv_x", recv_x->dimensions(), {R, C, H});
  if (err.empty()) err = ExpectShape("send_row", send_row->dimensions(), {R, T, R});
  if (!err.empty()) return Invalid(err);
  if (R < 1 || R > kMaxRanks || num_experts % R != 0)
    return Invalid("harness needs 1 <= R <= 32 and num_experts a multiple of R");
  if (C < 1) return Invalid("capacity must be >= 1");
  DispatchShapes s{T, H, K, R, C, num_experts,
                   static_cast<size_t>(H) * ffi::ByteWidth(x.element_type())};
  const int Ri = static_cast<int>(R);
  PeerTable peers;
  AreaConfig areas;
  if (ffi::Error e = HarnessSetup(stream, ordinal, Ri, kOpDispatch,
                                  DispatchAreaBytes(Ri, T, C, s.row_bytes, static_cast<int>(K)),
                                  &peers, &areas);
      e.failure())
    return e;
  const int64_t el = num_experts / R;
  const IntranodePreset& p = SelectIntranodePreset(Ri);
  for (int phase = 0; phase < kNumPhases; ++phase) {
    for (int r = 0; r < Ri; ++r) {
      DispatchArgs a = MakeDispatchArgs(s);
      a.c = HarnessCommon(peers, areas, kOpDispatch, Ri, ordinal, r);
      a.x = static_cast<const char*>(x.untyped_data()) + r * T * s.row_bytes;
      a.topk_idx = topk_idx.typed_data() + r * T * K;
      a.topk_w = topk_weights.typed_data() + r * T * K;
      a.recv_x = static_cast<char*>(recv_x->untyped_data()) + r * C * s.row_bytes;
      a.recv_idx = recv_idx->typed_data() + r * C * K;
      a.recv_w = recv_w->typed_data() + r * C * K;
      a.num_recv = num_recv->typed_data() + r;
      a.num_dropped = num_dropped->typed_data() + r;
      a.recv_per_expert = recv_per_expert->typed_data() + r * el;
      a.src_rank = src_rank->typed_data() + r * C;
      a.src_index = src_index->typed_data() + r * C;
      a.send_row = send_row->typed_data() + r * T * R;
      const cudaError_t e = LaunchDispatchPhase(phase, a, p, stream);
      if (e != cudaSuccess) return CudaFailed("harness dispatch launch", e);
    }
  }
  return ffi::Error::Success();
}

ffi::Error HarnessCombineImpl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer y,
                              ffi::Buffer<ffi::S32> send_row, ffi::Result<ffi::AnyBuffer> out) {
  auto yd = y.dimensions();
  auto sd = send_row.dimensions();
  if (yd.size() != 3) return Invalid("harness y must be [R, C, H], got " + Dims(yd));
  const int64_t R = yd[0], C = yd[1], H = yd[2];
  if (sd.size() != 3 || sd[0] != R || sd[2] != R)
    return Invalid("harness send_row must be [R, T, R], got " + Dims(sd));
  const int64_t T = sd[1];
  std::string err = ExpectShape("out", out->dimensions(), {R, T, H});
  if (!err.empty()) return Invalid(err);
  ElemKind kind = ElemKind::kF32;
  if (!ElemKindOf(y.element_type(), &kind)) return Invalid("y must be float32, bfloat16 or float16");
  if (R < 1 || R > kMaxRanks) return Invalid("harness needs 1 <= R <= 32");
  const size_t row_bytes = static_cast<size_t>(H) * ffi::ByteWidth(y.element_type());
  const int Ri = static_cast<int>(R);
  PeerTable peers;
  AreaConfig areas;
  if (ffi::Error e = HarnessSetup(stream, ordinal, Ri, kOpCombine,
                                  CombineAreaBytes(Ri, T, C, row_bytes), &peers, &areas);
      e.failure())
    return e;
  const IntranodePreset& p = SelectIntranodePreset(Ri);
  for (int phase = 0; phase < kNumPhases; ++phase) {
    for (int r = 0; r < Ri; ++r) {
      CombineArgs a{};
      a.c = HarnessCommon(peers, areas, kOpCombine, Ri, ordinal, r);
      a.T = static_cast<int>(T);
      a.C = static_cast<int>(C);
      a.H = static_cast<int>(H);
      a.kind = kind;
      a.row_bytes = row_bytes;
      a.y = static_cast<const char*>(y.untyped_data()) + r * C * row_bytes;
      a.send_row = send_row.typed_data() + r * T * R;
      a.out = static_cast<char*>(out->untyped_data()) + r * T * row_bytes;
      const cudaError_t e = LaunchCombinePhase(phase, a, p, stream);
      if (e != cudaSuccess) return CudaFailed("harness combine launch", e);
    }
  }
  return ffi::Error::Success();
}

ffi::Error HarnessGatherImpl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer g,
                             ffi::Buffer<ffi::S32> src_rank, ffi::Buffer<ffi::S32> src_index,
                             ffi::Result<ffi::AnyBuffer> out) {
  auto gd = g.dimensions();
  if (gd.size() != 3) return Invalid("harness g must be [R, T, H], got " + Dims(gd));
  const int64_t R = gd[0], T = gd[1], H = gd[2];
  auto rd = src_rank.dimensions();
  if (rd.size() != 2 || rd[0] != R) return Invalid("harness src_rank must be [R, C], got " + Dims(rd));
  const int64_t C = rd[1];
  std::string err = ExpectShape("src_index", src_index.dimensions(), {R, C});
  if (err.empty()) err = ExpectShape("out", out->dimensions(), {R, C, H});
  if (!err.empty()) return Invalid(err);
  if (R < 1 || R > kMaxRanks) return Invalid("harness needs 1 <= R <= 32");
  const size_t row_bytes = static_cast<size_t>(H) * ffi::ByteWidth(g.element_type());
  const int Ri = static_cast<int>(R);
  PeerTable peers;
  AreaConfig areas;
  if (ffi::Error e = HarnessSetup(stream, ordinal, Ri, kOpGather,
                                  GatherLayout::Make(Ri, T, C, row_bytes).bytes, &peers, &areas);
      e.failure())
    return e;
  const IntranodePreset& p = SelectIntranodePreset(Ri);
  for (int phase = 0; phase < kNumPhases; ++phase) {
    for (int r = 0; r < Ri; ++r) {
      GatherArgs a{};
      a.c = HarnessCommon(peers, areas, kOpGather, Ri, ordinal, r);
      a.T = static_cast<int>(T);
      a.C = static_cast<int>(C);
      a.row_bytes = row_bytes;
      a.g = static_cast<const char*>(g.untyped_data()) + r * T * row_bytes;
      a.src_rank = src_rank.typed_data() + r * C;
      a.src_index = src_index.typed_data() + r * C;
      a.out = static_cast<char*>(out->untyped_data()) + r * C * row_bytes;
      const cudaError_t e = LaunchGatherPhase(phase, a, p, stream);
      if (e != cudaSuccess) return CudaFailed("harness gather launch", e);
    }
  }
  return ffi::Error::Success();
}

}  // namespace

#define JEP_CMD_BUFFER {ffi::Traits::kCmdBufferCompatible}

XLA_FFI_DEFINE_HANDLER_SYMBOL(LayoutCudaHandler, LayoutImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::PRED>>()
                                  .Attr<int64_t>("num_experts")
                                  .Attr<int64_t>("num_ranks"),
                              JEP_CMD_BUFFER);

XLA_FFI_DEFINE_HANDLER_SYMBOL(DispatchCudaHandler, DispatchImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("num_experts")
                                  .Attr<int64_t>("num_ranks")
                                  .Attr<int64_t>("capacity")
                                  .Attr<int64_t>("call_site"),
                              JEP_CMD_BUFFER);

XLA_FFI_DEFINE_HANDLER_SYMBOL(CombineCudaHandler, CombineImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("num_ranks")
                                  .Attr<int64_t>("call_site"),
                              JEP_CMD_BUFFER);

XLA_FFI_DEFINE_HANDLER_SYMBOL(GatherCudaHandler, GatherImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("num_ranks")
                                  .Attr<int64_t>("call_site"),
                              JEP_CMD_BUFFER);

// The harness allocates its buffers lazily, so it is not command-buffer compatible.
XLA_FFI_DEFINE_HANDLER_SYMBOL(HarnessDispatchHandler, HarnessDispatchImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("num_experts")
                                  .Attr<int64_t>("capacity"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(HarnessCombineHandler, HarnessCombineImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(HarnessGatherHandler, HarnessGatherImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>());

}  // namespace jax_ep
