// Intranode dispatch, combine and gather (combine's transpose) over peer pointers.
// Buffer layout and protocol: kernels/intranode_buffer.h. Each op is three kernels per
// rank (plan, push, finish; see kernels/cuda_kernels.h). Rows land in the XLA outputs in
// the contract's order (source rank, then token), with the routing math of
// kernels/layout_math.h, so results match the CPU backend bit for bit.
//
// Failing safely (see intranode_buffer.h): every kernel keeps the protocol going (epochs,
// requests, signals) whatever happened, so ranks never fall out of step; after a protocol
// error (also one after an earlier bad id or foreign handle) it moves no data, writes empty
// outputs and tells its peers (kSiteFailed). Once a timeout is recorded, waits return at
// once. jax_ep.cuda.reset() clears all of it.
#include <climits>
#include <cstdint>

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

// Starts epoch n of an op kind on this rank (plan kernels only, thread 0).
__device__ uint64_t begin_epoch(const CommonArgs& c, int kind) {
  RankHeader* h = peer::header(c.peers, c.me);
  const uint64_t n = h->seq[kind] + 1;
  h->seq[kind] = n;
  check_identity(c);
  return n;
}

// Called by every thread at the end of a multi-block kernel. Returns true in exactly
// one thread (thread 0 of the last block to finish), after every block's writes.
__device__ bool last_block_done(const CommonArgs& c, int counter) {
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
  return s_last && threadIdx.x == 0;
}

// Ranks a token is sent to (bit r), from its sanitized ids.
__device__ __forceinline__ uint32_t token_mask(const DispatchArgs& a, int t, bool record) {
  const int32_t* row = a.topk_idx + static_cast<int64_t>(t) * a.K;
  uint32_t mask = 0;
  for (int k = 0; k < a.K; ++k) {
    const int32_t raw = row[k];
    const int32_t e = sanitized(raw, a.E);
    if (record && e != raw) report(a.c, kErrBadTopkId, t, k, raw, a.E);
    if (e >= 0) mask |= 1u << owner_rank(e, a.experts_per_rank);
  }
  return mask;
}

__device__ __forceinline__ int global_warp() { return (blockIdx.x * blockDim.x + threadIdx.x) >> 5; }
__device__ __forceinline__ int total_warps() { return (gridDim.x * blockDim.x) >> 5; }

// Index s with base[s] <= i < base[s + 1] (base has R + 1 entries, non-decreasing).
__device__ __forceinline__ int find_segment(const int32_t* base, int R, int64_t i) {
  int s = 0;
  while (s + 1 < R && i >= base[s + 1]) ++s;
  return s;
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

// ================================ dispatch ================================

__global__ void __launch_bounds__(kPlanThreads) dispatch_plan_kernel(DispatchArgs a) {
  __shared__ int32_t s_warp[kPlanThreads / 32][kMaxRanks];
  __shared__ int32_t s_run[kMaxRanks];
  __shared__ bool s_fail;
  const int R = a.c.num_ranks;
  if (threadIdx.x == 0) {
    begin_epoch(a.c, kOpDispatch);
    s_fail = failed();  // then this rank sends nothing (its counts are all zero)
  }
  if (threadIdx.x < R) s_run[threadIdx.x] = 0;
  for (int e = threadIdx.x; e < a.experts_per_rank; e += blockDim.x) a.recv_per_expert[e] = 0;
  __syncthreads();
  const bool fail = s_fail;
  int32_t pos[kMaxRanks];
  for (int base = 0; base < a.T; base += blockDim.x) {
    const int t = base + threadIdx.x;
    const uint32_t mask = (t < a.T && !fail) ? token_mask(a, t, true) : 0u;
    chunk_positions(mask, R, s_warp, s_run, pos);
    if (t < a.T) {
      int32_t* out = a.send_row + static_cast<int64_t>(t) * R;
#pragma unroll 1
      for (int r = 0; r < R; ++r) out[r] = ((mask >> r) & 1u) ? pos[r] : -1;  // raw positions
    }
  }
  if (threadIdx.x < R) peer::header(a.c.peers, a.c.me)->my_counts[threadIdx.x] = s_run[threadIdx.x];
}

__global__ void dispatch_push_kernel(DispatchArgs a) {
  __shared__ uint64_t s_n;
  __shared__ bool s_fail;
  const int R = a.c.num_ranks, me = a.c.me, lane = threadIdx.x & 31;
  RankHeader* hdr = peer::header(a.c.peers, me);
  if (threadIdx.x == 0) {
    s_n = hdr->seq[kOpDispatch];
    wait_all(a.c, hdr->credit, s_n - 1, kOpDispatch);  // receivers done with epoch n - 1
    s_fail = failed();
  }
  __syncthreads();
  const int rows_cap = RowsCap(a.T, a.C);
  const DispatchRegion reg = DispatchRegion::Make(rows_cap, a.row_bytes, a.K);
  const size_t stride = RowStride(a.row_bytes);
  const size_t region_off = a.c.area_off + static_cast<size_t>(me) * reg.bytes;
  for (int t = s_fail ? a.T : global_warp(); t < a.T; t += total_warps()) {
    const int32_t pos_l = lane < R ? a.send_row[static_cast<int64_t>(t) * R + lane] : -1;
    const uint32_t keep = __ballot_sync(kFullMask, pos_l >= 0 && pos_l < rows_cap);
    const char* src = static_cast<const char*>(a.x) + static_cast<int64_t>(t) * a.row_bytes;
    const int32_t* row = a.topk_idx + static_cast<int64_t>(t) * a.K;
    const float* wrow = a.topk_w + static_cast<int64_t>(t) * a.K;
    for (uint32_t m = keep; m != 0; m &= m - 1) {
      const int r = __ffs(m) - 1;
      const int32_t pos = __shfl_sync(kFullMask, pos_l, r);
      char* region = peer::peer_ptr(a.c.peers, r, region_off);
      warp_copy_row<true>(region + reg.x_off + pos * stride, src, a.row_bytes, lane);
      int32_t* didx = reinterpret_cast<int32_t*>(region + reg.idx_off) + static_cast<int64_t>(pos) * a.K;
      float* dw = reinterpret_cast<float*>(region + reg.w_off) + static_cast<int64_t>(pos) * a.K;
      for (int k = lane; k < a.K; k += 32) {
        const int32_t local = local_expert_id(sanitized(row[k], a.E), a.experts_per_rank, r);
        peer::store(&didx[k], local);
        peer::store(&dw[k], local >= 0 ? wrow[k] : 0.0f);
      }
      if (lane == 0) peer::store(reinterpret_cast<int32_t*>(region + reg.tok_off) + pos, t);
    }
  }
  if (last_block_done(a.c, kDoneDispatchSend)) {
    // Checked again here: an error recorded since the start also empties this send.
    const int64_t site = site_to_send(a.c);
    for (int r = 0; r < R; ++r) {
      RankHeader* ph = peer::header(a.c.peers, r);
      for (int j = 0; j < R; ++j)
        peer::store(&ph->counts[me][j], site == kSiteFailed ? 0 : hdr->my_counts[j]);
      peer::store(&ph->site_arr[kOpDispatch][me], site);
    }
    peer::fence_data();
    for (int r = 0; r < R; ++r) peer::signal(&peer::header(a.c.peers, r)->arrive[kOpDispatch][me], s_n);
  }
}

__global__ void dispatch_finish_kernel(DispatchArgs a, bool smem_hist) {
  JEP_DYNAMIC_SMEM(int32_t, s_hist);
  __shared__ uint64_t s_n;
  __shared__ int32_t s_base[kMaxRanks + 1];
  __shared__ int32_t s_cnt[kMaxRanks];
  __shared__ int32_t s_mybase[kMaxRanks];  // first row of my tokens on each receiver
  __shared__ int64_t s_total;
  __shared__ int32_t s_kept;
  __shared__ bool s_fail;
  const int R = a.c.num_ranks, me = a.c.me, lane = threadIdx.x & 31;
  const int el = a.experts_per_rank;
  RankHeader* hdr = peer::header(a.c.peers, me);
  if (threadIdx.x == 0) {
    s_n = hdr->seq[kOpDispatch];
    s_fail = wait_and_check(a.c, hdr->arrive[kOpDispatch], hdr->site_arr[kOpDispatch], s_n,
                            kOpDispatch);
  }
  __syncthreads();
  const bool fail = s_fail;  // then nothing is received: empty outputs, send_row all -1
  if (threadIdx.x < R) {
    const int r = threadIdx.x;
    s_cnt[r] = fail ? 0 : peer::load_volatile(&hdr->counts[r][me]);
    int64_t b = 0;
    for (int s = 0; s < me; ++s) b += peer::load_volatile(&hdr->counts[s][r]);
    s_mybase[r] = static_cast<int32_t>(b < INT_MAX ? b : INT_MAX);
  }
  if (smem_hist)
    for (int e = threadIdx.x; e < el; e += blockDim.x) s_hist[e] = 0;
  __syncthreads();
  if (threadIdx.x == 0) {
    int64_t b = 0;
    for (int s = 0; s < R; ++s) {
      s_base[s] = static_cast<int32_t>(b < INT_MAX ? b : INT_MAX);
      b += s_cnt[s];
    }
    s_base[R] = static_cast<int32_t>(b < INT_MAX ? b : INT_MAX);
    s_total = b;
    s_kept = kept_rows(b, a.C);
  }
  __syncthreads();
  const int kept = s_kept;
  const DispatchRegion reg = DispatchRegion::Make(RowsCap(a.T, a.C), a.row_bytes, a.K);
  const size_t stride = RowStride(a.row_bytes);
  const char* area = peer::peer_ptr(a.c.peers, me, a.c.area_off);
  char* recv_x = static_cast<char*>(a.recv_x);
  for (int i = global_warp(); i < a.C; i += total_warps()) {
    char* dst = recv_x + static_cast<int64_t>(i) * a.row_bytes;
    int32_t* oidx = a.recv_idx + static_cast<int64_t>(i) * a.K;
    float* ow = a.recv_w + static_cast<int64_t>(i) * a.K;
    if (i < kept) {
      const int s = find_segment(s_base, R, i);
      const int j = i - s_base[s];
      const char* region = area + static_cast<size_t>(s) * reg.bytes;
      warp_copy_row<false>(dst, region + reg.x_off + j * stride, a.row_bytes, lane);
      const int32_t* sidx = reinterpret_cast<const int32_t*>(region + reg.idx_off) + static_cast<int64_t>(j) * a.K;
      const float* sw = reinterpret_cast<const float*>(region + reg.w_off) + static_cast<int64_t>(j) * a.K;
      for (int k = lane; k < a.K; k += 32) {
        const int32_t v = peer::load_cg_s32(sidx + k);
        oidx[k] = v;
        ow[k] = peer::load_cg_f32(sw + k);
        if (v >= 0 && v < el) {
          if (smem_hist)
            atomicAdd(&s_hist[v], 1);
          else
            atomicAdd(&a.recv_per_expert[v], 1);
        }
      }
      if (lane == 0) {
        a.src_rank[i] = s;
        a.src_index[i] = peer::load_cg_s32(reinterpret_cast<const int32_t*>(region + reg.tok_off) + j);
      }
    } else {
      warp_zero_row(dst, a.row_bytes, lane);
      for (int k = lane; k < a.K; k += 32) {
        oidx[k] = -1;
        ow[k] = 0.0f;
      }
      if (lane == 0) {
        a.src_rank[i] = -1;
        a.src_index[i] = -1;
      }
    }
  }
  // send_row: raw positions from the plan kernel become rows on each receiver.
  const int64_t n_sr = static_cast<int64_t>(a.T) * R;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < n_sr;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int32_t raw = a.send_row[e];
    if (fail) {
      a.send_row[e] = -1;
    } else if (raw >= 0) {
      const int64_t v = static_cast<int64_t>(s_mybase[e % R]) + raw;
      a.send_row[e] = v < a.C ? static_cast<int32_t>(v) : -1;
    }
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    *a.num_recv = kept;
    *a.num_dropped = static_cast<int32_t>(s_total - kept);
  }
  __syncthreads();
  if (smem_hist)
    for (int e = threadIdx.x; e < el; e += blockDim.x)
      if (s_hist[e] != 0) atomicAdd(&a.recv_per_expert[e], s_hist[e]);
  if (last_block_done(a.c, kDoneDispatchRecv)) {
    for (int s = 0; s < R; ++s) peer::signal(&peer::header(a.c.peers, s)->credit[me], s_n);
  }
}

// ================================ combine ================================

__global__ void __launch_bounds__(kPlanThreads) combine_plan_kernel(CombineArgs a) {
  __shared__ int32_t s_min[kPlanThreads / 32], s_max[kPlanThreads / 32];
  __shared__ uint64_t s_n;
  __shared__ bool s_fail;
  const int R = a.c.num_ranks, me = a.c.me, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  RankHeader* hdr = peer::header(a.c.peers, me);
  if (threadIdx.x == 0) {
    s_n = begin_epoch(a.c, kOpCombine);
    s_fail = failed();  // then this rank asks for nothing
  }
  __syncthreads();
  const int rows_cap = RowsCap(a.T, a.C);
  for (int r = 0; r < R; ++r) {
    int32_t lo = INT_MAX, hi = -1;
    for (int t = s_fail ? a.T : threadIdx.x; t < a.T; t += blockDim.x) {
      const int32_t v = a.send_row[static_cast<int64_t>(t) * R + r];
      if (v < -1 || v >= a.C) {
        report(a.c, kErrBadHandle, t, r, v, kOpCombine);
      } else if (v >= 0) {
        lo = min(lo, v);
        hi = max(hi, v);
      }
    }
    for (int o = 16; o > 0; o >>= 1) {
      lo = min(lo, __shfl_xor_sync(kFullMask, lo, o));
      hi = max(hi, __shfl_xor_sync(kFullMask, hi, o));
    }
    if (lane == 0) {
      s_min[warp] = lo;
      s_max[warp] = hi;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      for (int w = 1; w < static_cast<int>(blockDim.x >> 5); ++w) {
        lo = min(lo, s_min[w]);
        hi = max(hi, s_max[w]);
      }
      int32_t n = hi >= lo ? hi - lo + 1 : 0;
      if (n > rows_cap) {  // not a handle from dispatch: its rows are not contiguous
        report(a.c, kErrBadHandle, -1, r, n, kOpCombine);
        n = rows_cap;
      }
      const int32_t first = n > 0 ? lo : 0;
      hdr->own_lo[r] = first;
      hdr->own_n[r] = n;
      RankHeader* ph = peer::header(a.c.peers, r);
      peer::store(&ph->req_lo[me], first);
      peer::store(&ph->req_n[kOpCombine][me], n);
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    const int64_t site = site_to_send(a.c);
    for (int r = 0; r < R; ++r) peer::store(&peer::header(a.c.peers, r)->site_req[kOpCombine][me], site);
    peer::fence_data();
    for (int r = 0; r < R; ++r) peer::signal(&peer::header(a.c.peers, r)->request[kOpCombine][me], s_n);
  }
}

__global__ void combine_push_kernel(CombineArgs a) {
  __shared__ uint64_t s_n;
  __shared__ int32_t s_lo[kMaxRanks], s_off[kMaxRanks + 1];
  const int R = a.c.num_ranks, me = a.c.me, lane = threadIdx.x & 31;
  RankHeader* hdr = peer::header(a.c.peers, me);
  if (threadIdx.x == 0) {
    s_n = hdr->seq[kOpCombine];
    const bool fail = wait_and_check(a.c, hdr->request[kOpCombine], hdr->site_req[kOpCombine],
                                     s_n, kOpCombine);
    int32_t off = 0;
    for (int p = 0; p < R; ++p) {
      int32_t lo = fail ? 0 : peer::load_volatile(&hdr->req_lo[p]);
      int32_t n = fail ? 0 : peer::load_volatile(&hdr->req_n[kOpCombine][p]);
      if (lo < 0 || n < 0 || static_cast<int64_t>(lo) + n > a.C) {
        report(a.c, kErrBadHandle, lo, p, n, kOpCombine);
        lo = 0;
        n = 0;
      }
      s_lo[p] = lo;
      s_off[p] = off;
      off += n;
    }
    s_off[R] = off;
  }
  __syncthreads();
  const size_t stride = RowStride(a.row_bytes);
  const size_t region_off = a.c.area_off + static_cast<size_t>(me) * CombineRegionBytes(a.T, a.C, a.row_bytes);
  const char* y = static_cast<const char*>(a.y);
  for (int g = global_warp(); g < s_off[R]; g += total_warps()) {
    const int p = find_segment(s_off, R, g);
    const int j = g - s_off[p];
    char* dst = peer::peer_ptr(a.c.peers, p, region_off) + j * stride;
    warp_copy_row<true>(dst, y + static_cast<int64_t>(s_lo[p] + j) * a.row_bytes, a.row_bytes, lane);
  }
  if (last_block_done(a.c, kDoneCombinePush)) {
    const int64_t site = site_to_send(a.c);
    for (int p = 0; p < R; ++p) peer::store(&peer::header(a.c.peers, p)->site_arr[kOpCombine][me], site);
    peer::fence_data();
    for (int p = 0; p < R; ++p) peer::signal(&peer::header(a.c.peers, p)->arrive[kOpCombine][me], s_n);
  }
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

// out[t] = sum over r ascending of the staged row for (t, r), in float32.
template <FloatKind kKind>
__global__ void combine_finish_kernel(CombineArgs a) {
  using E = Elems<kKind>;
  JEP_DYNAMIC_SMEM(int32_t, s_j);  // [warps per block][kMaxRanks]: staged row per rank
  __shared__ uint64_t s_n;
  __shared__ int32_t s_lo[kMaxRanks], s_cnt[kMaxRanks];
  __shared__ bool s_fail;
  const int R = a.c.num_ranks, me = a.c.me, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  RankHeader* hdr = peer::header(a.c.peers, me);
  if (threadIdx.x == 0) {
    s_n = hdr->seq[kOpCombine];
    s_fail = wait_and_check(a.c, hdr->arrive[kOpCombine], hdr->site_arr[kOpCombine], s_n,
                            kOpCombine);
  }
  __syncthreads();
  if (threadIdx.x < R) {  // after a failure nothing counts as received: zero outputs
    s_lo[threadIdx.x] = hdr->own_lo[threadIdx.x];
    s_cnt[threadIdx.x] = s_fail ? 0 : hdr->own_n[threadIdx.x];
  }
  __syncthreads();
  const size_t stride = RowStride(a.row_bytes);
  const size_t region_bytes = CombineRegionBytes(a.T, a.C, a.row_bytes);
  const char* area = peer::peer_ptr(a.c.peers, me, a.c.area_off);
  int32_t* my_j = s_j + warp * kMaxRanks;
  const bool vec = (a.row_bytes % 16) == 0;
  for (int t = global_warp(); t < a.T; t += total_warps()) {
    int32_t j_l = -1;
    if (lane < R) {
      const int32_t v = a.send_row[static_cast<int64_t>(t) * R + lane];
      const int64_t j = static_cast<int64_t>(v) - s_lo[lane];
      if (v >= 0 && v < a.C && j >= 0 && j < s_cnt[lane]) j_l = static_cast<int32_t>(j);
      my_j[lane] = j_l;
    }
    const uint32_t valid = __ballot_sync(kFullMask, j_l >= 0);
    __syncwarp();
    char* out = static_cast<char*>(a.out) + static_cast<int64_t>(t) * a.row_bytes;
    if (vec) {
      const size_t nv = a.row_bytes / 16;
      for (size_t c = lane; c < nv; c += 32) {
        float acc[E::kPerVec];
#pragma unroll
        for (int i = 0; i < E::kPerVec; ++i) acc[i] = 0.0f;
        // Up to kCopyUnroll ranks' vectors are loaded before any is added (several loads in
        // flight per lane); the sum still runs over ranks in ascending order.
        for (uint32_t m = valid; m != 0;) {
          int rr[kCopyUnroll];
          uint4 q[kCopyUnroll];
#pragma unroll
          for (int u = 0; u < kCopyUnroll; ++u) {
            rr[u] = m != 0 ? __ffs(m) - 1 : -1;
            m &= m - 1;
          }
#pragma unroll
          for (int u = 0; u < kCopyUnroll; ++u)
            if (rr[u] >= 0) q[u] = peer::load_cg16(area + rr[u] * region_bytes + my_j[rr[u]] * stride + c * 16);
#pragma unroll
          for (int u = 0; u < kCopyUnroll; ++u)
            if (rr[u] >= 0) {
#pragma unroll
              for (int i = 0; i < E::kPerVec; ++i) acc[i] += E::get(q[u], i);
            }
        }
        reinterpret_cast<uint4*>(out)[c] = E::pack(acc);
      }
    } else {
      for (int h = lane; h < a.H; h += 32) {
        float acc = 0.0f;
        for (uint32_t m = valid; m != 0; m &= m - 1) {
          const int r = __ffs(m) - 1;
          acc += E::load1(area + r * region_bytes + my_j[r] * stride + static_cast<size_t>(h) * E::kBytes);
        }
        E::store1(out + static_cast<size_t>(h) * E::kBytes, acc);
      }
    }
    __syncwarp();
  }
}

// ================================ gather ================================

__global__ void __launch_bounds__(kPlanThreads) gather_plan_kernel(GatherArgs a) {
  __shared__ int32_t s_warp[kPlanThreads / 32][kMaxRanks];
  __shared__ int32_t s_run[kMaxRanks];
  __shared__ uint64_t s_n;
  __shared__ bool s_fail;
  const int R = a.c.num_ranks, me = a.c.me;
  if (threadIdx.x == 0) {
    s_n = begin_epoch(a.c, kOpGather);
    s_fail = failed();  // then this rank asks for nothing
  }
  if (threadIdx.x < R) s_run[threadIdx.x] = 0;
  __syncthreads();
  const bool fail = s_fail;
  const GatherLayout gl = GatherLayout::Make(R, a.T, a.C, a.row_bytes);
  const int cap = RowsCap(a.T, a.C);
  int32_t* slot = reinterpret_cast<int32_t*>(peer::peer_ptr(a.c.peers, me, a.c.area_off + gl.slot_off));
  int32_t pos[kMaxRanks];
  for (int base = 0; base < a.C; base += blockDim.x) {
    const int i = base + threadIdx.x;
    int32_t s = -1, t = -1;
    if (i < a.C && !fail) {
      s = a.src_rank[i];
      t = a.src_index[i];
      if (s != -1 && (s < 0 || s >= R || t < 0 || t >= a.T)) {
        report(a.c, kErrBadHandle, i, s, t, kOpGather);
        s = -1;
      }
    }
    chunk_positions(s >= 0 ? (1u << s) : 0u, R, s_warp, s_run, pos);
    if (i < a.C) {
      int32_t j = -1;
      if (s >= 0) {
        j = pos[s];
        if (j >= cap) {
          report(a.c, kErrBadHandle, i, s, j, kOpGather);
          j = -1;
        } else {
          int32_t* req = reinterpret_cast<int32_t*>(
              peer::peer_ptr(a.c.peers, s, a.c.area_off + gl.req_off + me * gl.req_stride));
          peer::store(&req[j], t);
        }
      }
      slot[i] = j;
    }
  }
  if (threadIdx.x < R) {
    const int32_t n = s_run[threadIdx.x];
    peer::store(&peer::header(a.c.peers, threadIdx.x)->req_n[kOpGather][me], n < cap ? n : cap);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    const int64_t site = site_to_send(a.c);
    for (int s = 0; s < R; ++s) peer::store(&peer::header(a.c.peers, s)->site_req[kOpGather][me], site);
  }
  peer::fence_data();
  __syncthreads();
  if (threadIdx.x == 0)
    for (int s = 0; s < R; ++s) peer::signal(&peer::header(a.c.peers, s)->request[kOpGather][me], s_n);
}

__global__ void gather_push_kernel(GatherArgs a) {
  __shared__ uint64_t s_n;
  __shared__ int32_t s_off[kMaxRanks + 1];
  const int R = a.c.num_ranks, me = a.c.me, lane = threadIdx.x & 31;
  RankHeader* hdr = peer::header(a.c.peers, me);
  const GatherLayout gl = GatherLayout::Make(R, a.T, a.C, a.row_bytes);
  if (threadIdx.x == 0) {
    s_n = hdr->seq[kOpGather];
    const bool fail = wait_and_check(a.c, hdr->request[kOpGather], hdr->site_req[kOpGather], s_n,
                                     kOpGather);
    int32_t off = 0;
    for (int q = 0; q < R; ++q) {
      s_off[q] = off;
      if (!fail) off += peer::load_volatile(&hdr->req_n[kOpGather][q]);
    }
    s_off[R] = off;
  }
  __syncthreads();
  const size_t stride = RowStride(a.row_bytes);
  const char* area = peer::peer_ptr(a.c.peers, me, a.c.area_off);
  const char* g = static_cast<const char*>(a.g);
  for (int x = global_warp(); x < s_off[R]; x += total_warps()) {
    const int q = find_segment(s_off, R, x);
    const int j = x - s_off[q];
    const int32_t t = peer::load_cg_s32(reinterpret_cast<const int32_t*>(area + gl.req_off + q * gl.req_stride) + j);
    char* dst = peer::peer_ptr(a.c.peers, q, a.c.area_off + gl.data_off + me * gl.region_bytes) + j * stride;
    if (t >= 0 && t < a.T)
      warp_copy_row<true>(dst, g + static_cast<int64_t>(t) * a.row_bytes, a.row_bytes, lane);
    else
      warp_zero_row(dst, a.row_bytes, lane);
  }
  if (last_block_done(a.c, kDoneGatherPush)) {
    const int64_t site = site_to_send(a.c);
    for (int q = 0; q < R; ++q) peer::store(&peer::header(a.c.peers, q)->site_arr[kOpGather][me], site);
    peer::fence_data();
    for (int q = 0; q < R; ++q) peer::signal(&peer::header(a.c.peers, q)->arrive[kOpGather][me], s_n);
  }
}

__global__ void gather_finish_kernel(GatherArgs a) {
  __shared__ uint64_t s_n;
  __shared__ bool s_fail;
  const int R = a.c.num_ranks, me = a.c.me, lane = threadIdx.x & 31;
  RankHeader* hdr = peer::header(a.c.peers, me);
  if (threadIdx.x == 0) {
    s_n = hdr->seq[kOpGather];
    s_fail = wait_and_check(a.c, hdr->arrive[kOpGather], hdr->site_arr[kOpGather], s_n, kOpGather);
  }
  __syncthreads();
  const bool fail = s_fail;  // then every output row is zero
  const GatherLayout gl = GatherLayout::Make(R, a.T, a.C, a.row_bytes);
  const size_t stride = RowStride(a.row_bytes);
  const char* area = peer::peer_ptr(a.c.peers, me, a.c.area_off);
  const int32_t* slot = reinterpret_cast<const int32_t*>(area + gl.slot_off);
  for (int i = global_warp(); i < a.C; i += total_warps()) {
    char* dst = static_cast<char*>(a.out) + static_cast<int64_t>(i) * a.row_bytes;
    const int32_t sl = fail ? -1 : slot[i];
    if (sl >= 0) {
      const int s = a.src_rank[i];
      warp_copy_row<false>(dst, area + gl.data_off + s * gl.region_bytes + sl * stride, a.row_bytes, lane);
    } else {
      warp_zero_row(dst, a.row_bytes, lane);
    }
  }
}

}  // namespace

cudaError_t LaunchDispatchPhase(int phase, const DispatchArgs& a, const IntranodePreset& p,
                                cudaStream_t stream) {
  if (a.c.num_ranks < 1 || a.c.num_ranks > kMaxRanks) return cudaErrorInvalidValue;
  switch (phase) {
    case kPhasePlan:
      JEP_LAUNCH(dispatch_plan_kernel, 1, kPlanThreads, 0, stream)(a);
      break;
    case kPhasePush:
      JEP_LAUNCH(dispatch_push_kernel, p.push_blocks, p.threads, 0, stream)(a);
      break;
    case kPhaseFinish: {
      const bool smem_hist = a.experts_per_rank <= kMaxSmemLocalExperts;
      const size_t smem = smem_hist ? sizeof(int32_t) * a.experts_per_rank : 0;
      JEP_LAUNCH(dispatch_finish_kernel, p.recv_blocks, p.threads, smem, stream)(a, smem_hist);
      break;
    }
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

cudaError_t LaunchCombinePhase(int phase, const CombineArgs& a, const IntranodePreset& p,
                               cudaStream_t stream) {
  if (a.c.num_ranks < 1 || a.c.num_ranks > kMaxRanks) return cudaErrorInvalidValue;
  switch (phase) {
    case kPhasePlan:
      JEP_LAUNCH(combine_plan_kernel, 1, kPlanThreads, 0, stream)(a);
      break;
    case kPhasePush:
      JEP_LAUNCH(combine_push_kernel, p.push_blocks, p.threads, 0, stream)(a);
      break;
    case kPhaseFinish: {
      const size_t smem = sizeof(int32_t) * kMaxRanks * (p.threads / 32);
      switch (a.kind) {
        case FloatKind::kF32:
          JEP_LAUNCH(combine_finish_kernel<FloatKind::kF32>, p.recv_blocks, p.threads, smem, stream)(a);
          break;
        case FloatKind::kBF16:
          JEP_LAUNCH(combine_finish_kernel<FloatKind::kBF16>, p.recv_blocks, p.threads, smem, stream)(a);
          break;
        case FloatKind::kF16:
          JEP_LAUNCH(combine_finish_kernel<FloatKind::kF16>, p.recv_blocks, p.threads, smem, stream)(a);
          break;
      }
      break;
    }
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

cudaError_t LaunchGatherPhase(int phase, const GatherArgs& a, const IntranodePreset& p,
                              cudaStream_t stream) {
  if (a.c.num_ranks < 1 || a.c.num_ranks > kMaxRanks) return cudaErrorInvalidValue;
  switch (phase) {
    case kPhasePlan:
      JEP_LAUNCH(gather_plan_kernel, 1, kPlanThreads, 0, stream)(a);
      break;
    case kPhasePush:
      JEP_LAUNCH(gather_push_kernel, p.push_blocks, p.threads, 0, stream)(a);
      break;
    case kPhaseFinish:
      JEP_LAUNCH(gather_finish_kernel, p.recv_blocks, p.threads, 0, stream)(a);
      break;
    default:
      return cudaErrorInvalidValue;
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
