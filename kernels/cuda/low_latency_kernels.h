// CUDA kernels of the low-latency mode (jax_ep.low_latency), over per-rank buffers that
// peers write into directly (peer pointers). Buffer sizes depend only on (R, M, H, K, E).
//
// One rank's buffer (LowLatencyLayout): the low-latency area of its intranode buffer on
// real ranks (jax_ep.cuda.setup(..., max_tokens_per_rank=M, num_experts=E), sized once,
// M and the row size being the largest a call may use), or one harness allocation per
// virtual rank:
//   header   epochs, last-block counters, and per peer: arrival flags and call tags
//            (written by sources / owners before their data signal) and credits
//            (written by owners / sources when they finished reading)
//   slots    [E_local][R][M] rows: source s's rows for local expert e, in token order
//   slot_tok [E_local][R][M] int32: their source tokens
//   counts   [E_local][R] int32: rows source s sent for local expert e
//   pos      [M * K] int32 scratch: each (token, slot)'s row among this rank's tokens
//            that pick the same expert (-1: none or past M); pos_c the same for combine
//   offsets  [E] int32 scratch: where expert g's rows start in its owner's combine stage
//   cstage   [R][rows_per_dest] rows: combine rows returned by each expert owner
// Index math shared with the host simulator: kernels/common/low_latency_math.h.
//
// Protocol, epochs n = 1, 2, ... per op kind, the same on every rank:
//   dispatch  plan (source s): n = ++seq, own tag; positions; waits credit_d[r] >= n - 1
//             from every owner r (r finished reading epoch n - 1, so no slot of r is
//             overwritten unread); counts into each owner.
//             push: each (token, slot) row into its owner's slot; the last block writes
//             tag_d[s] then arrive_d[s] = n (release, after a system fence) on every owner.
//             recv (owner r): waits arrive_d[s] >= n for all s (bounded), requires == n
//             and every tag equal to its own, packs the slots into the XLA outputs (rows
//             of source s at first_row[e, s], zero past the count); the last block then
//             writes credit_d[r] = n on every source.
//   combine   send (owner r): n = ++seq, own tag; waits credit_c[d] >= n - 1 from every
//             source d (d finished reading epoch n - 1 of its stage); each row of y into
//             its source's cstage[r]; the last block writes tag_c[r] then arrive_c[r] = n
//             on every source.
//             recv (source s): positions of its own routing, waits arrive_c[r] >= n for
//             all r with the same checks, sums each token's rows k ascending (float32,
//             rounded product, then add), casts; the last block credits every owner.
// Errors go to a sticky device record (g_ll_error, mirrored to the host). After a
// protocol error (timeout, tag or epoch mismatch, a peer's failure, rank mismatch) the
// kernels keep the epochs, credits and signals going but move no data and send
// kSiteFailed as their tag, so peers record kErrPeerFailed instead of waiting; waits end
// at once while such an error is recorded; jax_ep.cuda.reset() clears it. The harness
// launches each phase for every virtual rank before the next phase of any, so its waits
// and credits are always already met.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "kernels/common/dtype_convert.h"
#include "kernels/common/low_latency_math.h"
#include "kernels/cuda/intranode_buffer.h"  // kMaxRanks, ErrorRecord, AlignUp, RowStride

namespace jax_ep {

struct alignas(128) LowLatencyHeader {
  uint64_t seq_dispatch;
  uint64_t seq_combine;
  uint32_t done_dispatch;      // last-block counters: dispatch push, dispatch recv,
  uint32_t done_dispatch_recv; // combine push, combine recv
  uint32_t done_combine;
  uint32_t done_combine_recv;
  int64_t my_tag_dispatch;     // this rank's tag of its current call per op kind
  int64_t my_tag_combine;
  uint64_t arrive_dispatch[kMaxRanks];  // written by source s: epoch n's rows are here
  uint64_t arrive_combine[kMaxRanks];   // written by owner r: epoch n's stage rows are here
  uint64_t credit_dispatch[kMaxRanks];  // written by owner r: it read epoch n's slots
  uint64_t credit_combine[kMaxRanks];   // written by source d: it read epoch n's stage
  int64_t tag_dispatch[kMaxRanks];      // written by source s before arrive_dispatch[s]
  int64_t tag_combine[kMaxRanks];       // written by owner r before arrive_combine[r]
};
// Fixed, so the host sizes the area without the struct (jax_ep.cuda.buffer_bytes).
constexpr size_t kLowLatencyHeaderBytes = 4096;
static_assert(sizeof(LowLatencyHeader) <= kLowLatencyHeaderBytes, "low-latency header too large");

// Op kinds of the low-latency waits, as reported in kErrTimeout / kErrCallSite records.
enum LowLatencyOp : int { kOpLLDispatch = 8, kOpLLCombine = 9, kOpLLDispatchCredit = 10,
                          kOpLLCombineCredit = 11 };

struct LowLatencyLayout {
  int R, E, M, K;
  size_t row_bytes, stride;
  int64_t rows_per_dest;
  size_t slots_off, tok_off, counts_off, pos_off, pos_c_off, offsets_off, cstage_off, bytes;

  JEP_HDX int experts_per_rank() const { return E / R; }
  JEP_HDX static LowLatencyLayout Make(int R, int M, size_t row_bytes, int K, int E) {
    LowLatencyLayout l;
    l.R = R;
    l.E = E;
    l.M = M;
    l.K = K;
    l.row_bytes = row_bytes;
    l.stride = RowStride(row_bytes);
    const size_t el = static_cast<size_t>(E / R);
    l.rows_per_dest = ll_rows_per_dest(M, K, E / R);
    const size_t slots = el * R * M;
    l.slots_off = kLowLatencyHeaderBytes;
    l.tok_off = l.slots_off + AlignUp(slots * l.stride, kAreaAlign);
    l.counts_off = l.tok_off + AlignUp(slots * 4, kAreaAlign);
    l.pos_off = l.counts_off + AlignUp(el * R * 4, kAreaAlign);
    l.pos_c_off = l.pos_off + AlignUp(static_cast<size_t>(M) * K * 4, kAreaAlign);
    l.offsets_off = l.pos_c_off + AlignUp(static_cast<size_t>(M) * K * 4, kAreaAlign);
    l.cstage_off = l.offsets_off + AlignUp(static_cast<size_t>(E) * 4, kAreaAlign);
    l.bytes = l.cstage_off +
              AlignUp(static_cast<size_t>(R) * l.rows_per_dest * l.stride, kAreaAlign);
    return l;
  }
};

struct LowLatencyArgs {
  PeerTable peers;   // every rank's low-latency buffer (its header first)
  LowLatencyLayout L;  // the area's layout (sized for the largest M, rows, K)
  int me;
  int M;             // this call's max_tokens (<= L.M): R * M rows per output block
  size_t row_bytes;  // this call's row size (<= L.row_bytes; slots keep L.stride)
  int S;             // staged tokens of this call (<= L.M * L.K)
  int K;             // topk of this call's routing (<= L.K, or 1 for one-slot tokens)
  int64_t H;
  FloatKind kind;
  ErrorRecord* host_err;
  int64_t timeout_ns;
  int64_t tag;       // ll_call_tag of this call (send halves)
  const int32_t* rank_in;   // real ranks: XLA's rank/group scalars (receive halves),
  const int32_t* group_in;  // checked against expect_group / me; null in the harness
  int expect_group;
  int32_t* expert_count;    // dispatch plan: tokens per expert [E] (null: not wanted)
  // dispatch
  const void* x;
  const int32_t* topk_idx;
  void* recv_x;
  int32_t* recv_count;
  int32_t* src_rank;
  int32_t* src_index;
  int32_t* first_row;   // in (combine send) or out (dispatch recv)
  int32_t* row_count;
  // combine
  const void* y;
  const float* topk_w;
  void* out;
};

enum LowLatencyPhase : int {
  kLLDispatchPlan = 0, kLLDispatchPush = 1, kLLDispatchRecv = 2,
  kLLCombinePlan = 3, kLLCombinePush = 4, kLLCombineRecvPlan = 5, kLLCombineRecv = 6,
};

cudaError_t LaunchLowLatencyPhase(int phase, const LowLatencyArgs& a, cudaStream_t stream);
cudaError_t ReadLowLatencyError(ErrorRecord* out, bool clear);
// Re-zeroes the protocol state of a low-latency header (synchronous; jax_ep.cuda.reset).
cudaError_t ClearLowLatencyHeader(void* header);

}  // namespace jax_ep
