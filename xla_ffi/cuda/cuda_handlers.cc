// CUDA FFI handlers: validate shapes and attributes on the host (static shapes, so no
// device value is ever read here), then launch the kernels on XLA's stream. Nothing in
// a call synchronizes with the host, so the collective handlers are registered as
// command-buffer (CUDA graph) compatible.
//
// Errors that depend on values (ids outside [-1, E), a foreign handle, a missing peer, a
// peer in another call) are found on the device and recorded in a sticky per-GPU record,
// mirrored to mapped host memory; jax_ep.cuda.check_errors() reads and clears it. Bad
// entries are treated as unused. After a protocol error (timeout, call-site or rank
// mismatch, failed peer; also one behind an earlier bad entry, which the record's
// first-error-wins slot does not show) the kernels keep signalling but move no data,
// until jax_ep.cuda.reset(). A handler never returns early because of such an error: the
// host sees it late and at different calls on different ranks (and not at all when XLA
// replays a captured graph), so a host-side skip would leave ranks out of step.
#include "xla_ffi/cuda/cuda_handlers.h"

#include <cuda_runtime_api.h>

#include <cstdlib>
#include <mutex>
#include <sstream>
#include <string>

#include "kernels/common/configs.h"
#include "kernels/common/settings.h"
#include "kernels/cuda/cuda_kernels.h"
#include "kernels/cuda/intranode_buffer.h"
#include "xla_ffi/cuda/cuda_state.h"
#include "xla_ffi/common/ffi_helpers.h"
#include "xla_ffi/common/ffi_table.h"
#include "kernels/common/nvtx.h"

namespace ffi = xla::ffi;

namespace jax_ep {
namespace {

ffi::Error CudaFailed(const char* what, cudaError_t e) {
  return ffi::Error(ffi::ErrorCode::kInternal,
                    std::string("jax_ep: ") + what + ": " + cudaGetErrorString(e));
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

// ------------------------------- layout --------------------------------

ffi::Error LayoutImpl(cudaStream_t stream, int32_t ordinal, ffi::Buffer<ffi::S32> topk_idx,
                      ffi::ResultBuffer<ffi::S32> per_rank, ffi::ResultBuffer<ffi::S32> per_expert,
                      ffi::ResultBuffer<ffi::PRED> in_rank, int64_t num_experts,
                      int64_t num_ranks) {
  JEP_NVTX_RANGE("jax_ep.layout");
  auto d = topk_idx.dimensions();
  if (d.size() != 2) return Invalid("topk_idx must be [T, K], got " + Dims(d));
  if (num_ranks < 1 || num_experts % num_ranks != 0)
    return Invalid("num_experts must be a positive multiple of num_ranks");
  if (num_ranks > 4096) return Invalid("num_ranks above 4096 is not supported on GPU");
  MarkDeviceUsed(ordinal);
  const cudaError_t err =
      LaunchLayout(stream, topk_idx.typed_data(), static_cast<int>(d[0]), static_cast<int>(d[1]),
                   static_cast<int>(num_experts), static_cast<int>(num_ranks),
                   per_rank->typed_data(), per_expert->typed_data(), in_rank->typed_data(),
                   ErrorMirror(ordinal));
  if (err != cudaSuccess) return CudaFailed("layout kernel launch", err);
  return ffi::Error::Success();
}

// -------------------------------- ranks ---------------------------------
// The ranks one handler call launches kernels for: this GPU's rank of the group that
// jax_ep.cuda.setup registered (count 1), or the harness's R virtual ranks, whose
// buffers share one allocation on this GPU and whose inputs and outputs are stacked
// along a leading rank axis (count R, ranks 0..R-1).

struct Ranks {
  CudaDomain dom;                    // dom.rank: the first rank launched
  int count = 1;
  const int32_t* rank_in = nullptr;  // XLA's rank/group scalars, checked on the device
  const int32_t* group_in = nullptr;
  int64_t site = 0;                  // the call's call-site id, checked on the device
  const int64_t* sites = nullptr;    // harness: one per rank (tests plant mismatches)
  bool concurrent = false;           // harness: each rank on its own stream
  int absent = -1;                   // harness: a rank whose kernels are not launched
};

// A real rank: a registered domain of R ranks, room for `need`.
ffi::Error GroupRanks(int ordinal, int64_t num_ranks, int kind, size_t need, const char* what,
                      ffi::Buffer<ffi::S32> rank_buf, ffi::Buffer<ffi::S32> group_buf,
                      int64_t call_site, Ranks* k) {
  if (ffi::Error e = Domain(ordinal, num_ranks, &k->dom); e.failure()) return e;
  if (ffi::Error e = CheckArea(k->dom, kind, need, what); e.failure()) return e;
  k->rank_in = rank_buf.typed_data();
  k->group_in = group_buf.typed_data();
  k->site = call_site;
  return ffi::Error::Success();
}

// How the harness runs a call: per-rank call sites (empty: all 1), concurrent streams,
// and a rank left out (-1: none).
struct HarnessOpts {
  ffi::Span<const int64_t> call_sites;
  bool concurrent = false;
  int absent = -1;
};

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

// One stream per virtual rank, forked from and joined back into XLA's stream with events;
// made per device for the largest R so far, all in one go (see MakeRankStreams).
struct RankStreams {
  int count = 0;  // streams (and join events) made
  bool forked = false;  // `fork` made
  cudaStream_t s[kMaxRanks];
  cudaEvent_t fork;
  cudaEvent_t join[kMaxRanks];
};
RankStreams* Streams() {
  static RankStreams st[kMaxCudaDevices];
  return st;
}

// Small grids, so every rank's kernels are resident at once and really wait for each other
// (one channel for dispatch, combine and gather).
constexpr IntranodePreset kConcurrentPreset = {"concurrent", kMaxRanks, 2};

// Channels a dispatch, combine or gather call runs with: the harness's one (its ranks share a GPU),
// else the group's preset cut to the SM budget (JAX_EP_NUM_SMS, JAX_EP_INTRANODE_SMS).
int CallChannels(bool harness, int ordinal, int R) {
  const IntranodePreset p =
      harness ? kConcurrentPreset
              : IntranodeLaunchPreset(R, DeviceSmCount(ordinal));
  return p.num_sms / 2;
}

cudaError_t DestroyRankStreams(RankStreams* st) {
  cudaError_t e = cudaSuccess;
  for (int r = 0; r < st->count; ++r) {
    const cudaError_t a = cudaStreamDestroy(st->s[r]);
    const cudaError_t b = cudaEventDestroy(st->join[r]);
    if (e == cudaSuccess) e = a != cudaSuccess ? a : b;
  }
  if (st->forked) {
    const cudaError_t f = cudaEventDestroy(st->fork);
    if (e == cudaSuccess) e = f;
  }
  st->count = 0;
  st->forked = false;
  return e;
}

// The driver gives streams the GPU's hardware queues round-robin in creation order
// (CUDA_DEVICE_MAX_CONNECTIONS of them; CUDA C++ Programming Guide, "CUDA Environment
// Variables"), and a queue runs its commands in order whatever their stream. So the R
// streams are made one after another, exactly R of them (with R <= the queue count no two
// share a queue), and remade all together when a call needs more: streams made at
// different times could land on one queue.
cudaError_t MakeRankStreams(int ordinal, int R, RankStreams* st) {
  if (st->count >= R) return cudaSuccess;
  int prev = -1;
  cudaError_t e = cudaGetDevice(&prev);
  if (e == cudaSuccess) e = cudaSetDevice(ordinal);
  if (e == cudaSuccess) e = DestroyRankStreams(st);
  if (e == cudaSuccess) e = cudaEventCreateWithFlags(&st->fork, cudaEventDisableTiming);
  st->forked = e == cudaSuccess;
  for (int r = 0; r < R && e == cudaSuccess; ++r) {
    e = cudaStreamCreateWithFlags(&st->s[r], cudaStreamNonBlocking);
    if (e != cudaSuccess) break;
    e = cudaEventCreateWithFlags(&st->join[r], cudaEventDisableTiming);
    if (e != cudaSuccess) {
      cudaStreamDestroy(st->s[r]);
      break;
    }
    st->count = r + 1;
  }
  if (prev >= 0) cudaSetDevice(prev);
  return e;
}

// The hardware queues the driver made for this process: CUDA_DEVICE_MAX_CONNECTIONS as
// jax_ep.config read it (hardware_queues: once, at import, which precedes CUDA's start in
// a process that sets it before importing jax; the driver's default 8 when unset).
int HardwareQueues() { return settings().hardware_queues; }

// R virtual ranks with at least `area` bytes past the header each (the op's area starts
// right after the header), allocated on first use.
ffi::Error HarnessRanks(cudaStream_t stream, int ordinal, int R, int kind, size_t area,
                        const HarnessOpts& o, Ranks* k) {
  if (ordinal < 0 || ordinal >= kMaxCudaDevices) return Invalid("device ordinal out of range");
  if (o.call_sites.size() != 0 && static_cast<int>(o.call_sites.size()) != R)
    return Invalid("harness call_sites must list one id per rank (" + std::to_string(R) +
                   "), got " + std::to_string(o.call_sites.size()));
  if (o.absent < -1 || o.absent >= R)
    return Invalid("harness absent_rank must be -1 or a rank in [0, " + std::to_string(R) + ")");
  // The channel kernels of every rank wait on each other, so no order of them on one
  // stream can finish (each would wait for a rank that has not started): the ranks run
  // on their own streams or not at all. A sanitizer that serialises kernels cannot run
  // them for more than one rank either (scripts/gpu_sanitize_run.py).
  if (!o.concurrent)
    return Invalid("harness concurrent=False (the ranks' kernels one after another on one "
                   "stream) cannot run: every rank's channel kernels wait for the others'; "
                   "pass concurrent=True");
  // Two ranks on one hardware queue: the later one's kernels wait behind the earlier
  // one's, which wait for them.
  const int queues = HardwareQueues();
  if (R > queues)
    return Invalid("the harness runs each of its R = " + std::to_string(R) +
                   " virtual ranks on a stream of its own and their kernels wait on each other, "
                   "but the GPU has CUDA_DEVICE_MAX_CONNECTIONS = " + std::to_string(queues) +
                   " hardware queues, so ranks would share a queue and deadlock: set "
                   "CUDA_DEVICE_MAX_CONNECTIONS to at least " + std::to_string(R) +
                   " (at most 32) before CUDA initialises (before jax starts its GPU backend), "
                   "or run at most " + std::to_string(queues) + " ranks");
  MarkDeviceUsed(ordinal);
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
  k->dom.rank = 0;
  k->dom.group = -1;
  k->dom.num_ranks = R;
  for (int r = 0; r < kMaxRanks; ++r) k->dom.peers.base[r] = r < R ? h.base + r * h.per_rank : nullptr;
  for (int a = 0; a < kNumOpKinds; ++a) k->dom.areas.bytes[a] = a == kind ? area : 0;
  k->count = R;
  k->site = 1;
  k->sites = o.call_sites.size() == 0 ? nullptr : o.call_sites.begin();
  k->concurrent = true;
  k->absent = o.absent;
  return ffi::Error::Success();
}

// The per-rank dims of a harness buffer: `d` without its leading axis of R ranks.
std::string Unstack(const char* what, int64_t R, ffi::Span<const int64_t>* d) {
  if (d->size() < 2 || (*d)[0] != R)
    return std::string("harness ") + what + " must be stacked over the R = " + std::to_string(R) +
           " ranks of x/y/g on its leading axis, got " + Dims(*d);
  *d = d->last(d->size() - 1);
  return {};
}

// Rank r's slice of buffers stacked along a leading rank axis; r = 0 is all of a real
// rank's buffers.
DispatchArgs AtRank(DispatchArgs a, int r) {
  const int64_t R = a.c.num_ranks, T = a.T, K = a.K, C = a.C;
  a.x = static_cast<const char*>(a.x) + r * T * a.row_bytes;
  a.topk_idx += r * T * K;
  a.topk_w += r * T * K;
  a.recv_x = static_cast<char*>(a.recv_x) + r * C * a.row_bytes;
  a.recv_idx += r * C * K;
  a.recv_w += r * C * K;
  a.num_recv += r;
  a.num_dropped += r;
  a.recv_per_expert += static_cast<int64_t>(r) * a.experts_per_rank;
  a.src_rank += r * C;
  a.src_index += r * C;
  a.send_row += r * T * R;
  return a;
}
CombineArgs AtRank(CombineArgs a, int r) {
  const int64_t R = a.c.num_ranks, T = a.T, C = a.C;
  a.y = static_cast<const char*>(a.y) + r * C * a.row_bytes;
  a.send_row += r * T * R;
  a.out = static_cast<char*>(a.out) + r * T * a.row_bytes;
  return a;
}
GatherArgs AtRank(GatherArgs a, int r) {
  const int64_t T = a.T, C = a.C;
  a.g = static_cast<const char*>(a.g) + r * T * a.row_bytes;
  a.src_rank += r * C;
  a.src_index += r * C;
  a.out = static_cast<char*>(a.out) + r * C * a.row_bytes;
  return a;
}

// Launches an op's phases (kernels/cuda/cuda_kernels.h: notify and channel kernels, or
// gather's channel kernel). On XLA's stream, each phase for every rank before the next phase of
// any. In the harness's concurrent mode (every op now: all are channel kernels), each rank's
// kernels on its own stream with small grids, so ranks run at once and every wait is a
// real one.
template <typename Args>
ffi::Error LaunchPhases(cudaError_t (*launch)(int, const Args&, const IntranodePreset&,
                                              cudaStream_t),
                        const Ranks& k, int kind, int ordinal, Args a, cudaStream_t stream,
                        const char* what, int phases) {
  a.c.peers = k.dom.peers;
  a.c.area_off = k.dom.areas.offset(kind);
  a.c.num_ranks = k.dom.num_ranks;
  a.c.expect_group = k.dom.group;
  a.c.rank_in = k.rank_in;
  a.c.group_in = k.group_in;
  a.c.host_err = ErrorMirror(ordinal);
  a.c.timeout_ns = KernelTimeoutNs();
  auto at = [&](int r) {
    Args ar = AtRank(a, r);
    ar.c.me = k.dom.rank + r;
    ar.c.call_site = k.sites != nullptr ? k.sites[r] : k.site;
    return ar;
  };
  if (k.concurrent) {
    std::lock_guard<std::mutex> lock(HarnessMu());
    RankStreams* st = &Streams()[ordinal];
    cudaError_t e = MakeRankStreams(ordinal, k.count, st);
    if (e == cudaSuccess) e = cudaEventRecord(st->fork, stream);
    for (int r = 0; r < k.count && e == cudaSuccess; ++r) {
      if (r == k.absent) continue;
      e = cudaStreamWaitEvent(st->s[r], st->fork, 0);
      const Args ar = at(r);
      for (int phase = 0; phase < phases && e == cudaSuccess; ++phase)
        e = launch(phase, ar, kConcurrentPreset, st->s[r]);
      if (e == cudaSuccess) e = cudaEventRecord(st->join[r], st->s[r]);
    }
    // XLA's stream waits for the ranks only once every rank's work is enqueued: its stream
    // shares a hardware queue with one of theirs (R streams plus XLA's on at most R queues),
    // and a wait there would hold back that rank's kernels, which the awaited ones wait for.
    for (int r = 0; r < k.count && e == cudaSuccess; ++r)
      if (r != k.absent) e = cudaStreamWaitEvent(stream, st->join[r], 0);
    if (e != cudaSuccess) return CudaFailed(what, e);
    return ffi::Error::Success();
  }
  const IntranodePreset p =
      IntranodeLaunchPreset(k.dom.num_ranks, DeviceSmCount(ordinal));
  for (int phase = 0; phase < phases; ++phase) {
    for (int r = 0; r < k.count; ++r) {
      if (r == k.absent) continue;
      const cudaError_t e = launch(phase, at(r), p, stream);
      if (e != cudaSuccess) return CudaFailed(what, e);
    }
  }
  return ffi::Error::Success();
}

// ------------------------------- dispatch -------------------------------

std::string ValidateDispatch(ffi::Span<const int64_t> xd, ffi::DataType xt,
                             ffi::Span<const int64_t> id, ffi::Span<const int64_t> wd,
                             ffi::Span<const int64_t> rxd, ffi::Span<const int64_t> srd,
                             int64_t num_experts, int64_t R, int64_t C, DispatchArgs* a) {
  if (xd.size() != 2) return "x must be [T, H], got " + Dims(xd);
  if (id.size() != 2) return "topk_idx must be [T, K], got " + Dims(id);
  const int64_t T = xd[0], H = xd[1], K = id[1];
  std::string err = ExpectShape("topk_idx", id, {T, K});
  if (err.empty()) err = ExpectShape("topk_weights", wd, {T, K});
  if (err.empty()) err = ExpectShape("recv_x", rxd, {C, H});
  if (err.empty()) err = ExpectShape("send_row", srd, {T, R});
  if (!err.empty()) return err;
  if (R < 1 || num_experts % R != 0) return "num_experts must be a multiple of num_ranks";
  if (C < 1) return "capacity must be >= 1";
  if (R > kMaxRanks) return "num_ranks above 32 is not supported by the intranode GPU path";
  a->T = static_cast<int>(T);
  a->K = static_cast<int>(K);
  a->C = static_cast<int>(C);
  a->E = static_cast<int>(num_experts);
  a->experts_per_rank = static_cast<int>(num_experts / R);
  a->row_bytes = static_cast<size_t>(H) * ffi::ByteWidth(xt);
  return {};
}

// One rank (rank_buf/group_buf given) or the harness's stacked ranks (null).
ffi::Error Dispatch(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer x,
                    ffi::Buffer<ffi::S32> topk_idx, ffi::Buffer<ffi::F32> topk_weights,
                    const ffi::Buffer<ffi::S32>* rank_buf, const ffi::Buffer<ffi::S32>* group_buf,
                    ffi::Result<ffi::AnyBuffer> recv_x, ffi::ResultBuffer<ffi::S32> recv_idx,
                    ffi::ResultBuffer<ffi::F32> recv_w, ffi::ResultBuffer<ffi::S32> num_recv,
                    ffi::ResultBuffer<ffi::S32> num_dropped,
                    ffi::ResultBuffer<ffi::S32> recv_per_expert,
                    ffi::ResultBuffer<ffi::S32> src_rank, ffi::ResultBuffer<ffi::S32> src_index,
                    ffi::ResultBuffer<ffi::S32> send_row, int64_t num_experts, int64_t num_ranks,
                    int64_t capacity, int64_t call_site, const HarnessOpts& ho) {
  const bool harness = rank_buf == nullptr;
  auto xd = x.dimensions(), id = topk_idx.dimensions(), wd = topk_weights.dimensions();
  auto rxd = recv_x->dimensions(), srd = send_row->dimensions();
  std::string err;
  if (harness) {
    num_ranks = xd.size() == 3 ? xd[0] : 0;
    err = Unstack("x", num_ranks, &xd);
    if (err.empty()) err = Unstack("topk_idx", num_ranks, &id);
    if (err.empty()) err = Unstack("topk_weights", num_ranks, &wd);
    if (err.empty()) err = Unstack("recv_x", num_ranks, &rxd);
    if (err.empty()) err = Unstack("send_row", num_ranks, &srd);
  }
  DispatchArgs a{};
  if (err.empty())
    err = ValidateDispatch(xd, x.element_type(), id, wd, rxd, srd, num_experts, num_ranks,
                           capacity, &a);
  if (!err.empty()) return Invalid(err);
  const int R = static_cast<int>(num_ranks);
  a.c.channels = DispatchChannels(R, CallChannels(harness, ordinal, R));
  a.c.ring_tokens = IntranodeRingTokens();
  const size_t need = DispatchAreaBytes(R, a.c.channels, a.c.ring_tokens, a.row_bytes, a.K);
  Ranks k;
  if (ffi::Error e = harness ? HarnessRanks(stream, ordinal, R, kOpDispatch, need, ho, &k)
                             : GroupRanks(ordinal, num_ranks, kOpDispatch, need, "dispatch",
                                          *rank_buf, *group_buf, call_site, &k);
      e.failure())
    return e;
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
  return LaunchPhases(LaunchDispatchPhase, k, kOpDispatch, ordinal, a, stream,
                      harness ? "harness dispatch launch" : "dispatch kernel launch",
                      kNumChannelPhases);
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
  JEP_NVTX_RANGE("jax_ep.dispatch");
  return Dispatch(stream, ordinal, x, topk_idx, topk_weights, &rank_buf, &group_buf, recv_x,
                  recv_idx, recv_w, num_recv, num_dropped, recv_per_expert, src_rank, src_index,
                  send_row, num_experts, num_ranks, capacity, call_site, HarnessOpts{});
}

// ------------------------------- combine --------------------------------

std::string ValidateCombine(ffi::Span<const int64_t> yd, ffi::DataType yt,
                            ffi::Span<const int64_t> sd, ffi::Span<const int64_t> od, int64_t R,
                            CombineArgs* a) {
  if (yd.size() != 2) return "y must be [C, H], got " + Dims(yd);
  if (sd.size() != 2 || sd[1] != R) return "handle.send_row must be [T, R], got " + Dims(sd);
  std::string err = ExpectShape("out", od, {sd[0], yd[1]});
  if (!err.empty()) return err;
  if (!FloatKindOf(yt, &a->kind)) return "y must be float32, bfloat16 or float16";
  if (R < 1 || R > kMaxRanks) return "num_ranks must be in [1, 32] on the intranode GPU path";
  a->T = static_cast<int>(sd[0]);
  a->C = static_cast<int>(yd[0]);
  a->H = static_cast<int>(yd[1]);
  a->row_bytes = static_cast<size_t>(yd[1]) * ffi::ByteWidth(yt);
  return {};
}

// One rank (rank_buf/group_buf given) or the harness's stacked ranks (null).
ffi::Error Combine(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer y,
                   ffi::Buffer<ffi::S32> send_row, const ffi::Buffer<ffi::S32>* rank_buf,
                   const ffi::Buffer<ffi::S32>* group_buf, ffi::Result<ffi::AnyBuffer> out,
                   int64_t num_ranks, int64_t call_site, const HarnessOpts& ho) {
  const bool harness = rank_buf == nullptr;
  auto yd = y.dimensions(), sd = send_row.dimensions(), od = out->dimensions();
  std::string err;
  if (harness) {
    num_ranks = yd.size() == 3 ? yd[0] : 0;
    err = Unstack("y", num_ranks, &yd);
    if (err.empty()) err = Unstack("send_row", num_ranks, &sd);
    if (err.empty()) err = Unstack("out", num_ranks, &od);
  }
  CombineArgs a{};
  if (err.empty()) err = ValidateCombine(yd, y.element_type(), sd, od, num_ranks, &a);
  if (!err.empty()) return Invalid(err);
  const int R = static_cast<int>(num_ranks);
  a.c.channels = CallChannels(harness, ordinal, R);
  a.c.ring_tokens = IntranodeRingTokens();
  const size_t need = CombineAreaBytes(R, a.c.channels, a.c.ring_tokens, a.row_bytes);
  Ranks k;
  if (ffi::Error e = harness ? HarnessRanks(stream, ordinal, R, kOpCombine, need, ho, &k)
                             : GroupRanks(ordinal, num_ranks, kOpCombine, need, "combine",
                                          *rank_buf, *group_buf, call_site, &k);
      e.failure())
    return e;
  a.y = y.untyped_data();
  a.send_row = send_row.typed_data();
  a.out = out->untyped_data();
  return LaunchPhases(LaunchCombinePhase, k, kOpCombine, ordinal, a, stream,
                      harness ? "harness combine launch" : "combine kernel launch",
                      kNumChannelPhases);
}

ffi::Error CombineImpl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer y,
                       ffi::Buffer<ffi::S32> send_row, ffi::Buffer<ffi::S32> rank_buf,
                       ffi::Buffer<ffi::S32> group_buf, ffi::Result<ffi::AnyBuffer> out,
                       int64_t num_ranks, int64_t call_site) {
  JEP_NVTX_RANGE("jax_ep.combine");
  return Combine(stream, ordinal, y, send_row, &rank_buf, &group_buf, out, num_ranks, call_site,
                 HarnessOpts{});
}

// ------------------------------- gather ---------------------------------

std::string ValidateGather(ffi::Span<const int64_t> gd, ffi::DataType gt,
                           ffi::Span<const int64_t> srd, ffi::Span<const int64_t> sid,
                           ffi::Span<const int64_t> od, int64_t R, GatherArgs* a) {
  if (gd.size() != 2) return "cotangent must be [T, H], got " + Dims(gd);
  if (srd.size() != 1) return "handle.src_rank must be [C], got " + Dims(srd);
  const int64_t C = srd[0];
  std::string err = ExpectShape("handle.src_index", sid, {C});
  if (err.empty()) err = ExpectShape("out", od, {C, gd[1]});
  if (!err.empty()) return err;
  if (R < 1 || R > kMaxRanks) return "num_ranks must be in [1, 32] on the intranode GPU path";
  a->T = static_cast<int>(gd[0]);
  a->C = static_cast<int>(C);
  a->row_bytes = static_cast<size_t>(gd[1]) * ffi::ByteWidth(gt);
  return {};
}

// One rank (rank_buf/group_buf given) or the harness's stacked ranks (null).
ffi::Error Gather(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer g,
                  ffi::Buffer<ffi::S32> src_rank, ffi::Buffer<ffi::S32> src_index,
                  const ffi::Buffer<ffi::S32>* rank_buf, const ffi::Buffer<ffi::S32>* group_buf,
                  ffi::Result<ffi::AnyBuffer> out, int64_t num_ranks, int64_t call_site,
                  const HarnessOpts& ho) {
  const bool harness = rank_buf == nullptr;
  auto gd = g.dimensions(), srd = src_rank.dimensions(), sid = src_index.dimensions();
  auto od = out->dimensions();
  std::string err;
  if (harness) {
    num_ranks = gd.size() == 3 ? gd[0] : 0;
    err = Unstack("g", num_ranks, &gd);
    if (err.empty()) err = Unstack("src_rank", num_ranks, &srd);
    if (err.empty()) err = Unstack("src_index", num_ranks, &sid);
    if (err.empty()) err = Unstack("out", num_ranks, &od);
  }
  GatherArgs a{};
  if (err.empty()) err = ValidateGather(gd, g.element_type(), srd, sid, od, num_ranks, &a);
  if (!err.empty()) return Invalid(err);
  const int R = static_cast<int>(num_ranks);
  a.c.channels = CallChannels(harness, ordinal, R);
  a.c.ring_tokens = IntranodeRingTokens();
  const size_t need = GatherAreaBytes(R, a.c.channels, a.c.ring_tokens, a.row_bytes);
  Ranks k;
  if (ffi::Error e = harness ? HarnessRanks(stream, ordinal, R, kOpGather, need, ho, &k)
                             : GroupRanks(ordinal, num_ranks, kOpGather, need,
                                          "combine's transpose (gather)", *rank_buf,
                                          *group_buf, call_site, &k);
      e.failure())
    return e;
  a.g = g.untyped_data();
  a.src_rank = src_rank.typed_data();
  a.src_index = src_index.typed_data();
  a.out = out->untyped_data();
  return LaunchPhases(LaunchGatherPhase, k, kOpGather, ordinal, a, stream,
                      harness ? "harness gather launch" : "gather kernel launch",
                      kNumGatherPhases);
}

ffi::Error GatherImpl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer g,
                      ffi::Buffer<ffi::S32> src_rank, ffi::Buffer<ffi::S32> src_index,
                      ffi::Buffer<ffi::S32> rank_buf, ffi::Buffer<ffi::S32> group_buf,
                      ffi::Result<ffi::AnyBuffer> out, int64_t num_ranks, int64_t call_site) {
  JEP_NVTX_RANGE("jax_ep.gather");
  return Gather(stream, ordinal, g, src_rank, src_index, &rank_buf, &group_buf, out, num_ranks,
                call_site, HarnessOpts{});
}

// ------------------------- virtual-rank harness --------------------------
// R ranks' buffers live in one allocation on one GPU; the same kernels run for each
// rank (see Ranks and LaunchPhases).

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
                               int64_t capacity, ffi::Span<const int64_t> call_sites,
                               int64_t concurrent, int64_t absent_rank) {
  JEP_NVTX_RANGE("jax_ep.harness.dispatch");
  const HarnessOpts ho{call_sites, concurrent != 0, static_cast<int>(absent_rank)};
  return Dispatch(stream, ordinal, x, topk_idx, topk_weights, nullptr, nullptr, recv_x, recv_idx,
                  recv_w, num_recv, num_dropped, recv_per_expert, src_rank, src_index, send_row,
                  num_experts, 0, capacity, 0, ho);
}

ffi::Error HarnessCombineImpl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer y,
                              ffi::Buffer<ffi::S32> send_row, ffi::Result<ffi::AnyBuffer> out,
                              ffi::Span<const int64_t> call_sites, int64_t concurrent,
                              int64_t absent_rank) {
  JEP_NVTX_RANGE("jax_ep.harness.combine");
  const HarnessOpts ho{call_sites, concurrent != 0, static_cast<int>(absent_rank)};
  return Combine(stream, ordinal, y, send_row, nullptr, nullptr, out, 0, 0, ho);
}

ffi::Error HarnessGatherImpl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer g,
                             ffi::Buffer<ffi::S32> src_rank, ffi::Buffer<ffi::S32> src_index,
                             ffi::Result<ffi::AnyBuffer> out, ffi::Span<const int64_t> call_sites,
                             int64_t concurrent, int64_t absent_rank) {
  JEP_NVTX_RANGE("jax_ep.harness.gather");
  const HarnessOpts ho{call_sites, concurrent != 0, static_cast<int>(absent_rank)};
  return Gather(stream, ordinal, g, src_rank, src_index, nullptr, nullptr, out, 0, 0, ho);
}

}  // namespace

cudaError_t ReleaseHarnessStreams(int ordinal) {
  if (ordinal < 0 || ordinal >= kMaxCudaDevices) return cudaErrorInvalidValue;
  std::lock_guard<std::mutex> lock(HarnessMu());
  RankStreams* st = &Streams()[ordinal];
  if (st->count == 0) return cudaSuccess;
  int prev = -1;
  cudaError_t e = cudaGetDevice(&prev);
  if (e == cudaSuccess) e = cudaSetDevice(ordinal);
  if (e == cudaSuccess) e = DestroyRankStreams(st);
  if (prev >= 0) cudaSetDevice(prev);
  return e;
}

cudaError_t ResetHarnessBuffers(int ordinal) {
  if (ordinal < 0 || ordinal >= kMaxCudaDevices) return cudaErrorInvalidValue;
  std::lock_guard<std::mutex> lock(HarnessMu());
  HarnessBuffers& h = Harness()[ordinal];
  if (h.base == nullptr) return cudaSuccess;
  cudaError_t e = cudaSuccess;
  for (int r = 0; r < h.num_ranks && e == cudaSuccess; ++r)
    e = cudaMemset(h.base + r * h.per_rank, 0, sizeof(RankHeader));
  return e;
}

// The handlers of JEP_CUDA_TARGETS (xla_ffi/common/op_tables.h).
JEP_CUDA_TARGETS(JEP_FFI_DEFINE_TARGET)

}  // namespace jax_ep
