// CUDA kernels of the low-latency mode (jax_ep.low_latency), over per-rank buffers that
// peers write into directly (peer pointers). Buffer sizes depend only on (R, M, H, K, E).
//
// One rank's buffer (LowLatencyLayout):
//   header   epochs, last-block counters, arrival flags per source (dispatch) and per
//            expert owner (combine)
//   slots    [E_local][R][M] rows: source s's rows for local expert e, in token order
//   slot_tok [E_local][R][M] int32: their source tokens
//   counts   [E_local][R] int32: rows source s sent for local expert e
//   pos      [M * K] int32 scratch: each (token, slot)'s row among this rank's tokens
//            that pick the same expert (-1: none or past M)
//   offsets  [E] int32 scratch: where expert g's rows start in its owner's combine stage
//   cstage   [R][rows_per_dest] rows: combine rows returned by each expert owner
//
// Protocol, epochs n = 1, 2, ... per op kind, the same on every rank:
//   dispatch  plan (source s): n = ++seq; positions and counts; counts into each owner.
//             push: each (token, slot) row into its owner's slot; the last block sets
//             arrive_d[s] = n on every owner.
//             recv (owner r): waits arrive_d[s] >= n for all s, packs the slots into the
//             XLA outputs (rows of source s at first_row[e, s], zero past the count).
//   combine   send (owner r): n = ++seq; each row of y into its source's cstage[r]; the
//             last block sets arrive_c[r] = n on every source.
//             recv (source s): positions of its own routing, waits arrive_c[r] >= n for
//             all r, sums each token's rows k ascending (float32, rounded product, then
//             add), casts.
// The virtual-rank harness launches each phase for every rank before the next phase of
// any, so a slot is never rewritten before its owner read it; a real group would also
// need the owners' credits (not built: the mode runs on real GPU ranks only through the
// harness for now).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "kernels/common/dtype_convert.h"
#include "kernels/cuda/intranode_buffer.h"  // kMaxRanks, ErrorRecord, AlignUp, RowStride

namespace jax_ep {

struct alignas(128) LowLatencyHeader {
  uint64_t seq_dispatch;
  uint64_t seq_combine;
  uint32_t done_dispatch;
  uint32_t done_combine;
  uint64_t arrive_dispatch[kMaxRanks];
  uint64_t arrive_combine[kMaxRanks];
};

struct LowLatencyLayout {
  int R, E, M, K;
  size_t row_bytes, stride;
  int64_t rows_per_dest;
  size_t slots_off, tok_off, counts_off, pos_off, offsets_off, cstage_off, bytes;

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
    l.rows_per_dest = static_cast<int64_t>(M) * (K < E / R ? K : E / R);
    const size_t slots = el * R * M;
    l.slots_off = AlignUp(sizeof(LowLatencyHeader), kAreaAlign);
    l.tok_off = l.slots_off + AlignUp(slots * l.stride, kAreaAlign);
    l.counts_off = l.tok_off + AlignUp(slots * 4, kAreaAlign);
    l.pos_off = l.counts_off + AlignUp(el * R * 4, kAreaAlign);
    l.offsets_off = l.pos_off + AlignUp(static_cast<size_t>(M) * K * 4, kAreaAlign);
    l.cstage_off = l.offsets_off + AlignUp(static_cast<size_t>(E) * 4, kAreaAlign);
    l.bytes = l.cstage_off +
              AlignUp(static_cast<size_t>(R) * l.rows_per_dest * l.stride, kAreaAlign);
    return l;
  }
};

struct LowLatencyArgs {
  PeerTable peers;   // every rank's low-latency buffer
  LowLatencyLayout L;
  int me;
  int S;             // staged tokens of this call (<= M * K)
  int K;             // topk of this call's routing (<= L.K, or 1 for one-slot tokens)
  int64_t H;
  FloatKind kind;
  ErrorRecord* host_err;
  int64_t timeout_ns;
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

}  // namespace jax_ep
