// Hierarchical internode dispatch, combine and gather (NVSHMEM backend of
// kernels/internode/transport.cuh). The protocol is the one tests/sim/hierarchical_sim.py
// replays on the host; the layout is kernels/internode/hierarchical_layout.h; docs in
// docs/internode.md ("Hierarchical mode"). Ranks are node-major, rank = node * G + local.
//
// Every call: an exchange of count rows on QP 0 (dispatch and gather carry the rows each
// rank sends every rank and every node; the signal value itself carries the sequence
// number, the configuration hash and the bad-id flag, so a mismatch or a peer's bad id
// fails the call on every rank), then one cooperative kernel whose warps play the roles
// of the simulator's actors, so every ring has a producer and a consumer running at once:
//
// Dispatch / gather (gather: dispatch's paths for rows of g, routed by the handle)
//   sender m        rows of this rank's tokens with a receiver on node m, in token order,
//                   packed into the staging ring, chunk c put on QP qp_for(rail peer, c)
//                   with ADD 1 on word data[my node][qp] there, once the credit word of
//                   node m covers the slot (hier::credit_needed); closing signal per QP;
//                   the final credit wait, then the sender resets its credit word.
//   local forwarder the rows of this rank's tokens for its own node, straight into the
//                   receivers' NVLink rings (no RDMA).
//   rail forwarder  per remote node n: chunk by chunk (bounded wait on the chunk's own
//                   QP word), each row pushed to every receiver of this node in its node
//                   mask that keeps it (the receiver row is computed here, as the
//                   capacity cut is per receiver), then a credit (SET c+1, QP 0); after
//                   the closing signals, the reader resets its data words.
//   receivers       poll the NVLink rings [forwarder][source node] of this rank without
//                   blocking on any one, write each row at its destination row.
//   The sender and forwarders run as parts, a warp each (configs.h): a sender's part owns
//   the chunks of a set of QPs (so each QP's chunks stay in order), a forwarder's part a
//   set of the node's receivers, itself as column parts (HierForwardColumns, one by
//   default) on consecutive blocks that each copy a slice of every row; column part 0 writes the
//   row's words and releases a ring's tail once every column part has marked its rows
//   written (so each ring's tail keeps one writer). The rail forwarder's part 0 credits
//   a chunk once every part is done with it. The role warps spread over
//   the mode's SMs in blocks (configs.h InternodeModeSms), each block a slice of every role.
// Combine
//   pushers         every row this rank holds from source s goes, in token order, into
//                   the NVLink ring at s's rail peer on this node (s itself when s is on
//                   this node); a pusher per source up to 64 ranks (kMaxPushWarps),
//                   as parts (configs.h HierPushParts) on consecutive blocks, a warp
//                   each copying a slice of every row; part 0 releases a batch all
//                   have written, in batches of half a ring (kPushRows).
//   forwarder n     merges the rings of the source (n, my local) by token; per token the
//                   node partial (its rows in ascending rank order summed in float32 and
//                   rounded to the row dtype, kernels/common/combine_order.h): one row per
//                   (token, node) in one RDMA stream (chunked, credited) back to the source,
//                   as many rows as the dispatch sent this way. Parts, a warp each, sum
//                   slices of the columns; part 0 frees and puts a chunk all have written.
//   source          blocks [0, nsrc) (configs.h HierSourceBlocks), each a slice of the
//                   columns: windows of one token per warp, per token the node partials
//                   in ascending node order (its own node's summed here from the NVLink
//                   rings), added in float32, each lane 16 bytes of every row at a time;
//                   block 0 frees a window's rows once every block has summed its slice.
// NVLink ring tails are published once per batch of rows (a chunk, 32 tokens, or what the
// ring holds): one system fence per lane and one release per ring, never one per row.
//
// Every wait is bounded (JAX_EP_TIMEOUT_S) and records the peer and the word it waited
// for in the sticky error record it shares with the direct mode; NVLink ring head/tail
// words are reset by the ring's owner once every row it expects has been consumed.
//
// This file holds the kernels and their launchers (declared in kernels/internode/api.cuh);
// the host side -- a call's checks and geometry, the per-call host code, the error text --
// is kernels/internode/hierarchical_host.cu.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <climits>
#include <string>
#include <utility>

#include "kernels/common/combine_order.h"
#include "kernels/common/configs.h"
#include "kernels/common/dtype_convert.h"
#include "kernels/common/layout_math.h"
#include "kernels/common/striping_plan.h"
#include "kernels/internode/api.cuh"
#include "kernels/internode/device_copy.cuh"
#include "kernels/internode/hierarchical_kernels.h"
#include "kernels/internode/hierarchical_layout.h"
#include "kernels/internode/internode_kernels.h"
#include "kernels/internode/transport_select.cuh"
#include "kernels/internode/wire_protocol.h"

namespace jax_ep {
namespace hier {
namespace JEP_TR_NS {  // this build's transport (transport_select.cuh)
namespace {

// RDMA streams and credits go to the same local GPU of other nodes (rail connections);
// the count exchange reaches every rank.
using Tr = transport::JEP_TR_NS::TransportFor<transport::Conn::kRail>;
using TrAll = transport::JEP_TR_NS::TransportFor<transport::Conn::kFull>;
using transport::Sig;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr unsigned kFull = 0xffffffffu;
// SourceRole moves each node's credit and each own-node ring's head from a thread of its
// own (tid == node, tid == local rank) after one __syncthreads, with no loop.
static_assert(kMaxNodes <= kThreads && kMaxGpusPerNode <= kThreads,
              "SourceRole's per-node and per-ring releases take one thread each");
// Combine pushers at most: each serves ceil(R / kMaxPushWarps) sources (one up to 64
// ranks, so every source's rows have a pusher of their own and the pushers spread over
// blocks; at most 32, a lane each).
constexpr int kMaxPushWarps = 64;
// Pointers into this call's half.
struct View {
  uint64_t *data, *credit, *cnt_sig, *head, *tail;
  int32_t* counts;  // [R][R + N]
  char *send, *recv, *nvl;
};

__device__ __forceinline__ View ViewOf(const Geo& g) {
  char* b = g.heap + static_cast<int64_t>(*g.counter & 1ull) * g.half_bytes + g.region;
  View v;
  v.data = reinterpret_cast<uint64_t*>(b + g.L.sig_data);
  v.credit = reinterpret_cast<uint64_t*>(b + g.L.sig_credit);
  v.cnt_sig = reinterpret_cast<uint64_t*>(b + g.L.sig_counts);
  v.head = reinterpret_cast<uint64_t*>(b + g.L.nvl_head);
  v.tail = reinterpret_cast<uint64_t*>(b + g.L.nvl_tail);
  v.counts = reinterpret_cast<int32_t*>(b + g.L.counts);
  v.send = b + g.L.rdma_send;
  v.recv = b + g.L.rdma_recv;
  v.nvl = b + g.L.nvl_recv;
  return v;
}

__device__ __forceinline__ uint64_t* DataWord(const View& v, const Geo& g, int n, int q) {
  return v.data + static_cast<int64_t>(n) * g.nq + q;
}
__device__ __forceinline__ uint64_t* HeadW(const View& v, const Geo& g, int gl, int n) {
  return v.head + static_cast<int64_t>(gl) * g.N + n;
}
__device__ __forceinline__ uint64_t* TailW(const View& v, const Geo& g, int gl, int n) {
  return v.tail + static_cast<int64_t>(gl) * g.N + n;
}
__device__ __forceinline__ char* SendSlot(const View& v, const Geo& g, int m, int64_t c) {
  return v.send + m * g.rdma_ring_bytes + rdma_slot(c) * kRdmaChunkRows * g.stride;
}
__device__ __forceinline__ char* RecvSlot(const View& v, const Geo& g, int n, int64_t c) {
  return v.recv + n * g.rdma_ring_bytes + rdma_slot(c) * kRdmaChunkRows * g.stride;
}
__device__ __forceinline__ char* NvlRing(const View& v, const Geo& g, int gl, int n) {
  return v.nvl + (static_cast<int64_t>(gl) * g.N + n) * g.nvl_ring_bytes;
}

__device__ __forceinline__ uint64_t NowNs() { return peer::global_timer_ns(); }
// NVLink ring positions: written by one GPU's stores, read by another's loads.
__device__ __forceinline__ uint64_t LoadAcq(const uint64_t* p) { return peer::load_acquire(p); }
__device__ __forceinline__ void StoreRel(uint64_t* p, uint64_t v) { peer::signal(p, v); }

__device__ __forceinline__ bool Failed(const Geo& g) {
  return *reinterpret_cast<volatile const int32_t*>(&g.err->code) != wire::kErrNone;
}

// First error wins; fields before the code, so the host never reads half a record.
__device__ void Record(const Geo& g, int32_t code, int peer, int kind, int qp,
                       uint64_t expected, uint64_t seen, uint64_t my_seq = 0,
                       uint64_t peer_seq = 0) {
  if (atomicCAS_system(&g.err->code, wire::kErrNone, -1) != wire::kErrNone) return;
  volatile wire::ErrorRecord* e = g.err;
  e->rank = g.rank;
  e->op = g.cfg[wire::kCfgOp];
  e->peer = peer;
  e->kind = kind;
  e->qp = qp;
  e->expected = expected;
  e->seen = seen;
  e->my_seq = my_seq;
  e->peer_seq = peer_seq;
  for (int i = 0; i < wire::kNumCfgFields; ++i) {
    e->mine[i] = g.cfg[i];
    e->theirs[i] = 0;
  }
  __threadfence_system();
  e->code = code;
  __threadfence_system();
}

// One thread: polls `read()` until it reaches `expect`, for at most the timeout; on
// expiry records (peer, kind, qp). False if it expired or the call already failed.
template <class Read>
__device__ bool WaitAtLeast(const Geo& g, Read read, uint64_t expect, int peer, int kind,
                            int qp) {
  const uint64_t start = NowNs();
  uint64_t v = read();
  for (int spin = 0; v < expect; ++spin) {
    if ((spin & 255) == 0) {
      if (Failed(g)) return false;
      if (static_cast<int64_t>(NowNs() - start) > g.timeout_ns) {
        Record(g, wire::kErrTimeout, peer, kind, qp, expect, v);
        return false;
      }
    }
    v = read();
  }
  return true;
}

// Lane 0 waits for an RDMA signal word; the warp gets the outcome.
__device__ __forceinline__ bool WarpWaitSig(const Geo& g, uint64_t* w, uint64_t expect,
                                            int peer, int kind, int qp) {
  int ok = 1;
  if ((threadIdx.x & 31) == 0)
    ok = WaitAtLeast(g, [w] { return Tr::fetch(w); }, expect, peer, kind, qp) ? 1 : 0;
  return __shfl_sync(kFull, ok, 0) != 0;
}

using devcopy::CopyBytes;
// Every store a row makes into a ring (payload, ids, weights, meta words) goes through the
// copy helpers: a peer's NVLink ring is written with plain stores that its reader may see
// only after the writer's fence (the emulated GPU buffers them until then).
using devcopy::StoreWord;

// Row counts from a count matrix with row stride `cs`: first row of source s at d, and
// the rows of s that d keeps under the capacity.
__device__ __forceinline__ int64_t BaseOf(const int32_t* cnt, int cs, int s, int d) {
  int64_t b = 0;
  for (int i = 0; i < s; ++i) b += cnt[static_cast<int64_t>(i) * cs + d];
  return b;
}
__device__ __forceinline__ int64_t KeptOf(const int32_t* cnt, int cs, int s, int d, int C) {
  const int64_t b = BaseOf(cnt, cs, s, d);
  const int64_t n = cnt[static_cast<int64_t>(s) * cs + d];
  const int64_t room = C - b;
  return room <= 0 ? 0 : (n < room ? n : room);
}

// Local indices (bit g) of the receivers on node m of token t: from its expert ids
// (dispatch) or from the handle's send slots (gather). The same function sizes the
// node's stream in the count exchange and selects its rows, so the two agree.
__device__ __forceinline__ uint32_t NodeMask(const Geo& g, int t, int m,
                                             const int32_t* topk_idx,
                                             const int32_t* send_slot) {
  uint32_t mask = 0;
  if (topk_idx != nullptr) {
    for (int k = 0; k < g.K; ++k) {
      const int32_t e = topk_idx[static_cast<int64_t>(t) * g.K + k];
      if (e < 0) continue;
      const int d = owner_rank(e, g.el);
      if (d < g.R && d / g.G == m) mask |= 1u << (d % g.G);
    }
  } else {
    for (int l = 0; l < g.G; ++l)
      if (send_slot[static_cast<int64_t>(t) * g.R + m * g.G + l] >= 0) mask |= 1u << l;
  }
  return mask;
}

__device__ __forceinline__ int Lane() { return threadIdx.x & 31; }

// ---- count exchange ------------------------------------------------------------------

// Items [0, R): send slots (dispatch only) and rows for rank d; items [R, R + N): tokens
// with a receiver on node m; item b on block b mod the grid (cut to the mode's SMs). Item 0
// of a dispatch also notes bad ids.
__global__ void CountKernel(Geo g, const int32_t* topk_idx, const int32_t* send_slot_in,
                            int32_t* send_slot_out) {
  const View v = ViewOf(g);
  __shared__ int warp_total[kWarps];
  __shared__ int running;
  const int lane = Lane(), warp = threadIdx.x >> 5;
  for (int b = blockIdx.x; b < g.R + g.N; b += gridDim.x) {  // block-uniform
    if (threadIdx.x == 0) running = 0;
    __syncthreads();
    for (int base = 0; base < g.T; base += kThreads) {
      const int t = base + threadIdx.x;
      bool hit = false;
      if (t < g.T) {
        if (b < g.R) {
          hit = topk_idx != nullptr
                    ? token_in_rank(topk_idx + static_cast<int64_t>(t) * g.K, g.K, g.el, b)
                    : send_slot_in[static_cast<int64_t>(t) * g.R + b] >= 0;
        } else {
          hit = NodeMask(g, t, b - g.R, topk_idx, send_slot_in) != 0;
        }
        if (b == 0 && topk_idx != nullptr) {
          for (int k = 0; k < g.K; ++k) {
            const int32_t e = topk_idx[static_cast<int64_t>(t) * g.K + k];
            if ((e < -1 || e >= g.E) && atomicCAS(g.bad, 0, 1) == 0) {
              g.bad[1] = t;
              g.bad[2] = k;
              g.bad[3] = e;
            }
          }
        }
      }
      const unsigned mask = __ballot_sync(kFull, hit);
      if (lane == 0) warp_total[warp] = __popc(mask);
      __syncthreads();
      int off = running;
      for (int w = 0; w < warp; ++w) off += warp_total[w];
      if (t < g.T && b < g.R && send_slot_out != nullptr)
        send_slot_out[static_cast<int64_t>(t) * g.R + b] =
            hit ? off + __popc(mask & ((1u << lane) - 1u)) : -1;
      __syncthreads();
      if (threadIdx.x == 0)
        for (int w = 0; w < kWarps; ++w) running += warp_total[w];
      __syncthreads();
    }
    if (threadIdx.x == 0) v.counts[static_cast<int64_t>(g.rank) * (g.R + g.N) + b] = running;
    __syncthreads();  // `running` is read above before the next item resets it
  }
}

// The signal value of the exchange: nonzero, the bad-id flag, 30 bits of the sequence
// number and the configuration hash.
__device__ __forceinline__ uint64_t HeaderValue(uint64_t seq, uint32_t hash, bool bad) {
  return (1ull << 63) | (bad ? 1ull << 62 : 0ull) | ((seq & 0x3fffffffull) << 32) | hash;
}

// One block: puts this rank's count row to every peer on QP 0 with a SET of the header
// value into word cnt_sig[rank] there; then thread s waits (bounded) for source s's
// word, checks it and resets it (its reader). A peer in another call or with bad ids
// fails the call on every rank alike.
__global__ void ExchangeKernel(Geo g, bool with_rows) {
  const View v = ViewOf(g);
  const int warp = threadIdx.x >> 5;
  const uint64_t seq = *g.counter;
  __shared__ int skip;
  if (threadIdx.x == 0) skip = Failed(g) ? 1 : 0;
  __syncthreads();
  if (skip) return;  // an earlier call failed: stay silent, peers time out
  const bool bad = g.bad[0] != 0;
  const uint64_t mine = HeaderValue(seq, g.hash, bad);
  int32_t* row = v.counts + static_cast<int64_t>(g.rank) * (g.R + g.N);
  const size_t row_bytes = with_rows ? sizeof(int32_t) * (g.R + g.N) : sizeof(int32_t);
  for (int i = 1 + warp; i < g.R; i += kWarps) {
    const int peer = (g.rank + i) % g.R;
    // the reader resets its word after reading it: a SET from 0
    TrAll::put_signal_warp(row, row, row_bytes, transport::Set(v.cnt_sig + g.rank, mine, 0),
                           peer, wire::kControlQp);
  }
  TrAll::quiet_warp();
  if (threadIdx.x == 0 && bad)
    Record(g, wire::kErrBadId, g.bad[1], 0, g.bad[2], static_cast<uint64_t>(g.E),
           static_cast<uint64_t>(static_cast<int64_t>(g.bad[3])));
  for (int s = threadIdx.x; s < g.R; s += blockDim.x) {
    if (s == g.rank) continue;
    uint64_t* w = v.cnt_sig + s;
    if (!WaitAtLeast(g, [w] { return Tr::fetch(w); }, 1, s, wire::kSigCounts,
                     wire::kControlQp))
      continue;
    const uint64_t theirs = Tr::fetch(w);
    *w = 0;
    const uint64_t want = HeaderValue(seq, g.hash, false);
    if ((theirs & ~(1ull << 62)) != want)
      Record(g, wire::kErrMismatch, s, wire::kSigCounts, wire::kControlQp, g.hash,
             theirs & 0xffffffffull, seq & 0x3fffffffull, (theirs >> 32) & 0x3fffffffull);
    else if (theirs & (1ull << 62))
      Record(g, wire::kErrPeerFailed, s, wire::kSigCounts, wire::kControlQp, 0, 0);
  }
}

// ---- dispatch and gather ---------------------------------------------------------------

// Writes a dispatch-pattern row: payload bytes [b0, b1) (all when b1 < 0), and with
// `words` the K ids and weights (dispatch) and the metadata.
__device__ __forceinline__ void WriteRow(const Geo& g, char* dst, const char* payload,
                                         const int32_t* topk_idx, const float* topk_w, int t,
                                         uint32_t mask, int64_t dest, int64_t b0 = 0,
                                         int64_t b1 = -1, bool words = true) {
  const int lane = Lane();
  if (b1 < 0) b1 = g.prow;
  CopyBytes(dst + b0, payload + static_cast<int64_t>(t) * g.prow + b0, b1 - b0, lane, 32);
  if (!words) return;
  if (topk_idx != nullptr) {
    int32_t* ids = reinterpret_cast<int32_t*>(dst + meta_offset(g.prow));
    float* ws = reinterpret_cast<float*>(ids + g.K);
    for (int k = lane; k < g.K; k += 32) {
      StoreWord(ids + k, topk_idx[static_cast<int64_t>(t) * g.K + k]);
      StoreWord(ws + k, topk_w[static_cast<int64_t>(t) * g.K + k]);
    }
  }
  if (lane == 0) {
    int32_t* meta = reinterpret_cast<int32_t*>(dst + g.dmeta);
    StoreWord(meta + 0, static_cast<int32_t>(t));
    StoreWord(meta + 1, static_cast<int32_t>(g.rank));
    StoreWord(meta + 2, static_cast<int32_t>(mask));
    StoreWord(meta + 3, static_cast<int32_t>(dest));
  }
}

// Chunks of a stream each rail forwarder part is done with, per (source node, part): the
// call (*counter + 1) in the high 32 bits, the chunks in the low ones. Part 0 waits for
// the others before it frees a chunk they all read.
JEP_DEVICE_GLOBAL uint64_t g_fwd_done[kMaxNodes * kMaxHierParts];
// Rows each column part of a forwarder has written, per (source node, part): FwdCols.
JEP_DEVICE_GLOBAL uint64_t g_fwd_cols[kMaxNodes * kMaxHierParts];
static_assert(kHierForwardParts * kHierForwardColumns <= kMaxHierParts,
              "a forwarder's receiver and column parts index one word each");

__device__ __forceinline__ uint64_t CallTag(const Geo& g) {
  return static_cast<uint64_t>(*g.counter + 1ull) << 32;
}

// Lane 0 of part 0: waits (bounded) until every other part's word of `words` (np parts)
// reaches `mark`.
__device__ bool JoinParts(const Geo& g, const uint64_t* words, int np, uint64_t mark) {
  for (int b = 1; b < np; ++b) {
    const uint64_t* w = words + b;
    if (!WaitAtLeast(g, [w] { return LoadAcq(w); }, mark, g.rank, kKindPart, b)) return false;
  }
  return true;
}

// A forwarder's view of the receivers of its node for one source: lane l < G holds
// receiver (node, l)'s numbering, capacity cut and NVLink ring (peer pointers).
struct FwdLane {
  long long sent = 0, base = 0, kept = 0;
  unsigned long long tail = 0;  // rows written into the ring
  unsigned long long pub = 0;   // rows published (the tail word's value)
  char* ring = nullptr;
  uint64_t* head = nullptr;
  uint64_t* tailw = nullptr;
};

__device__ bool FwdSetup(const Geo& g, const View& v, const int32_t* cnt, int cs, int s,
                         FwdLane* f) {
  const int lane = Lane();
  int ok = 1;
  if (lane < g.G) {
    const int d = g.node * g.G + lane;
    f->base = BaseOf(cnt, cs, s, d);
    f->kept = KeptOf(cnt, cs, s, d, g.C);
    const int ns = s / g.G;
    f->ring = static_cast<char*>(Tr::peer_ptr(NvlRing(v, g, g.local, ns), d));
    f->head = static_cast<uint64_t*>(Tr::peer_ptr(HeadW(v, g, g.local, ns), d));
    f->tailw = static_cast<uint64_t*>(Tr::peer_ptr(TailW(v, g, g.local, ns), d));
    ok = f->ring != nullptr && f->head != nullptr && f->tailw != nullptr;
    if (!ok) Record(g, wire::kErrTimeout, d, kKindNoPeer, 0, 1, 0);
  }
  return __all_sync(kFull, ok) != 0;
}

template <class P>
__device__ __forceinline__ P* ShflPtr(P* p, int src) {
  return reinterpret_cast<P*>(
      __shfl_sync(kFull, reinterpret_cast<unsigned long long>(p), src));
}

// A forwarder part's column slice: part q of cq copies payload bytes [b0, b1) of every
// row it forwards (part 0 also the row's words). All parts of a forwarder forward the
// same rows in the same order; `writes` counts them. Before part 0 releases a tail, every
// other part has fenced its slices of the rows behind it and marked its count in
// words[q] (the call's tag in the high 32 bits).
struct FwdCols {
  uint64_t* words = nullptr;
  uint64_t tag = 0;
  long long writes = 0;
  int64_t b0 = 0, b1 = 0;
  int q = 0, cq = 1;
};

// Columns [b0, b1) of part q of cq over a row of `bytes` bytes: whole 16-byte vectors.
__device__ __forceinline__ void ColumnSlice(int64_t bytes, int q, int cq, int64_t* b0,
                                            int64_t* b1) {
  const int64_t units = (bytes + 15) / 16;
  *b0 = 16 * (units * q / cq) < bytes ? 16 * (units * q / cq) : bytes;
  *b1 = 16 * (units * (q + 1) / cq) < bytes ? 16 * (units * (q + 1) / cq) : bytes;
}

// Publishes every ring's rows written since its last publication: one system fence per
// lane (each lane wrote a part of the rows) and one release of each tail that moved, per
// chunk of rows, never per row. With column parts only part 0 releases, once every part
// has marked the rows written. False when that wait timed out.
__device__ bool NvlFlush(const Geo& g, FwdLane* f, FwdCols* c) {
  const bool dirty = f->tail > f->pub;
  if (!__any_sync(kFull, dirty)) return true;
  __threadfence_system();
  __syncwarp();
  if (c->cq > 1) {
    int ok = 1;
    if (Lane() == 0) {
      const uint64_t mark = c->tag | static_cast<uint64_t>(c->writes);
      if (c->q != 0) StoreRel(c->words + c->q, mark);
      else ok = JoinParts(g, c->words, c->cq, mark) ? 1 : 0;
    }
    if (!__shfl_sync(kFull, ok, 0)) return false;
  }
  if (dirty) {
    if (c->q == 0) StoreRel(f->tailw, f->tail);
    f->pub = f->tail;
  }
  __syncwarp();
  return true;
}

// Waits (lane 0, bounded) for room in receiver l's ring; its slot, or null on failure.
// A full ring is flushed first, so its reader can free it. Every column part waits for the
// same room: a part behind part 0 finds it there, since part 0 passed the same wait.
__device__ char* NvlReserve(const Geo& g, FwdLane* f, FwdCols* c, int l) {
  const unsigned long long tail = __shfl_sync(kFull, f->tail, l);
  uint64_t* head = ShflPtr(f->head, l);
  int wait = 0;
  if (Lane() == 0 && tail >= static_cast<unsigned long long>(kNvlRingRows))
    wait = LoadAcq(head) < tail + 1 - kNvlRingRows ? 1 : 0;
  int ok = 1;
  if (__shfl_sync(kFull, wait, 0)) {
    if (!NvlFlush(g, f, c)) return nullptr;
    if (Lane() == 0)
      ok = WaitAtLeast(g, [head] { return LoadAcq(head); }, tail + 1 - kNvlRingRows,
                       g.node * g.G + l, kKindNvl, l) ? 1 : 0;
  }
  if (!__shfl_sync(kFull, ok, 0)) return nullptr;
  return ShflPtr(f->ring, l) + nvl_slot(static_cast<int64_t>(tail)) * g.stride;
}

// Counts the row just written into receiver l's ring; NvlFlush publishes it.
__device__ __forceinline__ void NvlWritten(FwdLane* f, FwdCols* c, int l) {
  __syncwarp();
  if (Lane() == l) f->tail += 1;
  c->writes += 1;
  __syncwarp();
}

// Hands one row (at `row`, already in this GPU's memory, or composed from the inputs
// when `row` is null) to every receiver of this node in `mask` that keeps it: this
// column part's slice of it (part 0 also its words).
__device__ bool Forward(const Geo& g, FwdLane* f, FwdCols* c, uint32_t mask, const char* row,
                        const char* payload, const int32_t* topk_idx, const float* topk_w,
                        int t) {
  while (mask != 0) {
    const int l = __ffs(mask) - 1;
    mask &= mask - 1;
    const long long slot = __shfl_sync(kFull, f->sent, l);
    const long long kept = __shfl_sync(kFull, f->kept, l);
    const long long base = __shfl_sync(kFull, f->base, l);
    if (Lane() == l) f->sent = slot + 1;
    if (slot >= kept) continue;  // past the capacity there: dropped, never forwarded
    char* dst = NvlReserve(g, f, c, l);
    if (dst == nullptr) return false;
    if (row != nullptr) {
      devcopy::CopyLanded(dst + c->b0, row + c->b0, c->b1 - c->b0, Lane(), 32);
      if (c->q == 0) {
        const int64_t m0 = meta_offset(g.prow);
        devcopy::CopyLanded(dst + m0, row + m0, g.stride - m0, Lane(), 32);
        __syncwarp();
        if (Lane() == 0)
          StoreWord(reinterpret_cast<int32_t*>(dst + g.dmeta) + 3,
                    static_cast<int32_t>(base + slot));
      }
    } else {
      WriteRow(g, dst, payload, topk_idx, topk_w, t, 0, base + slot, c->b0, c->b1, c->q == 0);
    }
    NvlWritten(f, c, l);
  }
  return true;
}

// The QP of chunk c of a stream to `peer`: the striping plan's, channel c % nq. Every QP
// is used once per nq consecutive chunks (channels are a bijection onto QPs), so chunk c
// is number c / nq on its QP.
__device__ __forceinline__ int ChunkQp(const Geo& g, int peer, int64_t c) {
  return qp_for(peer, static_cast<int32_t>(c % g.nq), c, g.P, g.Qpp).qp;
}

// Waits (bounded) for every closing signal of a stream of `chunks` chunks from node n's
// peer `peer`, checks none holds more, then resets the words (their reader).
__device__ bool CloseStream(const Geo& g, const View& v, int n, int peer, int64_t chunks,
                            int kind) {
  int ok = 1;
  for (int q = Lane(); q < g.nq; q += 32) {
    uint64_t* w = DataWord(v, g, n, q);
    const uint64_t expect = wire::expected_signal(chunks, g.rank, q, g.P, g.Qpp);
    if (!WaitAtLeast(g, [w] { return Tr::fetch(w); }, expect, peer, kind, q)) {
      ok = 0;
      continue;
    }
    const uint64_t seen = Tr::fetch(w);
    if (seen != expect) {
      Record(g, wire::kErrExtraSignal, peer, kind, q, expect, seen);
      ok = 0;
    }
    *w = 0;
  }
  return __all_sync(kFull, ok) != 0;
}

// Part p of sp of the stream's writer: the closing signal on its own QPs (those of the
// chunks it put); then part 0 waits for the final credit (no credit of this call may land
// after the word is reset) and resets the word. No part can still read the word then:
// the final credit covers every chunk, and a chunk is put only after its part's wait.
__device__ void EndStream(const Geo& g, const View& v, int m, int peer, int64_t chunks,
                          int data_node, int p, int sp) {
  for (int ch = Lane(); ch < g.nq; ch += 32)
    if (ch % sp == p)
      Tr::signal(transport::Add(DataWord(v, g, data_node, ChunkQp(g, peer, ch)), 1), peer,
                 ChunkQp(g, peer, ch));
  __syncwarp();
  if (Lane() == 0 && p == 0) {
    uint64_t* cw = v.credit + m;
    if (WaitAtLeast(g, [cw] { return Tr::fetch(cw); }, static_cast<uint64_t>(chunks), peer,
                    kKindCredit, 0))
      *cw = 0;
  }
  __syncwarp();
}

// Chunk c (rows of the staging slot for node m) to `peer`, data and signal on its QP.
__device__ __forceinline__ void PutChunk(const Geo& g, const View& v, int m, int peer,
                                         int64_t c, int64_t rows) {
  __syncwarp();
  __threadfence();
  const int q = ChunkQp(g, peer, c);
  Tr::put_signal_warp(RecvSlot(v, g, g.node, c), SendSlot(v, g, m, c),
                      static_cast<size_t>(rows * g.stride),
                      transport::Add(DataWord(v, g, g.node, q), 1), peer, q);
}

// Waits (bounded) for the credit that frees the staging slot of chunk c.
__device__ __forceinline__ bool WaitCredit(const Geo& g, const View& v, int m, int peer,
                                           int64_t c) {
  const int64_t need = credit_needed(c);
  if (need == 0) return true;
  return WarpWaitSig(g, v.credit + m, static_cast<uint64_t>(need), peer, kKindCredit, 0);
}

// Sender part p of sp to node m's rail peer: the rows of this rank's tokens with a
// receiver on m. Every part numbers all the rows; part p writes and puts chunks
// c = p (mod sp), so the chunks of one QP (sp divides the QP count) go in order.
__device__ void SendRole(const Geo& g, const View& v, int m, int p, int sp,
                         const char* payload, const int32_t* topk_idx, const float* topk_w,
                         const int32_t* send_slot) {
  const int peer = m * g.G + g.local;
  int64_t o = 0;
  for (int tb = 0; tb < g.T; tb += 32) {
    const int t = tb + Lane();
    const uint32_t mask = t < g.T ? NodeMask(g, t, m, topk_idx, send_slot) : 0u;
    const unsigned any = __ballot_sync(kFull, mask != 0);
    // the rows of these tokens: o .. o + popc(any); skip them unless a chunk is ours
    const int64_t c0 = o / kRdmaChunkRows, c1 = (o + __popc(any) - 1) / kRdmaChunkRows;
    bool mine = false;
    for (int64_t c = c0; c <= c1 && !mine && any != 0; ++c) mine = c % sp == p;
    if (!mine) {
      o += __popc(any);
      continue;
    }
    unsigned todo = any;
    while (todo != 0) {
      const int l = __ffs(todo) - 1;
      todo &= todo - 1;
      const int64_t c = o / kRdmaChunkRows, j = o % kRdmaChunkRows;
      ++o;
      if (c % sp != p) continue;
      const uint32_t mm = __shfl_sync(kFull, mask, l);
      if (j == 0 && !WaitCredit(g, v, m, peer, c)) return;
      WriteRow(g, SendSlot(v, g, m, c) + j * g.stride, payload, topk_idx, topk_w, tb + l, mm,
               -1);
      if (j == kRdmaChunkRows - 1) PutChunk(g, v, m, peer, c, kRdmaChunkRows);
    }
  }
  if (o % kRdmaChunkRows != 0 && (o / kRdmaChunkRows) % sp == p)
    PutChunk(g, v, m, peer, o / kRdmaChunkRows, o % kRdmaChunkRows);
  EndStream(g, v, m, peer, (o + kRdmaChunkRows - 1) / kRdmaChunkRows, g.node, p, sp);
}

// The receivers of this node that forwarder part p of fp serves: l = p (mod fp).
__device__ __forceinline__ uint32_t PartReceivers(const Geo& g, int p, int fp) {
  uint32_t own = 0;
  for (int l = p; l < g.G; l += fp) own |= 1u << l;
  return own;
}

// Column part q of cq of forwarder part p of fp for source node n.
__device__ FwdCols ColumnsOf(const Geo& g, int n, int p, int q, int cq) {
  FwdCols c;
  c.words = g_fwd_cols + static_cast<int64_t>(n) * kMaxHierParts + p * cq;
  c.tag = CallTag(g);
  c.q = q;
  c.cq = cq;
  ColumnSlice(g.prow, q, cq, &c.b0, &c.b1);
  return c;
}

// This rank's own tokens for its own node: straight into the receivers' rings.
// Part p of fp: the rings of its own receivers only (each ring's rows written by that
// part's cq column parts, released by column part 0).
__device__ void LocalForwardRole(const Geo& g, const View& v, int p, int fp, int q, int cq,
                                 const char* payload, const int32_t* topk_idx,
                                 const float* topk_w, const int32_t* send_slot) {
  FwdLane f;
  if (!FwdSetup(g, v, v.counts, g.R + g.N, g.rank, &f)) return;
  FwdCols cols = ColumnsOf(g, g.node, p, q, cq);
  const uint32_t own = PartReceivers(g, p, fp);
  for (int tb = 0; tb < g.T; tb += 32) {
    const int t = tb + Lane();
    const uint32_t mask =
        t < g.T ? NodeMask(g, t, g.node, topk_idx, send_slot) & own : 0u;
    unsigned todo = __ballot_sync(kFull, mask != 0);
    while (todo != 0) {
      const int l = __ffs(todo) - 1;
      todo &= todo - 1;
      if (!Forward(g, &f, &cols, __shfl_sync(kFull, mask, l), nullptr, payload, topk_idx,
                   topk_w, tb + l))
        return;
    }
    if (!NvlFlush(g, &f, &cols)) return;  // the rows of these 32 tokens: one release per ring
  }
}

// Rail forwarder part p of fp, column part q of cq, for the source (n, my local index):
// chunk by chunk from the RDMA ring to its own receivers of this node; part (0, 0)
// credits a chunk once every part has published its rows of it, and closes the stream.
__device__ void RailForwardRole(const Geo& g, const View& v, int n, int p, int fp, int q,
                                int cq) {
  const int s = n * g.G + g.local;
  const int cs = g.R + g.N;
  FwdLane f;
  if (!FwdSetup(g, v, v.counts, cs, s, &f)) return;
  FwdCols cols = ColumnsOf(g, n, p, q, cq);
  const int part = p * cq + q;
  const uint32_t own = PartReceivers(g, p, fp);
  uint64_t* done = g_fwd_done + static_cast<int64_t>(n) * kMaxHierParts;
  const uint64_t tag = CallTag(g);
  const int64_t rows = v.counts[static_cast<int64_t>(s) * cs + g.R + g.node];
  const int64_t chunks = (rows + kRdmaChunkRows - 1) / kRdmaChunkRows;
  for (int64_t c = 0; c < chunks; ++c) {
    const int qp = ChunkQp(g, g.rank, c);
    if (!WarpWaitSig(g, DataWord(v, g, n, qp), static_cast<uint64_t>(c / g.nq + 1), s,
                     wire::kSigDispatch, qp))
      return;
    const char* slot = RecvSlot(v, g, n, c);
    const int64_t nr = rows - c * kRdmaChunkRows < kRdmaChunkRows ? rows - c * kRdmaChunkRows
                                                                  : kRdmaChunkRows;
    for (int64_t j = 0; j < nr; ++j) {
      const char* row = slot + j * g.stride;
      const uint32_t mask = static_cast<uint32_t>(
          devcopy::LoadLanded(reinterpret_cast<const int32_t*>(row + g.dmeta) + 2));
      if (!Forward(g, &f, &cols, mask & own, row, nullptr, nullptr, nullptr, 0)) return;
    }
    // the chunk's rows: one release per ring, before the credit frees them
    if (!NvlFlush(g, &f, &cols)) return;
    __syncwarp();
    int ok = 1;
    if (Lane() == 0) {
      const uint64_t mark = tag | static_cast<uint64_t>(c + 1);
      if (part != 0)
        StoreRel(done + part, mark);  // its reads of the chunk are over
      else if (JoinParts(g, done, fp * cq, mark))
        Tr::signal(transport::Set(v.credit + g.node, static_cast<uint64_t>(c + 1),
                                  static_cast<uint64_t>(c)),  // credits advance one chunk
                   s, wire::kControlQp);
      else
        ok = 0;
    }
    if (!__shfl_sync(kFull, ok, 0)) return;
  }
  if (part == 0) CloseStream(g, v, n, s, chunks, wire::kSigDispatch);
}

// Writes one received dispatch-pattern row to the outputs.
__device__ void Unpack(const Geo& g, const char* row, const Outs& out, bool gather, int ring) {
  const int lane = Lane();
  const int32_t* meta = reinterpret_cast<const int32_t*>(row + g.dmeta);
  const int64_t dest = meta[3];
  if (dest < 0 || dest >= g.C) {
    if (lane == 0) Record(g, wire::kErrMismatch, meta[1], kKindRow, ring, g.C, dest);
    return;
  }
  // a peer's ring row (its forwarder's stores): global-level loads, never .nc
  devcopy::CopyLanded(out.x + dest * g.prow, row, g.prow, lane, 32);
  if (gather) return;
  const int32_t* ids = reinterpret_cast<const int32_t*>(row + meta_offset(g.prow));
  const float* ws = reinterpret_cast<const float*>(ids + g.K);
  for (int k = lane; k < g.K; k += 32) {
    const int32_t local = local_expert_id(ids[k], g.el, g.rank);
    out.idx[dest * g.K + k] = local;
    out.w[dest * g.K + k] = local < 0 ? 0.f : ws[k];
    if (local >= 0) atomicAdd(out.per_expert + local, 1);
  }
  if (lane == 0) {
    out.src_rank[dest] = meta[1];
    out.src_index[dest] = meta[0];
  }
}

// Receiver warp w of nw: rings w, w + nw, ... of this rank (lane j: ring w + j * nw),
// polled without blocking on any one; the owner resets each ring's words at the end.
__device__ void ReceiveRole(const Geo& g, const View& v, int w, int nw, const Outs& out,
                            bool gather) {
  const int lane = Lane();
  const int ring = w + lane * nw;
  const bool mine = ring < g.G * g.N;
  const int gl = mine ? ring / g.N : 0, n = mine ? ring % g.N : 0;
  const int s = n * g.G + gl;
  long long left = mine ? KeptOf(v.counts, g.R + g.N, s, g.rank, g.C) : 0;
  unsigned long long head = 0;
  uint64_t last = NowNs();
  for (int spin = 0;; ++spin) {
    const bool active = left > 0;
    if (!__any_sync(kFull, active)) break;
    const unsigned long long tail = active ? LoadAcq(TailW(v, g, gl, n)) : 0ull;
    unsigned ready = __ballot_sync(kFull, active && tail > head);
    __syncwarp();
    if (ready == 0) {
      int stop = 0;
      if (lane == 0 && (spin & 255) == 0) {
        if (Failed(g)) stop = 1;
        else if (static_cast<int64_t>(NowNs() - last) > g.timeout_ns) stop = 2;
      }
      stop = __shfl_sync(kFull, stop, 0);
      if (stop == 2) {
        const int l = __ffs(__ballot_sync(kFull, active)) - 1;
        const int r = __shfl_sync(kFull, ring, l);
        const unsigned long long h = __shfl_sync(kFull, head, l);
        if (lane == 0)
          Record(g, wire::kErrTimeout, g.node * g.G + r / g.N, kKindNvl, r, h + 1, h);
      }
      if (stop) return;
      continue;
    }
    last = NowNs();
    while (ready != 0) {
      const int l = __ffs(ready) - 1;
      ready &= ready - 1;
      const unsigned long long h = __shfl_sync(kFull, head, l);
      const long long lim = __shfl_sync(kFull, left, l);
      long long avail = static_cast<long long>(__shfl_sync(kFull, tail, l) - h);
      if (avail > lim) avail = lim;
      const int lgl = __shfl_sync(kFull, gl, l), ln = __shfl_sync(kFull, n, l);
      const char* base = NvlRing(v, g, lgl, ln);
      for (long long k = 0; k < avail; ++k)
        Unpack(g, base + nvl_slot(static_cast<int64_t>(h + k)) * g.stride, out, gather,
               __shfl_sync(kFull, ring, l));
      __syncwarp();
      if (lane == l) {
        head = h + avail;
        left -= avail;
        StoreRel(HeadW(v, g, gl, n), head);
      }
    }
  }
  __syncwarp();
  if (mine) {
    *HeadW(v, g, gl, n) = 0;
    *TailW(v, g, gl, n) = 0;
  }
}

// Role warps, warp w of the launch at block w % B (consecutive warps of a role on
// consecutive blocks): [0, (N-1) sp) senders, sp parts per remote node; then fp cq local
// forwarder parts; then (N-1) fp cq rail forwarder parts (cq column parts of each
// receiver part, consecutive); then nw receivers.
__device__ __forceinline__ int RemoteNode(const Geo& g, int i) { return i < g.node ? i : i + 1; }

__global__ void __launch_bounds__(kThreads) DispatchMain(Geo g, const char* payload,
                                                         const int32_t* topk_idx,
                                                         const float* topk_w,
                                                         const int32_t* send_slot, Outs out,
                                                         int nw, int sp, int fp, int cq,
                                                         bool gather) {
  int gw = (threadIdx.x >> 5) * static_cast<int>(gridDim.x) + static_cast<int>(blockIdx.x);
  int failed = 0;
  if (Lane() == 0) failed = Failed(g) ? 1 : 0;
  if (__shfl_sync(kFull, failed, 0)) return;
  const View v = ViewOf(g);
  const int remote = g.N - 1;
  if (gw < remote * sp) {
    SendRole(g, v, RemoteNode(g, gw / sp), gw % sp, sp, payload, topk_idx, topk_w, send_slot);
  } else if ((gw -= remote * sp) < fp * cq) {
    LocalForwardRole(g, v, gw / cq, fp, gw % cq, cq, payload, topk_idx, topk_w, send_slot);
  } else if ((gw -= fp * cq) < remote * fp * cq) {
    const int r = gw % (fp * cq);
    RailForwardRole(g, v, RemoteNode(g, gw / (fp * cq)), r / cq, fp, r % cq, cq);
  } else if ((gw -= remote * fp * cq) < nw) {
    ReceiveRole(g, v, gw, nw, out, gather);
  }
  // No quiet: nothing here waits for a put to complete. A staging slot is rewritten only
  // after its credit, which the reader sends once the chunk's signal (delivered after its
  // data) arrived; every signal and credit of the call is awaited by its reader before the
  // call ends (closing waits, the final credit), so none is left in flight.
}

// After DispatchMain: the row totals, the count matrix, and the empty state of every row
// past the rows kept (all rows when the call failed anywhere).
__global__ void DispatchFinish(Geo g, Outs out, bool gather, int32_t* num_recv,
                               int32_t* num_dropped, int32_t* counts_out) {
  const View v = ViewOf(g);
  const int cs = g.R + g.N;
  const bool failed = Failed(g);
  __shared__ long long total;
  if (threadIdx.x == 0) total = failed ? 0 : BaseOf(v.counts, cs, g.R, g.rank);
  __syncthreads();
  const int64_t kept = kept_rows(total, g.C);
  const int64_t gtid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t gstride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  // A failed call is never silently empty: float outputs NaN (every byte 0xff), every
  // count -1, ids and sources -1.
  if (gtid == 0 && num_recv != nullptr) {
    *num_recv = failed ? -1 : static_cast<int32_t>(kept);
    *num_dropped = failed ? -1 : static_cast<int32_t>(total - kept);
  }
  if (counts_out != nullptr)
    for (int64_t i = gtid; i < static_cast<int64_t>(g.R) * g.R; i += gstride)
      counts_out[i] = failed ? -1 : v.counts[(i / g.R) * cs + i % g.R];
  if (failed && !gather)
    for (int64_t i = gtid; i < g.el; i += gstride) out.per_expert[i] = -1;
  const char fill = failed ? static_cast<char>(0xff) : 0;
  for (int64_t i = kept * g.prow + gtid; i < g.C * g.prow; i += gstride) out.x[i] = fill;
  if (gather) return;
  for (int64_t i = kept * g.K + gtid; i < static_cast<int64_t>(g.C) * g.K; i += gstride) {
    out.idx[i] = -1;
    out.w[i] = failed ? __int_as_float(0x7fc00000) : 0.f;
  }
  for (int64_t i = kept + gtid; i < g.C; i += gstride) out.src_rank[i] = out.src_index[i] = -1;
}

// Advances the call counter shared with the direct mode (after every reader of it).
__global__ void AdvanceKernel(unsigned long long* counter) { ++*counter; }

// ---- combine -----------------------------------------------------------------------------

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

// A combine pusher writes a ring's rows in batches of kPushRows (fewer only for a
// source's last rows) and waits until the ring has room for a whole batch: each system
// fence and tail release then covers kPushRows rows however far the reader lags, not the
// few rows one head release frees once the ring is full. Half the ring, so the reader
// takes one half while the pusher writes the other. No deadlock: a reader waiting for a
// ring's next row holds fewer than kHeldRows + 1 of its rows unreleased (a forwarder
// releases them once per RDMA chunk, the source once per window of at most kWarps
// tokens), so the ring then has room for a batch.
constexpr int Least(int a, int b) { return a < b ? a : b; }
constexpr int kHeldRows = Least(kRdmaChunkRows, kNvlRingRows) > Least(kWarps, kNvlRingRows)
                              ? Least(kRdmaChunkRows, kNvlRingRows) - 1
                              : Least(kWarps, kNvlRingRows) - 1;
constexpr int kPushRows = Least(kNvlRingRows / 2, kNvlRingRows - kHeldRows) > 1
                              ? Least(kNvlRingRows / 2, kNvlRingRows - kHeldRows)
                              : 1;
static_assert(kPushRows >= 1 && kPushRows + kHeldRows <= kNvlRingRows,
              "a pusher's batch fits beside the rows a waiting reader holds");

// Rows of a source each combine pusher part has written, per (source, part): the call
// (*counter + 1) in the high 32 bits, the rows in the low ones. Part 0 waits for the
// others before it releases a batch they all wrote.
JEP_DEVICE_GLOBAL uint64_t g_push_done[kMaxRanks * kHierPushParts];

// Pusher p, part `part` of pp (a warp each): lane l < per owns source s = per p + l, the
// rows this rank holds from s (in token order) into the ring [my local][s's node] at s's
// rail peer on this node. Every part walks the same batches (their sizes do not depend
// on timing) and copies its slice of each row's 16-byte vectors; part 0 writes the row's
// words and releases a batch's tail once every part has marked the batch written.
__device__ void PushRole(const Geo& g, const View& v, int p, int per, int part, int pp,
                         const char* y, const int32_t* counts, const int32_t* src_index) {
  const int lane = Lane();
  int64_t b0 = 0, b1 = 0;
  ColumnSlice(g.prow, part, pp, &b0, &b1);
  const uint64_t tag = CallTag(g);
  const int s = lane < per ? p * per + lane : g.R;
  const bool mine = s < g.R;
  long long start = 0, n = 0, next = 0;
  unsigned long long tail = 0;
  char* ring = nullptr;
  uint64_t *head = nullptr, *tailw = nullptr;
  int ok = 1;
  if (mine) {
    const int64_t b = BaseOf(counts, g.R, s, g.rank);
    start = b;
    n = KeptOf(counts, g.R, s, g.rank, g.C);
    const int f = g.node * g.G + s % g.G;
    const int ns = s / g.G;
    if (n > 0) {
      ring = static_cast<char*>(Tr::peer_ptr(NvlRing(v, g, g.local, ns), f));
      head = static_cast<uint64_t*>(Tr::peer_ptr(HeadW(v, g, g.local, ns), f));
      tailw = static_cast<uint64_t*>(Tr::peer_ptr(TailW(v, g, g.local, ns), f));
      ok = ring != nullptr && head != nullptr && tailw != nullptr;
      if (!ok) Record(g, wire::kErrTimeout, f, kKindNoPeer, 0, 1, 0);
    }
  }
  if (!__all_sync(kFull, ok)) return;
  uint64_t last = NowNs();
  for (int spin = 0;; ++spin) {
    const bool active = next < n;
    if (!__any_sync(kFull, active)) break;
    // this lane's next batch, once the ring has room for all of it
    long long batch = 0;
    if (active) {
      const unsigned long long hd =
          tail < static_cast<unsigned long long>(kNvlRingRows) ? 0ull : LoadAcq(head);
      const long long room = static_cast<long long>(hd + kNvlRingRows - tail);
      const long long want = n - next < kPushRows ? n - next : kPushRows;
      batch = room >= want ? want : 0;
    }
    unsigned ready = __ballot_sync(kFull, batch > 0);
    if (ready == 0) {
      int stop = 0;
      if (lane == 0 && (spin & 255) == 0) {
        if (Failed(g)) stop = 1;
        else if (static_cast<int64_t>(NowNs() - last) > g.timeout_ns) stop = 2;
      }
      stop = __shfl_sync(kFull, stop, 0);
      if (stop == 2) {
        const int l = __ffs(__ballot_sync(kFull, active)) - 1;
        const int ls = __shfl_sync(kFull, s, l);
        if (lane == 0)
          Record(g, wire::kErrTimeout, g.node * g.G + ls % g.G, kKindNvl, g.local, 0, 0);
      }
      if (stop) return;
      continue;
    }
    last = NowNs();
    while (ready != 0) {
      const int l = __ffs(ready) - 1;
      ready &= ready - 1;
      const long long i0 = __shfl_sync(kFull, start + next, l);
      const long long cnt = __shfl_sync(kFull, batch, l);
      const unsigned long long tl = __shfl_sync(kFull, tail, l);
      const int ls = __shfl_sync(kFull, s, l);
      char* rb = ShflPtr(ring, l);
      uint64_t* tw = ShflPtr(tailw, l);
      for (long long k = 0; k < cnt; ++k) {
        char* dst = rb + nvl_slot(static_cast<int64_t>(tl + k)) * g.stride;
        CopyBytes(dst + b0, y + (i0 + k) * g.prow + b0, b1 - b0, lane, 32);
        if (lane == 0 && part == 0) {
          int32_t* meta = reinterpret_cast<int32_t*>(dst + g.cmeta);
          StoreWord(meta + 0, src_index[i0 + k]);
          StoreWord(meta + 1, static_cast<int32_t>(g.rank));
        }
      }
      // the batch's rows, then one release of the tail (one fence per lane per batch)
      __threadfence_system();
      __syncwarp();
      // parts past 0 mark their slice of the batch written; part 0 joins them, then
      // releases the tail once for the batch
      uint64_t* done = g_push_done + static_cast<int64_t>(ls) * kHierPushParts;
      const uint64_t mark = tag | static_cast<uint64_t>(tl + cnt);
      int joined = 1;
      if (lane == 0) {
        if (part != 0) StoreRel(done + part, mark);
        else if (JoinParts(g, done, pp, mark)) StoreRel(tw, tl + cnt);
        else joined = 0;
      }
      if (!__shfl_sync(kFull, joined, 0)) return;
      if (lane == l) {
        tail = tl + cnt;
        next += cnt;
      }
      __syncwarp();
    }
  }
}

// ---- combine sums (kernels/common/combine_order.h) ----------------------------------------

// Elements of E in one 16-byte access.
template <typename E>
struct Vec {
  static constexpr int kN = 16 / static_cast<int>(sizeof(E));
};

// V elements of a landed row from element x0 on, as float32: one 16-byte load when V is a
// full vector (x0 * sizeof(E) then 16-byte aligned), else one element.
template <typename E, int V>
__device__ __forceinline__ void LoadF(const char* row, int64_t x0, float* f) {
  if constexpr (V == 1) {
    f[0] = ToF(devcopy::LoadLandedElem(reinterpret_cast<const E*>(row) + x0));
  } else {
    const int4 w = devcopy::LoadLandedInt4(reinterpret_cast<const int4*>(
        row + x0 * static_cast<int64_t>(sizeof(E))));
    E e[V];
    __builtin_memcpy(e, &w, sizeof(e));
#pragma unroll
    for (int i = 0; i < V; ++i) f[i] = ToF(e[i]);
  }
}

// A float32 value rounded to the row dtype E and back (combine_order.h step 2).
template <typename E>
__device__ __forceinline__ float RoundTo(float v) { return ToF(FromF<E>(v)); }

// The forwarder's node partial of one token, elements [x0, x0 + V): the rows rp[0, n)
// (ascending rank) summed in float32 from +0, rounded to E, stored at dst.
template <typename E, int V>
__device__ __forceinline__ void PartialAt(char* dst, const char* const* rp, int n,
                                          int64_t x0) {
  float p[V], f[V];
#pragma unroll
  for (int i = 0; i < V; ++i) p[i] = 0.f;
  for (int k = 0; k < n; ++k) {
    LoadF<E, V>(rp[k], x0, f);
#pragma unroll
    for (int i = 0; i < V; ++i) p[i] += f[i];
  }
  E e[V];
#pragma unroll
  for (int i = 0; i < V; ++i) e[i] = FromF<E>(p[i]);
  if constexpr (V == 1) {
    reinterpret_cast<E*>(dst)[x0] = e[0];
  } else {
    int4 w;
    __builtin_memcpy(&w, e, sizeof(e));
    *reinterpret_cast<int4*>(dst + x0 * static_cast<int64_t>(sizeof(E))) = w;
  }
}

// Elements that go 16 bytes at a time: all of them when a row's payload is a multiple of
// 16 bytes (rows start 16-byte aligned: the stride and every ring base are), else none.
__device__ __forceinline__ int64_t VecElems(const Geo& g) { return g.prow % 16 == 0 ? g.H : 0; }

// The source's sum of one token, elements [x0, x0 + V), stored at dst: the items
// rows[0, n) added in order in float32 from +0, where rows[own0, own0 + nown) are its own
// node's rows (summed from +0 into the node partial, rounded to E when the order rounds,
// then added) and the others are the partials of other nodes as they came over RDMA.
template <typename E, int V>
__device__ __forceinline__ void SourceSumAt(E* dst, const char* const* rows, int n,
                                            int own0, int nown, bool rounds, int64_t x0) {
  float a[V], f[V];
#pragma unroll
  for (int i = 0; i < V; ++i) a[i] = 0.f;
  for (int k = 0; k < n; ++k) {
    if (k == own0 && nown > 0) {
      float p[V];
#pragma unroll
      for (int i = 0; i < V; ++i) p[i] = 0.f;
      for (int q = own0; q < own0 + nown; ++q) {
        LoadF<E, V>(rows[q], x0, f);
#pragma unroll
        for (int i = 0; i < V; ++i) p[i] += f[i];
      }
#pragma unroll
      for (int i = 0; i < V; ++i) a[i] += rounds ? RoundTo<E>(p[i]) : p[i];
      k += nown - 1;
      continue;
    }
    LoadF<E, V>(rows[k], x0, f);
#pragma unroll
    for (int i = 0; i < V; ++i) a[i] += f[i];
  }
  E e[V];
#pragma unroll
  for (int i = 0; i < V; ++i) e[i] = FromF<E>(a[i]);
  if constexpr (V == 1) {
    dst[x0] = e[0];
  } else {
    int4 w;
    __builtin_memcpy(&w, e, sizeof(e));
    *reinterpret_cast<int4*>(dst + x0) = w;
  }
}

// Chunks of a combine stream each forwarder part has written, per (source node, part):
// the call (*counter + 1) in the high 32 bits, the chunks in the low ones.
JEP_DEVICE_GLOBAL uint64_t g_cfwd_done[kMaxNodes * kMaxHierParts];

// A forwarder part holds the rows it summed for the chunk it writes (fewer than a chunk's
// from one ring) until every part is done with the chunk, while it may wait for the next
// row of that ring: the ring must have room for that row beside them.
static_assert(kNvlRingRows >= kRdmaChunkRows,
              "a combine forwarder releases its NVLink rings' heads once per RDMA chunk");

// Combine forwarder part p of cp for the source s = (n, my local index): merges this
// node's rings of s (ring l: rank (my node, l)'s rows of s in token order) by token and
// sends ONE row per token back to s, the node partial (its rows in ascending rank order
// summed in float32, rounded to the row dtype), as one credited RDMA stream: the same rows
// per token as the dispatch sent here. Every part walks the same merge; part p sums a
// slice of the columns into the staging row, and part 0, once every part has written a
// chunk, releases the rings' heads past the chunk's rows and puts it.
template <typename E>
__device__ void CombineForwardRole(const Geo& g, const View& v, int n, const int32_t* counts,
                                   int p, int cp) {
  const int lane = Lane();
  const int s = n * g.G + g.local;
  long long left = lane < g.G ? KeptOf(counts, g.R, s, g.node * g.G + lane, g.C) : 0;
  unsigned long long head = 0, pub = 0;  // rows of ring `lane` summed, and released
  int64_t o = 0;                          // partials written
  uint64_t* done = g_cfwd_done + static_cast<int64_t>(n) * kMaxHierParts;
  const uint64_t tag = CallTag(g);
  // this part's columns: vectors [v0, v1) of the 16-byte part, elements [e0, e1) past it
  const int64_t nv = VecElems(g), nvec = nv / Vec<E>::kN, ns = g.H - nv;
  const int64_t v0 = nvec * p / cp, v1 = nvec * (p + 1) / cp;
  const int64_t e0 = nv + ns * p / cp, e1 = nv + ns * (p + 1) / cp;
  // part 0: writes chunk c's last row, then (all parts done) frees the rows and puts it
  const auto finish_chunk = [&](int64_t c, int64_t rows) -> bool {
    __threadfence();  // this part's columns before its mark (part 0's put reads them)
    __syncwarp();
    int ok = 1;
    if (lane == 0) {
      const uint64_t mark = tag | static_cast<uint64_t>(c + 1);
      if (p != 0) StoreRel(done + p, mark);
      else ok = JoinParts(g, done, cp, mark) ? 1 : 0;
    }
    if (!__shfl_sync(kFull, ok, 0)) return false;
    if (p == 0) {
      if (lane < g.G && head > pub) {
        StoreRel(HeadW(v, g, lane, n), head);
        pub = head;
      }
      PutChunk(g, v, n, s, c, rows);
    }
    return true;
  };
  uint64_t last = NowNs();
  for (int spin = 0;; ++spin) {
    const bool need = left > 0;
    if (!__any_sync(kFull, need)) break;
    // every ring with rows left shows its next row: the smallest token is then known
    const bool have = !need || LoadAcq(TailW(v, g, lane, n)) > head;
    if (!__all_sync(kFull, have)) {
      int stop = 0;
      if (lane == 0 && (spin & 255) == 0) {
        if (Failed(g)) stop = 1;
        else if (static_cast<int64_t>(NowNs() - last) > g.timeout_ns) stop = 2;
      }
      stop = __shfl_sync(kFull, stop, 0);
      if (stop == 2) {
        const int l = __ffs(__ballot_sync(kFull, !have)) - 1;
        if (lane == 0)
          Record(g, wire::kErrTimeout, g.node * g.G + l, kKindNvl, l * g.N + n, 1, 0);
      }
      if (stop) return;
      continue;
    }
    __syncwarp();  // every lane's acquire before any lane reads another lane's ring
    last = NowNs();
    const char* row =
        need ? NvlRing(v, g, lane, n) + nvl_slot(static_cast<int64_t>(head)) * g.stride
             : nullptr;
    const int tok =
        need ? devcopy::LoadLanded(reinterpret_cast<const int32_t*>(row + g.cmeta)) : INT_MAX;
    int t = tok;
    for (int x = 16; x > 0; x >>= 1) {
      const int other = __shfl_xor_sync(kFull, t, x);
      t = other < t ? other : t;
    }
    const unsigned mask = __ballot_sync(kFull, need && tok == t);
    const char* rp[kMaxGpusPerNode];
    int nr = 0;
    for (unsigned m = mask; m != 0; m &= m - 1) rp[nr++] = ShflPtr(row, __ffs(m) - 1);
    const int64_t c = o / kRdmaChunkRows, j = o % kRdmaChunkRows;
    if (j == 0 && !WaitCredit(g, v, n, s, c)) return;
    char* dst = SendSlot(v, g, n, c) + j * g.stride;
    for (int64_t i = v0 + lane; i < v1; i += 32)
      PartialAt<E, Vec<E>::kN>(dst, rp, nr, i * Vec<E>::kN);
    for (int64_t x = e0 + lane; x < e1; x += 32) PartialAt<E, 1>(dst, rp, nr, x);
    if (lane == 0 && p == 0) {
      int32_t* meta = reinterpret_cast<int32_t*>(dst + g.cmeta);
      meta[0] = t;
      meta[1] = g.rank;
    }
    __syncwarp();
    if ((mask >> lane) & 1u) {  // the rows are summed (their slots freed with the chunk)
      head += 1;
      --left;
    }
    ++o;
    if (j == kRdmaChunkRows - 1 && !finish_chunk(c, kRdmaChunkRows)) return;
  }
  if (o % kRdmaChunkRows != 0 && !finish_chunk(o / kRdmaChunkRows, o % kRdmaChunkRows)) return;
  if (p != 0) return;
  EndStream(g, v, n, s, (o + kRdmaChunkRows - 1) / kRdmaChunkRows, g.node, 0, 1);
  __syncwarp();
  if (lane < g.G) {
    *HeadW(v, g, lane, n) = 0;
    *TailW(v, g, lane, n) = 0;
  }
}

// Windows of the combine source blocks summed since the process started, per block: the
// call (*counter + 1) in the high 32 bits, the windows of this call in the low ones.
JEP_DEVICE_GLOBAL uint64_t g_source_done[kMaxHierSourceBlocks];

// The source (blocks [0, B), block sb a slice of the columns): per token, the node
// partials in ascending node order (combine_order.h): its own node's rows (NVLink rings,
// ascending rank) summed here into the node partial, rounded to the row dtype when there
// are several nodes; every other node's partial as its forwarder sent it over RDMA; all
// added in float32. Every block walks the same windows and waits for the same rows; block
// 0 frees them (heads, credits) once every block has summed its columns of the window.
// Tokens go in windows of at most one token per warp, summed by their warps at once. A
// window holds no more rows of an NVLink ring than the ring has slots past its published
// head, and no more chunks of a node's stream than the forwarder may put past the chunks
// credited before the window (kRdmaRingChunks), so every row a window waits for can
// arrive without anything the window itself frees; the heads and credits move once per
// window (one release per ring, one signal per stream), not once per token.
template <typename E>
__device__ void SourceRole(const Geo& g, const View& v, const int32_t* counts,
                           const int32_t* send_slot, E* out, char* smem, int sb, int B) {
  __shared__ int sbase[kMaxRanks];      // min(first row of this rank at d, C)
  __shared__ int pos[kMaxNodes];        // partials of node k's stream taken by past windows
  __shared__ int nrows[kMaxNodes];      // partials in node k's stream (tokens kept there)
  __shared__ int credited[kMaxNodes];   // chunks of node k's stream credited
  __shared__ int wk[kMaxNodes];         // partials of node k's stream in this window
  __shared__ unsigned long long nvl_head[kMaxGpusPerNode];  // own node's ring rows taken
  __shared__ int wl[kMaxGpusPerNode];   // rows of own-node ring l in this window
  __shared__ int s_items[kWarps];       // items of warp w's token (-1: no token)
  __shared__ int s_t1, s_stop;
  const int tid = threadIdx.x, lane = Lane(), warp = tid >> 5;
  const int M = g.G + g.N;  // items of one token at most (own node's ranks, other nodes)
  // smem: per warp M items (x >= 0: own-node ring x, row y; x < 0: node -1 - x's stream,
  // partial y), then per warp M row pointers (source_smem_bytes)
  int2* const items_of = reinterpret_cast<int2*>(smem);
  const char** const rows_of = reinterpret_cast<const char**>(
      smem + static_cast<size_t>(kWarps) * M * sizeof(int2));
  const bool rounds = combine_rounds_partials(g.N);
  for (int d = tid; d < g.R; d += blockDim.x) {
    const int64_t b = BaseOf(counts, g.R, g.rank, d);
    sbase[d] = static_cast<int>(b < g.C ? b : g.C);
  }
  for (int k = tid; k < g.N; k += blockDim.x) {
    nrows[k] = 0;
    pos[k] = 0;
    credited[k] = 0;
  }
  for (int l = tid; l < g.G; l += blockDim.x) nvl_head[l] = 0;
  if (tid == 0) s_stop = 0;
  __syncthreads();
  // whether rank d keeps a row of token t
  const auto kept = [&](int t, int d) {
    const int j = send_slot[static_cast<int64_t>(t) * g.R + d];
    return j >= 0 && static_cast<int64_t>(sbase[d]) + j < g.C;
  };
  for (int t = tid; t < g.T; t += blockDim.x)
    for (int k = 0; k < g.N; ++k) {
      if (k == g.node) continue;
      for (int l = 0; l < g.G; ++l)
        if (kept(t, k * g.G + l)) {
          atomicAdd(&nrows[k], 1);
          break;
        }
    }
  __syncthreads();
  // this block's columns: vectors [v0, v1) of the 16-byte part, elements [e0, e1) past it
  const int64_t nv = VecElems(g), nvec = nv / Vec<E>::kN, ns = g.H - nv;
  const int64_t v0 = nvec * sb / B, v1 = nvec * (sb + 1) / B;
  const int64_t e0 = nv + ns * sb / B, e1 = nv + ns * (sb + 1) / B;
  const uint64_t tag = static_cast<uint64_t>(*g.counter + 1ull) << 32;
  for (int t0 = 0, win = 0; t0 < g.T; ++win) {
    if (tid == 0) {
      // the window [t0, s_t1): each token's items in node order, while they fit
      for (int l = 0; l < g.G; ++l) wl[l] = 0;
      for (int k = 0; k < g.N; ++k) wk[k] = 0;
      int t = t0, w = 0;
      for (; w < kWarps && t < g.T; ++w, ++t) {
        int2* it = items_of + w * M;
        int n = 0;
        bool fits = true;
        for (int k = 0; k < g.N && fits; ++k) {
          if (k == g.node) {
            for (int l = 0; l < g.G; ++l) {
              if (!kept(t, k * g.G + l)) continue;
              if (wl[l] + 1 > kNvlRingRows) fits = false;
              it[n++] = make_int2(l, static_cast<int>(nvl_head[l]) + wl[l]);
            }
            continue;
          }
          bool any = false;
          for (int l = 0; l < g.G && !any; ++l) any = kept(t, k * g.G + l);
          if (!any) continue;
          const int o = pos[k] + wk[k];
          if (o / kRdmaChunkRows - pos[k] / kRdmaChunkRows + 1 > kRdmaRingChunks) fits = false;
          it[n++] = make_int2(-1 - k, o);
        }
        if (!fits) break;  // never the window's first token: its rows always fit
        for (int j = 0; j < n; ++j) {
          if (it[j].x >= 0) ++wl[it[j].x];
          else ++wk[-1 - it[j].x];
        }
        s_items[w] = n;
      }
      for (int r = w; r < kWarps; ++r) s_items[r] = -1;
      s_t1 = t;
    }
    __syncthreads();
    const int n = s_items[warp];
    if (n >= 0) {
      // lane 0 waits for the token's rows and checks them; then every lane sums
      const int t = t0 + warp;
      const int2* it = items_of + warp * M;
      const char** rp = rows_of + warp * M;
      int ok = 1, own0 = -1, nown = 0;
      if (lane == 0) {
        for (int j = 0; j < n && ok; ++j) {
          const char* row;
          int d;
          if (it[j].x >= 0) {
            const int l = it[j].x;
            d = g.node * g.G + l;
            uint64_t* tw = TailW(v, g, l, g.node);
            if (!WaitAtLeast(g, [tw] { return LoadAcq(tw); },
                             static_cast<uint64_t>(it[j].y) + 1, d, kKindNvl,
                             l * g.N + g.node)) {
              ok = 0;
              break;
            }
            row = NvlRing(v, g, l, g.node) + nvl_slot(it[j].y) * g.stride;
            if (own0 < 0) own0 = j;
            ++nown;
          } else {
            const int k = -1 - it[j].x;
            const int64_t c = it[j].y / kRdmaChunkRows;
            d = k * g.G + g.local;
            const int q = ChunkQp(g, g.rank, c);
            uint64_t* w = DataWord(v, g, k, q);
            if (!WaitAtLeast(g, [w] { return Tr::fetch(w); },
                             static_cast<uint64_t>(c / g.nq + 1), d, wire::kSigCombine, q)) {
              ok = 0;
              break;
            }
            row = RecvSlot(v, g, k, c) + (it[j].y % kRdmaChunkRows) * g.stride;
          }
          const int32_t* meta = reinterpret_cast<const int32_t*>(row + g.cmeta);
          const int32_t mt = devcopy::LoadLanded(meta), md = devcopy::LoadLanded(meta + 1);
          if (mt != t || md != d) {
            Record(g, wire::kErrMismatch, d, kKindRow, t, static_cast<uint64_t>(t),
                   static_cast<uint64_t>(static_cast<int64_t>(mt)));
            ok = 0;
            break;
          }
          rp[j] = row;
        }
        if (!ok) s_stop = 1;
      }
      __syncwarp();
      ok = __shfl_sync(kFull, ok, 0);
      own0 = __shfl_sync(kFull, own0, 0);
      nown = __shfl_sync(kFull, nown, 0);
      if (ok) {
        // each lane 16 bytes of every row at a time (float32 sums per element, so the
        // split across lanes does not change a bit)
        E* o = out + static_cast<int64_t>(t) * g.H;
        for (int64_t i = v0 + lane; i < v1; i += 32)
          SourceSumAt<E, Vec<E>::kN>(o, rp, n, own0, nown, rounds, i * Vec<E>::kN);
        for (int64_t x = e0 + lane; x < e1; x += 32)
          SourceSumAt<E, 1>(o, rp, n, own0, nown, rounds, x);
      }
    }
    __syncthreads();
    if (s_stop) break;
    if (tid == 0) {
      const uint64_t mark = tag | static_cast<uint64_t>(win + 1);
      if (sb != 0) {
        // this block's columns of the window are summed (its reads before the release)
        StoreRel(&g_source_done[sb], mark);
      } else {
        for (int b = 1; b < B && !s_stop; ++b) {
          const uint64_t* w = &g_source_done[b];
          if (!WaitAtLeast(g, [w] { return LoadAcq(w); }, mark, g.rank, kKindSource, b))
            s_stop = 1;
        }
      }
    }
    __syncthreads();
    // the window's rows are summed: one release per ring it read (thread l: ring l), one
    // credit per stream (thread k: node k's), from threads of their own, so no thread's
    // releases grow with the rings (block 0 frees them; every block keeps the positions)
    if (!s_stop && tid < g.G && wl[tid] != 0) {
      nvl_head[tid] += static_cast<unsigned long long>(wl[tid]);
      if (sb == 0) StoreRel(HeadW(v, g, tid, g.node), nvl_head[tid]);
    }
    if (!s_stop && tid < g.N && tid != g.node) {
      const int k = tid;
      pos[k] += wk[k];
      // every chunk whose rows are summed is free (the last, partial one once the
      // stream is read to its end)
      const int done = pos[k] == nrows[k] ? (pos[k] + kRdmaChunkRows - 1) / kRdmaChunkRows
                                          : pos[k] / kRdmaChunkRows;
      if (done > credited[k]) {
        if (sb == 0)
          Tr::signal(transport::Set(v.credit + g.node, static_cast<uint64_t>(done),
                                    static_cast<uint64_t>(credited[k])),
                     k * g.G + g.local, wire::kControlQp);
        credited[k] = done;
      }
    }
    t0 = s_t1;
    __syncthreads();
    if (s_stop) break;
  }
  if (sb != 0) return;  // block 0 closes the streams and resets the words
  // Closing waits of every node's stream (also with T == 0: the forwarders still close).
  for (int k = threadIdx.x >> 5; k < g.N; k += kWarps) {
    // warp-uniform: CloseStream's vote needs every lane
    const int stop = __shfl_sync(kFull, Failed(g) ? 1 : 0, 0);
    if (k == g.node || stop) continue;
    CloseStream(g, v, k, k * g.G + g.local,
                (nrows[k] + kRdmaChunkRows - 1) / kRdmaChunkRows, wire::kSigCombine);
  }
  __syncthreads();
  for (int l = tid; l < g.G; l += blockDim.x) {
    *HeadW(v, g, l, g.node) = 0;
    *TailW(v, g, l, g.node) = 0;
  }
  if (Failed(g))  // NaN, never plausible zeros
    for (int64_t i = tid; i < static_cast<int64_t>(g.T) * g.H; i += blockDim.x)
      out[i] = FromF<E>(__int_as_float(0x7fc00000));
}

// Blocks [0, nsrc): the source (a slice of the columns each); then `roles` blocks of role
// warps: [0, (N-1) cp) forwarders, cp parts per remote node, then np pushers of `per`
// sources each, pp parts per pusher.
template <typename E>
__global__ void __launch_bounds__(kThreads) CombineMain(Geo g, const char* y,
                                                        const int32_t* counts,
                                                        const int32_t* send_slot,
                                                        const int32_t* src_index, E* out,
                                                        int np, int per, int pp,
                                                        int nsrc, int roles, int cp) {
  const View v = ViewOf(g);
  __shared__ int failed;
  if (threadIdx.x == 0) failed = Failed(g) ? 1 : 0;
  __syncthreads();
  if (failed) {
    if (blockIdx.x == 0)
      for (int64_t i = threadIdx.x; i < static_cast<int64_t>(g.T) * g.H; i += blockDim.x)
        out[i] = FromF<E>(__int_as_float(0x7fc00000));
    return;
  }
  if (static_cast<int>(blockIdx.x) < nsrc) {
    JEP_DYNAMIC_SMEM(char, smem);  // SourceSmemBytes: its warps' items and row pointers
    SourceRole<E>(g, v, counts, send_slot, out, smem, blockIdx.x, nsrc);
  } else {
    // warp w of the roles at role block w % roles (consecutive warps on consecutive blocks)
    const int gw = (threadIdx.x >> 5) * roles + (static_cast<int>(blockIdx.x) - nsrc);
    const int fw = (g.N - 1) * cp;
    if (gw < fw)
      CombineForwardRole<E>(g, v, RemoteNode(g, gw / cp), counts, gw % cp, cp);
    else if (gw < fw + np * pp)
      PushRole(g, v, (gw - fw) / pp, per, (gw - fw) % pp, pp, y, counts, src_index);
  }
  // No quiet, as DispatchMain: every put's slot is reused only after its reader's credit.
}
// ---- launchers (kernels/internode/api.cuh) ---------------------------------------------

// A launch whose blocks all run at once (the roles wait on one another), with `smem`
// bytes of dynamic shared memory per block. `name`: the kernel's, for the emulated GPU's
// co-residency limit (its occupancy table row).
template <typename... Args, typename... Act>
std::string LaunchCoop(void (*kernel)(Args...), const char* name, int blocks, size_t smem,
                       cudaStream_t stream, Act&&... args) {
#if !defined(JAX_EP_EMU)
  if (smem > 48 * 1024) {
    const std::string e = CudaErr(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             static_cast<int>(smem)), "shared memory size");
    if (!e.empty()) return e;
  }
#endif
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeCooperative;
  attr[0].val.cooperative = 1;
  // Positional: the emulated GPU spells blockDim/gridDim as macros, so no member names.
  // Fields: gridDim, blockDim, dynamicSmemBytes, stream, attrs, numAttrs.
  cudaLaunchConfig_t cfg = {dim3(static_cast<unsigned>(blocks)), dim3(kThreads), smem, stream,
                            attr, 1};
#if defined(JAX_EP_EMU)
  return CudaErr(::emu::launch_kernel_ex(&cfg, name, kernel, std::forward<Act>(args)...),
                 "cooperative launch");
#else
  (void)name;
  return CudaErr(cudaLaunchKernelEx(&cfg, kernel, std::forward<Act>(args)...),
                 "cooperative launch");
#endif
}

// Blocks of a cooperative kernel (`name` on the emulated GPU) with `smem` bytes of dynamic
// shared memory that can be resident at once within `sms` SMs (the mode's budget,
// configs.h InternodeModeSms): its roles wait on each other, so no block may wait to
// start. `per_cache`: the kernel's blocks per SM, found once.
template <typename K>
int ResidentCap(K kernel, const char* name, size_t smem, int sms, int* per_cache) {
#if defined(JAX_EP_EMU)
  (void)kernel;
  (void)per_cache;
  const int lim = static_cast<int>(::emu::resident_limit(name, kThreads, smem));
  return lim < sms ? lim : sms;
#else
  (void)name;
  if (*per_cache == 0) {
    int per = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per, kernel, kThreads, smem) !=
            cudaSuccess ||
        per < 1)
      per = 1;
    cudaGetLastError();
    *per_cache = per;
  }
  return sms * (*per_cache < kAssumedBlocksPerSm ? *per_cache : kAssumedBlocksPerSm);
#endif
}

// Dynamic shared memory of CombineMain: the source block's per-warp items and row
// pointers of one token (SourceRole), at most G + N of each.
size_t SourceSmemBytes(const Geo& g) {
  return static_cast<size_t>(kWarps) * static_cast<size_t>(g.G + g.N) *
         (sizeof(int2) + sizeof(const char*));
}

}  // namespace

// Dispatch and gather share the path: x or g rows, routed by topk_idx or the handle.
std::string RunDispatchPattern(cudaStream_t stream, const Geo& g, const char* payload,
                               const int32_t* topk_idx, const float* topk_w,
                               const int32_t* send_slot_in, int32_t* send_slot_out,
                               const Outs& out, bool gather, int32_t* num_recv,
                               int32_t* num_dropped, int32_t* counts_out,
                               const internode::SharedRuntime& rt) {
  std::string e;
  const int nw = g.G * g.N < 32 ? g.G * g.N : 32;
  const int sp = HierSendParts(g.nq), fp = HierForwardParts(g.G);
  const int cq = HierForwardColumns(g.N * fp, (g.prow + 15) / 16);
  const int warps = (g.N - 1) * sp + g.N * fp * cq + nw;
  // the mode's SMs (configs.h InternodeModeSms: JAX_EP_HIERARCHICAL_SMS or the preset), cut
  // to what stays resident; never below what holds every warp (a launch that cannot be
  // resident then fails with the co-residency error), and a budget set below that is an
  // error naming the setting
  const int sms = InternodeModeSms(kModeHierarchical, g.R, DeviceSms());
  const int least = (warps + kWarps - 1) / kWarps;
  if (ModeSmSetting(kModeHierarchical) > 0 && least > sms)
    return ModeSmError(kModeHierarchical, sms, least, "dispatch (a block per 8 role warps)");
  int nb = HierRoleBlocks("JAX_EP_HIER_DISPATCH_BLOCKS", sms, warps, kWarps);
  static int per_sm = 0;
  const int cap = ResidentCap(DispatchMain, "DispatchMain", 0, sms, &per_sm);
  if (nb > cap) nb = cap > least ? cap : least;
  if (!gather)
    e = CudaErr(cudaMemsetAsync(out.per_expert, 0, sizeof(int32_t) * g.el, stream),
                "clear expert counts");
  if (e.empty()) e = CudaErr(cudaMemsetAsync(rt.bad, 0, sizeof(int32_t) * 4, stream), "clear");
  if (!e.empty()) return e;
  JEP_LAUNCH(CountKernel, g.R + g.N < sms ? g.R + g.N : sms, kThreads, 0, stream)(
      g, topk_idx, send_slot_in, send_slot_out);
  JEP_LAUNCH(ExchangeKernel, 1, kThreads, 0, stream)(g, true);
  e = LaunchCoop(DispatchMain, "DispatchMain", nb, 0, stream, g,
                 payload, topk_idx, topk_w, send_slot_in, out, nw, sp, fp, cq, gather);
  if (!e.empty()) return e;
  const int64_t work = static_cast<int64_t>(g.C) * g.prow;
  const int64_t blocks = (work + kThreads - 1) / kThreads;
  JEP_LAUNCH(DispatchFinish, blocks < 1 ? 1 : (blocks > sms ? sms : blocks), kThreads, 0, stream)(
      g, out, gather, num_recv, num_dropped, counts_out);
  JEP_LAUNCH(AdvanceKernel, 1, 1, 0, stream)(g.counter);
  return CudaErr(cudaGetLastError(), gather ? "gather launch" : "dispatch launch");
}

std::string LaunchCombine(cudaStream_t stream, const Geo& g, FloatKind elem, const void* y,
                          const int32_t* counts, const int32_t* send_slot,
                          const int32_t* src_index, void* out) {
  std::string e;
  const int per = (g.R + kMaxPushWarps - 1) / kMaxPushWarps;  // sources per pusher warp
  const int np = (g.R + per - 1) / per;                         // pushers
  const int64_t vec_elems = 16 / FloatKindBytes(elem);
  const int64_t row_units = g.prow % 16 == 0 ? g.H / vec_elems : g.H;
  const size_t smem_bytes = SourceSmemBytes(g);
  // the mode's SMs (configs.h InternodeModeSms) split between the source blocks and the
  // forwarder and pusher warps' role blocks (HierCombineFit shrinks the parts to fit),
  // cut to what stays resident (one instantiation's occupancy stands for the three: same
  // code but the type)
  const int sms = InternodeModeSms(kModeHierarchical, g.R, DeviceSms());
  const HierCombineSplit fit =
      HierCombineFit(sms, g.N - 1, np, row_units, (g.prow + 15) / 16, kWarps);
  const int nsrc = fit.nsrc, cp = fit.cp, pp = fit.pp;
  if (ModeSmSetting(kModeHierarchical) > 0 && nsrc + fit.roles > sms)
    return ModeSmError(kModeHierarchical, sms, nsrc + fit.roles,
                       "combine (source blocks beside a block per 8 role warps)");
  static int per_sm = 0;
  const int rw = (g.N - 1) * cp + np * pp;
  const int least = (rw + kWarps - 1) / kWarps;
  int roles = fit.roles;
  const int room = ResidentCap(CombineMain<float>, "CombineMain", smem_bytes, sms, &per_sm) - nsrc;
  if (roles > room) roles = room > least ? room : least;
  const int blocks = nsrc + roles;
  // Header only (no rows): seq, configuration and error flag, as every call (after the
  // budget's check, so a refused call launches nothing).
  JEP_LAUNCH(ExchangeKernel, 1, kThreads, 0, stream)(g, false);
  const char* yc = static_cast<const char*>(y);
  switch (elem) {
    case FloatKind::kF32:
      e = LaunchCoop(CombineMain<float>, "CombineMain", blocks, smem_bytes, stream, g, yc,
                     counts, send_slot, src_index, static_cast<float*>(out), np, per, pp,
                     nsrc, roles, cp);
      break;
    case FloatKind::kBF16:
      e = LaunchCoop(CombineMain<__nv_bfloat16>, "CombineMain", blocks, smem_bytes, stream, g,
                     yc, counts, send_slot, src_index, static_cast<__nv_bfloat16*>(out), np,
                     per, pp, nsrc, roles, cp);
      break;
    case FloatKind::kF16:
      e = LaunchCoop(CombineMain<__half>, "CombineMain", blocks, smem_bytes, stream, g, yc,
                     counts, send_slot, src_index, static_cast<__half*>(out), np, per, pp,
                     nsrc, roles, cp);
      break;
  }
  if (!e.empty()) return e;
  JEP_LAUNCH(AdvanceKernel, 1, 1, 0, stream)(g.counter);
  return CudaErr(cudaGetLastError(), "combine launch");
}

}  // namespace JEP_TR_NS
}  // namespace hier
}  // namespace jax_ep
