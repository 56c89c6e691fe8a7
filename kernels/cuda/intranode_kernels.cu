// Intranode dispatch, combine and gather (combine's transpose) over peer pointers.
// Buffer layout and protocol: kernels/cuda/intranode_buffer.h, docs/intranode.md.
// Dispatch and combine are a notify kernel and one channel kernel per rank, sending
// through per-(channel, peer) rings (a rank's own rows skip them). Dispatch: every block a
// channel, sending to every rank and receiving from every source; combine: both blocks of
// a channel send, to the even and to the odd ranks, and the odd block also receives.
// Gather (cached dispatch) is its channel kernel alone, with combine's roles
// (kernels/cuda/cuda_kernels.h). Rows land
// in the XLA outputs in the contract's order (source rank, then token), with the routing
// math of kernels/common/layout_math.h, so results match the CPU backend bit for bit.
//
// Failing safely (see intranode_buffer.h): every kernel keeps the protocol going (epochs,
// requests, signals) whatever happened, so ranks never fall out of step; after a protocol
// error (also one after an earlier bad id or foreign handle) it moves no data, writes empty
// outputs and tells its peers (kSiteFailed). Once a timeout is recorded, waits return at
// once. jax_ep.cuda.reset() clears all of it.
#include <climits>
#include <cstdint>

#include "kernels/cuda/copy_engine.cuh"
#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/cuda_kernels.h"
#include "kernels/cuda/launch.cuh"
#include "kernels/common/layout_math.h"

namespace jax_ep {
namespace {

// First error of any kind on this GPU: what check_errors() reports first.
JEP_DEVICE_GLOBAL ErrorRecord g_intranode_error;
// First protocol error on this GPU, kept beside the record above: that one's first error
// may be an earlier bad id or foreign handle (which stop nothing), and a timeout behind it
// must still stop every send, or a push whose credit wait timed out would write into
// regions its receiver has not read. A non-zero code here is this GPU's failed state.
JEP_DEVICE_GLOBAL ErrorRecord g_intranode_failed;
// Non-zero once a timeout is recorded on this GPU: every later wait returns at once. Other
// protocol errors leave waits running: a rank's counts and call sites sit in one header
// slot per op kind, so a rank that stopped waiting for its credits would overwrite them
// while a healthy peer still reads the last epoch's.
JEP_DEVICE_GLOBAL int32_t g_intranode_stop;

__device__ __forceinline__ void report(const CommonArgs& c, int32_t code, int32_t a, int32_t b,
                                       int32_t x, int32_t d) {
  if (IsProtocolError(code)) {
    record_error(&g_intranode_failed, nullptr, code, c.me, a, b, x, d);
    if (code == kErrTimeout) atomicExch(&g_intranode_stop, 1);
  }
  record_error(&g_intranode_error, c.host_err, code, c.me, a, b, x, d);
}

// Whether this GPU has a protocol error recorded: its kernels then move no data.
__device__ __forceinline__ bool failed() {
  return *reinterpret_cast<const volatile int32_t*>(&g_intranode_failed.code) != kErrNone;
}

// The call-site id this rank sends with a request or a data signal.
__device__ __forceinline__ int64_t site_to_send(const CommonArgs& c) {
  return failed() ? kSiteFailed : c.call_site;
}

// Waits for `flags[r] >= value` for every rank r, all within one timeout; a timeout is
// recorded, not fatal (the caller carries on, so a missing peer never hangs the GPU).
// Returns false on a timeout, now or earlier on this GPU.
__device__ bool wait_all(const CommonArgs& c, const uint64_t* flags, uint64_t value, int kind) {
  const uint64_t start = peer::global_timer_ns();
  for (int r = 0; r < c.num_ranks; ++r) {
    const int64_t used = static_cast<int64_t>(peer::global_timer_ns() - start);
    const int64_t left = c.timeout_ns > used ? c.timeout_ns - used : 1;
    if (!peer::wait_geq(&flags[r], value, left, &g_intranode_stop)) {
      // The first timeout is recorded (first error wins); waits cut short by it add none.
      report(c, kErrTimeout, r, kind, static_cast<int32_t>(value), 0);
      return false;
    }
  }
  return true;
}

// After a successful wait: every peer's call-site id (written before its signal) must be
// this call's. A peer that sent kSiteFailed had an error and moved no data.
__device__ void check_sites(const CommonArgs& c, const int64_t* sites, int kind) {
  for (int r = 0; r < c.num_ranks; ++r) {
    const int64_t got = *reinterpret_cast<const volatile int64_t*>(&sites[r]);
    if (got == c.call_site) continue;
    if (got == kSiteFailed)
      report(c, kErrPeerFailed, r, kind, 0, 0);
    else
      report(c, kErrCallSite, r, kind, static_cast<int32_t>(got), static_cast<int32_t>(c.call_site));
    return;
  }
}

// Thread 0: waits for every peer's signal of epoch n, checks their call sites, and tells
// whether this kernel must skip its data work.
__device__ bool wait_and_check(const CommonArgs& c, const uint64_t* flags, const int64_t* sites,
                               uint64_t n, int kind) {
  if (wait_all(c, flags, n, kind)) {
    __threadfence();
    check_sites(c, sites, kind);
  }
  return failed();
}

// Checks the rank and group scalars XLA passed against the group set up on this device.
__device__ void check_identity(const CommonArgs& c) {
  if (c.rank_in == nullptr) return;
  const int32_t r = *c.rank_in;
  const int32_t g = c.group_in != nullptr ? *c.group_in : -1;
  if (r != c.me || (c.expect_group >= 0 && g != c.expect_group))
    report(c, kErrRankMismatch, r, c.me, g, c.expect_group);
}

// Starts epoch n of an op kind on this rank (notify kernels only, thread 0).
__device__ uint64_t begin_epoch(const CommonArgs& c, int kind) {
  RankHeader* h = peer::header(c.peers, c.me);
  const uint64_t n = h->seq[kind] + 1;
  h->seq[kind] = n;
  check_identity(c);
  return n;
}

// Ranks a token is sent to (bit r), from its sanitized ids.
// With `record`, a bad id is reported and `*bad` set.
__device__ __forceinline__ uint32_t token_mask(const DispatchArgs& a, int t, bool record,
                                               int* bad = nullptr) {
  const int32_t* row = a.topk_idx + static_cast<int64_t>(t) * a.K;
  uint32_t mask = 0;
  for (int k = 0; k < a.K; ++k) {
    const int32_t raw = row[k];
    const int32_t e = sanitized(raw, a.E);
    if (record && e != raw) {
      report(a.c, kErrBadTopkId, t, k, raw, a.E);
      if (bad != nullptr) *bad = 1;
    }
    if (e >= 0) mask |= 1u << owner_rank(e, a.experts_per_rank);
  }
  return mask;
}

// Exclusive prefix of `bits` (bit r set: this thread's item goes to r) over a chunk of
// blockDim.x items, continuing the running totals s_run[r]. pos_out[r] is meaningful
// where the bit is set. s_warp is [blockDim.x / 32][kMaxRanks].
__device__ void chunk_positions(uint32_t bits, int R, int32_t (*s_warp)[kMaxRanks], int32_t* s_run,
                                int32_t* pos_out) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  for (int r = 0; r < R; ++r) {
    const unsigned b = __ballot_sync(kFullMask, (bits >> r) & 1u);
    if (lane == 0) s_warp[warp][r] = __popc(b);
  }
  __syncthreads();
  if (threadIdx.x < R) {
    int32_t run = s_run[threadIdx.x];
    for (int w = 0; w < nwarps; ++w) {
      const int32_t cnt = s_warp[w][threadIdx.x];
      s_warp[w][threadIdx.x] = run;
      run += cnt;
    }
    s_run[threadIdx.x] = run;
  }
  __syncthreads();
  for (int r = 0; r < R; ++r) {
    const unsigned b = __ballot_sync(kFullMask, (bits >> r) & 1u);
    pos_out[r] = s_warp[warp][r] + __popc(b & lanemask_lt());
  }
  __syncthreads();
}

template <FloatKind kKind>
struct Elems;
template <>
struct Elems<FloatKind::kF32> {
  static constexpr int kPerVec = 4;
  static constexpr int kBytes = 4;
  __device__ static float get(const uint4& v, int i) {
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
    return __uint_as_float(w[i]);
  }
  __device__ static uint4 pack(const float* f) {
    return make_uint4(__float_as_uint(f[0]), __float_as_uint(f[1]), __float_as_uint(f[2]), __float_as_uint(f[3]));
  }
  __device__ static float load1(const char* p) { return __uint_as_float(peer::load_cg4(p)); }
  __device__ static void store1(char* p, float f) { *reinterpret_cast<float*>(p) = f; }
};
template <FloatKind kKind>
struct Elems16 {
  static constexpr int kPerVec = 8;
  static constexpr int kBytes = 2;
  __device__ static float cvt_in(uint32_t h) {
    const uint16_t b = static_cast<uint16_t>(h);
    return kKind == FloatKind::kBF16 ? bf16_to_f32(b) : f16_to_f32(b);
  }
  __device__ static uint32_t cvt_out(float f) {
    return kKind == FloatKind::kBF16 ? f32_to_bf16(f) : f32_to_f16(f);
  }
  __device__ static float get(const uint4& v, int i) {
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
    return cvt_in((w[i >> 1] >> ((i & 1) * 16)) & 0xffffu);
  }
  __device__ static uint4 pack(const float* f) {
    uint32_t w[4];
    for (int i = 0; i < 4; ++i) w[i] = cvt_out(f[2 * i]) | (cvt_out(f[2 * i + 1]) << 16);
    return make_uint4(w[0], w[1], w[2], w[3]);
  }
  __device__ static float load1(const char* p) {
    return cvt_in(*reinterpret_cast<const volatile uint16_t*>(p));
  }
  __device__ static void store1(char* p, float f) {
    *reinterpret_cast<uint16_t*>(p) = static_cast<uint16_t>(cvt_out(f));
  }
};
template <>
struct Elems<FloatKind::kBF16> : Elems16<FloatKind::kBF16> {};
template <>
struct Elems<FloatKind::kF16> : Elems16<FloatKind::kF16> {};


// ============================ channels (shared) ============================

// The named barrier of a channel block's receiving warps (barrier 0 is __syncthreads).
constexpr int kRecvBarrier = 1;

// First token of channel ch of nch over T tokens (channels own contiguous ranges).
__device__ __forceinline__ int channel_begin(int T, int ch, int nch) {
  return static_cast<int>(static_cast<int64_t>(T) * ch / nch);
}

// Called by every thread at the end of the channel kernels: true in every thread of the
// last block to finish (after every block's writes), which then closes the epoch.
__device__ bool last_block(const CommonArgs& c, int counter) {
  __shared__ bool s_last;
  peer::fence_data();
  __syncthreads();
  if (threadIdx.x == 0) {
    RankHeader* h = peer::header(c.peers, c.me);
    const unsigned prev = atomicAdd(&h->done[counter], 1u);
    s_last = prev == gridDim.x - 1;
    if (s_last) {
      h->done[counter] = 0;
      peer::fence_data();
    }
  }
  __syncthreads();
  return s_last;
}

// Lane 0 of a warp: waits until a ring counter reaches `need` (the whole warp gets the
// value it saw, or false after a timeout, now or earlier on this GPU).
__device__ bool warp_wait_counter(const CommonArgs& c, const uint64_t* ctr, uint64_t need,
                                  int peer_rank, int kind, uint64_t* seen) {
  const int lane = threadIdx.x & 31;
  uint64_t v = 0;
  int ok = 1;
  if (lane == 0) {
    v = peer::load_acquire(ctr);
    if (v < need) {
      ok = peer::wait_geq(ctr, need, c.timeout_ns, &g_intranode_stop) ? 1 : 0;
      if (!ok) report(c, kErrTimeout, peer_rank, kind, static_cast<int32_t>(need), 1);
      v = peer::load_acquire(ctr);
    }
  }
  __syncwarp();
  *seen = __shfl_sync(kFullMask, static_cast<unsigned long long>(v), 0);
  return __shfl_sync(kFullMask, ok, 0) != 0;
}

// Publishes a sender's ring tail: one fence per lane for the chunk's rows (stores through
// peer pointers), then lane 0's release, which the receiver's acquire pairs with
// (copy_engine.cuh group_release).
__device__ __forceinline__ void publish_tail(uint64_t* tail, uint64_t k) {
  group_release(warp_group(), tail, k);
}

// 16-byte loads each lane keeps in flight in a channel kernel's row copies: 8 (4 KiB per
// warp) where the block's register budget allows (kThreads <= 512: 128 registers a
// thread), 2 in the 768- and 1024-thread blocks of 16 and 32 ranks (80 and 64 registers),
// where more would spill.
template <int kThreads>
struct ChannelUnroll {
  static constexpr int value = kThreads <= 512 ? kCopyEngineUnroll : 2;
};

// ================================ dispatch ================================

// Notify: positions and counts, exchanged with every peer, so send_row (the row of each
// token on each receiver, capacity cut applied) is known before any row moves.
__global__ void __launch_bounds__(kPlanThreads) dispatch_notify_kernel(DispatchArgs a) {
  __shared__ int32_t s_warp[kPlanThreads / 32][kMaxRanks];
  __shared__ int32_t s_run[kMaxRanks];
  __shared__ int32_t s_mybase[kMaxRanks];  // first row of my tokens on each receiver
  __shared__ uint64_t s_n;
  __shared__ bool s_fail;
  __shared__ int s_bad;  // a bad id in this rank's topk_idx (told to every peer)
  const int R = a.c.num_ranks, me = a.c.me;
  RankHeader* hdr = peer::header(a.c.peers, me);
  if (threadIdx.x == 0) {
    s_n = begin_epoch(a.c, kOpDispatch);
    s_fail = failed();  // then this rank sends nothing (its counts are all zero)
    s_bad = 0;
  }
  if (threadIdx.x < R) s_run[threadIdx.x] = 0;
  for (int e = threadIdx.x; e < a.experts_per_rank; e += blockDim.x) a.recv_per_expert[e] = 0;
  __syncthreads();
  int32_t pos[kMaxRanks];
  for (int base = 0; base < a.T; base += blockDim.x) {
    const int t = base + threadIdx.x;
    const uint32_t mask = (t < a.T && !s_fail) ? token_mask(a, t, true, &s_bad) : 0u;
    chunk_positions(mask, R, s_warp, s_run, pos);
    if (t < a.T) {
      int32_t* out = a.send_row + static_cast<int64_t>(t) * R;
#pragma unroll 1
      for (int r = 0; r < R; ++r) out[r] = ((mask >> r) & 1u) ? pos[r] : -1;  // raw positions
    }
  }
  if (threadIdx.x == 0) {
    // Every receiver finished epoch n - 1 (it read the counts this overwrites).
    wait_all(a.c, hdr->credit, s_n - 1, kOpDispatch);
    const int64_t site = site_to_send(a.c);
    for (int r = 0; r < R; ++r) {
      RankHeader* ph = peer::header(a.c.peers, r);
      for (int j = 0; j < R; ++j) peer::store(&ph->counts[me][j], site == kSiteFailed ? 0 : s_run[j]);
      peer::store(&ph->site_arr[kOpDispatch][me], site);
      peer::store(&ph->bad_ids[me], s_bad ? static_cast<int64_t>(s_n) : int64_t{0});
    }
    peer::fence_data();
    for (int r = 0; r < R; ++r) peer::signal(&peer::header(a.c.peers, r)->arrive[kOpDispatch][me], s_n);
    s_fail = wait_and_check(a.c, hdr->arrive[kOpDispatch], hdr->site_arr[kOpDispatch], s_n,
                            kOpDispatch);
    // A peer's bad ids reach this rank's record too (they stop nothing: the data moved).
    for (int r = 0; r < R && !s_fail; ++r) {
      const int64_t tag = *reinterpret_cast<const volatile int64_t*>(&hdr->bad_ids[r]);
      if (r != me && tag == static_cast<int64_t>(s_n)) {
        report(a.c, kErrPeerBadId, r, kOpDispatch, 0, 0);
        break;
      }
    }
  }
  __syncthreads();
  const bool fail = s_fail;  // then nothing moves: send_row all -1, nothing received
  if (threadIdx.x < R) {
    int64_t b = 0;
    for (int s = 0; s < me; ++s) b += peer::load_volatile(&hdr->counts[s][threadIdx.x]);
    s_mybase[threadIdx.x] = static_cast<int32_t>(b < INT_MAX ? b : INT_MAX);
  }
  if (threadIdx.x == 0) {
    int64_t total = 0;
    for (int s = 0; s < R && !fail; ++s) total += peer::load_volatile(&hdr->counts[s][me]);
    const int32_t kept = kept_rows(total, a.C);
    *a.num_recv = kept;
    *a.num_dropped = static_cast<int32_t>(total - kept);
  }
  __syncthreads();
  const int64_t n_sr = static_cast<int64_t>(a.T) * R;
  for (int64_t e = threadIdx.x; e < n_sr; e += blockDim.x) {
    const int32_t raw = a.send_row[e];
    if (fail) {
      a.send_row[e] = -1;
    } else if (raw >= 0) {
      const int64_t v = static_cast<int64_t>(s_mybase[e % R]) + raw;
      a.send_row[e] = v < a.C ? static_cast<int32_t>(v) : -1;
    }
  }
}

// The bulk-copy stage (cuda_common.cuh BulkStage) of source rank r in the dispatch channel
// kernel's shared memory `sm` (layout: intranode_buffer.h DispatchChannelSmemBytes).
__device__ __forceinline__ BulkStage dispatch_stage(const DispatchArgs& a, char* sm, int r) {
  BulkStage st;
  uint64_t* mb = reinterpret_cast<uint64_t*>(sm + kBulkZeroBytes) + 2 * r;
  const int R = a.c.num_ranks, pb = a.bulk_piece;
  char* b = sm + DispatchBulkStagingOff(R) + 2 * static_cast<size_t>(r) * pb;
  st.buf[0] = b;
  st.buf[1] = b + pb;
  st.mbar[0] = mb;
  st.mbar[1] = mb + 1;
  st.bytes = static_cast<uint32_t>(pb);
  st.phase = 0;
  st.timeout_ns = a.c.timeout_ns;
  st.failed = false;
  return st;
}

// The sending warp of channel ch towards this rank itself: its rows go straight into the
// outputs. Ring (ch, me) on this rank stays unused (no receiving warp waits on it): a row
// through it would be copied twice more on this GPU, and the outputs are this kernel's to
// write, so no late write can land after the call.
// Lane 0 copies the rows with bulk copies when they are 16-byte aligned.
template <int kU>
__device__ void dispatch_self(const DispatchArgs& a, int ch, bool fail, char* sm) {
  if (fail) return;
  const int R = a.c.num_ranks, me = a.c.me, lane = threadIdx.x & 31, el = a.experts_per_rank;
  const bool bulk = aligned16(a.recv_x, a.x, a.row_bytes);
  BulkStage st = dispatch_stage(a, sm, me);
  const int t0 = channel_begin(a.T, ch, a.c.channels), t1 = channel_begin(a.T, ch + 1, a.c.channels);
  for (int tb = t0; tb < t1; tb += 32) {
    const int t = tb + lane;
    const int32_t row = t < t1 ? a.send_row[static_cast<int64_t>(t) * R + me] : -1;
    for (uint32_t m = __ballot_sync(kFullMask, row >= 0); m != 0; m &= m - 1) {
      const int l = __ffs(m) - 1;
      const int tt = tb + l;
      const int32_t rr = __shfl_sync(kFullMask, row, l);
      char* dst = static_cast<char*>(a.recv_x) + static_cast<int64_t>(rr) * a.row_bytes;
      const char* src = static_cast<const char*>(a.x) + static_cast<int64_t>(tt) * a.row_bytes;
      if (!bulk) group_copy<CopySrc::kReadOnly, kU>(warp_group(), dst, src, a.row_bytes);
      else if (lane == 0 && !bulk_copy_row(st, dst, src, a.row_bytes))
        report(a.c, kErrTimeout, me, kOpDispatch, 0, 5);  // its own bulk load never landed
      const int32_t* idx = a.topk_idx + static_cast<int64_t>(tt) * a.K;
      const float* wt = a.topk_w + static_cast<int64_t>(tt) * a.K;
      int32_t* oidx = a.recv_idx + static_cast<int64_t>(rr) * a.K;
      float* ow = a.recv_w + static_cast<int64_t>(rr) * a.K;
      for (int j = lane; j < a.K; j += 32) {
        const int32_t local = local_expert_id(sanitized(idx[j], a.E), el, me);
        oidx[j] = local;
        ow[j] = local >= 0 ? wt[j] : 0.0f;
        if (local >= 0 && local < el) atomicAdd(&a.recv_per_expert[local], 1);
      }
      if (lane == 0) {
        a.src_rank[rr] = me;
        a.src_index[rr] = tt;
      }
    }
  }
}

// Sending warp of channel ch towards receiver d: its tokens' rows for d, in token order,
// through ring (ch, me) on d (this rank's own rows: dispatch_self).
template <int kU>
__device__ void dispatch_send(const DispatchArgs& a, int ch, int d, bool fail, uint64_t n, char* sm) {
  const int R = a.c.num_ranks, me = a.c.me, lane = threadIdx.x & 31;
  if (d == me) {
    dispatch_self<kU>(a, ch, fail, sm);
    return;
  }
  RankHeader* hdr = peer::header(a.c.peers, me);
  RankHeader* dh = peer::header(a.c.peers, d);
  const DispatchRing ring = DispatchRing::Make(a.c.ring_tokens, a.row_bytes, a.K);
  const size_t stride = RowStride(a.row_bytes);
  const size_t words = DispatchMetaWords(a.K);
  char* rbase = peer::peer_ptr(a.c.peers, d, a.c.area_off + (static_cast<size_t>(ch) * R + me) * ring.bytes);
  int32_t* meta = reinterpret_cast<int32_t*>(rbase + ring.meta_off);
  const uint64_t Q = static_cast<uint64_t>(a.c.ring_tokens);
  const uint64_t chunk = Q > 4 ? Q / 4 : 1;  // rows per published tail
  uint64_t* tail = &dh->d_ring.tail[ch][me];
  const uint64_t base = hdr->d_ring.sent[ch][d];
  uint64_t k = base, published = base, credit = base;
  bool ok = !fail;
  const int t0 = channel_begin(a.T, ch, a.c.channels), t1 = channel_begin(a.T, ch + 1, a.c.channels);
  for (int tb = t0; tb < t1 && ok; tb += 32) {
    const int t = tb + lane;
    const int32_t row = t < t1 ? a.send_row[static_cast<int64_t>(t) * R + d] : -1;
    for (uint32_t m = __ballot_sync(kFullMask, row >= 0); m != 0 && ok; m &= m - 1) {
      const int l = __ffs(m) - 1;
      const int tt = tb + l;
      const int32_t rr = __shfl_sync(kFullMask, row, l);
      if (k - credit >= Q) {
        // Ring full: what is written goes out first, so the receiver can free slots.
        if (published < k) {
          publish_tail(tail, k);
          published = k;
        }
        ok = warp_wait_counter(a.c, &hdr->d_ring.head[ch][d], k - Q + 1, d, kOpDispatch, &credit);
        if (!ok) break;
      }
      const uint64_t slot = k % Q;
      group_copy<CopySrc::kReadOnly, kU>(warp_group(), rbase + slot * stride,
                                         static_cast<const char*>(a.x) + static_cast<int64_t>(tt) * a.row_bytes,
                                         a.row_bytes);
      int32_t* w = meta + slot * words;
      const int32_t* idx = a.topk_idx + static_cast<int64_t>(tt) * a.K;
      const float* wt = a.topk_w + static_cast<int64_t>(tt) * a.K;
      for (int j = lane; j < a.K; j += 32) {
        const int32_t local = local_expert_id(sanitized(idx[j], a.E), a.experts_per_rank, d);
        peer::store(&w[2 + j], local);
        peer::store(reinterpret_cast<float*>(&w[2 + a.K + j]), local >= 0 ? wt[j] : 0.0f);
      }
      if (lane == 0) {
        peer::store(&w[0], rr);
        peer::store(&w[1], static_cast<int32_t>(tt));
      }
      ++k;
      if (k - published >= chunk) {
        publish_tail(tail, k);
        published = k;
      }
    }
  }
  // The ring's last tail, then its end mark for epoch n (the receiver reads the mark
  // before the tail, so a mark it sees means the tail it reads next is final).
  publish_tail(tail, k);
  if (lane == 0) {
    peer::signal(&dh->d_end[ch][me], n);
    hdr->d_ring.sent[ch][d] = k;
  }
  __syncwarp();
}

// Lane 0: waits until ring (ch, s) holds rows past k, or has ended epoch n; *tail_out is
// the tail then (k when it ended with nothing more). False after a timeout.
__device__ bool wait_ring(const CommonArgs& c, const uint64_t* tail, const uint64_t* end,
                          uint64_t k, uint64_t n, int s, uint64_t* tail_out) {
  const uint64_t start = peer::global_timer_ns();
  while (true) {
    const uint64_t e = peer::load_acquire(end);
    const uint64_t t = peer::load_acquire(tail);
    if (t > k || e >= n) {
      *tail_out = t;
      return true;
    }
    if (*reinterpret_cast<const volatile int32_t*>(&g_intranode_stop) != 0 ||
        (c.timeout_ns > 0 && peer::global_timer_ns() - start > static_cast<uint64_t>(c.timeout_ns))) {
      report(c, kErrTimeout, s, kOpDispatch, static_cast<int32_t>(n), 2);
      return false;
    }
    __nanosleep(64);
  }
}

// Receiving warp of channel ch for source s: copies each slot of ring (ch, s) into its
// row of the XLA outputs and hands the slots back (head) once read. Lane 0 copies the
// rows with bulk copies when they are 16-byte aligned; its waits for their loads come
// before the head it releases.
template <int kU>
__device__ void dispatch_recv(const DispatchArgs& a, int ch, int s, bool fail, uint64_t n, char* sm) {
  const int R = a.c.num_ranks, me = a.c.me, lane = threadIdx.x & 31;
  RankHeader* hdr = peer::header(a.c.peers, me);
  const DispatchRing ring = DispatchRing::Make(a.c.ring_tokens, a.row_bytes, a.K);
  const size_t stride = RowStride(a.row_bytes);
  const size_t words = DispatchMetaWords(a.K);
  const char* rbase = peer::peer_ptr(a.c.peers, me, a.c.area_off + (static_cast<size_t>(ch) * R + s) * ring.bytes);
  const int32_t* meta = reinterpret_cast<const int32_t*>(rbase + ring.meta_off);
  const uint64_t Q = static_cast<uint64_t>(a.c.ring_tokens);
  const uint64_t chunk = Q > 2 ? Q / 2 : 1;  // rows per credit
  uint64_t* head = &peer::header(a.c.peers, s)->d_ring.head[ch][me];
  const int el = a.experts_per_rank;
  const bool bulk = aligned16(a.recv_x, rbase, a.row_bytes);
  BulkStage st = dispatch_stage(a, sm, s);
  uint64_t k = hdr->d_ring.read[ch][s];
  while (true) {
    uint64_t t = 0;
    int ok = 1;
    if (lane == 0) {
      ok = wait_ring(a.c, &hdr->d_ring.tail[ch][s], &hdr->d_end[ch][s], k, n, s, &t) ? 1 : 0;
      if (bulk) peer::fence_bulk_global();  // the rows the tail covers, for the bulk loads
    }
    __syncwarp();
    ok = __shfl_sync(kFullMask, ok, 0);
    t = __shfl_sync(kFullMask, static_cast<unsigned long long>(t), 0);
    if (!ok || t <= k) break;
    const uint64_t stop = t - k > chunk ? k + chunk : t;
    for (; k < stop; ++k) {
      const uint64_t slot = k % Q;
      const int32_t* w = meta + slot * words;
      const int32_t row = peer::load_cg_s32(&w[0]);
      if (fail || row < 0 || row >= a.C) continue;  // a failed rank drains without copying
      char* dst = static_cast<char*>(a.recv_x) + static_cast<int64_t>(row) * a.row_bytes;
      if (!bulk) group_copy<CopySrc::kPeerWritten, kU>(warp_group(), dst, rbase + slot * stride, a.row_bytes);
      else if (lane == 0 && !bulk_copy_row(st, dst, rbase + slot * stride, a.row_bytes))
        report(a.c, kErrTimeout, s, kOpDispatch, static_cast<int32_t>(n), 5);
      int32_t* oidx = a.recv_idx + static_cast<int64_t>(row) * a.K;
      float* ow = a.recv_w + static_cast<int64_t>(row) * a.K;
      for (int j = lane; j < a.K; j += 32) {
        const int32_t v = peer::load_cg_s32(&w[2 + j]);
        oidx[j] = v;
        ow[j] = peer::load_cg_f32(reinterpret_cast<const float*>(&w[2 + a.K + j]));
        if (v >= 0 && v < el) atomicAdd(&a.recv_per_expert[v], 1);
      }
      if (lane == 0) {
        a.src_rank[row] = s;
        a.src_index[row] = peer::load_cg_s32(&w[1]);
      }
    }
    // The slots' reads are done before the release that lets the sender overwrite them.
    __syncwarp();
    if (lane == 0) peer::signal(head, k);
    __syncwarp();
  }
  if (lane == 0) hdr->d_ring.read[ch][s] = k;
  __syncwarp();
}

// Row i of the dispatch outputs as nothing received it: zeros, ids -1, no source. With
// `zeros` (kBulkZeroBytes in shared memory), lane 0 stores the row's zeros as bulk copies
// of a piece each.
__device__ void dispatch_empty_row(const DispatchArgs& a, int i, int lane, const char* zeros = nullptr) {
  char* row = static_cast<char*>(a.recv_x) + static_cast<int64_t>(i) * a.row_bytes;
  if (zeros == nullptr) group_zero(warp_group(), row, a.row_bytes);
  else if (lane == 0) bulk_zero_row(zeros, static_cast<uint32_t>(a.bulk_piece), row, a.row_bytes);
  for (int k = lane; k < a.K; k += 32) {
    a.recv_idx[static_cast<int64_t>(i) * a.K + k] = -1;
    a.recv_w[static_cast<int64_t>(i) * a.K + k] = 0.0f;
  }
  if (lane == 0) {
    a.src_rank[i] = -1;
    a.src_index[i] = -1;
  }
}

// Empties every dispatch output of this rank (a failed call: nothing counts as received).
__device__ void dispatch_empty_outputs(const DispatchArgs& a) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  for (int i = warp; i < a.C; i += nw) dispatch_empty_row(a, i, lane);
  const int64_t n_sr = static_cast<int64_t>(a.T) * a.c.num_ranks;
  for (int64_t e = threadIdx.x; e < n_sr; e += blockDim.x) a.send_row[e] = -1;
  for (int e = threadIdx.x; e < a.experts_per_rank; e += blockDim.x) a.recv_per_expert[e] = 0;
  if (threadIdx.x == 0) {
    *a.num_recv = 0;
    *a.num_dropped = 0;
  }
}

// The channel kernel: block ch is channel ch (DispatchChannels): a warp per receiver
// sends its tokens (warp d to rank d; a rank's own rows skip the rings, dispatch_self),
// and a warp per source after them receives channel ch of the other sources, so every
// block carries the same share of the NVLink stores and of the received rows. Above
// kMaxSplitSendRanks block 2 ch sends channel ch to every rank and 2 ch + 1 receives it
// from every source. Every warp then fills its share of the rows past the received ones
// (a warp with no ring starts at once). The last block to finish hands the epoch's credit
// to every sender. Rows move as bulk copies (the TMA) through shared memory when 16-byte
// aligned (DispatchChannelSmemBytes of it), leaving the warps' own loads and stores to
// the sends over NVLink.
template <int kThreads>
__global__ void __launch_bounds__(kThreads, 1) dispatch_channel_kernel(DispatchArgs a) {
  constexpr int kU = ChannelUnroll<kThreads>::value;
  __shared__ bool s_fail;
  JEP_DYNAMIC_SMEM(uint4, s_bulk);
  char* const sm = reinterpret_cast<char*>(s_bulk);
  const int R = a.c.num_ranks, me = a.c.me, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const bool split = ChannelSendSplit(R);
  const int ch = split ? static_cast<int>(blockIdx.x) : static_cast<int>(blockIdx.x >> 1);
  const bool sends = split || (blockIdx.x & 1) == 0, receives = split || (blockIdx.x & 1) == 1;
  const int src = warp - DispatchRecvWarp0(R);  // the source a receiving warp reads
  RankHeader* hdr = peer::header(a.c.peers, me);
  const uint64_t n = *reinterpret_cast<const volatile uint64_t*>(&hdr->seq[kOpDispatch]);
  if (threadIdx.x == 0) s_fail = failed();
  for (int i = threadIdx.x; i < kBulkZeroBytes / 16; i += blockDim.x) s_bulk[i] = make_uint4(0, 0, 0, 0);
  if (threadIdx.x == 0)
    for (int i = 0; i < 2 * R; ++i) peer::mbar_init(reinterpret_cast<uint64_t*>(sm + kBulkZeroBytes) + i);
  peer::fence_bulk_shared();  // the zeros and mbarriers, before any bulk copy uses them
  __syncthreads();
  if (sends && warp < R) {
    dispatch_send<kU>(a, ch, warp, s_fail, n, sm);
  } else if (receives && src >= 0 && src < R && src != me) {
    dispatch_recv<kU>(a, ch, src, s_fail, n, sm);
  }
  if (!s_fail) {
    const int kept = *a.num_recv;
    const int nw = blockDim.x >> 5;
    const char* zeros = aligned16(a.recv_x, a.recv_x, a.row_bytes) ? sm : nullptr;
    for (int i = kept + blockIdx.x * nw + warp; i < a.C; i += gridDim.x * nw)
      dispatch_empty_row(a, i, lane, zeros);
  }
  // This thread's bulk stores have landed before the block counts as finished (an error
  // found by the last block rewrites every row).
  peer::bulk_wait_all();
  if (last_block(a.c, kDoneDispatchChannel)) {
    // An error anywhere in this call empties every output (the contract's failed call).
    if (failed()) {
      dispatch_empty_outputs(a);
      // Peers that have not checked this epoch's call site yet (one that skipped the call
      // and comes later) find this rank failed, whatever site its notify sent.
      if (threadIdx.x < R)
        peer::store(&peer::header(a.c.peers, threadIdx.x)->site_arr[kOpDispatch][me], kSiteFailed);
    }
    peer::fence_data();
    __syncthreads();
    if (threadIdx.x == 0)
      for (int s = 0; s < R; ++s) peer::signal(&peer::header(a.c.peers, s)->credit[me], n);
  }
}

// ================================ combine ================================

// Notify: for each channel of my tokens and each rank r, the range of r's rows those
// tokens use (contiguous, since dispatch ordered them by token), posted to r.
__global__ void __launch_bounds__(kPlanThreads) combine_notify_kernel(CombineArgs a) {
  __shared__ uint64_t s_n;
  __shared__ bool s_fail;
  const int R = a.c.num_ranks, me = a.c.me, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int nch = a.c.channels;
  RankHeader* hdr = peer::header(a.c.peers, me);
  if (threadIdx.x == 0) {
    s_n = begin_epoch(a.c, kOpCombine);
    s_fail = failed();  // then this rank asks for nothing
  }
  __syncthreads();
  for (int p = warp; p < nch * R; p += blockDim.x >> 5) {
    const int ch = p / R, r = p % R;
    const int t0 = channel_begin(a.T, ch, nch), t1 = channel_begin(a.T, ch + 1, nch);
    int32_t lo = INT_MAX, hi = -1, cnt = 0;
    for (int t = s_fail ? t1 : t0 + lane; t < t1; t += 32) {
      const int32_t v = a.send_row[static_cast<int64_t>(t) * R + r];
      if (v < -1 || v >= a.C) {
        report(a.c, kErrBadHandle, t, r, v, kOpCombine);
      } else if (v >= 0) {
        lo = min(lo, v);
        hi = max(hi, v);
        ++cnt;
      }
    }
    for (int o = 16; o > 0; o >>= 1) {
      lo = min(lo, __shfl_xor_sync(kFullMask, lo, o));
      hi = max(hi, __shfl_xor_sync(kFullMask, hi, o));
      cnt += __shfl_xor_sync(kFullMask, cnt, o);
    }
    if (lane == 0) {
      int32_t first = cnt > 0 ? lo : 0, num = cnt > 0 ? hi - lo + 1 : 0;
      if (num != cnt) {  // not a handle from dispatch: its rows are not contiguous
        report(a.c, kErrBadHandle, -1, r, num, kOpCombine);
        first = 0;
        num = 0;
      }
      hdr->c_own_lo[ch][r] = first;
      hdr->c_own_n[ch][r] = num;
      RankHeader* ph = peer::header(a.c.peers, r);
      peer::store(&ph->c_req_lo[ch][me], first);
      peer::store(&ph->c_req_n[ch][me], num);
    }
  }
  peer::fence_data();
  __syncthreads();
  if (threadIdx.x == 0) {
    const int64_t site = site_to_send(a.c);
    for (int r = 0; r < R; ++r) peer::store(&peer::header(a.c.peers, r)->site_req[kOpCombine][me], site);
    peer::fence_data();
    for (int r = 0; r < R; ++r) peer::signal(&peer::header(a.c.peers, r)->request[kOpCombine][me], s_n);
  }
}

// Sending warp of channel ch towards token owner d: the rows of y d's channel ch asked
// for, in order, through ring (ch, me) on d. A failed rank moves the tail without data
// (its receivers know from its call site and only drain). This rank's own rows stay in y:
// its summing warps read them there (ring (ch, me) stays unused, as in dispatch).
template <int kU>
__device__ void combine_send(const CombineArgs& a, int ch, int d, bool fail) {
  const int R = a.c.num_ranks, me = a.c.me, lane = threadIdx.x & 31;
  if (d == me) return;
  RankHeader* hdr = peer::header(a.c.peers, me);
  RankHeader* dh = peer::header(a.c.peers, d);
  const size_t rb = CombineRingBytes(a.c.ring_tokens, a.row_bytes);
  const size_t stride = RowStride(a.row_bytes);
  char* rbase = peer::peer_ptr(a.c.peers, d, a.c.area_off + (static_cast<size_t>(ch) * R + me) * rb);
  const uint64_t Q = static_cast<uint64_t>(a.c.ring_tokens);
  const uint64_t chunk = Q > 4 ? Q / 4 : 1;
  uint64_t* tail = &dh->c_ring.tail[ch][me];
  int32_t lo = peer::load_volatile(&hdr->c_req_lo[ch][d]);
  int32_t cnt = peer::load_volatile(&hdr->c_req_n[ch][d]);
  if (lo < 0 || cnt < 0 || static_cast<int64_t>(lo) + cnt > a.C) {
    if (lane == 0) report(a.c, kErrBadHandle, lo, d, cnt, kOpCombine);
    lo = 0;
    cnt = 0;
  }
  const uint64_t base = hdr->c_ring.sent[ch][d];
  const uint64_t end = base + static_cast<uint64_t>(cnt);
  uint64_t k = base, published = base, credit = base;
  const char* y = static_cast<const char*>(a.y);
  for (int j = 0; j < cnt && !fail; ++j, ++k) {
    if (k - credit >= Q) {
      if (published < k) {
        publish_tail(tail, k);
        published = k;
      }
      if (!warp_wait_counter(a.c, &hdr->c_ring.head[ch][d], k - Q + 1, d, kOpCombine, &credit)) break;
    }
    group_copy<CopySrc::kReadOnly, kU>(warp_group(), rbase + (k % Q) * stride,
                                       y + static_cast<int64_t>(lo + j) * a.row_bytes, a.row_bytes);
    if (k + 1 - published >= chunk) {
      publish_tail(tail, k + 1);
      published = k + 1;
    }
  }
  publish_tail(tail, fail ? end : k);
  if (lane == 0) hdr->c_ring.sent[ch][d] = fail ? end : k;
  __syncwarp();
}

// Lane 0: waits until ring (ch, r) holds row `pos` (cumulative); false after a timeout.
__device__ __forceinline__ bool wait_row(const CommonArgs& c, const uint64_t* tail, uint64_t pos,
                                         int r) {
  if (peer::load_acquire(tail) > pos) return true;
  if (peer::wait_geq(tail, pos + 1, c.timeout_ns, &g_intranode_stop)) return true;
  report(c, kErrTimeout, r, kOpCombine, static_cast<int32_t>(pos), 3);
  return false;
}

// The channel kernel: both blocks of channel ch send (ChannelSendWarps, warp i the rows
// token owner d = 2 i + (block & 1), or i, asked for from its channel ch), block 2 ch + 1
// also sums channel ch's tokens with the warps after its senders, a chunk of tokens at a
// time (one per warp): out[t] = sum over r ascending of r's row for t, in float32. The
// summing warps meet at their own barrier (kRecvBarrier), never waiting for the senders
// beside them: those wait for credits from other ranks' summing warps.
template <FloatKind kKind, int kThreads>
__global__ void __launch_bounds__(kThreads, 1) combine_channel_kernel(CombineArgs a) {
  using E = Elems<kKind>;
  constexpr int kU = ChannelUnroll<kThreads>::value;
  // Ranks' vectors a summing lane loads before adding them: 4, and 1 in the 1024-thread
  // block of 32 ranks (64 registers), where 2 or more beside the float32 sums spill
  // (ptxas: 12 bytes; tests/test_ptxas_spills.py). The rows' other lanes and warps keep
  // the loads of that block in flight.
  constexpr int kSumRanks = kThreads < 1024 ? 4 : 1;
  __shared__ uint64_t s_base[kMaxRanks];   // ring (ch, r): rows consumed before this call
  __shared__ int32_t s_lo[kMaxRanks], s_cnt[kMaxRanks], s_used[kMaxRanks];
  __shared__ const char* s_src[kThreads / 32][kMaxRanks];  // per warp: its token's row from r
  __shared__ bool s_fail_send, s_fail;
  const int R = a.c.num_ranks, me = a.c.me, lane = threadIdx.x & 31;
  const int ch = blockIdx.x >> 1, half = blockIdx.x & 1;
  const bool split = ChannelSendSplit(R);
  const int sw = (split || half == 0) ? ChannelSendWarps(R) : 0, rw0 = ChannelRecvWarp0(R);
  const int nw = ChannelRecvWarps(R);                // summing warps of block 2 ch + 1
  const int warp = (threadIdx.x >> 5) - rw0;         // its summing warp (when half == 1)
  const int tid = static_cast<int>(threadIdx.x) - 32 * rw0;
  RankHeader* hdr = peer::header(a.c.peers, me);
  const uint64_t n = *reinterpret_cast<const volatile uint64_t*>(&hdr->seq[kOpCombine]);
  if (threadIdx.x == 0 && sw > 0) {
    // Every token owner posted its request of epoch n (it consumed epoch n - 1's rows).
    s_fail_send = wait_and_check(a.c, hdr->request[kOpCombine], hdr->site_req[kOpCombine], n,
                                 kOpCombine);
    if (blockIdx.x == 0) {  // my call site before any row, for the owners' check
      const int64_t site = site_to_send(a.c);
      for (int d = 0; d < R; ++d) peer::store(&peer::header(a.c.peers, d)->site_arr[kOpCombine][me], site);
      peer::fence_data();
      for (int d = 0; d < R; ++d) peer::signal(&peer::header(a.c.peers, d)->arrive[kOpCombine][me], n);
      s_fail_send = failed();
    }
  }
  if (half == 1 && tid == 0)
    s_fail = wait_and_check(a.c, hdr->arrive[kOpCombine], hdr->site_arr[kOpCombine], n, kOpCombine);
  __syncthreads();
  if (static_cast<int>(threadIdx.x >> 5) < sw) {
    const int d = split ? 2 * static_cast<int>(threadIdx.x >> 5) + half : static_cast<int>(threadIdx.x >> 5);
    if (d < R) combine_send<kU>(a, ch, d, s_fail_send);
    return;
  }
  if (half == 0 || tid < 0) return;
  const int rthreads = 32 * nw;
  if (tid < R) {
    s_lo[tid] = hdr->c_own_lo[ch][tid];
    s_cnt[tid] = hdr->c_own_n[ch][tid];
    s_base[tid] = hdr->c_ring.read[ch][tid];
    s_used[tid] = 0;
  }
  peer::sync_threads(kRecvBarrier, rthreads);
  const bool fail = s_fail;  // then the rows are drained unread and the outputs are zero
  const size_t rb = CombineRingBytes(a.c.ring_tokens, a.row_bytes);
  const size_t stride = RowStride(a.row_bytes);
  const uint64_t Q = static_cast<uint64_t>(a.c.ring_tokens);
  const char* area = peer::peer_ptr(a.c.peers, me, a.c.area_off + static_cast<size_t>(ch) * R * rb);
  const bool vec = (a.row_bytes % 16) == 0;
  const int t0 = channel_begin(a.T, ch, a.c.channels), t1 = channel_begin(a.T, ch + 1, a.c.channels);
  // Tokens summed at once: at most one row per ring each, so a ring of Q slots never
  // holds back a row the chunk still needs.
  const int span = static_cast<int>(Q < static_cast<uint64_t>(nw) ? Q : nw);
  for (int tb = t0; tb < t1; tb += span) {
    const int t = tb + warp;
    if (warp < span && t < t1) {
      char* out = static_cast<char*>(a.out) + static_cast<int64_t>(t) * a.row_bytes;
      uint32_t valid = 0;
      const char** src = s_src[warp];
      if (!fail) {
        int32_t j_l = -1;
        if (lane < R) {
          const int32_t v = a.send_row[static_cast<int64_t>(t) * R + lane];
          const int64_t j = static_cast<int64_t>(v) - s_lo[lane];
          if (v >= 0 && v < a.C && j >= 0 && j < s_cnt[lane]) j_l = static_cast<int32_t>(j);
        }
        valid = __ballot_sync(kFullMask, j_l >= 0);
        if (j_l >= 0 && lane == me) {
          // this rank's own row: in y, where the sender would have copied it from
          src[lane] = static_cast<const char*>(a.y) + (static_cast<int64_t>(s_lo[lane]) + j_l) * a.row_bytes;
        } else if (j_l >= 0) {
          const uint64_t pos = s_base[lane] + static_cast<uint64_t>(j_l);
          src[lane] = area + lane * rb + (pos % Q) * stride;
          atomicMax(&s_used[lane], j_l + 1);
        }
        // Lane 0 waits for each peer's row in turn (ascending), then the warp reads them.
        int good = 1;
        for (uint32_t m = valid & ~(1u << me); m != 0 && good; m &= m - 1) {
          const int r = __ffs(m) - 1;
          const int32_t j = __shfl_sync(kFullMask, j_l, r);
          if (lane == 0)
            good = wait_row(a.c, &hdr->c_ring.tail[ch][r], s_base[r] + static_cast<uint64_t>(j), r) ? 1 : 0;
          good = __shfl_sync(kFullMask, good, 0);
        }
        __syncwarp();
        if (!good) valid = 0;
      }
      if (vec) {
        const size_t nv = a.row_bytes / 16;
        for (size_t c = lane; c < nv; c += 32) {
          float acc[E::kPerVec];
#pragma unroll
          for (int i = 0; i < E::kPerVec; ++i) acc[i] = 0.0f;
          // Up to kSumRanks ranks' vectors are loaded before any is added (several loads
          // in flight per lane); the sum still runs over ranks in ascending order.
          for (uint32_t m = valid; m != 0;) {
            int rr[kSumRanks];
            uint4 q[kSumRanks];
#pragma unroll
            for (int u = 0; u < kSumRanks; ++u) {
              rr[u] = m != 0 ? __ffs(m) - 1 : -1;
              m &= m - 1;
            }
#pragma unroll
            for (int u = 0; u < kSumRanks; ++u)
              if (rr[u] >= 0) q[u] = engine_load16<CopySrc::kPeerWritten>(src[rr[u]] + c * 16);
#pragma unroll
            for (int u = 0; u < kSumRanks; ++u)
              if (rr[u] >= 0) {
#pragma unroll
                for (int i = 0; i < E::kPerVec; ++i) acc[i] += E::get(q[u], i);
              }
          }
          engine_store16(out + c * 16, E::pack(acc));
        }
      } else {
        for (int h = lane; h < a.H; h += 32) {
          float acc = 0.0f;
          for (uint32_t m = valid; m != 0; m &= m - 1) {
            const int r = __ffs(m) - 1;
            acc += E::load1(src[r] + static_cast<size_t>(h) * E::kBytes);
          }
          E::store1(out + static_cast<size_t>(h) * E::kBytes, acc);
        }
      }
      __syncwarp();
    }
    // Every warp's reads of the chunk's slots are done: hand them back.
    peer::sync_threads(kRecvBarrier, rthreads);
    if (tid < R && tid != me) {
      const uint64_t h = s_base[tid] + static_cast<uint64_t>(s_used[tid]);
      if (!fail) peer::signal(&peer::header(a.c.peers, tid)->c_ring.head[ch][me], h);
    }
    peer::sync_threads(kRecvBarrier, rthreads);
  }
  // Every row asked for is in (a failed rank drains them unread, handing slots back as
  // they fill, so a sender with more rows than slots is never stuck), then all go back.
  if (warp < R && warp != me && lane == 0) {
    const int r = warp;
    const uint64_t* tail = &hdr->c_ring.tail[ch][r];
    uint64_t* head = &peer::header(a.c.peers, r)->c_ring.head[ch][me];
    const uint64_t end = s_base[r] + static_cast<uint64_t>(s_cnt[r]);
    for (uint64_t k = s_base[r] + static_cast<uint64_t>(s_used[r]); k < end;) {
      if (!wait_row(a.c, tail, k, r)) break;
      const uint64_t t = peer::load_acquire(tail);
      k = t < end ? t : end;
      peer::signal(head, k);
    }
    hdr->c_ring.read[ch][r] = end;
  }
  __syncwarp();
}

// ================================ gather ================================
// Combine's transpose (and cached dispatch): out[i] = g_{src_rank[i]}[src_index[i]]. No
// notify kernel: the handle holds the layout, so each receiving warp knows its rows and
// tells its source how many, with the first ids (intranode_buffer.h, "gather").

// Sending warp of channel ch towards receiver q: the rows of g q's channel ch asks for,
// in the order of its ids, through data ring (ch, me) on q.
template <int kU>
__device__ void gather_send(const GatherArgs& a, int ch, int q, uint64_t n) {
  const int R = a.c.num_ranks, me = a.c.me, lane = threadIdx.x & 31;
  RankHeader* hdr = peer::header(a.c.peers, me);
  RankHeader* qh = peer::header(a.c.peers, q);
  const GatherRing ring = GatherRing::Make(a.c.ring_tokens, a.row_bytes);
  const size_t stride = RowStride(a.row_bytes);
  char* dbase = peer::peer_ptr(a.c.peers, q, a.c.area_off + (static_cast<size_t>(ch) * R + me) * ring.bytes);
  const int32_t* ids = reinterpret_cast<const int32_t*>(
      peer::peer_ptr(a.c.peers, me, a.c.area_off + (static_cast<size_t>(ch) * R + q) * ring.bytes) +
      ring.req_off);
  const uint64_t Q = static_cast<uint64_t>(a.c.ring_tokens);
  const uint64_t chunk = Q > 4 ? Q / 4 : 1;  // rows per published tail
  uint64_t* tail = &qh->g_ring.tail[ch][me];
  const uint64_t* posted = &hdr->g_ring.head[ch][q];
  // q's count of epoch n and its call site.
  uint64_t seen = 0;
  const bool ok = warp_wait_counter(a.c, &hdr->g_req_epoch[ch][q], n, q, kOpGather, &seen);
  int32_t cnt = 0;
  if (ok && lane == 0) {
    __threadfence();
    const int64_t got = *reinterpret_cast<const volatile int64_t*>(&hdr->g_req_site[ch][q]);
    if (got == kSiteFailed)
      report(a.c, kErrPeerFailed, q, kOpGather, 0, 0);
    else if (got != a.c.call_site)
      report(a.c, kErrCallSite, q, kOpGather, static_cast<int32_t>(got), static_cast<int32_t>(a.c.call_site));
    cnt = peer::load_volatile(&hdr->g_req_n[ch][q]);
    if (cnt < 0) cnt = 0;
  }
  cnt = __shfl_sync(kFullMask, cnt, 0);
  // One decision for the whole ring: a failed rank sends its failed site and no rows (the
  // receiver skips the ring on that site), a healthy one every row asked for.
  const bool fail = __shfl_sync(kFullMask, (!ok || failed()) ? 1 : 0, 0) != 0;
  if (lane == 0) {
    peer::store(&qh->g_arr_site[ch][me], fail ? kSiteFailed : a.c.call_site);
    peer::fence_data();
    peer::signal(&qh->g_arr_epoch[ch][me], n);
  }
  __syncwarp();
  const uint64_t base = hdr->g_ring.sent[ch][q];
  const uint64_t end = base + static_cast<uint64_t>(cnt);
  uint64_t k = fail ? end : base, published = base, avail = base;
  const char* g = static_cast<const char*>(a.g);
  while (k < end) {
    if (avail <= k) {
      // Rows written go out before waiting: q posts more ids only as it reads them.
      if (published < k) {
        publish_tail(tail, k);
        published = k;
      }
      if (!warp_wait_counter(a.c, posted, k + 1, q, kOpGather, &avail)) break;
      if (avail > end) avail = end;
    }
    // Up to 32 ids at once, one per lane, then their rows one after another.
    const uint64_t stop = avail - k < 32 ? avail : k + 32;
    int32_t t = -1;
    if (k + lane < stop) t = peer::load_cg_s32(&ids[(k + lane) % Q]);
    for (uint64_t j = k; j < stop; ++j) {
      const int32_t tt = __shfl_sync(kFullMask, t, static_cast<int>(j - k));
      char* dst = dbase + (j % Q) * stride;
      if (tt >= 0 && tt < a.T)
        group_copy<CopySrc::kReadOnly, kU>(warp_group(), dst, g + static_cast<int64_t>(tt) * a.row_bytes,
                                           a.row_bytes);
      else
        group_zero(warp_group(), dst, a.row_bytes);  // never asked by a checked handle
      if (j + 1 - published >= chunk) {
        publish_tail(tail, j + 1);
        published = j + 1;
      }
    }
    k = stop;
  }
  publish_tail(tail, k);
  if (lane == 0) hdr->g_ring.sent[ch][q] = k;
  __syncwarp();
}

// Receiving warp of channel ch for this rank's own rows [lo, lo + cnt): copied from g
// straight into place. Its rings (ch, me) stay unused, as in dispatch (dispatch_self):
// through them each row would be stored and loaded once more on this GPU.
template <int kU>
__device__ void gather_self(const GatherArgs& a, int32_t lo, int32_t cnt, bool fail) {
  if (fail) return;
  const char* g = static_cast<const char*>(a.g);
  for (int32_t j = 0; j < cnt; ++j) {
    const int64_t i = static_cast<int64_t>(lo) + j;
    group_copy<CopySrc::kReadOnly, kU>(warp_group(), static_cast<char*>(a.out) + i * a.row_bytes,
                                       g + static_cast<int64_t>(a.src_index[i]) * a.row_bytes, a.row_bytes);
  }
}

// Receiving warp of channel ch for source s: rows [lo, lo + cnt) of the outputs come from
// s's channel ch. Posts their token ids into request ring (ch, me) on s, a ring's worth
// ahead of the rows read, and copies each row of data ring (ch, s) into place (this
// rank's own rows: gather_self).
template <int kU>
__device__ void gather_recv(const GatherArgs& a, int ch, int s, int32_t lo, int32_t cnt, bool fail,
                            uint64_t n) {
  const int R = a.c.num_ranks, me = a.c.me, lane = threadIdx.x & 31;
  if (s == me) {
    gather_self<kU>(a, lo, cnt, fail);
    return;
  }
  RankHeader* hdr = peer::header(a.c.peers, me);
  RankHeader* sh = peer::header(a.c.peers, s);
  const GatherRing ring = GatherRing::Make(a.c.ring_tokens, a.row_bytes);
  const size_t stride = RowStride(a.row_bytes);
  const char* dbase = peer::peer_ptr(a.c.peers, me, a.c.area_off + (static_cast<size_t>(ch) * R + s) * ring.bytes);
  int32_t* ids = reinterpret_cast<int32_t*>(
      peer::peer_ptr(a.c.peers, s, a.c.area_off + (static_cast<size_t>(ch) * R + me) * ring.bytes) +
      ring.req_off);
  const uint64_t Q = static_cast<uint64_t>(a.c.ring_tokens);
  const uint64_t chunk = Q > 2 ? Q / 2 : 1;  // free slots per batch of ids
  uint64_t* posted_ctr = &sh->g_ring.head[ch][me];
  const uint64_t* tail = &hdr->g_ring.tail[ch][s];
  if (fail) cnt = 0;  // a failed rank asks for nothing
  if (lane == 0) {
    peer::store(&sh->g_req_site[ch][me], fail ? kSiteFailed : a.c.call_site);
    peer::store(&sh->g_req_n[ch][me], cnt);
    peer::fence_data();
    peer::signal(&sh->g_req_epoch[ch][me], n);
  }
  __syncwarp();
  const uint64_t base = hdr->g_ring.read[ch][s];
  const uint64_t end = base + static_cast<uint64_t>(cnt);
  uint64_t posted = base;
  // Ids [posted, upto) into their slots, fenced before the count that publishes them.
  auto post = [&](uint64_t upto) {
    for (uint64_t j = posted + lane; j < upto; j += 32)
      peer::store(&ids[j % Q], a.src_index[lo + static_cast<int64_t>(j - base)]);
    publish_tail(posted_ctr, upto);
    posted = upto;
  };
  post(end - base < Q ? end : base + Q);  // the first ids go out before s's site is read
  uint64_t seen = 0;
  bool skip = !warp_wait_counter(a.c, &hdr->g_arr_epoch[ch][s], n, s, kOpGather, &seen);
  if (!skip) {
    int bad = 0;
    if (lane == 0) {
      __threadfence();
      const int64_t got = *reinterpret_cast<const volatile int64_t*>(&hdr->g_arr_site[ch][s]);
      if (got != a.c.call_site) {
        bad = 1;  // s sends no rows
        if (got == kSiteFailed)
          report(a.c, kErrPeerFailed, s, kOpGather, 0, 0);
        else
          report(a.c, kErrCallSite, s, kOpGather, static_cast<int32_t>(got), static_cast<int32_t>(a.c.call_site));
      }
    }
    skip = __shfl_sync(kFullMask, bad, 0) != 0;
  }
  uint64_t k = base;
  while (!skip && k < end) {
    uint64_t t = 0;
    if (!warp_wait_counter(a.c, tail, k + 1, s, kOpGather, &t)) break;
    const uint64_t stop = t < end ? t : end;
    for (; k < stop; ++k)
      if (!fail)
        group_copy<CopySrc::kPeerWritten, kU>(
            warp_group(), static_cast<char*>(a.out) + static_cast<int64_t>(lo + static_cast<int64_t>(k - base)) * a.row_bytes,
            dbase + (k % Q) * stride, a.row_bytes);
    // The slots just read are free: their ids' successors may go out.
    __syncwarp();
    const uint64_t room = k + Q - posted, want = end - posted;
    if (posted < end && room >= (want < chunk ? want : chunk)) post(k + Q < end ? k + Q : end);
  }
  if (lane == 0) hdr->g_ring.read[ch][s] = skip ? end : k;
  __syncwarp();
}

// The channel kernel: both blocks of channel ch send (ChannelSendWarps, warp i the rows
// receiver q = 2 i + (block & 1), or i, asks for from its channel ch), block 2 ch + 1 also
// receives channel ch of every source (its warps after its senders, warp s from source s;
// its own rows straight from g, gather_self). The receiving warps find, for each source,
// the contiguous range of its rows whose token is in that source's channel ch (dispatch
// ordered rows by source, then token), and zero the rows nothing fills; they meet at
// their own barrier (kRecvBarrier), never waiting for the senders beside them, which wait
// for other ranks' receivers to ask. The last block to finish closes the epoch.
template <int kThreads>
__global__ void __launch_bounds__(kThreads, 1) gather_channel_kernel(GatherArgs a) {
  constexpr int kU = ChannelUnroll<kThreads>::value;
  __shared__ uint64_t s_n;
  __shared__ bool s_fail;
  __shared__ int32_t s_lo[kMaxRanks], s_hi[kMaxRanks], s_cnt[kMaxRanks];
  const int R = a.c.num_ranks, me = a.c.me, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int nw = blockDim.x >> 5, nch = a.c.channels;
  const int ch = blockIdx.x >> 1, half = blockIdx.x & 1;
  const bool split = ChannelSendSplit(R);
  const int sw = (split || half == 0) ? ChannelSendWarps(R) : 0, rw0 = ChannelRecvWarp0(R);
  const int rnw = ChannelRecvWarps(R);          // receiving warps of block 2 ch + 1
  const int rwarp = warp - rw0;                 // its receiving warp (when half == 1)
  const int rtid = static_cast<int>(threadIdx.x) - 32 * rw0;
  RankHeader* hdr = peer::header(a.c.peers, me);
  if (threadIdx.x == 0) {
    // Every block reads the epoch before the last one stores it (below).
    s_n = *reinterpret_cast<const volatile uint64_t*>(&hdr->seq[kOpGather]) + 1;
    check_identity(a.c);
    s_fail = failed();
  }
  if (threadIdx.x < R) {
    s_lo[threadIdx.x] = INT_MAX;
    s_hi[threadIdx.x] = -1;
    s_cnt[threadIdx.x] = 0;
  }
  __syncthreads();
  const uint64_t n = s_n;
  if (warp < sw) {
    const int q = split ? 2 * warp + half : warp;
    if (q < R && q != me) gather_send<kU>(a, ch, q, n);  // own rows: gather_self
  } else if (half == 1 && rwarp >= 0 && rwarp < rnw) {
    const bool fail = s_fail;
    const int rthreads = 32 * rnw;
    const int t0 = channel_begin(a.T, ch, nch), t1 = channel_begin(a.T, ch + 1, nch);
    for (int i = fail ? a.C : rtid; i < a.C; i += rthreads) {
      const int32_t s = a.src_rank[i], t = a.src_index[i];
      if (s == -1) continue;
      if (s < 0 || s >= R || t < 0 || t >= a.T) {
        if (i % nch == ch) report(a.c, kErrBadHandle, i, s, t, kOpGather);
        continue;
      }
      if (t < t0 || t >= t1) continue;
      atomicMin(&s_lo[s], i);
      atomicMax(&s_hi[s], i);
      atomicAdd(&s_cnt[s], 1);
    }
    peer::sync_threads(kRecvBarrier, rthreads);
    if (rtid < R && s_cnt[rtid] > 0 && s_hi[rtid] - s_lo[rtid] + 1 != s_cnt[rtid]) {
      // Not a handle from dispatch: these rows are not contiguous. Reported, left zero.
      report(a.c, kErrBadHandle, -1, rtid, s_cnt[rtid], kOpGather);
      s_cnt[rtid] = -1;
    }
    peer::sync_threads(kRecvBarrier, rthreads);
    // Rows no ring fills: empty or bad ones (spread over the channels), and this
    // channel's rows of a rejected range.
    for (int b = fail ? a.C : rwarp * 32; b < a.C; b += rnw * 32) {
      const int i = b + lane;
      bool zero = false;
      if (i < a.C) {
        const int32_t s = a.src_rank[i], t = a.src_index[i];
        if (s < 0 || s >= R || t < 0 || t >= a.T)
          zero = i % nch == ch;
        else
          zero = t >= t0 && t < t1 && s_cnt[s] < 0;
      }
      for (unsigned m = __ballot_sync(kFullMask, zero); m != 0; m &= m - 1)
        group_zero(warp_group(), static_cast<char*>(a.out) + static_cast<int64_t>(b + __ffs(m) - 1) * a.row_bytes,
                   a.row_bytes);
    }
    if (rwarp < R) {
      const int32_t cnt = s_cnt[rwarp] > 0 ? s_cnt[rwarp] : 0;
      gather_recv<kU>(a, ch, rwarp, cnt > 0 ? s_lo[rwarp] : 0, cnt, fail, n);
    }
  }
  if (last_block(a.c, kDoneGatherChannel)) {
    if (failed()) {
      // An error anywhere in this call empties the output (the contract's failed call),
      // and peers that have not read this epoch's sites yet find this rank failed.
      for (int i = warp; i < a.C; i += nw)
        group_zero(warp_group(), static_cast<char*>(a.out) + static_cast<int64_t>(i) * a.row_bytes, a.row_bytes);
      for (int e = threadIdx.x; e < nch * R; e += blockDim.x) {
        RankHeader* ph = peer::header(a.c.peers, e % R);
        peer::store(&ph->g_req_site[e / R][me], kSiteFailed);
        peer::store(&ph->g_arr_site[e / R][me], kSiteFailed);
      }
      peer::fence_data();
    }
    if (threadIdx.x == 0) hdr->seq[kOpGather] = n;
  }
}

// The compiled block size of a channel kernel at R ranks: its block at the launch preset
// whose rank count covers R (configs.h kIntranodePresets: 2, 4, 8, 16, 32 ranks), so at
// every preset __launch_bounds__ is the block it runs with, and ptxas gives each thread
// the registers that block size leaves (65536 / threads), not the 64 of a 1024-thread
// bound. Between presets the next preset's instance runs a smaller block.
inline int BoundRanks(int R) {
  int p = 2;
  while (p < R && p < kMaxRanks) p *= 2;
  return p;
}

template <int kThreads>
void LaunchDispatchChannel(const DispatchArgs& b, int R, cudaStream_t stream) {
  JEP_LAUNCH_T(dispatch_channel_kernel, kThreads, DispatchBlocks(R, b.c.channels), DispatchRoleThreads(R),
               DispatchChannelSmemBytes(R, b.bulk_piece), stream,
               dispatch_channel_kernel<kThreads>)(b);
}

template <FloatKind kKind, int kThreads>
void LaunchCombineChannel(const CombineArgs& a, int R, cudaStream_t stream) {
  JEP_LAUNCH_T(combine_channel_kernel, kThreads, 2 * a.c.channels, ChannelRoleThreads(R), 0, stream,
               combine_channel_kernel<kKind, kThreads>)(a);
}

template <FloatKind kKind>
cudaError_t LaunchCombineChannelKind(const CombineArgs& a, int R, cudaStream_t stream) {
  switch (ChannelRoleThreads(BoundRanks(R))) {
    case 288: LaunchCombineChannel<kKind, 288>(a, R, stream); break;
    case 320: LaunchCombineChannel<kKind, 320>(a, R, stream); break;
    case 384: LaunchCombineChannel<kKind, 384>(a, R, stream); break;
    case 768: LaunchCombineChannel<kKind, 768>(a, R, stream); break;
    case 1024: LaunchCombineChannel<kKind, 1024>(a, R, stream); break;
    default: return cudaErrorInvalidConfiguration;  // a preset's block without an instance
  }
  return cudaSuccess;
}

template <int kThreads>
void LaunchGatherChannel(const GatherArgs& a, int R, cudaStream_t stream) {
  JEP_LAUNCH_T(gather_channel_kernel, kThreads, 2 * a.c.channels, ChannelRoleThreads(R), 0, stream,
               gather_channel_kernel<kThreads>)(a);
}

}  // namespace

cudaError_t LaunchDispatchPhase(int phase, const DispatchArgs& a, const IntranodePreset& p,
                                cudaStream_t stream) {
  (void)p;
  const int R = a.c.num_ranks;
  if (R < 1 || R > kMaxRanks || a.c.channels < 1 ||
      a.c.channels > (ChannelSendSplit(R) ? kMaxDispatchChannels : kMaxChannels) ||
      a.c.ring_tokens < 1)
    return cudaErrorInvalidValue;
  switch (phase) {
    case kPhaseNotify:
      JEP_LAUNCH(dispatch_notify_kernel, 1, kPlanThreads, 0, stream)(a);
      break;
    case kPhaseChannel: {
      DispatchArgs b = a;
      b.bulk_piece = IntranodeBulkPieceBytes(R);
      switch (DispatchRoleThreads(BoundRanks(R))) {
        case 320: LaunchDispatchChannel<320>(b, R, stream); break;
        case 384: LaunchDispatchChannel<384>(b, R, stream); break;
        case 512: LaunchDispatchChannel<512>(b, R, stream); break;
        case 1024: LaunchDispatchChannel<1024>(b, R, stream); break;
        default: return cudaErrorInvalidConfiguration;
      }
      break;
    }
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

cudaError_t LaunchCombinePhase(int phase, const CombineArgs& a, const IntranodePreset& p,
                               cudaStream_t stream) {
  (void)p;
  const int R = a.c.num_ranks;
  if (R < 1 || R > kMaxRanks || a.c.channels < 1 || a.c.channels > kMaxChannels ||
      a.c.ring_tokens < 1)
    return cudaErrorInvalidValue;
  cudaError_t e = cudaSuccess;
  switch (phase) {
    case kPhaseNotify:
      JEP_LAUNCH(combine_notify_kernel, 1, kPlanThreads, 0, stream)(a);
      break;
    case kPhaseChannel:
      switch (a.kind) {
        case FloatKind::kF32: e = LaunchCombineChannelKind<FloatKind::kF32>(a, R, stream); break;
        case FloatKind::kBF16: e = LaunchCombineChannelKind<FloatKind::kBF16>(a, R, stream); break;
        case FloatKind::kF16: e = LaunchCombineChannelKind<FloatKind::kF16>(a, R, stream); break;
      }
      if (e != cudaSuccess) return e;
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

cudaError_t LaunchGatherPhase(int phase, const GatherArgs& a, const IntranodePreset& p,
                              cudaStream_t stream) {
  (void)p;
  const int R = a.c.num_ranks;
  if (R < 1 || R > kMaxRanks || a.c.channels < 1 || a.c.channels > kMaxChannels ||
      a.c.ring_tokens < 1 || phase != 0)
    return cudaErrorInvalidValue;
  switch (ChannelRoleThreads(BoundRanks(R))) {
    case 288: LaunchGatherChannel<288>(a, R, stream); break;
    case 320: LaunchGatherChannel<320>(a, R, stream); break;
    case 384: LaunchGatherChannel<384>(a, R, stream); break;
    case 768: LaunchGatherChannel<768>(a, R, stream); break;
    case 1024: LaunchGatherChannel<1024>(a, R, stream); break;
    default: return cudaErrorInvalidConfiguration;
  }
  return cudaGetLastError();
}

// Clears the first-error record only. The failed state (and the stop word) stays: after a
// protocol error the headers are out of step, and a kernel that went on would read its
// peers' counts and call sites of another epoch. ClearIntranodeFailure() lifts it, from
// reset() only, once the headers are zero again.
cudaError_t ReadIntranodeError(ErrorRecord* out, bool clear) {
  return ReadErrorSymbol(g_intranode_error, out, clear);
}

cudaError_t ClearIntranodeFailure() {
  ErrorRecord failure{};
  cudaError_t e = ReadErrorSymbol(g_intranode_failed, &failure, true);
  if (e == cudaSuccess) {
    const int32_t zero = 0;
    e = cudaMemcpyToSymbol(g_intranode_stop, &zero, sizeof(zero));
  }
  return e;
}

cudaError_t ReadIntranodeFailure(ErrorRecord* out) {
  return ReadErrorSymbol(g_intranode_failed, out, false);
}

}  // namespace jax_ep

