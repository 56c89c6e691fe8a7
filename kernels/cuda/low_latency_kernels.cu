// CUDA kernels of the low-latency mode; protocol and buffer in low_latency_kernels.h.
#include "kernels/cuda/low_latency_kernels.h"

#include "kernels/common/fp8_quant.h"
#include "kernels/common/fp8_warp.cuh"
#include "kernels/common/low_latency_math.h"
#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/ll_combine_sum.cuh"
#include "kernels/cuda/peer_transport.cuh"

namespace jax_ep {

JEP_DEVICE_GLOBAL ErrorRecord g_ll_error;
// Set by every protocol error, also when the record above already holds an earlier bad id
// or foreign handle (first error wins there): otherwise a later timeout would go unseen
// and a send would write into halves whose reader never gave its credit.
JEP_DEVICE_GLOBAL int32_t g_ll_failed;

namespace {

constexpr int kThreads = kLLThreads;
constexpr int kWarps = kThreads / 32;
static_assert(kThreads % 32 == 0 && kThreads >= kMaxRanks, "a thread per rank in a block");

__device__ __forceinline__ LowLatencyHeader* ll_header(const LowLatencyArgs& a, int r) {
  return reinterpret_cast<LowLatencyHeader*>(a.peers.base[r]);
}
__device__ __forceinline__ char* ll_at(const LowLatencyArgs& a, int r, size_t off) {
  return a.peers.base[r] + off;
}

__device__ __forceinline__ void ll_report(const LowLatencyArgs& a, int32_t code, int32_t p,
                                          int32_t q, int32_t u, int32_t v) {
  if (IsProtocolError(code)) atomicExch(&g_ll_failed, 1);
  record_error(&g_ll_error, a.host_err, code, a.me, p, q, u, v);
}

// A protocol error happened on this GPU: move no data, end waits at once.
__device__ __forceinline__ bool ll_failed() {
  return *reinterpret_cast<const volatile int32_t*>(&g_ll_failed) != 0;
}

__device__ __forceinline__ int64_t load_volatile64(const int64_t* p) {
  return *reinterpret_cast<const volatile int64_t*>(p);
}

// Spins until done(acquired value) holds, bounded by the timeout; ends at once while a
// protocol error is recorded. A timeout is recorded with the peer and op kind; the
// caller carries on. Returns the last value read (valid when *ok).
template <typename Done>
__device__ uint64_t ll_spin(const LowLatencyArgs& a, const uint64_t* flag, uint64_t want, int peer,
                            int op, Done done, bool* ok) {
  uint64_t v = peer::load_acquire(flag);
  *ok = true;
  if (done(v)) return v;
  const uint64_t start = peer::global_timer_ns();
  while (!done(v = peer::load_acquire(flag))) {
    if (ll_failed()) {
      *ok = false;
      return v;
    }
    if (a.timeout_ns > 0 &&
        peer::global_timer_ns() - start > static_cast<uint64_t>(a.timeout_ns)) {
      ll_report(a, kErrTimeout, peer, op, static_cast<int32_t>(want), 0);
      *ok = false;
      return v;
    }
    __nanosleep(64);
  }
  return v;
}

// Credit of peer p: *flag >= value (it finished reading the last epoch of this half).
__device__ bool ll_wait_credit(const LowLatencyArgs& a, const uint64_t* flag, uint64_t value,
                               int peer, int op) {
  bool ok;
  ll_spin(a, flag, value, peer, op, [&](uint64_t v) { return v >= value; }, &ok);
  return ok;
}

// Arrival word of epoch n; returns its row count, or -1 when the wait ended without it.
__device__ int32_t ll_wait_word(const LowLatencyArgs& a, const uint64_t* word, uint64_t n,
                                int peer, int op) {
  bool ok;
  const uint64_t v =
      ll_spin(a, word, n, peer, op, [&](uint64_t w) { return ll_word_is_epoch(w, n); }, &ok);
  return ok ? ll_word_count(v) : -1;
}

// Rank/group XLA passed to a receive half, against the domain (real ranks only).
__device__ void ll_check_rank(const LowLatencyArgs& a) {
  if (a.rank_in == nullptr || threadIdx.x != 0 || blockIdx.x != 0) return;
  const int32_t r = *a.rank_in, g = *a.group_in;
  if (r != a.me || g != a.expect_group) ll_report(a, kErrRankMismatch, r, a.me, g, a.expect_group);
}

// Peer p's tag for epoch n (read after one of its words of n was acquired) against
// `mine`; true when no data of p may be used. With `bad_owners` (combine), an owner that
// sent kLLTagBadHandle is reported and gets its bit set there instead: its rows count as
// zero. `report`: this thread records what it finds (one block does, all decide alike).
__device__ bool ll_tag_bad(const LowLatencyArgs& a, int64_t tag, int64_t mine, int p, int op,
                           bool report, uint32_t* bad_owners) {
  if (tag == kSiteFailed) {
    if (report) ll_report(a, kErrPeerFailed, p, op, 0, 0);
    return true;
  }
  if (tag == kLLTagBadHandle && bad_owners != nullptr) {
    if (report) ll_report(a, kErrBadHandle, p, -1, 0, op);
    atomicOr(bad_owners, 1u << p);
    return false;
  }
  if (tag != mine) {
    if (report)
      ll_report(a, kErrCallSite, p, op, static_cast<int32_t>(tag), static_cast<int32_t>(mine));
    return true;
  }
  return false;
}

// The epoch a receive half works on: the one its send half handed over (or, with no
// hand-over, the last one sent).
__device__ __forceinline__ uint64_t ll_recv_epoch(const LowLatencyArgs& a, uint64_t seq) {
  return a.epoch_in == nullptr ? seq : ll_epoch_from_low(seq, *a.epoch_in);
}

// End of a send kernel: the last block to finish stores the epoch every block worked on
// as this rank's latest (every block read the old one first), for the receive half and
// the next call. No fence on peer data: the arrival words carry that.
__device__ void ll_advance_epoch(uint32_t* done, uint64_t* seq, uint64_t n) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();  // this block's read of seq before the count
    if (atomicAdd(done, 1u) == gridDim.x - 1) {
      *seq = n;
      *done = 0;
    }
  }
}

// Last block of a receive kernel: after every block's reads, `signal` runs once, and the
// counter `done` is zero again for the next launch. Every thread of every block calls it.
template <typename F>
__device__ void ll_last_block(uint32_t* done, F signal) {
  // Each thread orders its own reads of the peers' rows before the credit that lets them
  // be overwritten (a fence by thread 0 alone covers other threads only through the
  // barrier's cumulativity, which CUDA's __threadfence_system() does not promise).
  peer::fence_data();
  __syncthreads();
  if (threadIdx.x == 0) {
    peer::fence_data();
    if (atomicAdd(done, 1u) == gridDim.x - 1) {
      peer::fence_data();
      signal();
      *done = 0;
    }
  }
}

// ------------------------------- routing --------------------------------

// Slot i repeats an id of an earlier slot of its token.
__device__ __forceinline__ bool ll_repeated(const LowLatencyArgs& a, int i, int32_t g) {
  const int t = i / a.K, k = i % a.K;
  bool rep = false;
  for (int j = 0; j < k; ++j) rep = rep || a.topk_idx[t * a.K + j] == g;
  return rep;
}

// Slot i's id is outside [-1, E) or repeats an earlier slot of its token.
__device__ __forceinline__ bool ll_bad_slot(const LowLatencyArgs& a, int i) {
  const int32_t g = a.topk_idx[i];
  if (g < -1 || g >= a.L.E) return true;
  return g >= 0 && ll_repeated(a, i, g);
}

// Records slot i's id if it is bad (d = -1 in the record: a repeat; DescribeError says
// so).
__device__ void ll_report_bad_slot(const LowLatencyArgs& a, int i) {
  if (!ll_bad_slot(a, i)) return;
  const int32_t g = a.topk_idx[i];
  const bool outside = g < -1 || g >= a.L.E;
  ll_report(a, kErrBadTopkId, i / a.K, i % a.K, g, outside ? a.L.E : -1);
}

// Block-wide numbering of expert g's slots in token order (repeats within a token get no
// row, as on the CPU), kThreads slots per round: a ballot per warp, the warps' prefix in
// shared memory. For each round, `each(i, p)` runs on every thread with p its row among
// the round's rows (the round's rows are list[0, *round_rows)), then `round(base,
// round_rows)` runs block-wide. Returns g's rows in all.
struct LLNumbering {
  int warp_rows[kWarps];
  int list[kThreads];
  int round_rows;
};

template <typename Round>
__device__ int ll_number_block(const LowLatencyArgs& a, int g, LLNumbering* sh, Round round) {
  const int n_slots = a.S * a.K;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  int base = 0;
  for (int start = 0; start < n_slots; start += kThreads) {
    const int i = start + threadIdx.x;
    const bool mine = i < n_slots && a.topk_idx[i] == g && !ll_repeated(a, i, g);
    const unsigned ballot = __ballot_sync(kFullMask, mine);
    if (lane == 0) sh->warp_rows[warp] = __popc(ballot);
    __syncthreads();
    if (threadIdx.x == 0) {
      int acc = 0;
      for (int w = 0; w < kWarps; ++w) {
        const int c = sh->warp_rows[w];
        sh->warp_rows[w] = acc;
        acc += c;
      }
      sh->round_rows = acc;
    }
    __syncthreads();
    if (mine) sh->list[sh->warp_rows[warp] + __popc(ballot & lanemask_lt())] = i;
    __syncthreads();
    const int rows = sh->round_rows;
    round(base, rows);
    base += rows;
    __syncthreads();  // list and warp_rows are rewritten by the next round
  }
  return base;
}

// ------------------------------- dispatch --------------------------------

// A warp casts x's row into an FP8 message in a peer's slot (kernels/common/fp8_warp.cuh),
// with the stores the visibility model buffers until the fence before the arrival word.
__device__ __forceinline__ void ll_warp_cast_fp8(char* dst, const char* src, int64_t H,
                                                 FloatKind kind, bool round_scale, int lane) {
  fp8_warp_cast_row(
      dst, src, H, kind, round_scale, lane, [](const char* p) { return peer::load_nc16(p); },
      [](char* p, uint4 v) { peer::store16(p, v); }, [](float* p, float v) { peer::store(p, v); });
}

// Source: a block per expert g (strided over the grid). Each row of g goes to its
// owner's slot (16-byte stores, a warp per row); then one release of the pair's word.
__global__ void __launch_bounds__(kThreads) ll_dispatch_send(LowLatencyArgs a) {
  LowLatencyHeader* h = ll_header(a, a.me);
  const int E = a.L.E, el = a.L.experts_per_rank(), R = a.L.R;
  const int n_slots = a.S * a.K;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const uint64_t n = h->seq_dispatch + 1;
  const int half = ll_half(n);
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    h->my_tag_dispatch[half] = a.tag;
    h->words_off = a.L.counts_off;
    h->words_bytes = 2 * a.L.counts_half;
    if (a.epoch_out != nullptr) *a.epoch_out = ll_epoch_low(n);
  }
  // Bad ids: reported once over the grid; every block needs to know of any (tokens per
  // expert are all zero then, as on the CPU).
  const int tid = blockIdx.x * kThreads + threadIdx.x;
  for (int i = tid; i < n_slots; i += gridDim.x * kThreads) ll_report_bad_slot(a, i);
  __shared__ int any_bad;
  __shared__ LLNumbering sh;
  if (threadIdx.x == 0) any_bad = 0;
  __syncthreads();
  bool bad = false;
  for (int i = threadIdx.x; i < n_slots && !bad; i += kThreads) bad = ll_bad_slot(a, i);
  if (bad) any_bad = 1;
  __syncthreads();
  const size_t slots_off = a.L.slots_off + half * a.L.slots_half;
  // x's rows: the message itself, or with fp8 the rows the message is cast from.
  const size_t x_row = a.fp8 != 0 ? static_cast<size_t>(a.H) * FloatKindBytes(a.kind) : a.row_bytes;
  int32_t* tok_at_owner = nullptr;
  for (int g = blockIdx.x; g < E; g += gridDim.x) {
    const int r = g / el, e = g % el;
    if (threadIdx.x == 0 && n > 2)
      ll_wait_credit(a, &h->credit_dispatch[half][r], n - 2, r, kOpLLDispatchCredit);
    __syncthreads();
    const bool skip = ll_failed();
    tok_at_owner = reinterpret_cast<int32_t*>(ll_at(a, r, a.L.tok_off + half * a.L.tok_half));
    const int c = ll_number_block(a, g, &sh, [&](int base, int rows) {
      if (skip) return;
      for (int j = warp; j < rows; j += kWarps) {
        const int p = base + j;
        if (p >= a.M) break;
        const int i = sh.list[j];
        const int64_t slot = ll_slot(e, a.me, p, R, a.L.M);
        char* dst = ll_at(a, r, slots_off + slot * a.L.stride);
        const char* src = static_cast<const char*>(a.x) + static_cast<size_t>(i / a.K) * x_row;
        if (a.fp8 != 0)
          ll_warp_cast_fp8(dst, src, a.H, a.kind, a.fp8 == 2, lane);
        else
          warp_copy_row<true>(dst, src, a.row_bytes, lane);
        if (lane == 0) peer::store(tok_at_owner + slot, i / a.K);
      }
    });
    // Every thread orders its own rows before the pair's word.
    peer::fence_data();
    __syncthreads();
    if (threadIdx.x == 0) {
      if (a.expert_count != nullptr) a.expert_count[g] = any_bad ? 0 : c;
      const bool failed = ll_failed();
      LowLatencyHeader* o = ll_header(a, r);
      peer::store_volatile(&o->tag_dispatch[half][a.me], failed ? kSiteFailed : a.tag);
      const int32_t rows = failed || skip ? 0 : (c < a.M ? c : a.M);
      peer::signal(reinterpret_cast<uint64_t*>(ll_at(a, r, a.L.dispatch_word_off(half, e, a.me))),
                   ll_count_word(n, rows));
    }
  }
  ll_advance_epoch(&h->done_dispatch, &h->seq_dispatch, n);
}

// Owner: a block per (local expert e, source s) (strided): waits the words of e from
// every source, places s's rows. Rows past recv_count[e] are left as they are.
__global__ void __launch_bounds__(kThreads) ll_dispatch_recv(LowLatencyArgs a) {
  LowLatencyHeader* h = ll_header(a, a.me);
  const uint64_t n = ll_recv_epoch(a, h->seq_dispatch);
  const int half = ll_half(n);
  ll_check_rank(a);
  const int el = a.L.experts_per_rank(), R = a.L.R;
  const int64_t RM = static_cast<int64_t>(R) * a.M;
  const int32_t* tok =
      reinterpret_cast<const int32_t*>(ll_at(a, a.me, a.L.tok_off + half * a.L.tok_half));
  const size_t slots_off = a.L.slots_off + half * a.L.slots_half;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  __shared__ int32_t cnt[kMaxRanks];
  __shared__ int bad;
  for (int w = blockIdx.x; w < el * R; w += gridDim.x) {
    const int e = w / R, s = w % R;
    if (threadIdx.x == 0) bad = 0;
    __syncthreads();
    for (int p = threadIdx.x; p < R; p += kThreads) {
      const uint64_t* word =
          reinterpret_cast<const uint64_t*>(ll_at(a, a.me, a.L.dispatch_word_off(half, e, p)));
      int32_t c = ll_wait_word(a, word, n, p, kOpLLDispatch);
      if (c < 0 || ll_tag_bad(a, load_volatile64(&h->tag_dispatch[half][p]),
                              h->my_tag_dispatch[half], p, kOpLLDispatch, w == blockIdx.x,
                              nullptr)) {
        bad = 1;
        c = 0;
      }
      cnt[p] = c < 0 ? 0 : (c > a.M ? a.M : c);
    }
    __syncthreads();
    const bool skip = bad != 0 || ll_failed();
    int64_t first = 0, total = 0;
    for (int p = 0; p < R; ++p) {
      const int32_t c = skip ? 0 : cnt[p];
      if (p < s) first += c;
      total += c;
    }
    const int32_t c = skip ? 0 : cnt[s];
    if (s == 0) {  // the handle of expert e, once
      for (int p = threadIdx.x; p < R; p += kThreads) {
        int32_t f = 0;
        for (int q = 0; q < p; ++q) f += skip ? 0 : cnt[q];
        a.first_row[e * R + p] = f;
        a.row_count[e * R + p] = skip ? 0 : cnt[p];
      }
      if (threadIdx.x == 0) a.recv_count[e] = static_cast<int32_t>(total);
    }
    const int64_t row0 = static_cast<int64_t>(e) * RM + first;
    for (int j = warp; j < c; j += kWarps) {
      const int64_t slot = ll_slot(e, s, j, R, a.L.M);
      const char* msg = ll_at(a, a.me, slots_off + slot * a.L.stride);
      if (a.fp8 != 0) {  // the message's values to recv_x, its scales to recv_scales
        const int64_t nb = a.H / kFp8Block;
        warp_copy_row<false>(static_cast<char*>(a.recv_x) + (row0 + j) * a.H, msg, a.H, lane);
        const float* sc = reinterpret_cast<const float*>(msg + ll_fp8_scales_off(a.H));
        float* out = static_cast<float*>(a.recv_scales) + (row0 + j) * nb;
        for (int64_t b = lane; b < nb; b += 32) out[b] = peer::load_cg_f32(sc + b);
      } else {
        warp_copy_row<false>(static_cast<char*>(a.recv_x) + (row0 + j) * a.row_bytes, msg,
                             a.row_bytes, lane);
      }
      if (lane == 0) {
        a.src_rank[row0 + j] = s;
        a.src_index[row0 + j] = peer::load_cg_s32(&tok[slot]);
      }
    }
    if (s == R - 1)  // the handle's empty rows (recv_x's are not written)
      for (int64_t i = total + threadIdx.x; i < RM; i += kThreads)
        a.src_rank[e * RM + i] = a.src_index[e * RM + i] = -1;
    __syncthreads();  // cnt and bad are rewritten for the next pair
  }
  ll_last_block(&h->done_dispatch_recv, [&] {
    for (int p = 0; p < R; ++p) peer::signal(&ll_header(a, p)->credit_dispatch[half][a.me], n);
  });
}

// -------------------------------- combine --------------------------------

// Owner's check of the handle (every entry inside y, at most the call's rows_per_dest
// rows per source), made alike by every block; block 0 records what it finds.
__device__ bool ll_combine_handle_bad(const LowLatencyArgs& a) {
  const int el = a.L.experts_per_rank(), R = a.L.R;
  const int64_t RM = static_cast<int64_t>(R) * a.M;
  const bool report = blockIdx.x == 0;
  __shared__ int bad;
  if (threadIdx.x == 0) bad = 0;
  __syncthreads();
  for (int i = threadIdx.x; i < el * R; i += kThreads) {
    const int64_t f = a.first_row[i], c = a.row_count[i];  // a foreign f + c may pass 2^31
    if (f < 0 || c < 0 || f + c > RM) {
      if (report)
        ll_report(a, kErrBadHandle, i / R, i % R, static_cast<int32_t>(f < 0 || f > RM ? f : c),
                  kOpLLCombine);
      bad = 1;
    }
  }
  // The call's rows per source, as the CPU checks them (never above the area's).
  const int64_t cap = a.rows_per_dest > 0 && a.rows_per_dest < a.L.rows_per_dest
                          ? a.rows_per_dest : a.L.rows_per_dest;
  for (int d = threadIdx.x; d < R; d += kThreads) {
    int64_t rows = 0;
    for (int e = 0; e < el; ++e) rows += a.row_count[e * R + d] > 0 ? a.row_count[e * R + d] : 0;
    if (rows > cap) {
      if (report) ll_report(a, kErrBadHandle, -1, d, static_cast<int32_t>(rows), kOpLLCombine);
      bad = 1;
    }
  }
  __syncthreads();
  const bool out = bad != 0;
  __syncthreads();
  return out;
}

// Owner: a block per (local expert e, source d) (strided): the rows of y that d's tokens
// sent to e into d's cstage[me] (ll_stage_row), then one release of the pair's word.
// One block per SM by design (the mode's grid is its SM budget): the minimum of 1 lets
// ptxas use the registers it needs (with the bound alone it picked 64 and spilled 32 B).
__global__ void __launch_bounds__(kThreads, 1) ll_combine_send(LowLatencyArgs a) {
  LowLatencyHeader* h = ll_header(a, a.me);
  const int el = a.L.experts_per_rank(), R = a.L.R;
  const int64_t RM = static_cast<int64_t>(R) * a.M;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const uint64_t n = h->seq_combine + 1;
  const int half = ll_half(n);
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    h->my_tag_combine[half] = a.tag;
    h->words_off = a.L.counts_off;
    h->words_bytes = 2 * a.L.counts_half;
    if (a.epoch_out != nullptr) *a.epoch_out = ll_epoch_low(n);
  }
  const bool bad_handle = ll_combine_handle_bad(a);
  const size_t cstage_off = a.L.cstage_off + half * a.L.cstage_half;
  for (int w = blockIdx.x; w < el * R; w += gridDim.x) {
    const int e = w / R, d = w % R;
    if (threadIdx.x == 0 && n > 2)
      ll_wait_credit(a, &h->credit_combine[half][d], n - 2, d, kOpLLCombineCredit);
    __syncthreads();
    const bool skip = ll_failed() || bad_handle;
    const int64_t f = a.first_row[e * R + d], c = skip ? 0 : a.row_count[e * R + d];
    for (int64_t j = warp; j < c; j += kWarps) {
      const int64_t off = ll_stage_row(a.row_count + d, R, e, j);
      if (off >= a.L.rows_per_dest) break;  // excluded by the handle check
      const size_t at =
          cstage_off + (static_cast<size_t>(a.me) * a.L.rows_per_dest + off) * a.L.stride;
      warp_copy_row<true>(ll_at(a, d, at),
                          static_cast<const char*>(a.y) + (e * RM + f + j) * a.row_bytes,
                          a.row_bytes, lane);
    }
    peer::fence_data();
    __syncthreads();
    if (threadIdx.x == 0) {
      const int64_t tag = ll_failed() ? kSiteFailed : (bad_handle ? kLLTagBadHandle : a.tag);
      peer::store_volatile(&ll_header(a, d)->tag_combine[half][a.me], tag);
      peer::signal(reinterpret_cast<uint64_t*>(ll_at(a, d, a.L.combine_word_off(half, a.me, e))),
                   ll_count_word(n, 0));
    }
  }
  ll_advance_epoch(&h->done_combine, &h->seq_combine, n);
}

// Source: a block per expert g (strided): positions of this call's routing (as the
// dispatch numbered them) into pos_c, g's rows (capped at M) into the offsets region.
// Slots no expert keeps (-1, bad, repeated) are set once over the grid.
__global__ void __launch_bounds__(kThreads) ll_combine_recv_plan(LowLatencyArgs a) {
  const int E = a.L.E;
  const int n_slots = a.S * a.K;
  int32_t* pos = reinterpret_cast<int32_t*>(ll_at(a, a.me, a.L.pos_c_off));
  int32_t* cnt = reinterpret_cast<int32_t*>(ll_at(a, a.me, a.L.offsets_off));
  const int tid = blockIdx.x * kThreads + threadIdx.x;
  for (int i = tid; i < n_slots; i += gridDim.x * kThreads) {
    // Reported (as the CPU's combine does) and left unused, as the dispatch left them.
    ll_report_bad_slot(a, i);
    if (a.topk_idx[i] < 0 || ll_bad_slot(a, i)) pos[i] = -1;
  }
  __shared__ LLNumbering sh;
  for (int g = blockIdx.x; g < E; g += gridDim.x) {
    const int c = ll_number_block(a, g, &sh, [&](int base, int rows) {
      for (int j = threadIdx.x; j < rows; j += kThreads)
        pos[sh.list[j]] = base + j < a.M ? base + j : -1;
    });
    if (threadIdx.x == 0) cnt[g] = c < a.M ? c : a.M;
  }
}

// Whether combine's receive sums 16-byte vectors (stage rows start 16-aligned, so the
// rows' size and the output's alignment decide).
__host__ __device__ __forceinline__ bool ll_combine_vec(const LowLatencyArgs& a) {
  return a.row_bytes % 16 == 0 && reinterpret_cast<uintptr_t>(a.out) % 16 == 0;
}

// Items (token, chunk) of combine's receive sum: the warps its grid asks for.
int64_t ll_combine_items(const LowLatencyArgs& a) {
  return a.S * ll_sum_chunks(ll_sum_units(ll_combine_vec(a), a.row_bytes, a.H));
}

// Source: waits every owner's words of epoch n, then a warp per item (token, chunk of its
// row; kernels/cuda/ll_combine_sum.cuh), the items of every token dealt over all warps of
// the grid, sums its rows k ascending with every row's loads in flight before the adds
// (16-byte loads of the stage rows when rows allow); then credits every owner.
__global__ void __launch_bounds__(kThreads) ll_combine_recv(LowLatencyArgs a) {
  LowLatencyHeader* h = ll_header(a, a.me);
  const uint64_t n = ll_recv_epoch(a, h->seq_combine);
  const int half = ll_half(n);
  ll_check_rank(a);
  const int E = a.L.E, el = a.L.experts_per_rank(), R = a.L.R;
  __shared__ uint32_t bad_owners;  // owners whose handle was foreign: their rows are zero
  __shared__ int bad;
  __shared__ int32_t offsets[kLLMaxExperts];
  if (threadIdx.x == 0) {
    bad = 0;
    bad_owners = 0;
  }
  __syncthreads();
  const int32_t* cnt = reinterpret_cast<const int32_t*>(ll_at(a, a.me, a.L.offsets_off));
  for (int g = threadIdx.x; g < E; g += kThreads) {
    const int r = g / el, e = g % el;
    const uint64_t* word =
        reinterpret_cast<const uint64_t*>(ll_at(a, a.me, a.L.combine_word_off(half, r, e)));
    if (ll_wait_word(a, word, n, r, kOpLLCombine) < 0) bad = 1;
    offsets[g] = static_cast<int32_t>(ll_stage_row(cnt + r * el, 1, e, 0));
  }
  __syncthreads();
  for (int r = threadIdx.x; r < R; r += kThreads)
    if (ll_tag_bad(a, load_volatile64(&h->tag_combine[half][r]), h->my_tag_combine[half], r,
                   kOpLLCombine, blockIdx.x == 0, &bad_owners))
      bad = 1;
  __syncthreads();
  const bool skip = bad != 0 || ll_failed();
  const size_t cstage_off = a.L.cstage_off + half * a.L.cstage_half;
  const int32_t* pos = reinterpret_cast<const int32_t*>(ll_at(a, a.me, a.L.pos_c_off));
  const int lane = threadIdx.x % 32;
  const int64_t units = ll_sum_units(ll_combine_vec(a), a.row_bytes, a.H);
  const int64_t chunks = ll_sum_chunks(units);
  for (int64_t item = blockIdx.x * kWarps + threadIdx.x / 32; item < a.S * chunks;
       item += static_cast<int64_t>(gridDim.x) * kWarps) {
    const int64_t t = item / chunks;
    const auto slot_of = [&](int k) -> LLSumSlot {
      const int64_t i = t * a.K + k;
      const int32_t g = a.topk_idx[i];
      const int p = pos[i];
      if (skip || g < 0 || p < 0 || (bad_owners >> (g / el)) & 1u) return LLSumSlot{nullptr, 0.0f};
      const int64_t row = offsets[g] + p;
      return LLSumSlot{
          ll_at(a, a.me,
                cstage_off + (static_cast<size_t>(g / el) * a.L.rows_per_dest + row) * a.L.stride),
          a.topk_w[i]};
    };
    ll_sum_item(a.kind, a.K, units, ll_combine_vec(a), item % chunks,
                static_cast<char*>(a.out) + static_cast<size_t>(t) * a.row_bytes, slot_of, false,
                lane);
  }
  ll_last_block(&h->done_combine_recv, [&] {
    for (int r = 0; r < R; ++r) peer::signal(&ll_header(a, r)->credit_combine[half][a.me], n);
  });
}

}  // namespace

cudaError_t LaunchLowLatencyPhase(int phase, const LowLatencyArgs& a, cudaStream_t stream) {
  const int64_t pairs = static_cast<int64_t>(a.L.experts_per_rank()) * a.L.R;
  const int cap = a.max_blocks;
  switch (phase) {
    case kLLDispatchSend:
      JEP_LAUNCH(ll_dispatch_send, LLGrid(a.L.E, cap), kThreads, 0, stream)(a);
      break;
    case kLLDispatchRecv:
      JEP_LAUNCH(ll_dispatch_recv, LLGrid(pairs, cap), kThreads, 0, stream)(a);
      break;
    case kLLCombineSend:
      JEP_LAUNCH(ll_combine_send, LLGrid(pairs, cap), kThreads, 0, stream)(a);
      break;
    case kLLCombineRecvPlan:
      JEP_LAUNCH(ll_combine_recv_plan, LLGrid(a.L.E, cap), kThreads, 0, stream)(a);
      break;
    case kLLCombineRecv:
      JEP_LAUNCH(ll_combine_recv, LLGrid((ll_combine_items(a) + kWarps - 1) / kWarps, cap),
                 kThreads, 0, stream)(a);
      break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

// The record only: the failed state stays until reset() (see ClearIntranodeFailure).
cudaError_t ReadLowLatencyError(ErrorRecord* out, bool clear) {
  return ReadErrorSymbol(g_ll_error, out, clear);
}

cudaError_t ReadLowLatencyFailed(int32_t* out) {
  return cudaMemcpyFromSymbol(out, g_ll_failed, sizeof(int32_t));
}

cudaError_t ClearLowLatencyFailure() {
  const int32_t zero = 0;
  return cudaMemcpyToSymbol(g_ll_failed, &zero, sizeof(zero));
}

cudaError_t ClearLowLatencyHeader(void* header) {
  // The arrival words hold epochs that a restarted count would meet again: zero them too
  // (where the sends recorded them; nothing before the first send).
  LowLatencyHeader h;
  cudaError_t e = cudaMemcpy(&h, header, sizeof(h), cudaMemcpyDeviceToHost);
  if (e == cudaSuccess && h.words_bytes > 0 && h.words_bytes < (size_t{1} << 40))
    e = cudaMemset(static_cast<char*>(header) + h.words_off, 0, h.words_bytes);
  if (e != cudaSuccess) return e;
  return cudaMemset(header, 0, sizeof(LowLatencyHeader));
}

}  // namespace jax_ep
