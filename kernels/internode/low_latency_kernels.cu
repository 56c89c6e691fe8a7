// Internode low-latency kernels: direct per-expert puts over the transport interface
// (kernels/internode/transport.cuh, NVSHMEM backend). Protocol and slot-reuse scheme in
// low_latency_kernels.h; word-level rules in low_latency_wire.h.
//
// Kernels per call (every grid cut to the mode's SMs, InternodeModeSms in configs.h):
//   dispatch send: Begin (epoch, token) -> DispatchPlan (a warp per expert) ->
//                  DispatchSendKernel (credits, headers, a warp per token: stage, put its
//                  rows, one fence, count them; the last row counted of an expert sends
//                  that expert's count signal)
//   dispatch recv: RecvWait -> DispatchUnpack (a warp per landed row) -> RecvFinish
//   combine send:  Begin -> CombinePlan -> CombineSendKernel (a warp per returned row)
//   combine recv:  CombineRecvPlan (a warp per expert) -> RecvWait -> CombineReduce
//                  (a warp per (token, chunk), every top-k row's loads in flight before the
//                  adds: ll_combine_sum.cuh) -> RecvFinish
// No kernel waits for its own puts to complete (no nvshmem_quiet anywhere).
//
// This file holds the kernels and their launchers (declared in kernels/internode/api.cuh);
// the host side -- the area's start-up, a call's checks and geometry, the grid sizes, the
// error text -- is kernels/internode/low_latency_host.cu.
#include "kernels/internode/low_latency_kernels.h"

#include <algorithm>
#include <string>

#include "kernels/common/fp8_quant.h"
#include "kernels/common/fp8_warp.cuh"
#include "kernels/common/low_latency_math.h"
#include "kernels/common/striping_plan.h"
#include "kernels/cuda/ll_combine_sum.cuh"
#include "kernels/internode/api.cuh"
#include "kernels/internode/device_copy.cuh"
#include "kernels/internode/low_latency_wire.h"
#include "kernels/internode/transport_select.cuh"
#include "kernels/internode/wire_protocol.h"

namespace jax_ep {
namespace ll_internode {
namespace JEP_TR_NS {  // this build's transport (transport_select.cuh)
namespace {

using Tr = transport::JEP_TR_NS::TransportFor<transport::Conn::kFull>;
using transport::Sig;
using llwire::Area;

constexpr int kD = llwire::kOpDispatch;
constexpr int kC = llwire::kOpCombine;

__device__ __forceinline__ uint64_t NowNs() { return peer::global_timer_ns(); }

__device__ __forceinline__ bool Failed(const G& g) {
  return *reinterpret_cast<volatile const int32_t*>(&g.err->code) != wire::kErrNone;
}

// First error wins; fields before the code, so the host never reads half a record.
__device__ void Record(const G& g, int32_t code, int peer, int kind, int qp, uint64_t expected,
                       uint64_t seen, uint64_t my_seq = 0, uint64_t peer_seq = 0) {
  if (atomicCAS_system(&g.err->code, wire::kErrNone, -1) != wire::kErrNone) return;
  volatile wire::ErrorRecord* e = g.err;
  e->rank = g.rank;
  e->op = llwire::kErrOpBase + g.op;
  e->peer = peer;
  e->kind = kind;
  e->qp = qp;
  e->expected = expected;
  e->seen = seen;
  e->my_seq = my_seq;
  e->peer_seq = peer_seq;
  for (int i = 0; i < wire::kNumCfgFields; ++i) {
    e->mine[i] = 0;
    e->theirs[i] = 0;
  }
  __threadfence_system();
  e->code = code;
  __threadfence_system();
}

// Polls a local word until it holds >= expect, for at most the timeout; records which
// peer and word on expiry. False if it expired or the process already failed.
__device__ bool WaitWord(const G& g, uint64_t* w, uint64_t expect, int peer, int kind, int qp) {
  const uint64_t start = NowNs();
  uint64_t v = Tr::fetch(w);
  for (unsigned spin = 0; v < expect; ++spin) {  // unsigned: wraps, never overflows
    if ((spin & 1023) == 0) {
      if (Failed(g)) return false;
      if (static_cast<int64_t>(NowNs() - start) > g.timeout_ns) {
        Record(g, wire::kErrTimeout, peer, kind, qp, expect, v);
        return false;
      }
    }
    v = Tr::fetch(w);
  }
  // acquire: the header or rows the word guards are read after it
  __threadfence_system();
  return true;
}

// The epoch of a call from its token (low 32 bits, widened against this PE's counter).
__device__ __forceinline__ unsigned long long TokenEpoch(int op, const int32_t* token) {
  return llwire::widen_epoch(g_ll_epoch[op], static_cast<uint32_t>(token[0]));
}

__device__ __forceinline__ uint64_t* Cnt(const G& g, int op, int b, int w, int e) {
  return reinterpret_cast<uint64_t*>(g.area + g.A.dsig) +
         llwire::cnt_index(op, b, w, e, g.R, g.el);
}
__device__ __forceinline__ uint64_t* Hsig(const G& g, int op, int b, int w) {
  return reinterpret_cast<uint64_t*>(g.area + g.A.hsig) + llwire::hsig_index(op, b, w, g.R);
}
__device__ __forceinline__ uint64_t* Credit(const G& g, int op, int b, int reader) {
  return reinterpret_cast<uint64_t*>(g.area + g.A.credit) +
         llwire::credit_index(op, b, reader, g.R);
}
__device__ __forceinline__ llwire::Header* Hdr(const G& g, int op, int b, int w) {
  return reinterpret_cast<llwire::Header*>(g.area + llwire::hdr_at(g.A, op, b, w));
}
__device__ __forceinline__ llwire::Header* Hstage(const G& g, int b, int op, int reader) {
  return reinterpret_cast<llwire::Header*>(g.area + llwire::hstage_at(g.A, b, op, reader));
}
__device__ __forceinline__ int32_t* HdrCounts(llwire::Header* h) {
  return reinterpret_cast<int32_t*>(h + 1);
}
__device__ __forceinline__ const int32_t* HdrCounts(const llwire::Header* h) {
  return reinterpret_cast<const int32_t*>(h + 1);
}
__device__ __forceinline__ int32_t* Local(const G& g, int64_t off) {
  return reinterpret_cast<int32_t*>(g.area + off);
}
// This op's bad-input note: [0] nonzero once noted, then three values.
__device__ __forceinline__ int32_t* Bad(const G& g) { return Local(g, g.A.bad) + 4 * g.op; }

using devcopy::CopyBytes;
using devcopy::NanBytes;

// Notes this rank's first bad input (bad[0] = 1, then three values).
__device__ __forceinline__ void NoteBad(const G& g, int32_t a, int32_t b, int32_t c) {
  int32_t* bad = Bad(g);
  if (atomicCAS(bad, 0, 1) == 0) {
    bad[1] = a;
    bad[2] = b;
    bad[3] = c;
  }
}

// Bad routing or handle found by the plan: recorded here, reported to every reader
// through the header's error flag.
__device__ void RecordOwnBad(const G& g) {
  const int32_t* bad = Bad(g);
  if (bad[0] == 0) return;
  Record(g, wire::kErrBadId, bad[1], g.op == kD ? 0 : llwire::kKindRows, bad[2],
         static_cast<uint64_t>(g.E), static_cast<uint64_t>(static_cast<int64_t>(bad[3])));
}

// The count signal of (this writer, reader's local expert e) after the last of its rows,
// on the rows' QP: a QP delivers in order, so the count lands after them. Without QP
// handles NVSHMEM may have spread the rows over its QPs: fenced first.
__device__ __forceinline__ void SignalCount(const G& g, int op, int b, int reader, int e,
                                            int32_t rows, int qp) {
  Tr::fence_qp(qp);
  // the reader resets its count words before its credit: a SET from 0
  Tr::signal(transport::Set(Cnt(g, op, b, g.rank, e), static_cast<uint64_t>(rows) + 1, 0), reader,
             qp);
}

// One lane per warp, after the warp issued rows of counter `i` (rows in all) and fenced
// its posts (__threadfence, once for all the rows it counts now): the warp that counts the
// last row sends the count signal. Rows are issued by many warps; the counter orders their
// posts before the signal's (each post precedes its fence, the fence its increment).
__device__ __forceinline__ void RowCounted(const G& g, int op, int b, int reader, int e,
                                           int32_t* done, int i, int32_t rows, int qp) {
  if (atomicAdd(done + i, 1) + 1 == rows) SignalCount(g, op, b, reader, e, rows, qp);
}

// RowCounted for a warp that issued one row: its own fence first.
__device__ __forceinline__ void RowIssued(const G& g, int op, int b, int reader, int e,
                                          int32_t* done, int i, int32_t rows, int qp) {
  __threadfence();
  RowCounted(g, op, b, reader, e, done, i, rows, qp);
}

// ---- send halves ------------------------------------------------------------------

// One block: the op's next epoch into the token, the bad note and the done counters
// cleared (the plan and the send kernels that follow are multi-block, so none of them
// can be the one that starts the epoch).
__global__ void Begin(G g, int32_t* token) {
  if (threadIdx.x == 0) {
    const unsigned long long n = ++g_ll_epoch[g.op];
    token[0] = static_cast<int32_t>(n);
    token[1] = static_cast<int32_t>(g.hash);
    Bad(g)[0] = 0;
  }
  int32_t* done = Local(g, g.A.done);
  for (int i = threadIdx.x; i < g.E; i += blockDim.x) done[i] = 0;
}

// Every thread of a warp, all lanes active: pos[i] for each slot naming expert e (its
// rank among this rank's slots naming e, in slot order; -1 past M, which the reference
// drops), and the capped count. A ballot per 32 slots, so a warp scans S * K slots in
// S * K / 32 steps and the experts go in parallel over the grid's warps.
__device__ void PlanExpert(const G& g, const int32_t* idx, int slots, int e, int32_t* pos,
                           int32_t* counts) {
  const int lane = threadIdx.x & 31;
  const unsigned below = (1u << lane) - 1u;
  int c = 0;
  for (int base = 0; base < slots; base += 32) {
    const int i = base + lane;
    const bool hit = i < slots && idx[i] == e;
    const unsigned m = __ballot_sync(0xffffffffu, hit);
    if (hit) {
      const int p = c + __popc(m & below);
      pos[i] = p < g.M ? p : -1;
    }
    c += __popc(m);
  }
  if (lane == 0) counts[e] = c < g.M ? c : g.M;
}

// Grid: bad or repeated ids noted (a thread per slot), then a warp per expert
// (PlanExpert). Slots with id -1 keep a stale pos: nothing reads it.
__global__ void DispatchPlan(G g, const int32_t* idx) {
  const int slots = g.S * g.K;
  const int tid = blockIdx.x * blockDim.x + threadIdx.x;
  const int nthreads = gridDim.x * blockDim.x;
  for (int i = tid; i < slots; i += nthreads) {
    const int32_t e = idx[i];
    const int t = i / g.K, k = i % g.K;
    if (e < -1 || e >= g.E) {
      NoteBad(g, t, k, e);
      continue;
    }
    for (int j = 0; j < k && e >= 0; ++j)
      if (idx[t * g.K + j] == e) NoteBad(g, t, k, e);  // repeated id in one token
  }
  int32_t* pos = Local(g, g.A.pos);
  int32_t* counts = Local(g, g.A.counts);
  for (int e = tid >> 5; e < g.E; e += nthreads >> 5) PlanExpert(g, idx, slots, e, pos, counts);
}

// Credits for buffer b from every reader (it finished epoch n - 2 there); false on
// timeout or an earlier failure. Every thread of the block returns the same answer.
__device__ bool WaitCredits(const G& g, int op, int b, unsigned long long n) {
  __shared__ int ok;
  if (threadIdx.x == 0) ok = Failed(g) ? 0 : 1;
  __syncthreads();
  if (n > 2 && ok) {
    for (int r = threadIdx.x; r < g.R; r += blockDim.x)
      if (!WaitWord(g, Credit(g, op, b, r), n - 2, r, llwire::kKindCredit, llwire::kControlQp))
        ok = 0;
  }
  __syncthreads();
  return ok != 0;
}

// What a header or credit word of buffer b = n & 1 holds before epoch n's SET: epoch n - 2,
// or 0 before the buffer's first use (low_latency_wire.h).
__device__ __forceinline__ uint64_t PrevEpoch(unsigned long long n) { return n > 2 ? n - 2 : 0; }

// Block 0, every thread, after the headers were staged in hstage[b]: one header per
// reader (SET n on the control QP).
__device__ void PutHeaders(const G& g, int op, int b, unsigned long long n) {
  __syncthreads();
  const int warp = threadIdx.x >> 5;
  for (int i = warp; i < g.R; i += kWarps) {
    const int r = (g.rank + i) % g.R;
    Tr::put_signal_warp(Hdr(g, op, b, g.rank), Hstage(g, b, op, r), static_cast<size_t>(g.A.hs),
                        transport::Set(Hsig(g, op, b, g.rank), n, PrevEpoch(n)), r,
                        llwire::kControlQp);
  }
}

// Grid: every block waits for the credits of buffer b (stage b and the readers' buffer b
// are free: see low_latency_wire.h); block 0 stages and puts the headers; experts with no
// rows get their count signal; then a warp per token stages it into dstage[b] (row, then
// its index) and puts it to each of its experts' slot drecv[b][e][this rank][pos], no
// signal, then one fence and the counts of its rows; the warp that counts an expert's last
// row sends its count. Returns with the puts in flight.
__global__ void DispatchSendKernel(G g, const char* x, const int32_t* idx,
                                   const int32_t* token) {
  const unsigned long long n = TokenEpoch(kD, token);
  const int b = static_cast<int>(n & 1ull);
  if (!WaitCredits(g, kD, b, n)) return;
  const int32_t* pos = Local(g, g.A.pos);
  const int32_t* counts = Local(g, g.A.counts);
  int32_t* done = Local(g, g.A.done);
  const bool bad = Bad(g)[0] != 0;  // the header tells every owner; no rows
  if (blockIdx.x == 0) {
    for (int r = threadIdx.x; r < g.R; r += blockDim.x) {
      llwire::Header* h = Hstage(g, b, kD, r);
      int rows = 0;
      for (int e = 0; e < g.el; ++e) {
        HdrCounts(h)[e] = counts[r * g.el + e];
        rows += counts[r * g.el + e];
      }
      h->seq = n;
      h->hash = g.hash;
      h->error = bad ? 1 : 0;
      h->rows = rows;
      h->pad[0] = h->pad[1] = h->pad[2] = 0;
    }
    PutHeaders(g, kD, b, n);
    if (threadIdx.x == 0) RecordOwnBad(g);
  }
  if (bad) return;
  const int tid = blockIdx.x * blockDim.x + threadIdx.x;
  const int nthreads = gridDim.x * blockDim.x;
  for (int e = tid; e < g.E; e += nthreads) {
    if (counts[e] != 0) continue;
    const int r = e / g.el, le = e % g.el;
    SignalCount(g, kD, b, r, le, 0, llwire::expert_qp(r, le, g.P, g.Q));
  }
  const int lane = threadIdx.x & 31;
  for (int t = tid >> 5; t < g.S; t += nthreads >> 5) {
    char* st = g.area + llwire::dstage_row(g.A, b, t);
    const char* row = x + static_cast<int64_t>(t) * g.x_row_bytes;
    if (g.fp8 != 0)  // the message cast in registers into this rank's stage
      fp8_warp_cast_row(
          st, row, g.H, g.elem, g.fp8 == 2, lane, [](const char* p) { return peer::load_nc16(p); },
          [](char* p, uint4 v) { *reinterpret_cast<uint4*>(p) = v; },
          [](float* p, float v) { *p = v; });
    else
      CopyBytes(st, row, g.row_bytes, lane, 32);
    if (lane == 0) *reinterpret_cast<int32_t*>(st + g.meta_off) = t;
    __syncwarp();
    for (int k = 0; k < g.K; ++k) {
      const int i = t * g.K + k;
      const int32_t e = idx[i];
      if (e < 0 || pos[i] < 0) continue;
      const int r = e / g.el, le = e % g.el;
      Tr::put_warp(g.area + llwire::drecv_row(g.A, b, le, g.rank, pos[i]), st,
                   static_cast<size_t>(g.ds_put), r, llwire::expert_qp(r, le, g.P, g.Q));
    }
    // The token's rows are posted: one fence orders them all before their counts (not a
    // fence per row); an expert's count signal waits at most for this token's other rows.
    if (lane == 0) {
      __threadfence();
      for (int k = 0; k < g.K; ++k) {
        const int i = t * g.K + k;
        const int32_t e = idx[i];
        if (e < 0 || pos[i] < 0) continue;
        const int r = e / g.el, le = e % g.el;
        RowCounted(g, kD, b, r, le, done, e, counts[e], llwire::expert_qp(r, le, g.P, g.Q));
      }
    }
    __syncwarp();
  }
}

// Grid: combine's handle checked (counts outside the blocks are a bad handle, reported
// like bad ids; a thread per (expert, source)), then a thread per source: where each
// (expert, source)'s rows start in the stream to that source.
__global__ void CombinePlan(G g, const int32_t* first_row, const int32_t* row_count) {
  const int tid = blockIdx.x * blockDim.x + threadIdx.x;
  const int nthreads = gridDim.x * blockDim.x;
  const int64_t RM = static_cast<int64_t>(g.R) * g.M;
  for (int i = tid; i < g.el * g.R; i += nthreads) {
    const int32_t f = first_row[i], c = row_count[i];
    if (f < 0 || c < 0 || c > g.M || static_cast<int64_t>(f) + c > RM)  // no int32 wrap
      NoteBad(g, i / g.R, i % g.R, c);
  }
  int32_t* offsets = Local(g, g.A.offsets);  // [E_local][R]
  for (int d = tid; d < g.R; d += nthreads) {
    int64_t rows = 0;
    for (int e = 0; e < g.el; ++e) {
      offsets[e * g.R + d] = static_cast<int32_t>(rows);
      const int32_t c = row_count[e * g.R + d];
      rows += c > 0 ? c : 0;
    }
    if (rows > g.rpd) NoteBad(g, -1, d, static_cast<int32_t>(rows));
  }
}

// Grid: credits of buffer b; block 0 stages and puts the headers; (expert, source) pairs
// with no rows get their count signal; then a warp per row (e, d, r), r < row_count[e, d]:
// row first_row[e, d] + r of y's block e into cstage[b] at its index j in the stream to d
// (experts in order, then r), put into crecv[b][this owner][j] on d, no signal; the warp
// that issues a pair's last row sends its count. Returns with the puts in flight.
__global__ void CombineSendKernel(G g, const char* y, const int32_t* first_row,
                                  const int32_t* row_count, const int32_t* token) {
  const unsigned long long n = TokenEpoch(kC, token);
  const int b = static_cast<int>(n & 1ull);
  if (!WaitCredits(g, kC, b, n)) return;
  const bool bad = Bad(g)[0] != 0;
  const int32_t* offsets = Local(g, g.A.offsets);
  int32_t* done = Local(g, g.A.done);
  if (blockIdx.x == 0) {
    for (int d = threadIdx.x; d < g.R; d += blockDim.x) {
      llwire::Header* h = Hstage(g, b, kC, d);
      int rows = 0;
      for (int e = 0; e < g.el; ++e) {
        const int32_t c = bad ? 0 : row_count[e * g.R + d];
        HdrCounts(h)[e] = c;
        rows += c;
      }
      h->seq = n;
      h->hash = g.hash;
      h->error = bad ? 1 : 0;
      h->rows = rows;
      h->pad[0] = h->pad[1] = h->pad[2] = 0;
    }
    PutHeaders(g, kC, b, n);
    if (threadIdx.x == 0) RecordOwnBad(g);
  }
  if (bad) return;
  const int tid = blockIdx.x * blockDim.x + threadIdx.x;
  const int nthreads = gridDim.x * blockDim.x;
  for (int i = tid; i < g.el * g.R; i += nthreads) {
    if (row_count[i] != 0) continue;
    const int e = i / g.R, d = i % g.R;
    SignalCount(g, kC, b, d, e, 0, llwire::expert_qp(d, e, g.P, g.Q));
  }
  const int64_t RM = static_cast<int64_t>(g.R) * g.M;
  const int lane = threadIdx.x & 31;
  const int64_t nwarps = nthreads >> 5;
  for (int64_t w = tid >> 5; w < g.el * RM; w += nwarps) {
    const int e = static_cast<int>(w / RM);
    const int d = static_cast<int>((w % RM) / g.M);
    const int r = static_cast<int>(w % g.M);
    const int32_t c = row_count[e * g.R + d];
    if (r >= c) continue;
    const int64_t i = static_cast<int64_t>(first_row[e * g.R + d]) + r;
    const int64_t j = offsets[e * g.R + d] + r;
    char* st = g.area + llwire::cstage_row(g.A, b, d, j);
    CopyBytes(st, y + (static_cast<int64_t>(e) * RM + i) * g.row_bytes, g.row_bytes, lane, 32);
    __syncwarp();
    const int q = llwire::expert_qp(d, e, g.P, g.Q);
    Tr::put_warp(g.area + llwire::crecv_row(g.A, b, g.rank, j), st,
                 static_cast<size_t>(g.cs_put), d, q);
    if (lane == 0) RowIssued(g, kC, b, d, e, done, e * g.R + d, c, q);
    __syncwarp();
  }
}

// ---- receive halves -----------------------------------------------------------------

// Combine's reader, grid: positions of its own routing (as its dispatch numbered them)
// and rows per (owner expert), a warp per expert.
__global__ void CombineRecvPlan(G g, const int32_t* idx) {
  int32_t* pos = Local(g, g.A.pos);
  int32_t* counts = Local(g, g.A.counts);
  const int tid = blockIdx.x * blockDim.x + threadIdx.x;
  const int nthreads = gridDim.x * blockDim.x;
  for (int e = tid >> 5; e < g.E; e += nthreads >> 5)
    PlanExpert(g, idx, g.S * g.K, e, pos, counts);
}

// A header's counts index inside the blocks: each in [0, M], summing to its rows (at
// most the area's rows per source for combine).
__device__ bool CountsFit(const G& g, const llwire::Header* h) {
  const int32_t* c = reinterpret_cast<const int32_t*>(h + 1);
  int64_t sum = 0;
  for (int e = 0; e < g.el; ++e) {
    if (c[e] < 0 || c[e] > g.M) return false;
    sum += c[e];
  }
  return sum == h->rows && (g.op == kD || h->rows <= g.A.rpd);
}

// One block: every writer's header (== epoch, and the hash this rank's own send of the
// epoch computed, which its token carries; no error); combine also checks the owner's
// count of each expert against its own routing. Then the row offsets the next kernel
// reads (dispatch: first row of each (expert, source) in recv_x and each expert's total;
// combine: where each expert's rows start in its owner's stream), and every (writer,
// expert) count word: its rows have landed, and it must say the header's count.
__global__ void RecvWait(G g, const int32_t* token) {
  const unsigned long long n = TokenEpoch(g.op, token);
  const uint32_t hash = static_cast<uint32_t>(token[1]);
  const int b = static_cast<int>(n & 1ull);
  int32_t* counts = Local(g, g.A.counts);
  int32_t* offsets = Local(g, g.A.offsets);
  __shared__ int ok;
  if (threadIdx.x == 0) ok = Failed(g) ? 0 : 1;
  __syncthreads();
  if (!ok) return;
  for (int w = threadIdx.x; w < g.R; w += blockDim.x) {
    if (!WaitWord(g, Hsig(g, g.op, b, w), n, w, llwire::kKindHeader, llwire::kControlQp)) {
      ok = 0;
      continue;
    }
    const llwire::Header* h = Hdr(g, g.op, b, w);
    if (h->seq != n || h->hash != hash) {
      Record(g, wire::kErrMismatch, w, llwire::kKindHeader, llwire::kControlQp, hash, h->hash,
             n, h->seq);
      ok = 0;
    } else if (h->error != 0) {
      if (w != g.rank) Record(g, wire::kErrPeerFailed, w, llwire::kKindHeader, 0, 0, 1);
      ok = 0;
    } else if (!CountsFit(g, h)) {
      // counts that would index past a slot block: never read them
      Record(g, wire::kErrMismatch, w, llwire::kKindCounts, 0, 0, static_cast<uint64_t>(h->rows));
      ok = 0;
    } else if (g.op == kC) {
      // every expert's count, not only the total: equal totals with other per-expert
      // counts would put rows at the wrong offsets
      const int32_t* hc = HdrCounts(h);
      for (int e = 0; e < g.el; ++e) {
        if (hc[e] != counts[w * g.el + e]) {
          Record(g, wire::kErrMismatch, w, llwire::kKindRows, e,
                 static_cast<uint64_t>(counts[w * g.el + e]), static_cast<uint64_t>(hc[e]));
          ok = 0;
          break;
        }
      }
    }
  }
  __syncthreads();
  if (!ok) return;
  if (g.op == kD) {
    for (int e = threadIdx.x; e < g.el; e += blockDim.x) {
      int32_t total = 0;
      for (int s = 0; s < g.R; ++s) {
        offsets[e * g.R + s] = total;
        total += devcopy::LoadLanded(HdrCounts(Hdr(g, kD, b, s)) + e);
      }
      counts[e] = total;
    }
  } else {
    for (int r = threadIdx.x; r < g.R; r += blockDim.x) {
      int32_t off = 0;
      for (int e = r * g.el; e < (r + 1) * g.el; ++e) {
        offsets[e] = off;
        off += counts[e];
      }
    }
  }
  for (int i = threadIdx.x; i < g.R * g.el; i += blockDim.x) {
    const int w = i / g.el, e = i % g.el;
    const uint64_t want =
        static_cast<uint64_t>(devcopy::LoadLanded(HdrCounts(Hdr(g, g.op, b, w)) + e)) + 1;
    uint64_t* word = Cnt(g, g.op, b, w, e);
    if (!WaitWord(g, word, 1, w, llwire::kKindData, e)) continue;
    const uint64_t v = Tr::fetch(word);
    if (v != want) Record(g, wire::kErrExtraSignal, w, llwire::kKindData, e, want - 1, v - 1);
  }
}

// Grid: block 0 writes the counts and first rows; a warp per landed row (e, s, p),
// p < source s's count for local expert e, into recv_x[e, first_row[e, s] + p]; a thread
// per row past an expert's total marks its source -1. recv_x past the totals is not
// written (consumers read recv_count). A failed call is never silently empty: every row
// NaN (bytes 0xff), every count and first row -1, sources -1.
__global__ void DispatchUnpack(G g, const int32_t* token, DispatchRecvOut out) {
  const int b = static_cast<int>(TokenEpoch(kD, token) & 1ull);
  const bool failed = Failed(g);
  const int64_t RM = static_cast<int64_t>(g.R) * g.M;
  const int32_t* counts = Local(g, g.A.counts);
  const int32_t* offsets = Local(g, g.A.offsets);
  if (blockIdx.x == 0) {
    for (int i = threadIdx.x; i < g.el * g.R; i += blockDim.x) {
      const int e = i / g.R, s = i % g.R;
      out.first_row[i] = failed ? -1 : offsets[i];
      out.row_count[i] = failed ? -1 : devcopy::LoadLanded(HdrCounts(Hdr(g, kD, b, s)) + e);
    }
    for (int e = threadIdx.x; e < g.el; e += blockDim.x) out.recv_count[e] = failed ? -1 : counts[e];
  }
  const int tid = blockIdx.x * blockDim.x + threadIdx.x;
  const int nthreads = gridDim.x * blockDim.x;
  for (int64_t i = tid; i < g.el * RM; i += nthreads)
    if (failed || i % RM >= counts[i / RM]) out.src_rank[i] = out.src_index[i] = -1;
  const int lane = threadIdx.x & 31;
  const int64_t nwarps = nthreads >> 5;
  // recv_x's rows: the rows as sent, or with fp8 the messages' H values.
  const int64_t out_row = g.fp8 != 0 ? g.H : g.row_bytes;
  const int64_t nb = g.H / kFp8Block;
  for (int64_t w = tid >> 5; w < g.el * RM; w += nwarps) {
    if (failed) {
      NanBytes(static_cast<char*>(out.recv_x) + w * out_row, out_row, lane, 32);
      if (g.fp8 != 0)
        NanBytes(reinterpret_cast<char*>(out.recv_scales + w * nb), nb * 4, lane, 32);
      continue;
    }
    const int e = static_cast<int>(w / RM);
    const int s = static_cast<int>((w % RM) / g.M);
    const int p = static_cast<int>(w % g.M);
    if (p >= devcopy::LoadLanded(HdrCounts(Hdr(g, kD, b, s)) + e)) continue;
    const int64_t row = static_cast<int64_t>(e) * RM + offsets[e * g.R + s] + p;
    const char* src = g.area + llwire::drecv_row(g.A, b, e, s, p);
    devcopy::CopyLanded(static_cast<char*>(out.recv_x) + row * out_row, src, out_row, lane, 32);
    if (g.fp8 != 0) {  // the message's scales
      const float* sc = reinterpret_cast<const float*>(src + ll_fp8_scales_off(g.H));
      for (int64_t j = lane; j < nb; j += 32)
        out.recv_scales[row * nb + j] = devcopy::LoadLanded(sc + j);
    }
    if (lane == 0) {
      out.src_rank[row] = s;
      out.src_index[row] = devcopy::LoadLanded(reinterpret_cast<const int32_t*>(src + g.meta_off));
    }
  }
}

// Whether combine's receive sums 16-byte vectors: every landed row starts 16-aligned, so
// the rows' size and the output's alignment decide.
__host__ __device__ __forceinline__ bool CombineVec(const G& g, const void* out) {
  return g.row_bytes % 16 == 0 && reinterpret_cast<uintptr_t>(out) % 16 == 0;
}

// Items (token, chunk) of combine's receive sum: the warps its grid asks for.
int64_t CombineItems(const G& g, const void* out) {
  return g.S * ll_sum_chunks(ll_sum_units(CombineVec(g, out), g.row_bytes, g.H));
}

// A warp per item (token, chunk of its row; kernels/cuda/ll_combine_sum.cuh), the items of
// every token dealt over all warps of the grid: lane k finds slot k's landed row and
// weight, then each lane loads kLLSumRows rows x kLLSumCols 16-byte vectors (elements, for
// rows that are not whole vectors) before it adds them k ascending, the product rounded to
// float32 before the add (low_latency_math.h), then one cast and one store per vector.
__global__ void CombineReduce(G g, const int32_t* idx, const float* w, const int32_t* token,
                              char* out) {
  const int b = static_cast<int>(TokenEpoch(kC, token) & 1ull);
  const bool failed = Failed(g);
  const int32_t* pos = Local(g, g.A.pos);
  const int32_t* offsets = Local(g, g.A.offsets);
  const int lane = threadIdx.x & 31;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarps;
  const bool vec = CombineVec(g, out);
  const int64_t units = ll_sum_units(vec, g.row_bytes, g.H);
  const int64_t chunks = ll_sum_chunks(units);
  for (int64_t item = static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
       item < g.S * chunks; item += warps) {
    const int t = static_cast<int>(item / chunks);
    const auto slot_of = [&](int k) -> LLSumSlot {
      const int i = t * g.K + k;
      const int32_t e = idx[i];
      if (e < 0 || pos[i] < 0) return LLSumSlot{nullptr, 0.0f};
      return LLSumSlot{g.area + llwire::crecv_row(g.A, b, e / g.el, offsets[e] + pos[i]), w[i]};
    };
    ll_sum_item(g.elem, g.K, units, vec, item % chunks, out + static_cast<int64_t>(t) * g.row_bytes,
                slot_of, failed, lane);
  }
}

// One block, after the outputs are written: reset buffer b's count words, then return
// the credit (SET epoch) to every writer. A failed rank stays silent. No quiet: the
// credits are signals with no source buffer, and a writer polls for them.
__global__ void RecvFinish(G g, const int32_t* token) {
  const unsigned long long n = TokenEpoch(g.op, token);
  const int b = static_cast<int>(n & 1ull);
  __shared__ int skip;
  if (threadIdx.x == 0) skip = Failed(g) ? 1 : 0;
  __syncthreads();
  if (skip) return;
  for (int i = threadIdx.x; i < g.R * g.el; i += blockDim.x)
    *Cnt(g, g.op, b, i / g.el, i % g.el) = 0;
  __threadfence_system();  // the resets before any credit: writers reuse b only after it
  __syncthreads();
  for (int w = threadIdx.x; w < g.R; w += blockDim.x)
    Tr::signal(transport::Set(Credit(g, g.op, b, g.rank), n, PrevEpoch(n)), w,
               llwire::kControlQp);
}

// The grid of `Kernel` for `warps` warps of work (GridBlocks, low_latency_host.cu).
template <auto Kernel>
int Grid(const G& g, int64_t warps) {
  static int cache = 0;  // the kernel's occupancy (one instantiation per kernel)
  return GridBlocks(reinterpret_cast<const void*>(Kernel), &cache, warps, g.R);
}

}  // namespace

// ---- launchers (kernels/internode/api.cuh) ---------------------------------------------

std::string LaunchDispatchSend(cudaStream_t stream, const G& g, const void* x,
                               const int32_t* topk_idx, int32_t* token) {
  JEP_LAUNCH(Begin, 1, kThreads, 0, stream)(g, token);
  const int64_t plan_warps = std::max<int64_t>(g.E, static_cast<int64_t>(g.S) * g.K / 32);
  JEP_LAUNCH(DispatchPlan, Grid<DispatchPlan>(g, plan_warps), kThreads, 0, stream)(g, topk_idx);
  JEP_LAUNCH(DispatchSendKernel, Grid<DispatchSendKernel>(g, g.S), kThreads, 0, stream)(
      g, static_cast<const char*>(x), topk_idx, token);
  return CudaErr(cudaGetLastError(), "dispatch send launch");
}

std::string LaunchDispatchRecv(cudaStream_t stream, const G& g, const int32_t* token,
                               const DispatchRecvOut& out) {
  JEP_LAUNCH(RecvWait, 1, kThreads, 0, stream)(g, token);
  JEP_LAUNCH(DispatchUnpack, Grid<DispatchUnpack>(g, static_cast<int64_t>(g.el) * g.R * g.M),
             kThreads, 0, stream)(g, token, out);
  JEP_LAUNCH(RecvFinish, 1, kThreads, 0, stream)(g, token);
  return CudaErr(cudaGetLastError(), "dispatch receive launch");
}

std::string LaunchCombineSend(cudaStream_t stream, const G& g, const void* y,
                              const int32_t* first_row, const int32_t* row_count, int32_t* token) {
  JEP_LAUNCH(Begin, 1, kThreads, 0, stream)(g, token);
  JEP_LAUNCH(CombinePlan, Grid<CombinePlan>(g, (static_cast<int64_t>(g.E) + 31) / 32), kThreads, 0,
             stream)(g, first_row, row_count);
  JEP_LAUNCH(CombineSendKernel,
             Grid<CombineSendKernel>(g, static_cast<int64_t>(g.el) * g.R * g.M), kThreads, 0,
             stream)(g, static_cast<const char*>(y), first_row, row_count, token);
  return CudaErr(cudaGetLastError(), "combine send launch");
}

std::string LaunchCombineRecv(cudaStream_t stream, const G& g, const int32_t* token,
                              const int32_t* topk_idx, const float* topk_weights, void* out) {
  JEP_LAUNCH(CombineRecvPlan, Grid<CombineRecvPlan>(g, g.E), kThreads, 0, stream)(g, topk_idx);
  JEP_LAUNCH(RecvWait, 1, kThreads, 0, stream)(g, token);
  if (g.S > 0)
    JEP_LAUNCH(CombineReduce, Grid<CombineReduce>(g, CombineItems(g, out)), kThreads, 0, stream)(
        g, topk_idx, topk_weights, token, static_cast<char*>(out));
  JEP_LAUNCH(RecvFinish, 1, kThreads, 0, stream)(g, token);
  return CudaErr(cudaGetLastError(), "combine receive launch");
}

}  // namespace JEP_TR_NS
}  // namespace ll_internode
}  // namespace jax_ep
