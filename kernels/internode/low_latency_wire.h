// The internode (NVSHMEM) low-latency wire protocol: the symmetric area's layout, the
// per-call header, which QP carries each row, what a reader waits for, and the error
// kinds. Pure functions and constants, shared by the CUDA kernels
// (low_latency_kernels.cu), the FFI handlers, and, through the `ll_*` bindings, the heap
// sizing in jax_ep/nvshmem_bootstrap.py (the kernels run on the emulated GPU in
// tests/emu/test_internode_ll_emu.py).
//
// Ops: kOpDispatch (source -> expert owners) and kOpCombine (owners -> sources). Every
// call of an op on a rank takes the next epoch n = 1, 2, ... of that op; it uses buffer
// b = n & 1 of every area the op writes at its peers (double buffering by epoch parity),
// and the send half returns n to the receive half in its token, so a receive always
// completes the epoch its own send started.
//
// One call of an op, writer w (dispatch: every source; combine: every owner), reader p:
//   1. credit: before writing buffer b anywhere (its own stages hstage[b], dstage[b] /
//      cstage[b], or p's receive areas), w waits (bounded) until credit word (op, b, p) on
//      w holds >= n - 2 for every reader p: every p finished reading epoch n - 2.
//   2. header: w stages its Header (seq n, config hash, error flag, rows, per local expert
//      counts) in hstage[b] and puts it into hdr[op][b][w] on p with a put-with-signal SET n
//      on the control QP, word hsig[op][b][w]. Every writer sends every reader a header in
//      every call, even with no rows: that is what lets a reader finish and return its credit.
//   3. rows: every row of (writer w, p's local expert e) goes on QP expert_qp(p, e) as a
//      plain put (no signal); after the last of them is issued (the writer's per-expert done
//      counter), ONE signal SET count + 1 into count word cnt[op][b][w][e] on p, on the same
//      QP, so it lands after those rows (a QP delivers in order; without QP handles a
//      transport fence orders it). An expert with no rows gets its signal (SET 1) at once.
//   4. p waits (bounded) for hsig[op][b][w] == n, checks the header (seq, hash, error,
//      counts inside the blocks; combine: each count equal to the routing's), then waits
//      for every cnt[op][b][w][e] != 0 and fails unless it is the header's count + 1.
//   5. p reads the rows, resets the cnt words of buffer b, then signals SET n into credit
//      word (op, b, p) on every writer (control QP).
// The send halves post and return (no quiet). The puts read the writer's stages when the
// NIC gets to them, so the stages are double-buffered by parity too: epoch n + 2 rewrites
// stage b only after step 1's credits, and a reader's credit for epoch n means it saw all of
// w's signals of epoch n, each landed after the rows before it on its QP, so the NIC has read
// every source byte of epoch n from stage b. The receive half does not quiet either: its
// credits are signals with no source buffer.
// The header word is never reset: it holds the last epoch, and n != n - 2.
#pragma once

#include <cstdint>

#include "kernels/common/striping_plan.h"
#include "kernels/internode/wire_protocol.h"

#if defined(__CUDACC__)
#define JEP_LL_HD __host__ __device__ __forceinline__
#else
#define JEP_LL_HD inline
#endif

namespace jax_ep {
namespace llwire {

using ::jax_ep::kMaxQps;  // kernels/common/striping_plan.h
constexpr int kControlQp = wire::kControlQp;
constexpr int kNumOps = 2;
constexpr int kNumBufs = 2;
constexpr int64_t kAlign = 256;

enum Op : int { kOpDispatch = 0, kOpCombine = 1 };

// Op codes and wait kinds of this mode in the sticky error record the internode modes
// share (wire::ErrorRecord), beside wire::Op / wire::SigKind and the hierarchical kinds.
constexpr int kErrOpBase = 8;        // record.op = kErrOpBase + Op
enum Kind : int {
  kKindHeader = 32,   // header word of (op, buffer, writer)
  kKindData = 33,     // count word of (op, buffer, writer, local expert); qp field: expert
  kKindCredit = 34,   // credit of (op, buffer) from a reader
  kKindRows = 35,     // combine: the owner's count for one of its experts differs from
                      // the routing's (qp field: that local expert)
  kKindCounts = 36,   // a header whose counts do not fit the blocks
};

// The call's configuration as exchanged (hashed) in the header.
enum CfgField : int {
  kCfgOp = 0, kCfgRanks, kCfgExperts, kCfgMaxTokens, kCfgStageRows, kCfgTopk, kCfgHidden,
  kCfgDtype, kCfgRowsPerDest, kCfgNumQps, kCfgCallSite, kNumCfgFields
};

// FNV-1a over the config fields.
JEP_LL_HD uint32_t config_hash(const int32_t* cfg) {
  uint32_t h = 2166136261u;
  for (int i = 0; i < kNumCfgFields; ++i) {
    const uint32_t v = static_cast<uint32_t>(cfg[i]);
    for (int b = 0; b < 4; ++b) {
      h ^= (v >> (8 * b)) & 0xffu;
      h *= 16777619u;
    }
  }
  return h;
}

// Header: 32 fixed bytes, then one int32 count per local expert of the reader (dispatch:
// rows this source sends to each of the owner's experts; combine: rows of each of the
// owner's experts going back to this source).
struct Header {
  uint64_t seq;    // the epoch n
  uint32_t hash;   // config_hash of the writer's call
  int32_t error;   // nonzero: the writer found an error (bad ids, bad handle)
  int32_t rows;    // rows in this writer's stream to the reader
  int32_t pad[3];
};
static_assert(sizeof(Header) == 32, "fixed part of the header");

JEP_LL_HD int64_t round_up(int64_t v, int64_t a) { return (v + a - 1) / a * a; }
JEP_LL_HD int64_t header_stride(int64_t experts_per_rank) {
  return round_up(static_cast<int64_t>(sizeof(Header)) + 4 * experts_per_rank, 16);
}
// A dispatch row: the token's bytes, padded to 16, then its source token index (int32),
// padded to 16. A combine row: the bytes, padded to 16.
JEP_LL_HD int64_t dispatch_meta_offset(int64_t row_bytes) { return round_up(row_bytes, 16); }
JEP_LL_HD int64_t dispatch_stride(int64_t row_bytes) { return round_up(row_bytes, 16) + 16; }
JEP_LL_HD int64_t combine_stride(int64_t row_bytes) { return round_up(row_bytes, 16); }

// Rows an owner returns to one source: each of the source's M tokens names at most
// min(K, E_local) of the owner's experts.
JEP_LL_HD int64_t rows_per_dest(int64_t M, int64_t K, int64_t el) {
  return M * (K < el ? K : el);
}

// QP of row j of a stream to `peer`: the striping plan's QP of chunk j (one row, one
// chunk), so the rows to a peer alternate ports and use every QP.
JEP_LL_HD int32_t row_qp(int32_t peer, int64_t j, int32_t num_ports, int32_t qps_per_port) {
  const int32_t nq = num_ports * qps_per_port;
  return qp_for(peer, static_cast<int32_t>(j % nq), j, num_ports, qps_per_port).qp;
}

// QP of every row (and of the count signal) of one writer's rows for local expert e of
// `reader`: the striping plan's QP of chunk e, so a reader's experts spread over the ports
// and QPs while one expert's rows and their signal share one QP (delivered in order).
JEP_LL_HD int32_t expert_qp(int32_t reader, int32_t e, int32_t num_ports, int32_t qps_per_port) {
  return row_qp(reader, e, num_ports, qps_per_port);
}

// The token is int32[2], so it carries the low 32 bits of the epoch. The receive half
// widens them against the op's counter on its PE, which is at most one call ahead (two
// calls of an op in flight), so epochs past 2^31 (days of decoding) stay exact.
JEP_LL_HD uint64_t widen_epoch(uint64_t latest, uint32_t low) {
  return latest - static_cast<uint32_t>(static_cast<uint32_t>(latest) - low);
}

// Word indices within the signal regions. Count words: one per (writer, reader's local
// expert), so no word is written from two QPs.
JEP_LL_HD int64_t cnt_index(int op, int b, int writer, int e, int R, int el) {
  return ((static_cast<int64_t>(op) * kNumBufs + b) * R + writer) * el + e;
}
JEP_LL_HD int64_t hsig_index(int op, int b, int writer, int R) {
  return (static_cast<int64_t>(op) * kNumBufs + b) * R + writer;
}
JEP_LL_HD int64_t credit_index(int op, int b, int reader, int R) {
  return (static_cast<int64_t>(op) * kNumBufs + b) * R + reader;
}

// Layout of one rank's low-latency area (one nvshmem_malloc at start, the same on every
// PE). Sized by the limits (R, M, row bytes, K, E) only, never by a call's T:
//   dsig    [2 ops][2 bufs][R writers][E_local] u64   count words (SET count + 1; reset)
//   hsig    [2 ops][2 bufs][R writers] u64            header words (SET epoch)
//   credit  [2 ops][2 bufs][R readers] u64            credits (SET epoch)
//   hdr     [2 ops][2 bufs][R writers] headers        headers received
//   hstage  [2 bufs][2 ops][R readers] headers        headers to send (put source)
//   local   bad notes int32[2 ops][4], pos[M*K], counts[E], offsets[E], done[E] (int32,
//           this rank only)
//   dstage  [2 bufs][M*K] dispatch rows               staged tokens (put source)
//   drecv   [2 bufs][E_local][R][M] dispatch rows     rows received per (expert, source)
//   cstage  [2 bufs][R][rows_per_dest] combine rows   rows to return, per source
//   crecv   [2 bufs][R][rows_per_dest] combine rows   rows returned, per owner
// The stages are per parity because a send half returns with its puts in flight (see the
// protocol above). stage_rows = M * K: the gradients stage M * K one-slot tokens.
struct Area {
  int64_t R, M, K, E, el, row_bytes, ds, cs, hs, stage_rows, rpd;
  int64_t dsig, hsig, credit, hdr, hstage, bad, pos, counts, offsets, done, dstage, drecv,
      cstage, crecv, total;
};

JEP_LL_HD Area area_layout(int64_t R, int64_t M, int64_t row_bytes, int64_t K, int64_t E) {
  Area a{};
  a.R = R;
  a.M = M;
  a.K = K;
  a.E = E;
  a.el = R > 0 ? E / R : 0;
  a.row_bytes = row_bytes;
  a.ds = dispatch_stride(row_bytes);
  a.cs = combine_stride(row_bytes);
  a.hs = header_stride(a.el);
  a.stage_rows = M * K;
  a.rpd = rows_per_dest(M, K, a.el);
  const int64_t ob = kNumOps * kNumBufs;
  int64_t off = 0;
  a.dsig = off;    off += round_up(ob * R * a.el * 8, kAlign);
  a.hsig = off;    off += round_up(ob * R * 8, kAlign);
  a.credit = off;  off += round_up(ob * R * 8, kAlign);
  a.hdr = off;     off += round_up(ob * R * a.hs, kAlign);
  a.hstage = off;  off += round_up(ob * R * a.hs, kAlign);
  a.bad = off;     off += round_up(kNumOps * 16, kAlign);
  a.pos = off;     off += round_up(M * K * 4, kAlign);
  a.counts = off;  off += round_up(E * 4, kAlign);
  a.offsets = off; off += round_up(E * 4, kAlign);
  a.done = off;    off += round_up(E * 4, kAlign);
  a.dstage = off;  off += round_up(kNumBufs * a.stage_rows * a.ds, kAlign);
  a.drecv = off;   off += round_up(kNumBufs * a.el * R * M * a.ds, kAlign);
  a.cstage = off;  off += round_up(kNumBufs * R * a.rpd * a.cs, kAlign);
  a.crecv = off;   off += round_up(kNumBufs * R * a.rpd * a.cs, kAlign);
  a.total = off;
  return a;
}

// Byte offsets of one row within the area.
JEP_LL_HD int64_t drecv_row(const Area& a, int b, int e, int s, int64_t pos) {
  return a.drecv + (((static_cast<int64_t>(b) * a.el + e) * a.R + s) * a.M + pos) * a.ds;
}
JEP_LL_HD int64_t crecv_row(const Area& a, int b, int owner, int64_t j) {
  return a.crecv + ((static_cast<int64_t>(b) * a.R + owner) * a.rpd + j) * a.cs;
}
JEP_LL_HD int64_t hdr_at(const Area& a, int op, int b, int writer) {
  return a.hdr + hsig_index(op, b, writer, static_cast<int>(a.R)) * a.hs;
}
JEP_LL_HD int64_t hstage_at(const Area& a, int b, int op, int reader) {
  return a.hstage + ((static_cast<int64_t>(b) * kNumOps + op) * a.R + reader) * a.hs;
}
JEP_LL_HD int64_t dstage_row(const Area& a, int b, int64_t t) {
  return a.dstage + (static_cast<int64_t>(b) * a.stage_rows + t) * a.ds;
}
JEP_LL_HD int64_t cstage_row(const Area& a, int b, int d, int64_t j) {
  return a.cstage + ((static_cast<int64_t>(b) * a.R + d) * a.rpd + j) * a.cs;
}

}  // namespace llwire
}  // namespace jax_ep
