// CUDA kernels of the low-latency mode (jax_ep.low_latency), over per-rank buffers that
// peers write into directly (peer pointers). Buffer sizes depend only on (R, M, H, K, E).
//
// One rank's buffer (LowLatencyLayout, kernels/cuda/low_latency_layout.h): the
// low-latency area of its intranode buffer on real ranks (jax_ep.cuda.setup(...,
// max_tokens_per_rank=M, num_experts=E), sized once, M and the row size being the largest
// a call may use), or one harness allocation per virtual rank. Data regions come in two halves; epoch n of an op kind uses half n % 2,
// so two send halves of one kind may be in flight at once:
//   header   epochs, last-block counters, own tags, and per half and peer: call tags
//            (written by sources / owners before their arrival words) and credits
//            (written by owners / sources when they finished reading that half)
//   slots    [2][E_local][R][M] rows: source s's rows for local expert e, in token order
//   slot_tok [2][E_local][R][M] int32: their source tokens
//   words    [2] x ([E_local][R] dispatch words, by source s for local expert e, then
//            [R][E_local] combine words, by owner r for its local expert e): uint64
//            arrival words ll_count_word(epoch, rows), one release store per pair after
//            its rows (the "counts" region of the layout)
//   pos      [M * K] int32 scratch of the dispatch (unused since the plan is per block)
//   pos_c    [M * K] int32: each (token, slot)'s row among this rank's tokens that pick
//            the same expert (-1: none or past M), for the combine's receive half
//   offsets  [E] int32: the combine receive plan's rows per expert (capped at M)
//   cstage   [2][R][rows_per_dest] rows: combine rows returned by each expert owner
// Index math shared by host and device: kernels/common/low_latency_math.h.
//
// Protocol, epochs n = 1, 2, ... per op kind, the same on every rank; h = n % 2. Every
// kernel is a grid of at most the SM budget's blocks (a.max_blocks); no block waits for
// another block of its kernel, so any number of them may be resident:
//   dispatch  send (source s), a block per expert g (strided): every block reads n =
//             seq + 1 (the last block advances seq), the bad-slot check over all slots;
//             waits credit_d[h][r] >= n - 2 from g's owner r (r finished reading the last
//             epoch that used half h); numbers the slots naming g in token order (ballots
//             and a block prefix), copies each row into r's slot with 16-byte stores
//             (with fp8, a warp casts the row in registers and stores one FP8 message:
//             the values, then the 1 x 128 scales; kernels/common/fp8_quant.h);
//             then every thread fences its own stores and one thread writes
//             tag_d[h][s] and releases the word (g, s) = (n, rows) on r. It returns
//             without waiting for anything to land: the next epoch that reuses half h
//             waits for r's credit of this one.
//             recv (owner r, epoch n from its send half), a block per (e, s) (strided):
//             waits the words (e, s') of epoch n for all s' (bounded), requires every tag
//             equal to its own, places source s's rows at first_row[e, s] (FP8
//             messages split into recv_x and recv_scales); rows past
//             recv_count[e] are not written (unspecified; src_rank/src_index are -1
//             there); the last block then writes credit_d[h][r] = n on every source.
//   combine   send (owner r), a block per (e, d) (strided): every block checks the
//             handle alike (first_row/row_count inside y, at most rows_per_dest rows per
//             source); waits credit_c[h][d] >= n - 2; copies rows of (e, d) into d's
//             cstage[h][r] (ll_stage_row), fences, writes tag_c[h][r] (kLLTagBadHandle
//             for a foreign handle, whose rows are not sent) and releases the combine
//             word (r, e) = (n, 0) on d.
//             recv (source s): a plan kernel numbers this call's routing per expert in
//             parallel (as the dispatch numbered it); then every block waits every
//             word of epoch n, checks the tags, and a warp per (token, chunk) item sums
//             the token's rows k ascending (float32, rounded product, then add; every
//             row's 16-byte loads in flight before the adds, ll_combine_sum.cuh), casts;
//             the last block credits every owner.
// A third send half of one kind before the first's receive half would wait for a credit
// that only that receive half gives: it times out with an error instead of overwriting.
// Errors go to a sticky device record (g_ll_error, mirrored to the host). After a
// protocol error (timeout, tag mismatch, a peer's failure, rank mismatch) the kernels
// keep the epochs, credits and arrival words going but move no data and send kSiteFailed
// as their tag, so peers record kErrPeerFailed instead of waiting; waits end at once
// while such an error is recorded; jax_ep.cuda.reset() clears it (and the words). The
// harness launches each phase for every virtual rank before the next phase of any, so
// its waits and credits are always already met; its send halves hand each rank's epoch
// over in their token output, as the real ranks' do in theirs.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "kernels/common/dtype_convert.h"
#include "kernels/common/low_latency_math.h"
#include "kernels/cuda/intranode_buffer.h"  // kMaxRanks, ErrorRecord, AlignUp, RowStride
#include "kernels/cuda/low_latency_layout.h"  // LowLatencyLayout, kLowLatencyHeaderBytes

namespace jax_ep {

struct alignas(128) LowLatencyHeader {
  uint64_t seq_dispatch;       // this rank's last epoch per op kind (send halves)
  uint64_t seq_combine;
  uint32_t done_dispatch;      // last-block counters (dispatch send, dispatch recv,
  uint32_t done_dispatch_recv; // combine send, combine recv); the last block re-zeroes
  uint32_t done_combine;       // its counter for the next launch
  uint32_t done_combine_recv;
  int64_t my_tag_dispatch[2];  // this rank's tag of the epoch in each half
  int64_t my_tag_combine[2];
  uint64_t credit_dispatch[2][kMaxRanks];  // by owner r: it read epoch n's slots
  uint64_t credit_combine[2][kMaxRanks];   // by source d: it read epoch n's stage
  int64_t tag_dispatch[2][kMaxRanks];      // by source s before its dispatch words
  int64_t tag_combine[2][kMaxRanks];       // by owner r before its combine words
  uint64_t words_off, words_bytes;         // the arrival words (for reset), set by sends
};
// Tag an owner sends when its combine's handle does not fit y: it moved no rows, and its
// sources count them as zero and report the handle (no protocol error: the next call runs).
constexpr int64_t kLLTagBadHandle = -2;
// The combine receive kernel keeps per-expert offsets in shared memory.
constexpr int kLLMaxExperts = 1024;
// Threads per block of every low-latency kernel, and the blocks of one kernel that one SM
// is assumed to hold at that size (tests/test_ll_grid_budget.py checks it against
// `nvcc -Xptxas -v`): grids are cut to the SM budget (EpSmBudget) times this.
constexpr int kLLThreads = 256;
constexpr int kLLBlocksPerSm = 1;
static_assert(sizeof(LowLatencyHeader) <= kLowLatencyHeaderBytes, "low-latency header too large");

// Op kinds of the low-latency waits, as reported in kErrTimeout / kErrCallSite records.
enum LowLatencyOp : int { kOpLLDispatch = 8, kOpLLCombine = 9, kOpLLDispatchCredit = 10,
                          kOpLLCombineCredit = 11 };

struct LowLatencyArgs {
  PeerTable peers;   // every rank's low-latency buffer (its header first)
  LowLatencyLayout L;  // the area's layout (sized for the largest M, rows, K)
  int me;
  int M;             // this call's max_tokens (<= L.M): R * M rows per output block
  size_t row_bytes;  // this call's row size (<= L.row_bytes; slots keep L.stride)
  int S;             // staged tokens of this call (<= L.M * L.K)
  int K;             // topk of this call's routing (<= L.K, or 1 for one-slot tokens)
  int64_t H;
  FloatKind kind;    // combine: y's rows; dispatch with fp8: x's rows
  // Dispatch: 0 sends x's rows as they are; 1 casts each row to FP8 in the send kernel
  // and sends one message (kernels/common/fp8_quant.h: values, then scales; row_bytes is
  // the message's size), 2 the same with round_scale. The receive half unpacks into
  // recv_x (float8_e4m3fn [E_local, R * M, H]) and recv_scales (float32 [.., H / 128]).
  int fp8;
  void* recv_scales;
  ErrorRecord* host_err;
  int64_t timeout_ns;
  int64_t tag;       // ll_call_tag of this call (send halves)
  int64_t rows_per_dest;  // combine send: this call's rows per source (0: the area's)
  int max_blocks;         // grid cap: SM budget x kLLBlocksPerSm (0: kLLDefaultBlocks)
  const int32_t* rank_in;   // real ranks: XLA's rank/group scalars (receive halves),
  const int32_t* group_in;  // checked against expect_group / me; null in the harness
  int expect_group;
  int32_t* expert_count;    // dispatch send: tokens per expert [E] (null: not wanted)
  int32_t* epoch_out;       // send plan: the epoch handed to the receive half (null: none)
  const int32_t* epoch_in;  // receive half: that epoch (null: the last one sent)
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
  kLLDispatchSend = 0, kLLDispatchRecv = 1, kLLCombineSend = 2, kLLCombineRecvPlan = 3,
  kLLCombineRecv = 4,
};
// Blocks per kernel when the caller sets no budget (132 SMs less the default reserve).
constexpr int kLLDefaultBlocks = 116;
// Grid of a kernel with `work` independent items under a cap of `max_blocks` (<= 0: the
// default): never more blocks than items, never fewer than one.
inline int LLGrid(int64_t work, int max_blocks) {
  const int64_t cap = max_blocks > 0 ? max_blocks : kLLDefaultBlocks;
  const int64_t g = work < cap ? work : cap;
  return static_cast<int>(g < 1 ? 1 : g);
}

cudaError_t LaunchLowLatencyPhase(int phase, const LowLatencyArgs& a, cudaStream_t stream);
cudaError_t ReadLowLatencyError(ErrorRecord* out, bool clear);
// The low-latency failed state (non-zero: a protocol error, no data moves), kept when
// the record is cleared; ClearLowLatencyFailure() lifts it (jax_ep.cuda.reset only).
cudaError_t ReadLowLatencyFailed(int32_t* out);
cudaError_t ClearLowLatencyFailure();
// Re-zeroes the protocol state of a low-latency header and the arrival words its sends
// recorded (synchronous; jax_ep.cuda.reset).
cudaError_t ClearLowLatencyHeader(void* header);

}  // namespace jax_ep
