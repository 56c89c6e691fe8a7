// Internode low-latency kernels: direct per-expert puts over the transport interface
// (kernels/internode/transport.cuh, NVSHMEM backend). Protocol and slot-reuse scheme in
// low_latency_kernels.h; word-level rules in low_latency_wire.h; replayed on the host by
// tests/sim/low_latency_sim.py.
#include "kernels/internode/low_latency_kernels.h"

#include <cstring>
#include <string>

#include "kernels/common/low_latency_math.h"
#include "kernels/common/striping_plan.h"
#include "kernels/internode/device_copy.cuh"
#include "kernels/internode/hierarchical_kernels.h"
#include "kernels/internode/internode_kernels.h"
#include "kernels/internode/low_latency_wire.h"
#include "kernels/internode/transport_nvshmem.cuh"
#include "kernels/internode/wire_protocol.h"

namespace jax_ep {
namespace ll_internode {
namespace {

using Tr = transport::Nvshmem;
using transport::SignalOp;
using llwire::Area;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kD = llwire::kOpDispatch;
constexpr int kC = llwire::kOpCombine;

// Epochs started per op on this PE (send halves); the receive half reads its epoch from
// the send half's token.
JEP_DEVICE_GLOBAL unsigned long long g_ll_epoch[llwire::kNumOps];

struct State {
  Limits lim;
  char* area = nullptr;
  Area A{};
};
// One per process on a GPU; one per virtual GPU on the emulated GPU (see internode::Rt).
#if defined(JAX_EP_EMU)
State g_ll_of[64];
State& Ll() { return g_ll_of[emu::current_device() & 63]; }
#else
State g_ll;
State& Ll() { return g_ll; }
#endif

struct G {
  int R, rank, E, el, M, S, K, P, Q, nq;
  int64_t H, row_bytes, rpd, ds_put, meta_off, cs_put;
  int64_t timeout_ns;
  int op;
  int32_t cfg[llwire::kNumCfgFields];
  uint32_t hash;
  wire::ErrorRecord* err;
  char* area;
  Area A;
  FloatKind elem;
};

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

__device__ __forceinline__ uint64_t* Dsig(const G& g, int op, int b, int w, int q) {
  return reinterpret_cast<uint64_t*>(g.area + g.A.dsig) + llwire::dsig_index(op, b, w, q, g.R);
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
__device__ __forceinline__ llwire::Header* Hstage(const G& g, int op, int reader) {
  return reinterpret_cast<llwire::Header*>(g.area + llwire::hstage_at(g.A, op, reader));
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

using devcopy::CopyBytes;
using devcopy::NanBytes;
using devcopy::ZeroBytes;

// Notes this rank's first bad input (bad[0] = 1, then three values).
__device__ __forceinline__ void NoteBad(const G& g, int32_t a, int32_t b, int32_t c) {
  int32_t* bad = Local(g, g.A.bad);
  if (atomicCAS(bad, 0, 1) == 0) {
    bad[1] = a;
    bad[2] = b;
    bad[3] = c;
  }
}

// Bad routing or handle found by the send half: recorded here, reported to every reader
// through the header's error flag.
__device__ void RecordOwnBad(const G& g) {
  const int32_t* bad = Local(g, g.A.bad);
  if (bad[0] == 0) return;
  Record(g, wire::kErrBadId, bad[1], g.op == kD ? 0 : llwire::kKindRows, bad[2],
         static_cast<uint64_t>(g.E), static_cast<uint64_t>(static_cast<int64_t>(bad[3])));
}

// Called by every thread of one block, after pos[] was set to -1: each slot's row among
// this rank's slots naming the same expert (-1 past M: the reference drops those rows),
// the capped rows per expert, and where each expert's rows start in its owner's stream.
// The dispatch plan and the combine receive plan number the rows the same way.
__device__ void PlanRows(const G& g, const int32_t* idx, int slots, int32_t* pos,
                         int32_t* counts, int32_t* offsets) {
  for (int e = threadIdx.x; e < g.E; e += blockDim.x) {
    int c = 0;
    for (int i = 0; i < slots; ++i) {
      if (idx[i] != e) continue;
      pos[i] = c < g.M ? c : -1;
      ++c;
    }
    counts[e] = c < g.M ? c : g.M;
  }
  __syncthreads();
  for (int e = threadIdx.x; e < g.E; e += blockDim.x) {
    const int r = e / g.el;
    int off = 0;
    for (int f = r * g.el; f < e; ++f) off += counts[f];
    offsets[e] = off;
  }
}

// ---- send halves ------------------------------------------------------------------

// One block: the epoch, positions and counts of this rank's routing, the headers.
__global__ void DispatchPlan(G g, const int32_t* idx, int32_t* token) {
  __shared__ unsigned long long n;
  int32_t* bad = Local(g, g.A.bad);
  int32_t* pos = Local(g, g.A.pos);
  int32_t* counts = Local(g, g.A.counts);
  int32_t* offsets = Local(g, g.A.offsets);
  if (threadIdx.x == 0) {
    n = ++g_ll_epoch[kD];
    token[0] = static_cast<int32_t>(n);
    token[1] = static_cast<int32_t>(g.hash);
    bad[0] = 0;
  }
  __syncthreads();
  const int slots = g.S * g.K;
  for (int i = threadIdx.x; i < slots; i += blockDim.x) {
    const int32_t e = idx[i];
    const int t = i / g.K, k = i % g.K;
    pos[i] = -1;
    if (e < -1 || e >= g.E) {
      NoteBad(g, t, k, e);
      continue;
    }
    for (int j = 0; j < k && e >= 0; ++j)
      if (idx[t * g.K + j] == e) NoteBad(g, t, k, e);  // repeated id in one token
  }
  __syncthreads();
  PlanRows(g, idx, slots, pos, counts, offsets);
  for (int r = threadIdx.x; r < g.R; r += blockDim.x) {
    llwire::Header* h = Hstage(g, kD, r);
    int rows = 0;
    for (int e = 0; e < g.el; ++e) {
      HdrCounts(h)[e] = counts[r * g.el + e];
      rows += counts[r * g.el + e];
    }
    h->seq = n;
    h->hash = g.hash;
    h->error = bad[0];
    h->rows = rows;
    h->pad[0] = h->pad[1] = h->pad[2] = 0;
  }
}

// Block t: staged token t (row bytes, then its index) into the symmetric stage.
__global__ void DispatchPack(G g, const char* x) {
  const int t = blockIdx.x;
  char* dst = g.area + g.A.dstage + static_cast<int64_t>(t) * g.A.ds;
  CopyBytes(dst, x + static_cast<int64_t>(t) * g.row_bytes, g.row_bytes, threadIdx.x, blockDim.x);
  if (threadIdx.x == 0) *reinterpret_cast<int32_t*>(dst + g.meta_off) = t;
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

// CTA kControlQp also puts the headers (one per reader, SET n on the control QP).
__device__ void PutHeaders(const G& g, int op, int b, unsigned long long n) {
  if (static_cast<int>(blockIdx.x) != llwire::kControlQp) return;
  const int warp = threadIdx.x >> 5;
  for (int i = warp; i < g.R; i += kWarps) {
    const int r = (g.rank + i) % g.R;
    Tr::put_signal_warp(Hdr(g, op, b, g.rank), Hstage(g, op, r), static_cast<size_t>(g.A.hs),
                        Hsig(g, op, b, g.rank), n, SignalOp::kSet, r, llwire::kControlQp);
  }
}

// CTA q: credits, headers (CTA 0), then every (token, slot) row the plan puts on QP q,
// straight into its owner's slot.
__global__ void DispatchSendKernel(G g, const int32_t* idx, const int32_t* token) {
  const unsigned long long n = TokenEpoch(kD, token);
  const int b = static_cast<int>(n & 1ull);
  if (!WaitCredits(g, kD, b, n)) return;
  PutHeaders(g, kD, b, n);
  const int q = blockIdx.x;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int32_t* pos = Local(g, g.A.pos);
  const int32_t* offsets = Local(g, g.A.offsets);
  const bool bad = Local(g, g.A.bad)[0] != 0;  // the header told every owner; no rows
  for (int i = warp; !bad && i < g.S * g.K; i += kWarps) {
    const int32_t e = idx[i];
    const int p = pos[i];
    if (e < 0 || p < 0) continue;
    const int r = e / g.el;
    const int64_t j = offsets[e] + p;
    if (llwire::row_qp(r, j, g.P, g.Q) != q) continue;
    char* dst = g.area + llwire::drecv_row(g.A, b, e % g.el, g.rank, p);
    const char* src = g.area + g.A.dstage + static_cast<int64_t>(i / g.K) * g.A.ds;
    Tr::put_signal_warp(dst, src, static_cast<size_t>(g.ds_put), Dsig(g, kD, b, g.rank, q), 1,
                        SignalOp::kAdd, r, q);
  }
  __syncwarp();
  if (lane == 0) Tr::quiet();
  if (blockIdx.x == 0 && threadIdx.x == 0) RecordOwnBad(g);
}

// One block: combine's epoch; each source's row count and headers; where each (expert,
// source)'s rows start in the stream to that source. A handle with counts outside the
// blocks is a bad handle, reported like bad ids.
__global__ void CombinePlan(G g, const int32_t* first_row, const int32_t* row_count,
                            int32_t* token) {
  __shared__ unsigned long long n;
  int32_t* bad = Local(g, g.A.bad);
  int32_t* offsets = Local(g, g.A.offsets);  // [E_local][R]
  if (threadIdx.x == 0) {
    n = ++g_ll_epoch[kC];
    token[0] = static_cast<int32_t>(n);
    token[1] = static_cast<int32_t>(g.hash);
    bad[0] = 0;
  }
  __syncthreads();
  const int64_t RM = static_cast<int64_t>(g.R) * g.M;
  for (int i = threadIdx.x; i < g.el * g.R; i += blockDim.x) {
    const int32_t f = first_row[i], c = row_count[i];
    if (f < 0 || c < 0 || c > g.M || static_cast<int64_t>(f) + c > RM)  // no int32 wrap
      NoteBad(g, i / g.R, i % g.R, c);
  }
  __syncthreads();
  for (int d = threadIdx.x; d < g.R; d += blockDim.x) {
    llwire::Header* h = Hstage(g, kC, d);
    int rows = 0;
    for (int e = 0; e < g.el; ++e) {
      const int32_t c = bad[0] ? 0 : row_count[e * g.R + d];
      offsets[e * g.R + d] = rows;
      HdrCounts(h)[e] = c;
      rows += c;
    }
    if (rows > g.rpd) NoteBad(g, -1, d, rows);
    h->seq = n;
    h->hash = g.hash;
    h->rows = rows;
    h->pad[0] = h->pad[1] = h->pad[2] = 0;
  }
  __syncthreads();
  for (int d = threadIdx.x; d < g.R; d += blockDim.x) Hstage(g, kC, d)->error = bad[0];
}

// A warp per stage row (e, d, r), r < M: row first_row[e, d] + r of y's block e, if
// r < row_count[e, d], into the stage of source d at its stream index (experts in order,
// then r). Every stage row of the stream is written exactly once whatever the handle's
// ranges, as the CPU kernel copies them (LowLatencyCombineStageCpu).
__global__ void CombinePack(G g, const char* y, const int32_t* first_row,
                            const int32_t* row_count) {
  if (Local(g, g.A.bad)[0] != 0) return;
  const int64_t RM = static_cast<int64_t>(g.R) * g.M;
  const int32_t* offsets = Local(g, g.A.offsets);
  const int lane = threadIdx.x & 31;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarps;
  for (int64_t w = blockIdx.x * kWarps + (threadIdx.x >> 5); w < g.el * RM; w += warps) {
    const int e = static_cast<int>(w / RM);
    const int d = static_cast<int>((w % RM) / g.M);
    const int r = static_cast<int>(w % g.M);
    if (r >= row_count[e * g.R + d]) continue;
    const int64_t i = static_cast<int64_t>(first_row[e * g.R + d]) + r;
    const int64_t j = offsets[e * g.R + d] + r;
    CopyBytes(g.area + g.A.cstage + (static_cast<int64_t>(d) * g.A.rpd + j) * g.A.cs,
              y + (static_cast<int64_t>(e) * RM + i) * g.row_bytes, g.row_bytes, lane, 32);
  }
}

// CTA q: credits, headers (CTA 0), then row j of the stream to each source on QP
// row_qp(source, j), into crecv[b][this owner][j] there.
__global__ void CombineSendKernel(G g, const int32_t* token) {
  const unsigned long long n = TokenEpoch(kC, token);
  const int b = static_cast<int>(n & 1ull);
  if (!WaitCredits(g, kC, b, n)) return;
  PutHeaders(g, kC, b, n);
  const int q = blockIdx.x;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const bool bad = Local(g, g.A.bad)[0] != 0;
  for (int i = 1; !bad && i <= g.R; ++i) {
    const int d = (g.rank + i) % g.R;
    const int rows = Hstage(g, kC, d)->rows;
    for (int j = warp; j < rows; j += kWarps) {
      if (llwire::row_qp(d, j, g.P, g.Q) != q) continue;
      Tr::put_signal_warp(g.area + llwire::crecv_row(g.A, b, g.rank, j),
                          g.area + g.A.cstage + (static_cast<int64_t>(d) * g.A.rpd + j) * g.A.cs,
                          static_cast<size_t>(g.cs_put), Dsig(g, kC, b, g.rank, q), 1,
                          SignalOp::kAdd, d, q);
    }
  }
  __syncwarp();
  if (lane == 0) Tr::quiet();
  if (blockIdx.x == 0 && threadIdx.x == 0) RecordOwnBad(g);
}

// ---- receive halves -----------------------------------------------------------------

// Combine's reader: positions of its own routing (as its dispatch numbered them), rows
// per (owner expert), and where each expert's rows start in its owner's stream.
__global__ void CombineRecvPlan(G g, const int32_t* idx) {
  int32_t* pos = Local(g, g.A.pos);
  int32_t* counts = Local(g, g.A.counts);
  int32_t* offsets = Local(g, g.A.offsets);
  const int slots = g.S * g.K;
  for (int i = threadIdx.x; i < slots; i += blockDim.x) pos[i] = -1;
  __syncthreads();
  PlanRows(g, idx, slots, pos, counts, offsets);
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
// epoch computed, which its token carries; no error), then every (writer, QP) data word
// holds the rows the header implies on that QP, and no more. Combine also checks the
// owner's row count against its own routing.
__global__ void RecvWait(G g, const int32_t* token) {
  const unsigned long long n = TokenEpoch(g.op, token);
  const uint32_t hash = static_cast<uint32_t>(token[1]);
  const int b = static_cast<int>(n & 1ull);
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
      const int32_t* counts = Local(g, g.A.counts);
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
  for (int i = threadIdx.x; i < g.R * g.nq; i += blockDim.x) {
    const int w = i / g.nq, q = i % g.nq;
    const uint64_t want =
        static_cast<uint64_t>(llwire::rows_on_qp(Hdr(g, g.op, b, w)->rows, g.rank, q, g.P, g.Q));
    uint64_t* word = Dsig(g, g.op, b, w, q);
    if (!WaitWord(g, word, want, w, llwire::kKindData, q)) continue;
    const uint64_t v = Tr::fetch(word);
    if (v != want) Record(g, wire::kErrExtraSignal, w, llwire::kKindData, q, want, v);
  }
}

// A warp per output row (e, i) of recv_x[E_local, R*M, H]; block 0 also writes the
// counts. A failed call is never silently empty: every row NaN (bytes 0xff), every count
// and first row -1, sources -1.
__global__ void DispatchUnpack(G g, const int32_t* token, DispatchRecvOut out) {
  const int b = static_cast<int>(TokenEpoch(kD, token) & 1ull);
  const bool failed = Failed(g);
  const int64_t RM = static_cast<int64_t>(g.R) * g.M;
  if (blockIdx.x == 0) {
    for (int e = threadIdx.x; e < g.el; e += blockDim.x) {
      int32_t total = 0;
      for (int s = 0; s < g.R; ++s) {
        const int32_t c = failed ? 0 : devcopy::LoadLanded(HdrCounts(Hdr(g, kD, b, s)) + e);
        out.first_row[e * g.R + s] = failed ? -1 : total;
        out.row_count[e * g.R + s] = failed ? -1 : c;
        total += c;
      }
      out.recv_count[e] = failed ? -1 : total;
    }
  }
  const int lane = threadIdx.x & 31;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarps;
  for (int64_t w = blockIdx.x * kWarps + (threadIdx.x >> 5); w < g.el * RM; w += warps) {
    const int e = static_cast<int>(w / RM);
    const int64_t i = w % RM;
    int s = 0;
    int64_t first = 0;
    for (; !failed && s < g.R; ++s) {
      const int32_t c = devcopy::LoadLanded(HdrCounts(Hdr(g, kD, b, s)) + e);
      if (i < first + c) break;
      first += c;
    }
    char* dst = static_cast<char*>(out.recv_x) + w * g.row_bytes;
    if (failed || s == g.R) {
      if (failed)
        NanBytes(dst, g.row_bytes, lane, 32);
      else
        ZeroBytes(dst, g.row_bytes, lane, 32);
      if (lane == 0) out.src_rank[w] = out.src_index[w] = -1;
      continue;
    }
    const char* row = g.area + llwire::drecv_row(g.A, b, e, s, i - first);
    devcopy::CopyLanded(dst, row, g.row_bytes, lane, 32);
    if (lane == 0) {
      out.src_rank[w] = s;
      out.src_index[w] = devcopy::LoadLanded(reinterpret_cast<const int32_t*>(row + g.meta_off));
    }
  }
}

// A warp per token: lanes over the hidden dim, k ascending per element, the product
// rounded to float32 before the add (low_latency_math.h), then one cast.
__global__ void CombineReduce(G g, const int32_t* idx, const float* w, const int32_t* token,
                              char* out) {
  const int b = static_cast<int>(TokenEpoch(kC, token) & 1ull);
  const bool failed = Failed(g);
  const int32_t* pos = Local(g, g.A.pos);
  const int32_t* offsets = Local(g, g.A.offsets);
  const int lane = threadIdx.x & 31;
  const int warps = gridDim.x * kWarps;
  for (int t = blockIdx.x * kWarps + (threadIdx.x >> 5); t < g.S; t += warps) {
    char* dst = out + static_cast<int64_t>(t) * g.row_bytes;
    for (int64_t x = lane; x < g.H; x += 32) {
      float acc = 0.0f;
      for (int k = 0; k < g.K && !failed; ++k) {
        const int i = t * g.K + k;
        const int32_t e = idx[i];
        const int p = pos[i];
        if (e < 0 || p < 0) continue;
        const char* row = g.area + llwire::crecv_row(g.A, b, e / g.el, offsets[e] + p);
        acc = ll_weighted_add(acc, w[i], ll_load(g.elem, row, x));
      }
      // a failed call's sums are NaN, never plausible zeros
      ll_store(g.elem, dst, x, failed ? __int_as_float(0x7fc00000) : acc);
    }
  }
}

// One block, after the outputs are written: reset buffer b's data words, then return the
// credit (SET epoch) to every writer. A failed rank stays silent.
__global__ void RecvFinish(G g, const int32_t* token) {
  const unsigned long long n = TokenEpoch(g.op, token);
  const int b = static_cast<int>(n & 1ull);
  __shared__ int skip;
  if (threadIdx.x == 0) skip = Failed(g) ? 1 : 0;
  __syncthreads();
  if (skip) return;
  for (int i = threadIdx.x; i < g.R * llwire::kMaxQps; i += blockDim.x)
    *Dsig(g, g.op, b, i / llwire::kMaxQps, i % llwire::kMaxQps) = 0;
  __threadfence_system();  // the resets before any credit: writers reuse b only after it
  __syncthreads();
  for (int w = threadIdx.x; w < g.R; w += blockDim.x)
    Tr::signal(Credit(g, g.op, b, g.rank), n, SignalOp::kSet, w, llwire::kControlQp);
  __syncthreads();
  // nvshmem_quiet covers every QP to every PE: one thread is enough
  if (threadIdx.x == 0) Tr::quiet();
}

std::string CudaErr(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return {};
  return std::string("jax_ep internode low-latency: ") + what + ": " + cudaGetErrorString(e);
}

int BlocksFor(int64_t warps_of_work) {
  const int64_t b = (warps_of_work + kWarps - 1) / kWarps;
  return static_cast<int>(b < 1 ? 1 : (b > 1024 ? 1024 : b));
}

std::string MakeG(const CallDims& d, int op, G* g) {
  internode::SharedRuntime rt;
  std::string e = internode::SharedState(&rt);
  if (!e.empty()) return e;
  if (!Ll().lim.initialized)
    return "jax_ep internode low-latency: the low-latency area is not allocated; pass "
           "low_latency=dict(max_tokens_per_rank=..., hidden=..., topk=..., num_experts=...) "
           "to jax_ep.nvshmem_bootstrap.initialize";
  const Limits& l = Ll().lim;
  const int64_t row_bytes = d.H * d.elem_bytes;
  if (d.R != rt.world || d.rank != rt.rank)
    return "jax_ep internode low-latency: the EP group must be all " + std::to_string(rt.world) +
           " NVSHMEM PEs; got " + std::to_string(d.R) + " ranks";
  if (d.R != l.R || d.E != l.E || d.M > l.M || row_bytes > l.row_bytes ||
      static_cast<int64_t>(d.S) * d.K > static_cast<int64_t>(l.M) * l.K ||
      d.S > static_cast<int64_t>(l.M) * l.K || d.rows_per_dest > Ll().A.rpd)
    return "jax_ep internode low-latency: the call (R=" + std::to_string(d.R) + ", E=" +
           std::to_string(d.E) + ", M=" + std::to_string(d.M) + ", row bytes " +
           std::to_string(row_bytes) + ", staged slots " +
           std::to_string(static_cast<int64_t>(d.S) * d.K) + ", rows per source " +
           std::to_string(d.rows_per_dest) + ") does not fit the area started for (R=" +
           std::to_string(l.R) + ", E=" + std::to_string(l.E) + ", M=" + std::to_string(l.M) +
           ", row bytes " + std::to_string(l.row_bytes) + ", K=" + std::to_string(l.K) +
           "); start it with the largest limits the program uses";
  const int nq = d.num_ports * d.qps_per_port;
  if (nq != rt.num_qps)
    return "jax_ep internode low-latency: the call asks for " + std::to_string(nq) +
           " QPs per peer but NVSHMEM was started with " + std::to_string(rt.num_qps);
  g->R = d.R;
  g->rank = d.rank;
  g->E = d.E;
  g->el = d.E / d.R;
  g->M = d.M;
  g->S = d.S;
  g->K = d.K;
  g->P = d.num_ports;
  g->Q = d.qps_per_port;
  g->nq = nq;
  g->H = d.H;
  g->row_bytes = row_bytes;
  g->rpd = d.rows_per_dest;
  g->ds_put = llwire::dispatch_stride(row_bytes);
  g->meta_off = llwire::dispatch_meta_offset(row_bytes);
  g->cs_put = llwire::combine_stride(row_bytes);
  g->timeout_ns = d.timeout_ns > 0 ? d.timeout_ns : 300ll * 1000000000ll;
  g->op = op;
  int32_t* c = g->cfg;
  c[llwire::kCfgOp] = op;
  c[llwire::kCfgRanks] = d.R;
  c[llwire::kCfgExperts] = d.E;
  c[llwire::kCfgMaxTokens] = d.M;
  c[llwire::kCfgStageRows] = op == kD ? d.S : 0;
  c[llwire::kCfgTopk] = op == kD ? d.K : 0;
  c[llwire::kCfgHidden] = static_cast<int32_t>(d.H);
  c[llwire::kCfgDtype] = d.dtype_code;
  c[llwire::kCfgRowsPerDest] = static_cast<int32_t>(d.rows_per_dest);
  c[llwire::kCfgNumQps] = nq;
  c[llwire::kCfgCallSite] = static_cast<int32_t>(d.call_site);
  g->hash = llwire::config_hash(c);
  g->err = static_cast<wire::ErrorRecord*>(rt.err);
  g->area = Ll().area;
  g->A = Ll().A;
  g->elem = d.elem;
  return {};
}

}  // namespace

std::string Init(int num_ranks, int max_tokens, int64_t row_bytes, int topk, int num_experts) {
  internode::SharedRuntime rt;
  std::string e = internode::SharedState(&rt);
  if (!e.empty()) return e;
  if (Ll().lim.initialized) return "jax_ep internode low-latency: the area is already allocated";
  if (num_ranks != rt.world)
    return "jax_ep internode low-latency: num_ranks must be the NVSHMEM world (" +
           std::to_string(rt.world) + ")";
  if (max_tokens < 1 || row_bytes < 1 || topk < 1 || num_experts < 1 ||
      num_experts % num_ranks != 0)
    return "jax_ep internode low-latency: bad limits (max_tokens, row bytes, topk >= 1; "
           "num_experts a positive multiple of the ranks)";
  const Area A = llwire::area_layout(num_ranks, max_tokens, row_bytes, topk, num_experts);
  char* p = static_cast<char*>(nvshmem_malloc(static_cast<size_t>(A.total)));
  if (p == nullptr)
    return "jax_ep internode low-latency: nvshmem_malloc of " + std::to_string(A.total) +
           " bytes failed (NVSHMEM_SYMMETRIC_SIZE too small?)";
  e = CudaErr(cudaMemset(p, 0, static_cast<size_t>(A.total)), "clear area");
  const unsigned long long zero[llwire::kNumOps] = {0, 0};
  if (e.empty())
    e = CudaErr(cudaMemcpyToSymbol(g_ll_epoch, zero, sizeof(zero)), "epochs");
  if (e.empty()) e = CudaErr(cudaDeviceSynchronize(), "area");
  if (!e.empty()) return e;
  nvshmem_barrier_all();
  Ll().area = p;
  Ll().A = A;
  Ll().lim.initialized = true;
  Ll().lim.R = num_ranks;
  Ll().lim.M = max_tokens;
  Ll().lim.K = topk;
  Ll().lim.E = num_experts;
  Ll().lim.row_bytes = row_bytes;
  Ll().lim.area_bytes = A.total;
  return {};
}

Limits GetLimits() { return Ll().lim; }

std::string Finalize() {
  if (!Ll().lim.initialized) return {};
  const std::string e = CudaErr(cudaDeviceSynchronize(), "finalize");
  nvshmem_free(Ll().area);
  Ll() = State{};
  return e;
}

std::string DispatchSend(cudaStream_t stream, const CallDims& d, const void* x,
                         const int32_t* topk_idx, int32_t* token) {
  G g;
  std::string e = MakeG(d, kD, &g);
  if (!e.empty()) return e;
  JEP_LAUNCH(DispatchPlan, 1, kThreads, 0, stream)(g, topk_idx, token);
  if (g.S > 0) JEP_LAUNCH(DispatchPack, g.S, 128, 0, stream)(g, static_cast<const char*>(x));
  JEP_LAUNCH(DispatchSendKernel, g.nq, kThreads, 0, stream)(g, topk_idx, token);
  return CudaErr(cudaGetLastError(), "dispatch send launch");
}

std::string DispatchRecv(cudaStream_t stream, const CallDims& d, const int32_t* token,
                         const DispatchRecvOut& out) {
  G g;
  std::string e = MakeG(d, kD, &g);
  if (!e.empty()) return e;
  JEP_LAUNCH(RecvWait, 1, kThreads, 0, stream)(g, token);
  JEP_LAUNCH(DispatchUnpack, BlocksFor(static_cast<int64_t>(g.el) * g.R * g.M), kThreads, 0, stream)(
      g, token, out);
  JEP_LAUNCH(RecvFinish, 1, kThreads, 0, stream)(g, token);
  return CudaErr(cudaGetLastError(), "dispatch receive launch");
}

std::string CombineSend(cudaStream_t stream, const CallDims& d, const void* y,
                        const int32_t* first_row, const int32_t* row_count, int32_t* token) {
  G g;
  std::string e = MakeG(d, kC, &g);
  if (!e.empty()) return e;
  JEP_LAUNCH(CombinePlan, 1, kThreads, 0, stream)(g, first_row, row_count, token);
  JEP_LAUNCH(CombinePack, BlocksFor(static_cast<int64_t>(g.el) * g.R * g.M), kThreads, 0, stream)(
      g, static_cast<const char*>(y), first_row, row_count);
  JEP_LAUNCH(CombineSendKernel, g.nq, kThreads, 0, stream)(g, token);
  return CudaErr(cudaGetLastError(), "combine send launch");
}

std::string CombineRecv(cudaStream_t stream, const CallDims& d, const int32_t* token,
                        const int32_t* topk_idx, const float* topk_weights, void* out) {
  G g;
  std::string e = MakeG(d, kC, &g);
  if (!e.empty()) return e;
  JEP_LAUNCH(CombineRecvPlan, 1, kThreads, 0, stream)(g, topk_idx);
  JEP_LAUNCH(RecvWait, 1, kThreads, 0, stream)(g, token);
  if (g.S > 0)
    JEP_LAUNCH(CombineReduce, BlocksFor(g.S), kThreads, 0, stream)(g, topk_idx, topk_weights, token,
                                                          static_cast<char*>(out));
  JEP_LAUNCH(RecvFinish, 1, kThreads, 0, stream)(g, token);
  return CudaErr(cudaGetLastError(), "combine receive launch");
}

std::string PendingError() {
  internode::SharedRuntime rt;
  if (!internode::SharedState(&rt).empty() || rt.err == nullptr) return {};
  const volatile wire::ErrorRecord* r = static_cast<const wire::ErrorRecord*>(rt.err);
  const int code = r->code;
  const int op = r->op - llwire::kErrOpBase;
  if (code == wire::kErrNone || code < 0 || op < 0 || op >= llwire::kNumOps)
    return hier::PendingError();  // another mode's error: its own wording
  const int peer = r->peer, kind = r->kind, qp = r->qp, rank = r->rank;
  const unsigned long long expected = r->expected, seen = r->seen;
  const std::string name = op == kD ? "dispatch" : "combine";
  std::string m = "jax_ep internode low-latency " + name + ": ";
  switch (code) {
    case wire::kErrTimeout:
      m += "timed out (JAX_EP_TIMEOUT_S) waiting for rank " + std::to_string(peer) + ": " +
           (kind == llwire::kKindHeader  ? std::string("its header")
            : kind == llwire::kKindData  ? "its rows on QP " + std::to_string(qp)
                                         : std::string("its credit (it has not finished the "
                                                       "call two epochs back)")) +
           ", word holds " + std::to_string(seen) + " of " + std::to_string(expected) +
           "; that rank skipped the call, failed earlier, is slower than the timeout, or "
           "more than two calls of this op are in flight";
      break;
    case wire::kErrMismatch:
      if (kind == llwire::kKindRows)
        m += "rank " + std::to_string(peer) + " returns " + std::to_string(seen) +
             " rows of its local expert " + std::to_string(qp) + " but this rank's routing "
             "expects " + std::to_string(expected) + "; pass the dispatch's topk_idx and handle";
      else if (kind == llwire::kKindCounts)
        m += "rank " + std::to_string(peer) + " sent a header whose counts (" +
             std::to_string(seen) + " rows) do not fit the blocks";
      else
        m += "rank " + std::to_string(peer) + " is in another call: this rank epoch " +
             std::to_string(static_cast<unsigned long long>(r->my_seq)) + " config hash " +
             std::to_string(expected) + ", rank " + std::to_string(peer) + " epoch " +
             std::to_string(static_cast<unsigned long long>(r->peer_seq)) + " config hash " +
             std::to_string(seen) +
             "; every rank must make the same low-latency calls with the same shapes";
      break;
    case wire::kErrPeerFailed:
      m += "rank " + std::to_string(peer) +
           " reported an error in this call (bad or repeated ids, or a bad handle there)";
      break;
    case wire::kErrBadId:
      if (op == kD)
        m += "topk_idx[" + std::to_string(peer) + ", " + std::to_string(qp) + "] = " +
             std::to_string(static_cast<long long>(seen)) + " is outside [-1, " +
             std::to_string(expected) + ") or repeats an expert of that token";
      else
        m += "the handle's row counts do not fit the blocks (local expert " +
             std::to_string(peer) + ", source " + std::to_string(qp) + ")";
      break;
    case wire::kErrExtraSignal:
      m += "rank " + std::to_string(peer) + " sent " + std::to_string(seen) + " rows on QP " +
           std::to_string(qp) + ", expected " + std::to_string(expected);
      break;
    default:
      m += "error code " + std::to_string(code);
  }
  return m + " [rank " + std::to_string(rank) +
         "]. The internode transport stays failed for the life of this process; restart the "
         "job.";
}

}  // namespace ll_internode
}  // namespace jax_ep
