// CUDA kernels of the low-latency mode; protocol and buffer in low_latency_kernels.h.
#include "kernels/cuda/low_latency_kernels.h"

#include "kernels/common/low_latency_math.h"
#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/peer_transport.cuh"

namespace jax_ep {

JEP_DEVICE_GLOBAL ErrorRecord g_ll_error;
// Set by every protocol error, also when the record above already holds an earlier bad id
// or foreign handle (first error wins there): otherwise a later timeout would go unseen
// and a send would write into halves whose reader never gave its credit.
JEP_DEVICE_GLOBAL int32_t g_ll_failed;

namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

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

__device__ __forceinline__ void store_volatile(int64_t* p, int64_t v) { peer::store_volatile(p, v); }
__device__ __forceinline__ int64_t load_volatile64(const int64_t* p) {
  return *reinterpret_cast<const volatile int64_t*>(p);
}

// Spins until *flag >= value, bounded by the timeout; ends at once while a protocol error
// is recorded. A timeout is recorded with the peer and op kind; the caller carries on.
__device__ bool ll_wait(const LowLatencyArgs& a, const uint64_t* flag, uint64_t value, int peer,
                        int op) {
  if (peer::load_acquire(flag) >= value) return true;
  const uint64_t start = peer::global_timer_ns();
  while (peer::load_acquire(flag) < value) {
    if (ll_failed()) return false;
    if (a.timeout_ns > 0 &&
        peer::global_timer_ns() - start > static_cast<uint64_t>(a.timeout_ns)) {
      ll_report(a, kErrTimeout, peer, op, static_cast<int32_t>(value), 0);
      return false;
    }
    __nanosleep(64);
  }
  return true;
}

// Rank/group XLA passed to a receive half, against the domain (real ranks only).
__device__ void ll_check_rank(const LowLatencyArgs& a) {
  if (a.rank_in == nullptr || threadIdx.x != 0 || blockIdx.x != 0) return;
  const int32_t r = *a.rank_in, g = *a.group_in;
  if (r != a.me || g != a.expect_group) ll_report(a, kErrRankMismatch, r, a.me, g, a.expect_group);
}

// Block-wide: waits for every peer's arrival of epoch n, then checks the epoch is exactly
// n and each peer's tag is `mine`. Every block of a kernel reads the same flags and tags,
// so all decide alike. Returns true when this block must move no data. With `bad_owners`
// (combine), an owner that sent kLLTagBadHandle is reported and gets its bit set there:
// its rows count as zero.
__device__ bool ll_arrivals(const LowLatencyArgs& a, const uint64_t* arrive, const int64_t* tags,
                            uint64_t n, int64_t mine, int op, uint32_t* bad_owners = nullptr) {
  __shared__ int bad;
  if (threadIdx.x == 0) {
    bad = 0;
    if (bad_owners != nullptr) *bad_owners = 0;
  }
  __syncthreads();
  for (int s = threadIdx.x; s < a.L.R; s += blockDim.x) {
    if (!ll_wait(a, &arrive[s], n, s, op)) {
      bad = 1;
      continue;
    }
    const uint64_t got = peer::load_acquire(&arrive[s]);
    const int64_t tag = load_volatile64(&tags[s]);
    if (got != n) {  // a peer a whole call ahead: only a broken protocol gets here
      ll_report(a, kErrCallSite, s, op, static_cast<int32_t>(got), static_cast<int32_t>(n));
      bad = 1;
    } else if (tag == kSiteFailed) {
      ll_report(a, kErrPeerFailed, s, op, 0, 0);
      bad = 1;
    } else if (tag == kLLTagBadHandle && bad_owners != nullptr) {
      ll_report(a, kErrBadHandle, s, -1, 0, op);
      atomicOr(bad_owners, 1u << s);
    } else if (tag != mine) {
      ll_report(a, kErrCallSite, s, op, static_cast<int32_t>(tag), static_cast<int32_t>(mine));
      bad = 1;
    }
  }
  __syncthreads();
  const bool out = bad != 0 || ll_failed();
  __syncthreads();
  return out;
}

// Block-wide: waits credit[p] >= n - 2 from every peer p (it finished reading the last
// epoch that used this half of its buffer, so epoch n may overwrite it).
__device__ void ll_credits(const LowLatencyArgs& a, const uint64_t* credit, uint64_t n, int op) {
  if (n > 2)
    for (int p = threadIdx.x; p < a.L.R; p += blockDim.x) ll_wait(a, &credit[p], n - 2, p, op);
  __syncthreads();
}

// The epoch a receive half works on: the one its send half handed over (or, with no
// hand-over, the last one sent).
__device__ __forceinline__ uint64_t ll_recv_epoch(const LowLatencyArgs& a, uint64_t seq) {
  return a.epoch_in == nullptr ? seq : ll_epoch_from_low(seq, *a.epoch_in);
}

// Last block of a kernel: after every block's memory work, `signal` runs once, and the
// counter `done` is zero again for the next launch. Every thread of every block calls it.
template <typename F>
__device__ void ll_last_block(uint32_t* done, F signal) {
  // Each thread fences its own peer writes (and orders its reads before the credit): a
  // fence by thread 0 alone covers other threads' NVLink stores only through the barrier's
  // cumulativity, which CUDA's __threadfence_system() does not promise.
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

// ------------------------------- dispatch --------------------------------

// Reports slot i's id if it is outside [-1, E) or repeats an earlier slot of its token
// (d = -1 in the record: a repeat; DescribeError says so); true if it did.
__device__ bool ll_report_bad_slot(const LowLatencyArgs& a, int i) {
  const int32_t g = a.topk_idx[i];
  const int E = a.L.E;
  const bool outside = g < -1 || g >= E;
  bool repeated = false;
  const int t = i / a.K, k = i % a.K;
  for (int j = 0; j < k && !outside && g >= 0; ++j)
    repeated = repeated || a.topk_idx[t * a.K + j] == g;
  if (outside || repeated) ll_report(a, kErrBadTopkId, t, k, g, outside ? E : -1);
  return outside || repeated;
}

// Numbers expert g's rows among this rank's slots, token order, into pos (-1 past M) and
// returns how many slots name g. A repeat of g within its token gets no row: the dispatch
// plan and the combine receive plan number the rows alike, so the combine reads the rows
// the dispatch sent.
__device__ int ll_number_rows(const LowLatencyArgs& a, int g, int32_t* pos) {
  const int n_slots = a.S * a.K;
  int c = 0;
  for (int i = 0; i < n_slots; ++i) {
    if (a.topk_idx[i] != g) continue;
    const int t = i / a.K, k = i % a.K;
    bool dup = false;
    for (int j = 0; j < k; ++j) dup = dup || a.topk_idx[t * a.K + j] == g;
    if (dup) continue;
    pos[i] = c < a.M ? c : -1;
    ++c;
  }
  return c;
}

// One block. Numbers each (token, slot) among this rank's slots naming the same expert
// (ids outside [-1, E) and repeats within a token are recorded and left unused), waits
// for every owner's credit, then writes its counts into the owners.
__global__ void ll_dispatch_plan(LowLatencyArgs a) {
  LowLatencyHeader* h = ll_header(a, a.me);
  const int E = a.L.E, el = a.L.experts_per_rank(), R = a.L.R;
  const int n_slots = a.S * a.K;
  int32_t* pos = reinterpret_cast<int32_t*>(ll_at(a, a.me, a.L.pos_off));
  __shared__ int any_bad;
  __shared__ uint64_t epoch;
  if (threadIdx.x == 0) {
    any_bad = 0;
    epoch = h->seq_dispatch + 1;
    h->seq_dispatch = epoch;
    h->my_tag_dispatch[ll_half(epoch)] = a.tag;
    if (a.epoch_out != nullptr) *a.epoch_out = ll_epoch_low(epoch);
  }
  __syncthreads();
  const int half = ll_half(epoch);
  for (int i = threadIdx.x; i < n_slots; i += blockDim.x) {
    if (ll_report_bad_slot(a, i)) any_bad = 1;
    pos[i] = -1;
  }
  __syncthreads();
  ll_credits(a, h->credit_dispatch[half], epoch, kOpLLDispatchCredit);
  const bool skip = ll_failed();
  for (int g = threadIdx.x; g < E; g += blockDim.x) {
    const int c = ll_number_rows(a, g, pos);
    if (a.expert_count != nullptr) a.expert_count[g] = any_bad ? 0 : c;
    if (skip) continue;
    const int r = g / el, e = g % el;
    int32_t* counts =
        reinterpret_cast<int32_t*>(ll_at(a, r, a.L.counts_off + half * a.L.counts_half));
    peer::store(&counts[e * R + a.me], c < a.M ? c : a.M);
  }
  // The push kernel's arrival signal covers these counts too: make them visible to the
  // owners before it (the signal's own fence orders only the push kernel's writes).
  peer::fence_data();
}

// A warp per (token, slot): the token's row into its expert's slot on the owner. The
// last block tells every owner its rows and counts are there (tag, then arrival).
__global__ void ll_dispatch_push(LowLatencyArgs a) {
  const int el = a.L.experts_per_rank(), R = a.L.R;
  const int n_slots = a.S * a.K;
  const int32_t* pos = reinterpret_cast<const int32_t*>(ll_at(a, a.me, a.L.pos_off));
  const int lane = threadIdx.x % 32;
  const int warp = blockIdx.x * kWarps + threadIdx.x / 32;
  LowLatencyHeader* h = ll_header(a, a.me);
  const uint64_t n = h->seq_dispatch;  // set by this epoch's plan kernel
  const int half = ll_half(n);
  const size_t slots_off = a.L.slots_off + half * a.L.slots_half;
  const size_t tok_off = a.L.tok_off + half * a.L.tok_half;
  const bool skip = ll_failed();
  for (int i = warp; i < n_slots && !skip; i += gridDim.x * kWarps) {
    const int p = pos[i];
    if (p < 0) continue;
    const int32_t g = a.topk_idx[i];
    const int r = g / el, e = g % el;
    const int64_t slot = ll_slot(e, a.me, p, R, a.L.M);
    warp_copy_row<true>(ll_at(a, r, slots_off + slot * a.L.stride),
                        static_cast<const char*>(a.x) + static_cast<size_t>(i / a.K) * a.row_bytes,
                        a.row_bytes, lane);
    if (lane == 0) peer::store(reinterpret_cast<int32_t*>(ll_at(a, r, tok_off)) + slot, i / a.K);
  }
  ll_last_block(&h->done_dispatch, [&] {
    const int64_t tag = ll_failed() ? kSiteFailed : a.tag;
    for (int r = 0; r < R; ++r) {
      LowLatencyHeader* o = ll_header(a, r);
      store_volatile(&o->tag_dispatch[half][a.me], tag);
      peer::signal(&o->arrive_dispatch[half][a.me], n);
    }
  });
}

// Owner: a warp per output row (e, i) of the [E_local, R * M] blocks; then credits.
__global__ void ll_dispatch_recv(LowLatencyArgs a) {
  LowLatencyHeader* h = ll_header(a, a.me);
  const uint64_t n = ll_recv_epoch(a, h->seq_dispatch);
  const int half = ll_half(n);
  ll_check_rank(a);
  const bool skip = ll_arrivals(a, h->arrive_dispatch[half], h->tag_dispatch[half], n,
                                h->my_tag_dispatch[half], kOpLLDispatch);
  const int el = a.L.experts_per_rank(), R = a.L.R;
  const int64_t RM = static_cast<int64_t>(R) * a.M;
  const int32_t* counts = reinterpret_cast<const int32_t*>(
      ll_at(a, a.me, a.L.counts_off + half * a.L.counts_half));
  const int32_t* tok =
      reinterpret_cast<const int32_t*>(ll_at(a, a.me, a.L.tok_off + half * a.L.tok_half));
  const size_t slots_off = a.L.slots_off + half * a.L.slots_half;
  auto count = [&](int e, int s) {
    const int32_t c = skip ? 0 : peer::load_cg_s32(&counts[e * R + s]);
    return c < 0 ? 0 : (c > a.M ? a.M : c);
  };
  if (blockIdx.x == 0) {
    for (int e = threadIdx.x; e < el; e += blockDim.x) {
      int32_t total = 0;
      for (int s = 0; s < R; ++s) {
        const int32_t c = count(e, s);
        a.first_row[e * R + s] = total;
        a.row_count[e * R + s] = c;
        total += c;
      }
      a.recv_count[e] = total;
    }
  }
  const int lane = threadIdx.x % 32;
  const int warp = blockIdx.x * kWarps + threadIdx.x / 32;
  for (int64_t w = warp; w < el * RM; w += static_cast<int64_t>(gridDim.x) * kWarps) {
    const int e = static_cast<int>(w / RM);
    const int64_t i = w % RM;
    int s = 0;
    int64_t first = 0;
    for (; s < R; ++s) {
      const int32_t c = count(e, s);
      if (i < first + c) break;
      first += c;
    }
    char* dst = static_cast<char*>(a.recv_x) + w * a.row_bytes;
    if (s == R) {
      warp_zero_row(dst, a.row_bytes, lane);
      if (lane == 0) a.src_rank[w] = a.src_index[w] = -1;
      continue;
    }
    const int64_t slot = ll_slot(e, s, static_cast<int>(i - first), R, a.L.M);
    warp_copy_row<false>(dst, ll_at(a, a.me, slots_off + slot * a.L.stride), a.row_bytes, lane);
    if (lane == 0) {
      a.src_rank[w] = s;
      a.src_index[w] = peer::load_cg_s32(&tok[slot]);
    }
  }
  ll_last_block(&h->done_dispatch_recv, [&] {
    for (int s = 0; s < R; ++s) peer::signal(&ll_header(a, s)->credit_dispatch[half][a.me], n);
  });
}

// -------------------------------- combine --------------------------------

// One block: the epoch, the handle's check (every entry inside y, at most the call's
// rows_per_dest rows per source), then every source's credit (it read our previous stage
// rows).
__global__ void ll_combine_plan(LowLatencyArgs a) {
  LowLatencyHeader* h = ll_header(a, a.me);
  const int el = a.L.experts_per_rank(), R = a.L.R;
  const int64_t RM = static_cast<int64_t>(R) * a.M;
  __shared__ uint64_t epoch;
  __shared__ int bad;
  if (threadIdx.x == 0) {
    epoch = h->seq_combine + 1;
    h->seq_combine = epoch;
    h->my_tag_combine[ll_half(epoch)] = a.tag;
    if (a.epoch_out != nullptr) *a.epoch_out = ll_epoch_low(epoch);
    bad = 0;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < el * R; i += blockDim.x) {
    const int64_t f = a.first_row[i], c = a.row_count[i];  // a foreign f + c may pass 2^31
    if (f < 0 || c < 0 || f + c > RM) {
      ll_report(a, kErrBadHandle, i / R, i % R,
                static_cast<int32_t>(f < 0 || f > RM ? f : c), kOpLLCombine);
      bad = 1;
    }
  }
  // The call's rows per source, as the CPU checks them (never above the area's).
  const int64_t cap = a.rows_per_dest > 0 && a.rows_per_dest < a.L.rows_per_dest
                          ? a.rows_per_dest : a.L.rows_per_dest;
  for (int d = threadIdx.x; d < R; d += blockDim.x) {
    int64_t rows = 0;
    for (int e = 0; e < el; ++e) rows += a.row_count[e * R + d] > 0 ? a.row_count[e * R + d] : 0;
    if (rows > cap) {
      ll_report(a, kErrBadHandle, -1, d, static_cast<int32_t>(rows), kOpLLCombine);
      bad = 1;
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) h->combine_bad_handle[ll_half(epoch)] = bad;
  ll_credits(a, h->credit_combine[ll_half(epoch)], epoch, kOpLLCombineCredit);
}

// Owner: a warp per row (e, i) of y; rows of source d go to d's cstage[me], expert after
// expert, each expert's rows in order (ll_stage_row).
__global__ void ll_combine_push(LowLatencyArgs a) {
  const int el = a.L.experts_per_rank(), R = a.L.R;
  const int64_t RM = static_cast<int64_t>(R) * a.M;
  const int lane = threadIdx.x % 32;
  const int warp = blockIdx.x * kWarps + threadIdx.x / 32;
  LowLatencyHeader* h = ll_header(a, a.me);
  const uint64_t n = h->seq_combine;  // set by this epoch's plan kernel
  const int half = ll_half(n);
  const size_t cstage_off = a.L.cstage_off + half * a.L.cstage_half;
  const bool bad_handle = h->combine_bad_handle[half] != 0;  // checked by the plan kernel
  const bool skip = ll_failed() || bad_handle;
  for (int64_t w = warp; w < el * RM && !skip; w += static_cast<int64_t>(gridDim.x) * kWarps) {
    const int e = static_cast<int>(w / RM);
    const int64_t i = w % RM;
    int d = 0;
    for (; d < R; ++d) {
      const int64_t f = a.first_row[e * R + d], c = a.row_count[e * R + d];
      if (i >= f && i < f + c) break;
    }
    if (d == R) continue;  // row past the counts
    const int64_t off = ll_stage_row(a.row_count + d, R, e, i - a.first_row[e * R + d]);
    if (off >= a.L.rows_per_dest) continue;  // excluded by the plan's check
    const size_t at =
        cstage_off + (static_cast<size_t>(a.me) * a.L.rows_per_dest + off) * a.L.stride;
    warp_copy_row<true>(ll_at(a, d, at), static_cast<const char*>(a.y) + w * a.row_bytes,
                        a.row_bytes, lane);
  }
  ll_last_block(&h->done_combine, [&] {
    const int64_t tag = ll_failed() ? kSiteFailed : (bad_handle ? kLLTagBadHandle : a.tag);
    for (int d = 0; d < R; ++d) {
      LowLatencyHeader* o = ll_header(a, d);
      store_volatile(&o->tag_combine[half][a.me], tag);
      peer::signal(&o->arrive_combine[half][a.me], n);
    }
  });
}

// Source, one block: positions of this call's routing (as the dispatch numbered them)
// and where each expert's rows start in its owner's stage.
__global__ void ll_combine_recv_plan(LowLatencyArgs a) {
  const int E = a.L.E, el = a.L.experts_per_rank();
  const int n_slots = a.S * a.K;
  int32_t* pos = reinterpret_cast<int32_t*>(ll_at(a, a.me, a.L.pos_c_off));
  int32_t* offsets = reinterpret_cast<int32_t*>(ll_at(a, a.me, a.L.offsets_off));
  __shared__ int32_t cnt[kLLMaxExperts];
  for (int i = threadIdx.x; i < n_slots; i += blockDim.x) {
    // Reported (as the CPU's combine does) and left unused, as the dispatch left them.
    ll_report_bad_slot(a, i);
    pos[i] = -1;
  }
  __syncthreads();
  for (int g = threadIdx.x; g < E; g += blockDim.x) {
    const int c = ll_number_rows(a, g, pos);
    if (g < kLLMaxExperts) cnt[g] = c < a.M ? c : a.M;
  }
  __syncthreads();
  for (int r = threadIdx.x; r < a.L.R; r += blockDim.x)
    for (int e = 0; e < el; ++e)
      offsets[r * el + e] = static_cast<int32_t>(ll_stage_row(cnt + r * el, 1, e, 0));
}

// Source: a warp per token; lanes over the hidden dim, k ascending per element; then
// credits every owner.
__global__ void ll_combine_recv(LowLatencyArgs a) {
  LowLatencyHeader* h = ll_header(a, a.me);
  const uint64_t n = ll_recv_epoch(a, h->seq_combine);
  const int half = ll_half(n);
  ll_check_rank(a);
  __shared__ uint32_t bad_owners;  // owners whose handle was foreign: their rows are zero
  const bool skip = ll_arrivals(a, h->arrive_combine[half], h->tag_combine[half], n,
                                h->my_tag_combine[half], kOpLLCombine, &bad_owners);
  const size_t cstage_off = a.L.cstage_off + half * a.L.cstage_half;
  const int el = a.L.experts_per_rank();
  const int32_t* pos = reinterpret_cast<const int32_t*>(ll_at(a, a.me, a.L.pos_c_off));
  const int32_t* offsets = reinterpret_cast<const int32_t*>(ll_at(a, a.me, a.L.offsets_off));
  const int lane = threadIdx.x % 32;
  const int warp = blockIdx.x * kWarps + threadIdx.x / 32;
  for (int t = warp; t < a.S; t += gridDim.x * kWarps) {
    char* dst = static_cast<char*>(a.out) + static_cast<size_t>(t) * a.row_bytes;
    for (int64_t x = lane; x < a.H; x += 32) {
      float acc = 0.0f;
      for (int k = 0; k < a.K && !skip; ++k) {
        const int i = t * a.K + k;
        const int32_t g = a.topk_idx[i];
        const int p = pos[i];
        if (g < 0 || p < 0 || (bad_owners >> (g / el)) & 1u) continue;
        const int64_t row = offsets[g] + p;
        const char* src = ll_at(
            a, a.me,
            cstage_off + (static_cast<size_t>(g / el) * a.L.rows_per_dest + row) * a.L.stride);
        float v;
        switch (a.kind) {
          case FloatKind::kF32: v = peer::load_cg_f32(reinterpret_cast<const float*>(src) + x); break;
          case FloatKind::kBF16:
            v = bf16_to_f32(*reinterpret_cast<const volatile uint16_t*>(src + 2 * x)); break;
          default: v = f16_to_f32(*reinterpret_cast<const volatile uint16_t*>(src + 2 * x)); break;
        }
        acc = ll_weighted_add(acc, a.topk_w[i], v);
      }
      ll_store(a.kind, dst, x, acc);
    }
  }
  ll_last_block(&h->done_combine_recv, [&] {
    for (int r = 0; r < a.L.R; ++r)
      peer::signal(&ll_header(a, r)->credit_combine[half][a.me], n);
  });
}

int Blocks(int64_t warps_of_work) {
  const int64_t b = (warps_of_work + kWarps - 1) / kWarps;
  return static_cast<int>(b < 1 ? 1 : (b > 1024 ? 1024 : b));
}

}  // namespace

cudaError_t LaunchLowLatencyPhase(int phase, const LowLatencyArgs& a, cudaStream_t stream) {
  const int64_t rows = static_cast<int64_t>(a.L.experts_per_rank()) * a.L.R * a.M;
  switch (phase) {
    case kLLDispatchPlan: JEP_LAUNCH(ll_dispatch_plan, 1, kThreads, 0, stream)(a); break;
    case kLLDispatchPush:
      JEP_LAUNCH(ll_dispatch_push, Blocks(static_cast<int64_t>(a.S) * a.K), kThreads, 0, stream)(a);
      break;
    case kLLDispatchRecv: JEP_LAUNCH(ll_dispatch_recv, Blocks(rows), kThreads, 0, stream)(a); break;
    case kLLCombinePlan: JEP_LAUNCH(ll_combine_plan, 1, kThreads, 0, stream)(a); break;
    case kLLCombinePush: JEP_LAUNCH(ll_combine_push, Blocks(rows), kThreads, 0, stream)(a); break;
    case kLLCombineRecvPlan: JEP_LAUNCH(ll_combine_recv_plan, 1, kThreads, 0, stream)(a); break;
    case kLLCombineRecv: JEP_LAUNCH(ll_combine_recv, Blocks(a.S), kThreads, 0, stream)(a); break;
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
  return cudaMemset(header, 0, sizeof(LowLatencyHeader));
}

}  // namespace jax_ep
