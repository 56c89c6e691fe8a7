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
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <dlfcn.h>

#include <cstdlib>
#include <cstring>
#include <string>

#include "kernels/common/combine_order.h"
#include "kernels/common/dtype_convert.h"
#include "kernels/internode/device_copy.cuh"
#include "kernels/internode/internode_kernels.h"
#include "kernels/internode/internode_layout.h"
#include "kernels/internode/low_latency_wire.h"
#include "kernels/common/layout_math.h"
#include "kernels/common/striping_plan.h"
#include "kernels/internode/transport_nvshmem.cuh"
#include "kernels/internode/wire_protocol.h"

namespace jax_ep {
namespace transport {
JEP_DEVICE_GLOBAL int g_nvshmem_num_qp_handles = 0;
JEP_DEVICE_GLOBAL int g_nvshmem_qp_handles[kMaxQps];
}  // namespace transport

namespace internode {
namespace {

using Transport = transport::Nvshmem;
using transport::SignalOp;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxRanks = 1024;
// NVLink CTAs of SendKernel, beside its num_qps RDMA CTAs (the copies to the peers NVSHMEM
// reaches by load/store).
constexpr int kNvlBlocks = 4;

JEP_DEVICE_GLOBAL unsigned long long g_call_counter = 0;

struct RuntimeState {
  bool initialized = false;
  bool adopted = false;  // NVSHMEM was already running; we did not start it
  int rank = 0;
  int world = 0;
  size_t heap_bytes = 0;
  size_t half_bytes = 0;  // bytes per parity half
  char* heap = nullptr;
  int64_t* scratch = nullptr;       // [3R + 1] device prefixes
  int32_t* bad = nullptr;           // device [4]: flag, token, slot, value
  wire::ErrorRecord* err = nullptr; // mapped host memory (sticky)
  int num_qps = 0;                  // logical QPs asked for
  int num_handles = 0;              // explicit QP handles created (0: fallback)
  int handles[transport::kMaxQps] = {};
  int created[transport::kMaxQps] = {};  // in creation order; SetQpOrder permutes from it
  std::string qp_path = "none";
};
// One per process on a GPU; on the emulated GPU one per virtual GPU (the host code of
// every rank runs in one process there, each with its own current device).
#if defined(JAX_EP_EMU)
RuntimeState g_rt_of[64];
RuntimeState& Rt() { return g_rt_of[emu::current_device() & 63]; }
#else
RuntimeState g_rt;
RuntimeState& Rt() { return g_rt; }
#endif

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

struct Geometry {
  int R, rank, T, H, K, C, E, el;
  int64_t xrow;    // H * x bytes
  int64_t xmeta;   // offset of the int32 metadata in a dispatch row
  int64_t yrow;    // H * y bytes
  int64_t ds, cs;  // row strides on the wire
  int P, Q, num_qps;
  int G;  // combine's node size (combine_order.h), clamped to [1, R]
  int64_t chunk;
  int64_t timeout_ns;
  int32_t cfg[wire::kNumCfgFields];
  uint32_t hash;
  wire::ErrorRecord* err;
  int32_t* bad;
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
  const int d = blockIdx.x;
  const Half h = CurrentHalf(heap, half_bytes, L, g.R);
  __shared__ int warp_total[kWarps];
  __shared__ int running;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
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
}

// One block per token: pack its row once per destination into stage.
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
  const int t = blockIdx.x;
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
    T::put_signal_warp(h.hdr + g.rank, h.hdr + g.rank, wire::kHeaderBytes,
                       Word(h, g, wire::kSigHeader, g.rank, wire::kControlQp), 1,
                       SignalOp::kSet, peer, wire::kControlQp);
    if (with_counts)
      T::put_signal_warp(row, row, sizeof(int32_t) * g.R,
                         Word(h, g, wire::kSigCounts, g.rank, wire::kControlQp), 1,
                         SignalOp::kSet, peer, wire::kControlQp);
  }
  if ((threadIdx.x & 31) == 0) T::quiet();
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
// shared by the block's warps: data and signal on QP q into word (kind, this rank, q);
// then one closing signal on QP q.
template <class T>
__device__ void SendStreamOnQp(const Geometry& g, char* half, const Half& h,
                               const int32_t* counts, const int64_t* scratch,
                               const HeapLayout& L, Wire pattern, int kind, int peer, int q) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  uint64_t* sig = Word(h, g, kind, g.rank, q);
  const Span s = StreamTo(g, counts, scratch, peer, pattern, L);
  const int channel = wire::channel_of_qp(peer, q, g.P, g.Q);
  const int64_t n = num_chunks(s.bytes, g.chunk);
  int k = 0;
  for (int64_t j = channel; channel >= 0 && j < n; j += g.num_qps, ++k) {
    if (k % kWarps != warp) continue;
    const int64_t off = chunk_offset(j, g.chunk);
    T::put_signal_warp(half + s.dst + off, half + s.src + off,
                       static_cast<size_t>(chunk_size(s.bytes, j, g.chunk)), sig, 1,
                       SignalOp::kAdd, peer, q);
  }
  if (warp == 0 && lane == 0) T::signal(sig, 1, SignalOp::kAdd, peer, q);
}

// RDMA CTAs post every RDMA-only peer's chunks before NVLink CTAs copy anything: RDMA CTAs
// that have posted all their puts (this call); FinishKernel resets it.
JEP_DEVICE_GLOBAL unsigned long long g_rdma_posted = 0;

// RDMA first. Blocks [0, num_qps) are RDMA CTAs: CTA q posts, to every peer reachable only
// over the network (no NVSHMEM load/store pointer), the chunks the striping plan puts on
// QP q. Blocks [num_qps, num_qps + kNvlBlocks) are NVLink CTAs: they take the (peer, QP)
// streams of the peers NVSHMEM reaches by load/store (its puts there are this CTA's own
// copies over NVLink), and start only once every RDMA CTA has posted, so the NIC has all
// its work queued before the copies compete for the SMs and HBM, and no copy runs in an
// RDMA CTA. The network is the long pole: the copies still end long before the RDMA does.
// Same words and counts either way, so the receivers' WaitKernel does not change.
template <class T>
__global__ void SendKernel(Geometry g, const int32_t* counts_ext, const int64_t* scratch,
                           char* heap, int64_t half_bytes, HeapLayout L, Wire pattern) {
  char* half = heap + Parity() * half_bytes;
  const Half h = HalfAt(half, L, g.R);
  const int32_t* counts = counts_ext != nullptr ? counts_ext : h.counts;
  const int kind = pattern == Wire::kCombine ? wire::kSigCombine : wire::kSigDispatch;
  const bool rdma = static_cast<int>(blockIdx.x) < g.num_qps;
  const int lane = threadIdx.x & 31;
  __shared__ int skip;
  if (threadIdx.x == 0) skip = Failed(g) ? 1 : 0;
  __syncthreads();
  if (skip) {  // counted anyway: an NVLink CTA never waits for a CTA that stays silent
    if (rdma && threadIdx.x == 0) atomicAdd(&g_rdma_posted, 1ull);
    return;
  }
  if (rdma) {
    const int q = blockIdx.x;
    for (int i = 1; i < g.R; ++i) {
      const int peer = (g.rank + i) % g.R;
      if (T::peer_ptr(half, peer) != nullptr) continue;  // an NVLink CTA's
      SendStreamOnQp<T>(g, half, h, counts, scratch, L, pattern, kind, peer, q);
    }
    __syncthreads();
    if (threadIdx.x == 0) atomicAdd(&g_rdma_posted, 1ull);
  } else {
    const int b = blockIdx.x - g.num_qps, nb = gridDim.x - g.num_qps;
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
                 static_cast<uint64_t>(g.num_qps) &&
             !Failed(g) && static_cast<int64_t>(NowNs() - start) <= g.timeout_ns) {
      }
    }
    __syncthreads();
    int k = 0;  // (NVLink peer, QP) streams, dealt to the NVLink CTAs in turn
    for (int i = 1; i < g.R; ++i) {
      const int peer = (g.rank + i) % g.R;
      if (T::peer_ptr(half, peer) == nullptr) continue;
      for (int q = 0; q < g.num_qps; ++q, ++k)
        if (k % nb == b)
          SendStreamOnQp<T>(g, half, h, counts, scratch, L, pattern, kind, peer, q);
    }
  }
  __syncwarp();
  if (lane == 0) T::quiet();
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

// One block per token (after WaitKernel): sum in combine's order (combine_order.h): per
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
  const int t = blockIdx.x;
  const int nodes = combine_num_nodes(g.R, g.G);
  const bool rounds = combine_rounds_partials(nodes);
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

// ---- gather (combine's transpose) ----------------------------------------------------
// out[i] = g_{src_rank[i]}[src_index[i]]: every source sends, by the dispatch handle
// (counts, send_slot), its g rows to the rows they occupy on each receiver.

// One block per token: pack g[t] once per destination into the back rows, in send order.
__global__ void GatherPackKernel(Geometry g, const char* src, const int32_t* send_slot,
                                 const int64_t* scratch, char* heap, int64_t half_bytes,
                                 HeapLayout L) {
  const Half h = CurrentHalf(heap, half_bytes, L, g.R);
  const int t = blockIdx.x;
  const char* row = src + static_cast<int64_t>(t) * g.yrow;
  for (int d = 0; d < g.R; ++d) {
    const int j = send_slot[static_cast<int64_t>(t) * g.R + d];
    if (j < 0 || scratch[d] + j >= g.C) continue;  // not sent there, or dropped there
    CopyBytes(h.back + (scratch[g.R + d] + j) * g.cs, row, g.yrow, threadIdx.x, blockDim.x);
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

std::string CudaErr(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return {};
  return std::string("jax_ep internode: ") + what + ": " + cudaGetErrorString(e);
}

std::string MakeGeometry(const Dims& d, int op, FloatKind elem, int x_bytes, int y_bytes,
                         Geometry* g, HeapLayout* L) {
  if (!Rt().initialized)
    return "jax_ep internode: NVSHMEM is not initialised; call "
           "jax_ep.nvshmem_bootstrap.initialize(...) before jit";
  if (d.num_ranks != Rt().world || d.rank != Rt().rank)
    return "jax_ep internode: the EP group must be all NVSHMEM PEs (" +
           std::to_string(Rt().world) + " processes, one GPU each); got " +
           std::to_string(d.num_ranks) + " ranks";
  if (d.num_ranks > kMaxRanks) return "jax_ep internode: more than 1024 ranks";
  const int qps = d.num_ports * d.qps_per_port;
  if (d.num_ports < 1 || d.qps_per_port < 1 || qps > transport::kMaxQps || d.chunk_bytes < 1)
    return "jax_ep internode: bad transport config (ports, QPs per port, chunk bytes)";
  if (qps != Rt().num_qps)
    return "jax_ep internode: the call asks for " + std::to_string(qps) +
           " QPs per peer but NVSHMEM was started with " + std::to_string(Rt().num_qps) +
           "; trace with the TransportConfig given to nvshmem_bootstrap.initialize";
  g->R = d.num_ranks;
  g->rank = d.rank;
  g->T = d.tokens;
  g->H = d.hidden;
  g->K = d.topk;
  g->C = d.capacity;
  g->E = d.num_experts;
  g->el = d.experts_per_rank;
  g->xrow = static_cast<int64_t>(d.hidden) * x_bytes;
  g->xmeta = dispatch_meta_offset(g->xrow);
  g->yrow = static_cast<int64_t>(d.hidden) * y_bytes;
  g->ds = dispatch_row_stride(g->xrow, d.topk);
  g->cs = combine_row_stride(g->yrow);
  g->P = d.num_ports;
  g->Q = d.qps_per_port;
  g->num_qps = qps;
  g->G = combine_node_size(d.num_ranks, d.gpus_per_node);
  // Chunks are whole 16-byte units so every put stays aligned.
  g->chunk = round_up(d.chunk_bytes, 16);
  g->timeout_ns = d.timeout_ns > 0 ? d.timeout_ns : 300ll * 1000000000ll;
  g->cfg[wire::kCfgOp] = op;
  g->cfg[wire::kCfgRanks] = d.num_ranks;
  g->cfg[wire::kCfgTokens] = d.tokens;
  g->cfg[wire::kCfgHidden] = d.hidden;
  g->cfg[wire::kCfgTopk] = d.topk;
  g->cfg[wire::kCfgCapacity] = d.capacity;
  g->cfg[wire::kCfgDtype] = static_cast<int32_t>(elem);
  g->cfg[wire::kCfgNumQps] = qps;
  g->cfg[wire::kCfgCallSite] = static_cast<int32_t>(d.call_site);
  g->hash = wire::config_hash(g->cfg);
  g->err = Rt().err;
  g->bad = Rt().bad;
  *L = heap_layout(d.num_ranks, d.tokens, d.capacity, d.hidden, d.topk, x_bytes, y_bytes);
  if (static_cast<size_t>(L->total) > Rt().half_bytes)
    return "jax_ep internode: the NVSHMEM heap is too small for this call (needs " +
           std::to_string(2 * L->total) + " bytes plus slack, has " +
           std::to_string(Rt().heap_bytes) +
           "); initialise with the largest tokens/capacity/hidden/topk the program uses";
  return {};
}

const char* OpName(int op) {
  switch (op) {
    case wire::kOpDispatch: return "dispatch";
    case wire::kOpCombine: return "combine";
    case wire::kOpGather: return "gather";
    default: return "an internode call";
  }
}

const char* KindName(int kind) {
  switch (kind) {
    case wire::kSigHeader: return "header";
    case wire::kSigCounts: return "count row";
    case wire::kSigDispatch: return "dispatch/gather data";
    case wire::kSigCombine: return "combine data";
    default: return "?";
  }
}

std::string CfgText(const int32_t* c) {
  static const char* kNames[wire::kNumCfgFields] = {"op", "R", "T", "H", "K", "C", "dtype",
                                                    "qps", "call_site"};
  std::string out = "(";
  for (int i = 0; i < wire::kNumCfgFields; ++i) {
    if (i) out += ", ";
    out += kNames[i];
    out += "=";
    out += i == wire::kCfgOp ? std::string(OpName(c[i])) : std::to_string(c[i]);
  }
  return out + ")";
}

// Start of a handle-driven call (combine, gather): geometry and layout for rows of
// `elem` (they travel through the back and cstage regions; dispatch's regions, sized by
// x, are unused), then the row prefixes from the handle's counts.
std::string BeginHandleCall(cudaStream_t stream, const Dims& d, int op, FloatKind elem,
                            const int32_t* counts, Geometry* g, HeapLayout* L) {
  std::string e = MakeGeometry(d, op, elem, 0, FloatKindBytes(elem), g, L);
  if (!e.empty()) return e;
  JEP_LAUNCH(PrefixKernel, 1, kThreads, 0, stream)(*g, counts, Rt().heap,
                                           static_cast<int64_t>(Rt().half_bytes), *L,
                                           Rt().scratch);
  return {};
}

}  // namespace


int Version() {
  return NVSHMEM_VENDOR_MAJOR_VERSION * 10000 + NVSHMEM_VENDOR_MINOR_VERSION * 100 +
         NVSHMEM_VENDOR_PATCH_VERSION;
}

namespace {
// A symbol of the NVSHMEM host library already loaded with the extension, or null.
// Entry points newer than the oldest supported NVSHMEM are reached only this way, so the
// extension has no undefined reference to them and loads with any libnvshmem_host.so.3.
void* HostSymbol(const char* name) {
#if defined(JAX_EP_EMU)
  return nvshmem_emu::host_symbol(name);
#endif
  static void* lib = dlopen("libnvshmem_host.so.3", RTLD_NOLOAD | RTLD_LAZY);
  void* p = lib != nullptr ? dlsym(lib, name) : nullptr;
  return p != nullptr ? p : dlsym(RTLD_DEFAULT, name);
}

using QpHandle = int;  // nvshmemx_qp_handle_t in 3.8
// NVSHMEMX_QP_DEFAULT (device_host_transport/nvshmem_constants.h): what nvshmemx_qp_create
// returns for every handle when the remote transport has no custom QPs (init.cu).
constexpr QpHandle kQpDefault = 1;
using QpCreateFn = int (*)(int, QpHandle**);
using VersionFn = void (*)(int*, int*, int*);
}  // namespace

bool QpApiAvailable() {
#if JAX_EP_NVSHMEM_QP_API
  return HostSymbol("nvshmemx_qp_create") != nullptr;
#else
  return false;
#endif
}

int RuntimeVersion() {
  auto fn = reinterpret_cast<VersionFn>(HostSymbol("nvshmemx_vendor_get_version_info"));
  if (fn == nullptr) return -1;
  int major = 0, minor = 0, patch = 0;
  fn(&major, &minor, &patch);
  return major * 10000 + minor * 100 + patch;
}

int InitStatus() {
  using StatusFn = int (*)();
  auto fn = reinterpret_cast<StatusFn>(HostSymbol("nvshmemx_init_status"));
  return fn == nullptr ? -1 : fn();
}

bool Initialized() { return Rt().initialized; }
size_t HeapBytes() { return Rt().heap_bytes; }

TransportInfo TransportState() {
  TransportInfo t;
  t.initialized = Rt().initialized;
  t.adopted = Rt().adopted;
  t.num_qps = Rt().num_qps;
  t.qp_path = Rt().qp_path;
  for (int i = 0; i < Rt().num_handles; ++i) t.handles.push_back(Rt().handles[i]);
  return t;
}

std::string SetQpOrder(const std::vector<int>& order) {
  const int n = Rt().num_handles;
  if (n == 0) return "jax_ep internode: no explicit QP handles to order (fallback path)";
  if (static_cast<int>(order.size()) != n)
    return "jax_ep internode: QP order has " + std::to_string(order.size()) +
           " entries, expected one per handle (" + std::to_string(n) + ")";
  // A permutation of the creation order: logical QP q takes the handle created order[q]-th.
  // Always from the creation order, so applying it twice is applying it once.
  std::vector<bool> seen(n, false);
  for (int i : order) {
    if (i < 0 || i >= n || seen[i])
      return "jax_ep internode: QP order is not a permutation of [0, " + std::to_string(n) + ")";
    seen[i] = true;
  }
  int permuted[transport::kMaxQps] = {};
  for (int q = 0; q < n; ++q) permuted[q] = Rt().created[order[q]];
  const std::string e = CudaErr(
      cudaMemcpyToSymbol(transport::g_nvshmem_qp_handles, permuted, sizeof(int) * n),
      "QP handles");
  if (!e.empty()) return e;
  for (int q = 0; q < n; ++q) Rt().handles[q] = permuted[q];
  return {};
}

std::string UniqueId(std::string* out) {
  nvshmemx_uniqueid_t id = NVSHMEMX_UNIQUEID_INITIALIZER;
  if (nvshmemx_get_uniqueid(&id) != 0) return "jax_ep internode: nvshmemx_get_uniqueid failed";
  out->assign(reinterpret_cast<const char*>(&id), sizeof(id));
  return {};
}

std::string Init(int rank, int world, const std::string& unique_id, size_t heap_bytes,
                 int num_qps, bool use_qp_api, bool adopt) {
  if (Rt().initialized) return "jax_ep internode: NVSHMEM is already initialised";
  if (num_qps < 1 || num_qps > transport::kMaxQps)
    return "jax_ep internode: num_qps must be in [1, " + std::to_string(transport::kMaxQps) + "]";
  if (heap_bytes <= static_cast<size_t>(kHeapSlackBytes))
    return "jax_ep internode: heap_bytes is smaller than the reserved slack";
  std::string e = CudaErr(cudaFree(nullptr), "CUDA context");
  if (!e.empty()) return e;
  const int status = InitStatus();
  const bool running = status >= NVSHMEM_STATUS_IS_INITIALIZED;
  if (running && !adopt)
    return "jax_ep internode: NVSHMEM is already initialised in this process (XLA starts it "
           "for its own kernels); its settings were fixed then. Start jax_ep's NVSHMEM "
           "before anything else uses it, or set the NVSHMEM_* variables of "
           "TransportConfig.nvshmem_env() in the environment before the process starts "
           "and pass adopt=True";
  if (!running) {
    nvshmemx_uniqueid_t id = NVSHMEMX_UNIQUEID_INITIALIZER;
    if (unique_id.size() != sizeof(id))
      return "jax_ep internode: unique id has " + std::to_string(unique_id.size()) +
             " bytes, expected " + std::to_string(sizeof(id));
    std::memcpy(&id, unique_id.data(), sizeof(id));
    nvshmemx_init_attr_t attr = NVSHMEMX_INIT_ATTR_INITIALIZER;
    if (nvshmemx_set_attr_uniqueid_args(rank, world, &id, &attr) != 0)
      return "jax_ep internode: nvshmemx_set_attr_uniqueid_args failed";
    if (nvshmemx_init_attr(NVSHMEMX_INIT_WITH_UNIQUEID, &attr) != 0)
      return "jax_ep internode: nvshmemx_init_attr failed";
  }
  if (nvshmem_my_pe() != rank || nvshmem_n_pes() != world)
    return "jax_ep internode: NVSHMEM PE " + std::to_string(nvshmem_my_pe()) + "/" +
           std::to_string(nvshmem_n_pes()) + " does not match process " +
           std::to_string(rank) + "/" + std::to_string(world);
  const size_t usable = heap_bytes - kHeapSlackBytes;
  Rt().half_bytes = (usable / 2) / kHeapAlign * kHeapAlign;
  Rt().heap = static_cast<char*>(nvshmem_malloc(2 * Rt().half_bytes));
  if (Rt().heap == nullptr) return "jax_ep internode: nvshmem_malloc of the heap failed";
  e = CudaErr(cudaMemset(Rt().heap, 0, 2 * Rt().half_bytes), "clear heap");
  if (e.empty())
    e = CudaErr(cudaMalloc(&Rt().scratch, sizeof(int64_t) * (3 * world + 1)), "scratch");
  if (e.empty()) e = CudaErr(cudaMalloc(&Rt().bad, sizeof(int32_t) * 4), "bad-id note");
  if (e.empty()) e = CudaErr(cudaMemset(Rt().bad, 0, sizeof(int32_t) * 4), "bad-id note");
  void* rec = nullptr;
  if (e.empty())
    e = CudaErr(cudaHostAlloc(&rec, sizeof(wire::ErrorRecord),
                              cudaHostAllocMapped | cudaHostAllocPortable), "error record");
  if (!e.empty()) return e;
  std::memset(rec, 0, sizeof(wire::ErrorRecord));
  Rt().err = static_cast<wire::ErrorRecord*>(rec);
  // One explicit QP handle per logical QP: the plan's QP is the QP on the wire.
  Rt().num_handles = 0;
  Rt().qp_path = "fallback: NVSHMEM's own QP choice (no nvshmemx_qp_create)";
  if (use_qp_api) {
    auto create = reinterpret_cast<QpCreateFn>(
        QpApiAvailable() ? HostSymbol("nvshmemx_qp_create") : nullptr);
    if (create == nullptr)
      return "jax_ep internode: the QP API was asked for but this NVSHMEM host library has "
             "no nvshmemx_qp_create (NVSHMEM >= 3.8 needed); the bootstrap falls back to one "
             "port when it is absent";
    QpHandle* arr = nullptr;
    if (create(num_qps, &arr) != 0 || arr == nullptr)
      return "jax_ep internode: nvshmemx_qp_create(" + std::to_string(num_qps) + ") failed";
    // Each logical QP must be one QP on the wire: the protocols order a chunk's data before
    // its signal per QP, and fence_qp orders one QP. A default handle is routed to the
    // QP of the calling CTA (IBGDA's RC map), and shared handles mix logical QPs, so
    // counts could overtake their rows: refuse rather than run.
    static_assert(kQpDefault == NVSHMEMX_QP_DEFAULT, "NVSHMEM's default QP handle moved");
    for (int i = 0; i < num_qps; ++i) {
      bool shared = arr[i] == kQpDefault;
      for (int j = 0; j < i && !shared; ++j) shared = arr[j] == arr[i];
      if (shared)
        return "jax_ep internode: nvshmemx_qp_create(" + std::to_string(num_qps) +
               ") returned " + (arr[i] == kQpDefault ? std::string("NVSHMEMX_QP_DEFAULT")
                                                     : "a repeated handle") +
               " for QP " + std::to_string(i) + ": this NVSHMEM transport has no custom "
               "QPs (only IBGDA has them), and default QPs are chosen per CTA, which the "
               "internode protocols cannot order. Fix: NVSHMEM_IB_ENABLE_IBGDA=1 (and "
               "NVSHMEM_REMOTE_TRANSPORT=ibgda if set)";
    }
    for (int i = 0; i < num_qps; ++i) Rt().handles[i] = Rt().created[i] = arr[i];
    e = CudaErr(cudaMemcpyToSymbol(transport::g_nvshmem_qp_handles, Rt().handles,
                                   sizeof(int) * num_qps), "QP handles");
    if (!e.empty()) return e;
    Rt().num_handles = num_qps;
    Rt().qp_path = "qp_api: one nvshmemx_qp_create handle per planned QP";
  }
  e = CudaErr(cudaMemcpyToSymbol(transport::g_nvshmem_num_qp_handles, &Rt().num_handles,
                                 sizeof(int)), "QP handles");
  if (!e.empty()) return e;
  const unsigned long long zero = 0;
  e = CudaErr(cudaMemcpyToSymbol(g_call_counter, &zero, sizeof(zero)), "call counter");
  if (e.empty()) e = CudaErr(cudaMemcpyToSymbol(g_rdma_posted, &zero, sizeof(zero)), "posts");
  if (!e.empty()) return e;
  e = CudaErr(cudaDeviceSynchronize(), "init");
  if (!e.empty()) return e;
  nvshmem_barrier_all();
  Rt().initialized = true;
  Rt().adopted = running;
  Rt().rank = rank;
  Rt().world = world;
  Rt().heap_bytes = heap_bytes;
  Rt().num_qps = num_qps;
  return {};
}

// Collective: every PE must call it. Never called at exit (see jax_ep.nvshmem_bootstrap).
std::string Finalize() {
  if (!Rt().initialized) return {};
  cudaDeviceSynchronize();
  nvshmem_barrier_all();
  nvshmem_free(Rt().heap);
  cudaFree(Rt().scratch);
  cudaFree(Rt().bad);
  cudaFreeHost(Rt().err);
  if (!Rt().adopted) nvshmem_finalize();
  Rt() = RuntimeState{};
  return {};
}

std::string PendingError() {
  if (Rt().err == nullptr) return {};
  const volatile wire::ErrorRecord* r = Rt().err;
  const int code = r->code;
  if (code == wire::kErrNone) return {};
  // The low-latency mode shares the record with its own field meanings (op past
  // kErrOpBase): name it rather than decode it as a direct-mode record.
  if (r->op >= llwire::kErrOpBase)
    return "jax_ep internode: an earlier internode low-latency call failed on this rank "
           "(error code " + std::to_string(code) + ", peer " + std::to_string(r->peer) +
           "; its own call reported the details). The internode transport stays failed for "
           "the life of this process; restart the job.";
  std::string m = "jax_ep internode: ";
  const int op = r->op, peer = r->peer, kind = r->kind, qp = r->qp;
  const unsigned long long expected = r->expected, seen = r->seen;
  int32_t mine[wire::kNumCfgFields], theirs[wire::kNumCfgFields];
  for (int i = 0; i < wire::kNumCfgFields; ++i) {
    mine[i] = r->mine[i];
    theirs[i] = r->theirs[i];
  }
  switch (code) {
    case wire::kErrTimeout:
      m += std::string(OpName(op)) + " timed out (JAX_EP_TIMEOUT_S) waiting for rank " +
           std::to_string(peer) + ": " + KindName(kind) + " signal on QP " +
           std::to_string(qp) + " holds " + std::to_string(seen) + " of " +
           std::to_string(expected) +
           "; that rank skipped the call, failed earlier, or is slower than the timeout";
      break;
    case wire::kErrMismatch:
      m += std::string(OpName(op)) + ": rank " + std::to_string(peer) +
           " is in another call: this rank seq " + std::to_string(r->my_seq) + " " +
           CfgText(mine) + ", rank " + std::to_string(peer) + " seq " +
           std::to_string(r->peer_seq) + " " + CfgText(theirs) +
           "; every rank must make the same EP calls with the same shapes in the same order";
      break;
    case wire::kErrPeerFailed:
      m += std::string(OpName(op)) + ": rank " + std::to_string(peer) +
           " reported an error in this call (e.g. topk_idx out of range there); every rank "
           "fails it";
      break;
    case wire::kErrBadId:
      m += std::string(OpName(op)) + ": topk_idx[" + std::to_string(peer) + ", " +
           std::to_string(qp) + "] = " + std::to_string(static_cast<long long>(seen)) +
           " is outside [-1, " + std::to_string(expected) + ")";
      break;
    case wire::kErrExtraSignal:
      m += std::string(OpName(op)) + ": rank " + std::to_string(peer) + " signalled " +
           std::to_string(seen) + " times on " + KindName(kind) + " QP " +
           std::to_string(qp) + ", expected " + std::to_string(expected);
      break;
    default:
      m += "an error is being recorded (code " + std::to_string(code) + ")";
  }
  return m + " [rank " + std::to_string(static_cast<int>(r->rank)) +
         "]. The internode transport stays failed for the life of this process (the "
         "peers' signal words are out of step); restart the job.";
}

std::string Dispatch(cudaStream_t stream, const Dims& d, FloatKind elem, const void* x,
                     const int32_t* topk_idx, const float* topk_weights,
                     const DispatchOut& out) {
  Geometry g;
  HeapLayout L;
  // Each call lays out its own half; combine's regions (sized by y) are unused here.
  std::string e = MakeGeometry(d, wire::kOpDispatch, elem, FloatKindBytes(elem), 0, &g, &L);
  if (!e.empty()) return e;
  char* heap = Rt().heap;
  const int64_t hb = static_cast<int64_t>(Rt().half_bytes);
  e = CudaErr(cudaMemsetAsync(out.recv_per_expert, 0, sizeof(int32_t) * d.experts_per_rank,
                              stream), "clear expert counts");
  if (e.empty())
    e = CudaErr(cudaMemsetAsync(Rt().bad, 0, sizeof(int32_t) * 4, stream), "clear bad ids");
  if (!e.empty()) return e;
  JEP_LAUNCH(SlotsKernel, g.R, kThreads, 0, stream)(g, topk_idx, out.send_slot, heap, hb, L);
  if (g.T > 0)
    JEP_LAUNCH(PackKernel, g.T, 128, 0, stream)(g, static_cast<const char*>(x), topk_idx,
                                        topk_weights, out.send_slot, heap, hb, L);
  JEP_LAUNCH(HeaderKernel<Transport>, 1, kThreads, 0, stream)(g, heap, hb, L, true);
  JEP_LAUNCH(PrefixKernel, 1, kThreads, 0, stream)(g, nullptr, heap, hb, L, Rt().scratch);
  JEP_LAUNCH(SendKernel<Transport>, g.num_qps + kNvlBlocks, kThreads, 0, stream)(g, nullptr, Rt().scratch, heap,
                                                             hb, L, Wire::kDispatch);
  JEP_LAUNCH(WaitKernel<Transport>, 1, kThreads, 0, stream)(g, nullptr, heap, hb, L, Wire::kDispatch);
  const int blocks = static_cast<int>((g.C + kWarps - 1) / kWarps);
  JEP_LAUNCH(UnpackKernel, blocks < 1024 ? blocks : 1024, kThreads, 0, stream)(g, Rt().scratch, heap,
                                                                        hb, L, out);
  JEP_LAUNCH(FinishKernel, 1, kThreads, 0, stream)(g.R, heap, hb, L);
  return CudaErr(cudaGetLastError(), "dispatch launch");
}

std::string Combine(cudaStream_t stream, const Dims& d, FloatKind elem, const void* y,
                    const int32_t* counts, const int32_t* send_slot, void* out) {
  Geometry g;
  HeapLayout L;
  const std::string e = BeginHandleCall(stream, d, wire::kOpCombine, elem, counts, &g, &L);
  if (!e.empty()) return e;
  char* heap = Rt().heap;
  const int64_t hb = static_cast<int64_t>(Rt().half_bytes);
  JEP_LAUNCH(CombineStageKernel, g.C < 1024 ? g.C : 1024, kThreads, 0, stream)(
      g, static_cast<const char*>(y), Rt().scratch, heap, hb, L);
  // With T == 0 the header, send and wait still run: this rank's peers expect its
  // closing signals, and it must not reset words its peers are still signalling.
  JEP_LAUNCH(HeaderKernel<Transport>, 1, kThreads, 0, stream)(g, heap, hb, L, false);
  JEP_LAUNCH(SendKernel<Transport>, g.num_qps + kNvlBlocks, kThreads, 0, stream)(g, counts, Rt().scratch, heap,
                                                             hb, L, Wire::kCombine);
  JEP_LAUNCH(WaitKernel<Transport>, 1, kThreads, 0, stream)(g, counts, heap, hb, L, Wire::kCombine);
  if (g.T > 0) {
    switch (elem) {
      case FloatKind::kF32:
        JEP_LAUNCH(ReduceKernel<float>, g.T, kThreads, 0, stream)(
            g, static_cast<const float*>(y), counts, send_slot, Rt().scratch, heap, hb, L,
            static_cast<float*>(out));
        break;
      case FloatKind::kBF16:
        JEP_LAUNCH(ReduceKernel<__nv_bfloat16>, g.T, kThreads, 0, stream)(
            g, static_cast<const __nv_bfloat16*>(y), counts, send_slot, Rt().scratch, heap,
            hb, L, static_cast<__nv_bfloat16*>(out));
        break;
      case FloatKind::kF16:
        JEP_LAUNCH(ReduceKernel<__half>, g.T, kThreads, 0, stream)(
            g, static_cast<const __half*>(y), counts, send_slot, Rt().scratch, heap, hb, L,
            static_cast<__half*>(out));
        break;
    }
  }
  JEP_LAUNCH(FinishKernel, 1, kThreads, 0, stream)(g.R, heap, hb, L);
  return CudaErr(cudaGetLastError(), "combine launch");
}

std::string Gather(cudaStream_t stream, const Dims& d, FloatKind elem, const void* src,
                   const int32_t* counts, const int32_t* send_slot, void* out) {
  Geometry g;
  HeapLayout L;
  const std::string e = BeginHandleCall(stream, d, wire::kOpGather, elem, counts, &g, &L);
  if (!e.empty()) return e;
  char* heap = Rt().heap;
  const int64_t hb = static_cast<int64_t>(Rt().half_bytes);
  if (g.T > 0)
    JEP_LAUNCH(GatherPackKernel, g.T, 128, 0, stream)(g, static_cast<const char*>(src), send_slot,
                                              Rt().scratch, heap, hb, L);
  JEP_LAUNCH(HeaderKernel<Transport>, 1, kThreads, 0, stream)(g, heap, hb, L, false);
  JEP_LAUNCH(SendKernel<Transport>, g.num_qps + kNvlBlocks, kThreads, 0, stream)(g, counts, Rt().scratch, heap,
                                                             hb, L, Wire::kGather);
  JEP_LAUNCH(WaitKernel<Transport>, 1, kThreads, 0, stream)(g, counts, heap, hb, L, Wire::kGather);
  const int blocks = static_cast<int>((g.C + kWarps - 1) / kWarps);
  JEP_LAUNCH(GatherUnpackKernel, blocks < 1024 ? blocks : 1024, kThreads, 0, stream)(
      g, counts, Rt().scratch, heap, hb, L, static_cast<char*>(out));
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
  Transport::put_signal_warp(area + kBytes, area, kBytes, sig, 1, SignalOp::kSet, me, 0);
  if (threadIdx.x == 0) {
    Transport::quiet();
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

std::string SharedState(SharedRuntime* out) {
  if (!Rt().initialized)
    return "jax_ep internode: NVSHMEM is not initialised; call "
           "jax_ep.nvshmem_bootstrap.initialize(...) before jit";
  void* counter = nullptr;
  const std::string e = CudaErr(cudaGetSymbolAddress(&counter, g_call_counter), "call counter");
  if (!e.empty()) return e;
  out->heap = Rt().heap;
  out->half_bytes = Rt().half_bytes;
  out->err = Rt().err;
  out->bad = Rt().bad;
  out->call_counter = static_cast<unsigned long long*>(counter);
  out->rank = Rt().rank;
  out->world = Rt().world;
  out->num_qps = Rt().num_qps;
  return {};
}

std::string SelfPutCheck(bool* ok) {
  *ok = false;
  if (!Rt().initialized) return "jax_ep internode: NVSHMEM is not initialised";
  if (Rt().half_bytes < 8192 + 256) return "jax_ep internode: heap too small for the check";
  std::string e = CudaErr(cudaDeviceSynchronize(), "self put");
  // Uses the data area of the half the next call would use, then clears it again.
  unsigned long long counter = 0;
  if (e.empty()) e = CudaErr(cudaMemcpyFromSymbol(&counter, g_call_counter, sizeof(counter)),
                             "call counter");
  if (!e.empty()) return e;
  const HeapLayout L = heap_layout(Rt().world, 0, 1, 0, 1, 0, 0);
  char* area = Rt().heap + (counter & 1ull) * Rt().half_bytes + L.recv;
  if (static_cast<size_t>(L.recv) + 8192 + 256 > Rt().half_bytes)
    return "jax_ep internode: heap too small for the check";
  uint64_t* sig = reinterpret_cast<uint64_t*>(area + 8192);
  int* dok = Rt().bad;  // reused as the result cell, cleared below
  JEP_LAUNCH(SelfPutKernel, 1, 32, 0, nullptr)(area, sig, dok);
  int host = 0;
  e = CudaErr(cudaMemcpy(&host, dok, sizeof(int), cudaMemcpyDeviceToHost), "self put");
  if (e.empty()) e = CudaErr(cudaMemset(area, 0, 8192 + 256), "self put cleanup");
  if (e.empty()) e = CudaErr(cudaMemset(dok, 0, sizeof(int)), "self put cleanup");
  if (!e.empty()) return e;
  *ok = host == 1;
  return {};
}

}  // namespace internode
}  // namespace jax_ep
