// Internode dispatch, combine and gather: direct RDMA from every rank to every rank over
// the transport interface (kernels/internode/transport.cuh), NVSHMEM backend. The wire
// protocol (signal words, header, expected counts, error record) is
// kernels/internode/wire_protocol.h; docs/internode.md explains it and
// tests/sim/internode_sim.py replays it on the host.
//
// One call uses one half of the symmetric heap, chosen by the parity of a per-PE call
// counter, so a peer already in the next call never writes into memory this PE still
// reads (kernels/internode/internode_layout.h).
//
// Dispatch:  slots   -- per destination d, number this rank's tokens for d in token order
//                       (and note bad expert ids, which the header reports to every peer)
//            pack    -- pack (x row, ids, weights, token index) into stage, grouped by d
//            header  -- exchange headers (seq, config, error) and count rows; a mismatch
//                       or a peer's error fails the call on every rank (no data phase)
//            prefix  -- row offsets from the count matrix
//            send    -- CTA q = logical QP q; chunk j of each peer's stream goes on the
//                       QP of kernels/common/striping_plan.h, data and signal on that QP,
//                       into word (kind, source, q); one closing signal per QP
//            wait    -- one block waits (bounded) for every (source, QP) word
//            unpack  -- write the outputs (zeros if the call failed)
//            finish  -- reset this call's signal words, advance the call counter
// Combine:   header, then the same wire pattern backwards (recv rows -> the sources'
//            back rows), wait, then each source sums a token's rows in ascending rank
//            order in float32. With T == 0 the header, send and wait still run.
// Gather:    combine's transpose: dispatch's wire pattern for rows of g, driven by the
//            handle (counts, send_slot) with no count exchange; out[i] = g_src[index].
//
// No host synchronisation: errors (bad ids, timeouts, mismatches) go to a sticky error
// record in mapped host memory that the handlers read before each call.
//
// This file holds the kernels and their launchers (declared in kernels/internode/api.cuh);
// the host side -- NVSHMEM start-up, the heap and QP handles, the checks of a call and
// the error text -- is kernels/internode/nvshmem_host.cu.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <string>

#include "kernels/common/combine_order.h"
#include "kernels/common/configs.h"
#include "kernels/common/dtype_convert.h"
#include "kernels/common/layout_math.h"
#include "kernels/common/striping_plan.h"
#include "kernels/internode/api.cuh"
#include "kernels/internode/device_copy.cuh"
#include "kernels/internode/internode_layout.h"
#include "kernels/internode/transport_select.cuh"
#include "kernels/internode/wire_protocol.h"

namespace jax_ep {
namespace internode {
namespace JEP_TR_NS {  // this build's transport (transport_select.cuh)
namespace {

using Transport = transport::JEP_TR_NS::TransportFor<transport::Conn::kFull>;
using transport::Sig;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

// Pointers into one half of the heap for one call's dims.
struct Half {
  uint64_t* sigs;        // [kinds][R][kMaxQps] signal words
  wire::Header* hdr;     // [R]
  int32_t* counts;       // [R][R]
  char* recv;            // [C] dispatch rows
  char* back;            // [T*min(K,R)] combine rows
  char* stage;           // [T*min(K,R)] dispatch rows
  char* cstage;          // [C] combine rows
};

__host__ __device__ inline Half HalfAt(char* half_base, const HeapLayout& L, int R) {
  Half h;
  h.sigs = reinterpret_cast<uint64_t*>(half_base + L.sigs);
  h.hdr = reinterpret_cast<wire::Header*>(half_base + L.hdr);
  h.counts = reinterpret_cast<int32_t*>(half_base + L.counts);
  h.recv = half_base + L.recv;
  h.back = half_base + L.back;
  h.stage = half_base + L.stage;
  h.cstage = half_base + L.cstage;
  return h;
}

__device__ __forceinline__ uint64_t* Word(const Half& h, const Geometry& g, int kind, int src,
                                          int qp) {
  return h.sigs + wire::sig_word(kind, g.R, src, qp);
}

__device__ __forceinline__ uint64_t NowNs() { return peer::global_timer_ns(); }

// Whether this process has a recorded error (this call or an earlier one).
__device__ __forceinline__ bool Failed(const Geometry& g) {
  return *reinterpret_cast<volatile const int32_t*>(&g.err->code) != wire::kErrNone;
}

// Records `r` unless an error is already recorded (the first one wins). The record is in
// mapped host memory: fields first, the code last, so the host never sees half a record.
__device__ void Record(const Geometry& g, wire::ErrorRecord r) {
  if (atomicCAS_system(&g.err->code, wire::kErrNone, -1) != wire::kErrNone) return;
  volatile wire::ErrorRecord* e = g.err;
  e->rank = g.rank;
  e->op = g.cfg[wire::kCfgOp];
  e->peer = r.peer;
  e->kind = r.kind;
  e->qp = r.qp;
  e->expected = r.expected;
  e->seen = r.seen;
  e->my_seq = r.my_seq;
  e->peer_seq = r.peer_seq;
  for (int i = 0; i < wire::kNumCfgFields; ++i) {
    e->mine[i] = r.mine[i];
    e->theirs[i] = r.theirs[i];
  }
  __threadfence_system();
  e->code = r.code;
  __threadfence_system();
}

// Polls word `w` until it reaches `expect`, for at most the timeout. On expiry records
// which peer and word it waited for. False if it expired or the call already failed.
template <class T>
__device__ bool WaitWord(const Geometry& g, uint64_t* w, uint64_t expect, int peer, int kind,
                         int qp) {
  const uint64_t start = NowNs();
  uint64_t v = T::fetch(w);
  for (int spin = 0; v < expect; ++spin) {
    if ((spin & 1023) == 0) {
      if (Failed(g)) return false;
      if (static_cast<int64_t>(NowNs() - start) > g.timeout_ns) {
        wire::ErrorRecord r{};
        r.code = wire::kErrTimeout;
        r.peer = peer;
        r.kind = kind;
        r.qp = qp;
        r.expected = expect;
        r.seen = v;
        Record(g, r);
        return false;
      }
    }
    v = T::fetch(w);
  }
  return true;
}

using devcopy::CopyBytes;
using devcopy::CopyLanded;
using devcopy::LoadLanded;
using devcopy::NanBytes;
using devcopy::ZeroBytes;

__device__ __forceinline__ int Parity() { return static_cast<int>(g_call_counter & 1ull); }

__device__ __forceinline__ Half CurrentHalf(char* heap, int64_t half_bytes,
                                            const HeapLayout& L, int R) {
  return HalfAt(heap + Parity() * half_bytes, L, R);
}

// ---- dispatch ----------------------------------------------------------------------

// Block d numbers, in token order, the tokens this rank sends rank d.
// Ids outside [-1, E) are noted in g.bad (first one kept); the header reports them.
__global__ void SlotsKernel(Geometry g, const int32_t* topk_idx, int32_t* send_slot,
                            char* heap, int64_t half_bytes, HeapLayout L) {
  const Half h = CurrentHalf(heap, half_bytes, L, g.R);
  __shared__ int warp_total[kWarps];
  __shared__ int running;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int d = blockIdx.x; d < g.R; d += gridDim.x) {  // block-uniform
    if (threadIdx.x == 0) running = 0;
    __syncthreads();
    for (int base = 0; base < g.T; base += kThreads) {
      const int t = base + threadIdx.x;
      bool hit = false;
      if (t < g.T) {
        const int32_t* row = topk_idx + static_cast<int64_t>(t) * g.K;
        hit = token_in_rank(row, g.K, g.el, d);
        if (d == 0) {
          for (int k = 0; k < g.K; ++k)
            if ((row[k] < -1 || row[k] >= g.E) && atomicCAS(g.bad, 0, 1) == 0) {
              g.bad[1] = t;
              g.bad[2] = k;
              g.bad[3] = row[k];
            }
        }
      }
      const unsigned mask = __ballot_sync(0xffffffffu, hit);
      if (lane == 0) warp_total[warp] = __popc(mask);
      __syncthreads();
      int off = running;
      for (int w = 0; w < warp; ++w) off += warp_total[w];
      if (t < g.T) {
        send_slot[static_cast<int64_t>(t) * g.R + d] =
            hit ? off + __popc(mask & ((1u << lane) - 1u)) : -1;
      }
      __syncthreads();
      if (threadIdx.x == 0) {
        int s = 0;
        for (int w = 0; w < kWarps; ++w) s += warp_total[w];
        running += s;
      }
      __syncthreads();
    }
    if (threadIdx.x == 0) h.counts[g.rank * g.R + d] = running;
    __syncthreads();  // `running` is read above before the next d resets it
  }
}

// Token t on block t mod the grid (cut to the mode's SMs): its row packed once per
// destination into stage.
__global__ void PackKernel(Geometry g, const char* x, const int32_t* topk_idx,
                           const float* topk_weights, const int32_t* send_slot, char* heap,
                           int64_t half_bytes, HeapLayout L) {
  const Half h = CurrentHalf(heap, half_bytes, L, g.R);
  __shared__ int64_t row_base[kMaxRanks];
  if (threadIdx.x == 0) {
    int64_t acc = 0;
    for (int d = 0; d < g.R; ++d) {
      row_base[d] = acc;
      acc += h.counts[g.rank * g.R + d];
    }
  }
  __syncthreads();
  for (int t = blockIdx.x; t < g.T; t += gridDim.x) {
    const char* xrow = x + static_cast<int64_t>(t) * g.xrow;
    for (int d = 0; d < g.R; ++d) {
      const int j = send_slot[static_cast<int64_t>(t) * g.R + d];
      if (j < 0) continue;
      char* dst = h.stage + (row_base[d] + j) * g.ds;
      CopyBytes(dst, xrow, g.xrow, threadIdx.x, blockDim.x);
      int32_t* meta = reinterpret_cast<int32_t*>(dst + g.xmeta);
      for (int k = threadIdx.x; k < g.K; k += blockDim.x) {
        meta[k] = topk_idx[static_cast<int64_t>(t) * g.K + k];
        reinterpret_cast<float*>(meta + g.K)[k] = topk_weights[static_cast<int64_t>(t) * g.K + k];
      }
      if (threadIdx.x == 0) meta[2 * g.K] = t;
    }
  }
}

// Header exchange (every op) and, for dispatch, the all-gather of the count rows: one
// warp per peer puts this rank's header (and count row) on the control QP, each with its
// own signal word; then thread s waits (bounded) for source s's words and checks its
// header. Any difference or reported error fails the call on every rank alike, since
// every rank sees every header.
template <class T>
__global__ void HeaderKernel(Geometry g, char* heap, int64_t half_bytes, HeapLayout L,
                             bool with_counts) {
  const Half h = CurrentHalf(heap, half_bytes, L, g.R);
  const int warp = threadIdx.x >> 5;
  __shared__ int skip;
  if (threadIdx.x == 0) {
    skip = Failed(g) ? 1 : 0;  // an earlier call failed: stay silent, peers time out
    wire::Header& mine = h.hdr[g.rank];
    mine.seq = g_call_counter;
    mine.hash = g.hash;
    mine.error = g.bad[0];
    for (int i = 0; i < wire::kNumCfgFields; ++i) mine.cfg[i] = g.cfg[i];
    for (int i = 0; i < 16 - 4 - wire::kNumCfgFields; ++i) mine.pad[i] = 0;
  }
  __syncthreads();
  if (skip) return;
  int32_t* row = h.counts + static_cast<int64_t>(g.rank) * g.R;
  for (int i = 1 + warp; i < g.R; i += kWarps) {
    const int peer = (g.rank + i) % g.R;
    // the words are reset at the end of every call (finish): a SET from 0
    T::put_signal_warp(h.hdr + g.rank, h.hdr + g.rank, wire::kHeaderBytes,
                       transport::Set(Word(h, g, wire::kSigHeader, g.rank, wire::kControlQp), 1,
                                      0),
                       peer, wire::kControlQp);
    if (with_counts)
      T::put_signal_warp(row, row, sizeof(int32_t) * g.R,
                         transport::Set(Word(h, g, wire::kSigCounts, g.rank, wire::kControlQp),
                                        1, 0),
                         peer, wire::kControlQp);
  }
  T::quiet_warp();
  if (threadIdx.x == 0 && g.bad[0] != 0) {
    wire::ErrorRecord r{};
    r.code = wire::kErrBadId;
    r.peer = g.bad[1];      // token
    r.qp = g.bad[2];        // slot
    r.seen = static_cast<uint64_t>(static_cast<int64_t>(g.bad[3]));
    r.expected = static_cast<uint64_t>(g.E);
    Record(g, r);
  }
  for (int s = threadIdx.x; s < g.R; s += blockDim.x) {
    if (s == g.rank) continue;
    if (!WaitWord<T>(g, Word(h, g, wire::kSigHeader, s, wire::kControlQp), 1, s,
                     wire::kSigHeader, wire::kControlQp))
      continue;
    // the header landed by a put: read it past L1, after the acquire of its signal
    alignas(16) wire::Header th;
    CopyLanded(reinterpret_cast<char*>(&th), reinterpret_cast<const char*>(h.hdr + s),
               wire::kHeaderBytes, 0, 1);
    const uint64_t my_seq = g_call_counter;
    if (th.seq != my_seq || th.hash != g.hash || th.error != 0) {
      wire::ErrorRecord r{};
      r.code = th.error != 0 && th.seq == my_seq && th.hash == g.hash ? wire::kErrPeerFailed
                                                                      : wire::kErrMismatch;
      r.peer = s;
      r.kind = wire::kSigHeader;
      r.my_seq = my_seq;
      r.peer_seq = th.seq;
      r.expected = g.hash;
      r.seen = th.hash;
      for (int i = 0; i < wire::kNumCfgFields; ++i) {
        r.mine[i] = g.cfg[i];
        r.theirs[i] = th.cfg[i];
      }
      Record(g, r);
      continue;
    }
    if (with_counts)
      WaitWord<T>(g, Word(h, g, wire::kSigCounts, s, wire::kControlQp), 1, s,
                  wire::kSigCounts, wire::kControlQp);
  }
}

// scratch: [0, R) col_base[d] = rows of sources < rank at d; [R, 2R) row_base[d] = rows
// this rank sends ranks < d; [2R, 3R+1) recv_base[s] = rows of sources < s at this rank.
__global__ void PrefixKernel(Geometry g, const int32_t* counts_ext, char* heap,
                             int64_t half_bytes, HeapLayout L, int64_t* scratch) {
  const int R = g.R;
  const int32_t* counts =
      counts_ext != nullptr ? counts_ext : CurrentHalf(heap, half_bytes, L, R).counts;
  for (int d = threadIdx.x; d < R; d += blockDim.x) scratch[d] = recv_base(counts, R, g.rank, d);
  if (threadIdx.x == 0) {
    int64_t acc = 0;
    for (int d = 0; d < R; ++d) {
      scratch[R + d] = acc;
      acc += counts[g.rank * R + d];
    }
    acc = 0;
    for (int s = 0; s <= R; ++s) {
      scratch[2 * R + s] = acc;
      if (s < R) acc += counts[s * R + g.rank];
    }
  }
}

__device__ __forceinline__ int64_t Kept(int64_t base, int64_t n, int capacity) {
  const int64_t room = capacity - base;
  return room <= 0 ? 0 : (n < room ? n : room);
}

// The three wire patterns: dispatch (packed rows to the receivers' recv rows), combine
// (recv rows back to the sources' back rows) and gather (the sources' rows, by the
// dispatch handle, to the receivers' cstage rows: dispatch's pattern with y-sized rows).
enum class Wire : int { kDispatch = 0, kCombine = 1, kGather = 2 };

// What this rank sends `peer` in a call: source and destination byte offsets within a
// half and the byte count.
struct Span {
  int64_t src, dst, bytes;
};

__device__ __forceinline__ Span StreamTo(const Geometry& g, const int32_t* counts,
                                         const int64_t* scratch, int peer, Wire wire,
                                         const HeapLayout& L) {
  const int R = g.R;
  Span s;
  if (wire != Wire::kCombine) {
    const int64_t n = counts[g.rank * R + peer];
    const int64_t base = scratch[peer];  // rows of sources < rank at peer
    const int64_t kept = Kept(base, n, g.C);
    if (wire == Wire::kDispatch) {
      s.bytes = kept * g.ds;
      s.src = L.stage + scratch[R + peer] * g.ds;
      s.dst = L.recv + base * g.ds;
    } else {
      s.bytes = kept * g.cs;
      s.src = L.back + scratch[R + peer] * g.cs;
      s.dst = L.cstage + base * g.cs;
    }
  } else {
    // rows `peer` sent this rank: recv rows [recv_base[peer], +kept), back to peer's
    // back rows at its send offset for this rank.
    const int64_t n = counts[peer * R + g.rank];
    const int64_t base = scratch[2 * R + peer];
    const int64_t kept = Kept(base, n, g.C);
    int64_t peer_row_base = 0;
    for (int d = 0; d < g.rank; ++d) peer_row_base += counts[peer * R + d];
    s.bytes = kept * g.cs;
    s.src = L.cstage + base * g.cs;
    s.dst = L.back + peer_row_base * g.cs;
  }
  return s;
}

// Chunks a source sends this rank in a call (+1 closing signal is added by callers).
__device__ __forceinline__ int64_t ChunksFrom(const Geometry& g, const int32_t* counts,
                                              int source, Wire wire) {
  const int R = g.R;
  int64_t base, n, stride;
  if (wire != Wire::kCombine) {
    base = recv_base(counts, R, source, g.rank);
    n = counts[source * R + g.rank];
    stride = wire == Wire::kDispatch ? g.ds : g.cs;
  } else {
    base = recv_base(counts, R, g.rank, source);
    n = counts[g.rank * R + source];
    stride = g.cs;
  }
  return num_chunks(Kept(base, n, g.C) * stride, g.chunk);
}

// One block: waits (bounded) until every (source, QP) word of this call holds the
// source's chunks on that QP plus its closing signal, and checks none holds more.
template <class T>
__global__ void WaitKernel(Geometry g, const int32_t* counts_ext, char* heap,
                           int64_t half_bytes, HeapLayout L, Wire pattern) {
  const Half h = CurrentHalf(heap, half_bytes, L, g.R);
  const int32_t* counts = counts_ext != nullptr ? counts_ext : h.counts;
  const int kind = pattern == Wire::kCombine ? wire::kSigCombine : wire::kSigDispatch;
  const int64_t words = static_cast<int64_t>(g.R) * g.num_qps;
  for (int64_t i = threadIdx.x; i < words; i += blockDim.x) {
    const int s = static_cast<int>(i / g.num_qps), q = static_cast<int>(i % g.num_qps);
    if (s == g.rank || Failed(g)) continue;
    const uint64_t expect =
        wire::expected_signal(ChunksFrom(g, counts, s, pattern), g.rank, q, g.P, g.Q);
    uint64_t* w = Word(h, g, kind, s, q);
    if (!WaitWord<T>(g, w, expect, s, kind, q)) continue;
    const uint64_t v = T::fetch(w);
    if (v != expect) {
      wire::ErrorRecord r{};
      r.code = wire::kErrExtraSignal;
      r.peer = s;
      r.kind = kind;
      r.qp = q;
      r.expected = expect;
      r.seen = v;
      Record(g, r);
    }
  }
}

// Source rank of received row i: the last s with recv_base[s] <= i (scratch[2R, 3R]).
__device__ __forceinline__ int SourceOfRow(const Geometry& g, const int64_t* scratch,
                                           int64_t i) {
  int s = 0;
  while (s + 1 < g.R && scratch[2 * g.R + s + 1] <= i) ++s;
  return s;
}

// The chunks of this rank's stream to `peer` that the striping plan puts on logical QP q,
// dealt in turn to `nw` warps: the turns go on from `*turn` (the same on every warp), and
// warp `w` takes the chunks whose turn is w mod nw. Data and signal on QP q into word
// (kind, this rank, q); then one closing signal on QP q, by the warp of the next turn.
// Nothing waits for the puts to complete (no quiet): the source is the call's heap half,
// rewritten only two calls later, after every peer has sent its header for the next call,
// which it does only after its WaitKernel saw every signal of this call, and a signal is
// delivered after its data.
template <class T>
__device__ void SendStreamOnQp(const Geometry& g, char* half, const Half& h,
                               const int32_t* counts, const int64_t* scratch,
                               const HeapLayout& L, Wire pattern, int kind, int peer, int q,
                               int w, int nw, long long* turn) {
  const int lane = threadIdx.x & 31;
  uint64_t* sig = Word(h, g, kind, g.rank, q);
  const Span s = StreamTo(g, counts, scratch, peer, pattern, L);
  const int channel = wire::channel_of_qp(peer, q, g.P, g.Q);
  const int64_t n = num_chunks(s.bytes, g.chunk);
  long long k = *turn;
  for (int64_t j = channel; channel >= 0 && j < n; j += g.num_qps, ++k) {
    if (k % nw != w) continue;
    const int64_t off = chunk_offset(j, g.chunk);
    T::put_signal_warp(half + s.dst + off, half + s.src + off,
                       static_cast<size_t>(chunk_size(s.bytes, j, g.chunk)),
                       transport::Add(sig, 1), peer, q);
  }
  if (k % nw == w && lane == 0) T::signal(transport::Add(sig, 1), peer, q);
  *turn = k + 1;
}

// RDMA first. Blocks [0, nr) are RDMA CTAs: CTA b posts, to every peer reachable only over
// the network (no NVSHMEM load/store pointer), the chunks the striping plan puts on QPs
// q = b (mod nr) (configs.h DirectSendSplit: the mode's SMs, about half of them posting),
// its chunks dealt to its warps in turn. Blocks [nr, grid) are NVLink CTAs: they take the
// (peer, QP) streams of the peers NVSHMEM reaches by load/store (its puts there are this
// CTA's own copies over NVLink), every chunk of them dealt in turn to every NVLink warp
// (consecutive chunks on consecutive blocks), and start only once every RDMA CTA has
// posted, so the NIC has all its work queued before the copies compete for the SMs and HBM,
// and no copy runs in an RDMA CTA. The network is the long pole: the copies still end long
// before the RDMA does. With no NVLink CTA (no NVLink peers planned) the RDMA CTAs copy
// after their posts. Same words and counts either way, so the receivers' WaitKernel does
// not change.
template <class T>
__global__ void SendKernel(Geometry g, const int32_t* counts_ext, const int64_t* scratch,
                           char* heap, int64_t half_bytes, HeapLayout L, Wire pattern,
                           int nr) {
  char* half = heap + Parity() * half_bytes;
  const Half h = HalfAt(half, L, g.R);
  const int32_t* counts = counts_ext != nullptr ? counts_ext : h.counts;
  const int kind = pattern == Wire::kCombine ? wire::kSigCombine : wire::kSigDispatch;
  const bool rdma = static_cast<int>(blockIdx.x) < nr;
  const int warp = threadIdx.x >> 5;
  const int nb = static_cast<int>(gridDim.x) - nr;  // NVLink CTAs
  __shared__ int skip;
  if (threadIdx.x == 0) skip = Failed(g) ? 1 : 0;
  __syncthreads();
  if (skip) {  // counted anyway: an NVLink CTA never waits for a CTA that stays silent
    if (rdma && threadIdx.x == 0) atomicAdd(&g_rdma_posted, 1ull);
    return;
  }
  if (rdma) {
    long long turn = 0;
    for (int q = blockIdx.x; q < g.num_qps; q += nr)
      for (int i = 1; i < g.R; ++i) {
        const int peer = (g.rank + i) % g.R;
        if (T::peer_ptr(half, peer) != nullptr) continue;  // an NVLink CTA's
        SendStreamOnQp<T>(g, half, h, counts, scratch, L, pattern, kind, peer, q, warp,
                          kWarps, &turn);
      }
    __syncthreads();
    if (threadIdx.x == 0) atomicAdd(&g_rdma_posted, 1ull);
    if (nb > 0) return;
    for (int q = blockIdx.x; q < g.num_qps; q += nr)  // no NVLink CTA: copy after posting
      for (int i = 1; i < g.R; ++i) {
        const int peer = (g.rank + i) % g.R;
        if (T::peer_ptr(half, peer) == nullptr) continue;
        SendStreamOnQp<T>(g, half, h, counts, scratch, L, pattern, kind, peer, q, warp,
                          kWarps, &turn);
      }
  } else {
    const int b = blockIdx.x - nr;
    __shared__ int any;
    if (threadIdx.x == 0) {
      any = 0;
      for (int i = 1; i < g.R && !any; ++i) any = T::peer_ptr(half, (g.rank + i) % g.R) != nullptr;
    }
    __syncthreads();
    if (!any) return;
    if (threadIdx.x == 0) {  // bounded: past the timeout the copies go ahead unordered
      const uint64_t start = NowNs();
      while (peer::load_acquire(reinterpret_cast<const uint64_t*>(&g_rdma_posted)) <
                 static_cast<uint64_t>(nr) &&
             !Failed(g) && static_cast<int64_t>(NowNs() - start) <= g.timeout_ns) {
      }
    }
    __syncthreads();
    // every chunk of every (NVLink peer, QP) stream dealt in turn to the nb * kWarps NVLink
    // warps, warp `warp` of block b being number warp * nb + b
    long long turn = 0;
    for (int i = 1; i < g.R; ++i) {
      const int peer = (g.rank + i) % g.R;
      if (T::peer_ptr(half, peer) == nullptr) continue;
      for (int q = 0; q < g.num_qps; ++q)
        SendStreamOnQp<T>(g, half, h, counts, scratch, L, pattern, kind, peer, q,
                          warp * nb + b, nb * kWarps, &turn);
    }
  }
}

// Writes the dispatch outputs (after WaitKernel on the same stream).
__global__ void UnpackKernel(Geometry g, const int64_t* scratch, char* heap,
                             int64_t half_bytes, HeapLayout L, DispatchOut out) {
  const Half h = CurrentHalf(heap, half_bytes, L, g.R);
  // A failed call (any rank) is never silently empty: float outputs NaN, every count
  // (num_recv, num_dropped, per expert, the handle's matrix) -1, ids and sources -1.
  // Only then: a rank that receives no rows still keeps the count matrix its combine
  // needs (the rows it sent).
  __shared__ int failed;
  if (threadIdx.x == 0) failed = Failed(g) ? 1 : 0;
  __syncthreads();
  const int64_t gtid = threadIdx.x + static_cast<int64_t>(blockIdx.x) * blockDim.x;
  const int64_t gstride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t total = failed ? 0 : scratch[3 * g.R];
  const int64_t num_recv = kept_rows(total, g.C);
  if (gtid == 0) {
    *out.num_recv = failed ? -1 : static_cast<int32_t>(num_recv);
    *out.num_dropped = failed ? -1 : static_cast<int32_t>(total - num_recv);
  }
  for (int64_t i = gtid; i < static_cast<int64_t>(g.R) * g.R; i += gstride)
    out.counts[i] = failed ? -1 : LoadLanded(h.counts + i);
  if (failed)
    for (int64_t i = gtid; i < g.el; i += gstride) out.recv_per_expert[i] = -1;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int64_t i = blockIdx.x * kWarps + warp; i < g.C; i += gridDim.x * kWarps) {
    char* xo = static_cast<char*>(out.recv_x) + i * g.xrow;
    int32_t* io = out.recv_topk_idx + i * g.K;
    float* wo = out.recv_topk_weights + i * g.K;
    if (i >= num_recv) {
      if (failed)
        NanBytes(xo, g.xrow, lane, 32);
      else
        ZeroBytes(xo, g.xrow, lane, 32);
      for (int k = lane; k < g.K; k += 32) {
        io[k] = -1;
        wo[k] = failed ? __int_as_float(0x7fc00000) : 0.f;
      }
      if (lane == 0) out.src_rank[i] = out.src_index[i] = -1;
      continue;
    }
    const int s = SourceOfRow(g, scratch, i);
    const char* row = s == g.rank
                          ? h.stage + (scratch[g.R + g.rank] + (i - scratch[2 * g.R + s])) * g.ds
                          : h.recv + i * g.ds;
    CopyLanded(xo, row, g.xrow, lane, 32);
    const int32_t* ids = reinterpret_cast<const int32_t*>(row + g.xmeta);
    const float* ws = reinterpret_cast<const float*>(ids + g.K);
    for (int k = lane; k < g.K; k += 32) {
      const int32_t local = local_expert_id(LoadLanded(ids + k), g.el, g.rank);
      io[k] = local;
      wo[k] = local < 0 ? 0.f : LoadLanded(ws + k);
      if (local >= 0) atomicAdd(out.recv_per_expert + local, 1);
    }
    if (lane == 0) {
      out.src_rank[i] = s;
      out.src_index[i] = LoadLanded(ids + 2 * g.K);
    }
  }
}

// Resets the signal words of this call's half (header, counts, data) and advances the
// call counter. The half is next written two calls later, after every peer has heard
// this rank's next header, which follows this kernel on the stream.
__global__ void FinishKernel(int R, char* heap, int64_t half_bytes, HeapLayout L) {
  const Half h = CurrentHalf(heap, half_bytes, L, R);
  const int64_t n = wire::sig_words(R);
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) h.sigs[i] = 0;
  __syncthreads();
  if (threadIdx.x == 0) {
    g_rdma_posted = 0;  // the next call's RDMA CTAs count afresh
    ++g_call_counter;
  }
}

// ---- combine -----------------------------------------------------------------------

__global__ void CombineStageKernel(Geometry g, const char* y, const int64_t* scratch,
                                   char* heap, int64_t half_bytes, HeapLayout L) {
  const Half h = CurrentHalf(heap, half_bytes, L, g.R);
  const int64_t rows = kept_rows(scratch[3 * g.R], g.C);
  for (int64_t i = blockIdx.x; i < rows; i += gridDim.x)
    CopyBytes(h.cstage + i * g.cs, y + i * g.yrow, g.yrow, threadIdx.x, blockDim.x);
}

template <typename E>
__device__ __forceinline__ float ToF(E v) { return static_cast<float>(v); }
template <typename E>
__device__ __forceinline__ E FromF(float v) { return static_cast<E>(v); }
template <>
__device__ __forceinline__ float ToF(__nv_bfloat16 v) {
  return bf16_to_f32(__bfloat16_as_ushort(v));
}
template <>
__device__ __forceinline__ __nv_bfloat16 FromF(float v) {
  return __ushort_as_bfloat16(f32_to_bf16(v));
}
template <>
__device__ __forceinline__ float ToF(__half v) { return f16_to_f32(__half_as_ushort(v)); }
template <>
__device__ __forceinline__ __half FromF(float v) { return __ushort_as_half(f32_to_f16(v)); }

// Token t on block t mod the grid (after WaitKernel): sum in combine's order (combine_order.h): per
// node of g.G ranks ascending; with several nodes each node's partial is rounded to E (the
// dtype a partial crosses the network in, in the hierarchical mode) before the partials
// are summed over nodes ascending, so both internode modes and the reference agree.
template <typename E>
__global__ void ReduceKernel(Geometry g, const E* y, const int32_t* counts,
                             const int32_t* send_slot, const int64_t* scratch, char* heap,
                             int64_t half_bytes, HeapLayout L, E* out) {
  const Half h = CurrentHalf(heap, half_bytes, L, g.R);
  __shared__ int failed;
  if (threadIdx.x == 0) failed = Failed(g) ? 1 : 0;
  __syncthreads();
  const int nodes = combine_num_nodes(g.R, g.G);
  const bool rounds = combine_rounds_partials(nodes);
  for (int t = blockIdx.x; t < g.T; t += gridDim.x) {
    for (int x = threadIdx.x; x < g.H; x += blockDim.x) {
      float acc = 0.f;
      if (failed) {  // a failed call's sums are NaN, never plausible zeros
        out[static_cast<int64_t>(t) * g.H + x] = FromF<E>(__int_as_float(0x7fc00000));
        continue;
      }
      for (int n = 0; n < nodes; ++n) {
        float part = 0.f;
        const int end = (n + 1) * g.G < g.R ? (n + 1) * g.G : g.R;
        for (int d = n * g.G; d < end; ++d) {
          const int j = send_slot[static_cast<int64_t>(t) * g.R + d];
          if (j < 0) continue;
          const int64_t base = scratch[d];  // rows of sources < rank at d
          if (base + j >= g.C) continue;   // dropped at d
          const E* row = d == g.rank
                             ? y + (base + j) * g.H
                             : reinterpret_cast<const E*>(h.back + (scratch[g.R + d] + j) * g.cs);
          part += ToF(d == g.rank ? row[x] : devcopy::LoadLandedElem(row + x));
        }
        // one node: the partial is the sum (the plain ascending order, nothing rounded)
        acc = rounds ? acc + ToF(FromF<E>(part)) : part;
      }
      out[static_cast<int64_t>(t) * g.H + x] = FromF<E>(acc);
    }
  }
}

// ---- gather (combine's transpose) ----------------------------------------------------
// out[i] = g_{src_rank[i]}[src_index[i]]: every source sends, by the dispatch handle
// (counts, send_slot), its g rows to the rows they occupy on each receiver.

// Token t on block t mod the grid: g[t] packed once per destination into the back rows, in send order.
__global__ void GatherPackKernel(Geometry g, const char* src, const int32_t* send_slot,
                                 const int64_t* scratch, char* heap, int64_t half_bytes,
                                 HeapLayout L) {
  const Half h = CurrentHalf(heap, half_bytes, L, g.R);
  for (int t = blockIdx.x; t < g.T; t += gridDim.x) {
    const char* row = src + static_cast<int64_t>(t) * g.yrow;
    for (int d = 0; d < g.R; ++d) {
      const int j = send_slot[static_cast<int64_t>(t) * g.R + d];
      if (j < 0 || scratch[d] + j >= g.C) continue;  // not sent there, or dropped there
      CopyBytes(h.back + (scratch[g.R + d] + j) * g.cs, row, g.yrow, threadIdx.x, blockDim.x);
    }
  }
}

// Writes out[C, H] (after WaitKernel; zero rows past the rows kept).
__global__ void GatherUnpackKernel(Geometry g, const int32_t* counts, const int64_t* scratch,
                                   char* heap, int64_t half_bytes, HeapLayout L, char* out) {
  const Half h = CurrentHalf(heap, half_bytes, L, g.R);
  const bool failed = Failed(g);
  const int64_t num_recv = failed ? 0 : kept_rows(scratch[3 * g.R], g.C);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int64_t i = blockIdx.x * kWarps + warp; i < g.C; i += gridDim.x * kWarps) {
    char* o = out + i * g.yrow;
    if (i >= num_recv) {
      if (failed)
        NanBytes(o, g.yrow, lane, 32);
      else
        ZeroBytes(o, g.yrow, lane, 32);
      continue;
    }
    const int s = SourceOfRow(g, scratch, i);
    const char* row =
        s == g.rank ? h.back + (scratch[g.R + g.rank] + (i - scratch[2 * g.R + s])) * g.cs
                    : h.cstage + i * g.cs;
    CopyLanded(o, row, g.yrow, lane, 32);
  }
}

}  // namespace

// ---- launchers (kernels/internode/api.cuh) -------------------------------------------

namespace {

// The direct mode's grids: its SMs (configs.h InternodeModeSms: JAX_EP_DIRECT_SMS or the
// preset, within JAX_EP_NUM_SMS), every multi-block kernel cut to them (grid-stride loops
// cover the rest) and SendKernel's split into RDMA and NVLink CTAs (DirectSendSplit;
// NVLink peers where the node holds several GPUs).
struct DirectGrids {
  int sms;
  DirectSplit send;
  int Cut(int64_t blocks) const {
    return static_cast<int>(blocks < 1 ? 1 : (blocks > sms ? sms : blocks));
  }
};
DirectGrids GridsOf(const Geometry& g) {
  DirectGrids d;
  d.sms = InternodeModeSms(kModeDirect, g.R, DeviceSms());
  d.send = DirectSendSplit(d.sms, g.num_qps, g.G > 1);
  return d;
}
}  // namespace

void LaunchPrefix(cudaStream_t stream, const Geometry& g, const int32_t* counts, char* heap,
                  int64_t half_bytes, const HeapLayout& L, int64_t* scratch) {
  JEP_LAUNCH(PrefixKernel, 1, kThreads, 0, stream)(g, counts, heap, half_bytes, L, scratch);
}

std::string LaunchDispatch(cudaStream_t stream, const Geometry& g, const HeapLayout& L,
                           char* heap, int64_t hb, int64_t* scratch, const void* x,
                           const int32_t* topk_idx, const float* topk_weights,
                           const DispatchOut& out) {
  const DirectGrids gr = GridsOf(g);
  const DirectSplit sp = gr.send;
  JEP_LAUNCH(SlotsKernel, gr.Cut(g.R), kThreads, 0, stream)(g, topk_idx, out.send_slot, heap, hb, L);
  if (g.T > 0)
    JEP_LAUNCH(PackKernel, gr.Cut(g.T), 128, 0, stream)(g, static_cast<const char*>(x), topk_idx,
                                                       topk_weights, out.send_slot, heap, hb, L);
  JEP_LAUNCH(HeaderKernel<Transport>, 1, kThreads, 0, stream)(g, heap, hb, L, true);
  JEP_LAUNCH(PrefixKernel, 1, kThreads, 0, stream)(g, nullptr, heap, hb, L, scratch);
  JEP_LAUNCH(SendKernel<Transport>, sp.rdma + sp.nvl, kThreads, 0, stream)(
      g, nullptr, scratch, heap, hb, L, Wire::kDispatch, sp.rdma);
  JEP_LAUNCH(WaitKernel<Transport>, 1, kThreads, 0, stream)(g, nullptr, heap, hb, L, Wire::kDispatch);
  JEP_LAUNCH(UnpackKernel, gr.Cut((g.C + kWarps - 1) / kWarps), kThreads, 0, stream)(
      g, scratch, heap, hb, L, out);
  JEP_LAUNCH(FinishKernel, 1, kThreads, 0, stream)(g.R, heap, hb, L);
  return CudaErr(cudaGetLastError(), "dispatch launch");
}

std::string LaunchCombine(cudaStream_t stream, const Geometry& g, const HeapLayout& L,
                          char* heap, int64_t hb, int64_t* scratch, FloatKind elem,
                          const void* y, const int32_t* counts, const int32_t* send_slot,
                          void* out) {
  const DirectGrids gr = GridsOf(g);
  const DirectSplit sp = gr.send;
  JEP_LAUNCH(CombineStageKernel, gr.Cut(g.C), kThreads, 0, stream)(
      g, static_cast<const char*>(y), scratch, heap, hb, L);
  // With T == 0 the header, send and wait still run: this rank's peers expect its
  // closing signals, and it must not reset words its peers are still signalling.
  JEP_LAUNCH(HeaderKernel<Transport>, 1, kThreads, 0, stream)(g, heap, hb, L, false);
  JEP_LAUNCH(SendKernel<Transport>, sp.rdma + sp.nvl, kThreads, 0, stream)(
      g, counts, scratch, heap, hb, L, Wire::kCombine, sp.rdma);
  JEP_LAUNCH(WaitKernel<Transport>, 1, kThreads, 0, stream)(g, counts, heap, hb, L, Wire::kCombine);
  if (g.T > 0) {
    switch (elem) {
      case FloatKind::kF32:
        JEP_LAUNCH(ReduceKernel<float>, gr.Cut(g.T), kThreads, 0, stream)(
            g, static_cast<const float*>(y), counts, send_slot, scratch, heap, hb, L,
            static_cast<float*>(out));
        break;
      case FloatKind::kBF16:
        JEP_LAUNCH(ReduceKernel<__nv_bfloat16>, gr.Cut(g.T), kThreads, 0, stream)(
            g, static_cast<const __nv_bfloat16*>(y), counts, send_slot, scratch, heap,
            hb, L, static_cast<__nv_bfloat16*>(out));
        break;
      case FloatKind::kF16:
        JEP_LAUNCH(ReduceKernel<__half>, gr.Cut(g.T), kThreads, 0, stream)(
            g, static_cast<const __half*>(y), counts, send_slot, scratch, heap, hb, L,
            static_cast<__half*>(out));
        break;
    }
  }
  JEP_LAUNCH(FinishKernel, 1, kThreads, 0, stream)(g.R, heap, hb, L);
  return CudaErr(cudaGetLastError(), "combine launch");
}

std::string LaunchGather(cudaStream_t stream, const Geometry& g, const HeapLayout& L,
                         char* heap, int64_t hb, int64_t* scratch, const void* src,
                         const int32_t* counts, const int32_t* send_slot, void* out) {
  const DirectGrids gr = GridsOf(g);
  const DirectSplit sp = gr.send;
  if (g.T > 0)
    JEP_LAUNCH(GatherPackKernel, gr.Cut(g.T), 128, 0, stream)(g, static_cast<const char*>(src), send_slot,
                                              scratch, heap, hb, L);
  JEP_LAUNCH(HeaderKernel<Transport>, 1, kThreads, 0, stream)(g, heap, hb, L, false);
  JEP_LAUNCH(SendKernel<Transport>, sp.rdma + sp.nvl, kThreads, 0, stream)(
      g, counts, scratch, heap, hb, L, Wire::kGather, sp.rdma);
  JEP_LAUNCH(WaitKernel<Transport>, 1, kThreads, 0, stream)(g, counts, heap, hb, L, Wire::kGather);
  JEP_LAUNCH(GatherUnpackKernel, gr.Cut((g.C + kWarps - 1) / kWarps), kThreads, 0, stream)(
      g, counts, scratch, heap, hb, L, static_cast<char*>(out));
  JEP_LAUNCH(FinishKernel, 1, kThreads, 0, stream)(g.R, heap, hb, L);
  return CudaErr(cudaGetLastError(), "gather launch");
}

namespace {
// One warp puts 4 KiB from the first half of a scratch area to its second half on this
// PE through the transport on logical QP 0, with a signal; thread 0 polls the signal
// (bounded: about 10 s).
__global__ void SelfPutKernel(char* area, uint64_t* sig, int* ok) {
  const int me = Transport::my_pe();
  constexpr int kBytes = 4096;
  for (int i = threadIdx.x; i < kBytes; i += blockDim.x) area[i] = static_cast<char>(i * 7 + 3);
  __syncwarp();
  Transport::put_signal_warp(area + kBytes, area, kBytes, transport::Set(sig, 1, 0), me, 0);
  Transport::quiet_warp();
  if (threadIdx.x == 0) {
    const uint64_t start = NowNs();
    while (Transport::fetch(sig) < 1) {
      if (NowNs() - start > 10ull * 1000000000ull) {
        *ok = 0;
        return;
      }
    }
    int good = 1;
    for (int i = 0; i < kBytes; ++i) good &= area[kBytes + i] == static_cast<char>(i * 7 + 3);
    *ok = good;
  }
}
}  // namespace

void LaunchSelfPut(char* area, uint64_t* sig, int* ok) {
  JEP_LAUNCH(SelfPutKernel, 1, 32, 0, nullptr)(area, sig, ok);
}

}  // namespace JEP_TR_NS
}  // namespace internode
}  // namespace jax_ep
