// Host API of the internode (NVSHMEM) low-latency mode (jax_ep.low_latency on the
// internode backend): direct per-expert puts, no layout pass, no host synchronisation.
// Plain C++: no NVSHMEM types leak out of the internode sources (low_latency_host.cu, the
// kernels in low_latency_kernels.cu).
//
// Protocol (kernels/internode/low_latency_wire.h has the word-level rules):
//   dispatch_send (every rank as a source, epoch n of the dispatch op, buffer b = n & 1):
//     begin -- the epoch into the token, the bad note and per-expert done counters cleared
//     plan  -- a warp per expert: each (token, slot)'s position among this rank's slots
//              naming that expert (token order, a ballot per 32 slots), the count (at
//              most M); bad or repeated ids noted (a thread per slot)
//     send  -- every block waits (bounded) for every owner's credit for buffer b (the
//              owner finished epoch n - 2); block 0 stages and puts one header per owner
//              (seq n, config hash, error flag, counts; put-with-signal SET n on the
//              control QP); experts with no rows get their count signal (SET 1); a warp
//              per token copies it into dstage[b] (row + source token index; with fp8 the
//              warp casts the row to an FP8 message there instead) and puts it,
//              without a signal, into drecv[b][expert][source][position] of each of its
//              experts' owners, on the expert's QP (llwire::expert_qp); after a
//              token's puts its warp fences once and counts its rows, and the warp that
//              counts an expert's last row sends one count signal (SET count + 1) on
//              that QP. The kernel returns with its puts in flight (no quiet).
//     token -- int32[2] (n, hash): the epoch the receive half completes (its low 32 bits,
//              widened by the receive against this PE's counter, llwire::widen_epoch)
//              and this call's config hash, which every writer's header must carry
//   dispatch_recv (every rank as an owner): waits (bounded) for every source's header
//     word == n, checks seq, hash and error flag, then every (source, expert) count word
//     (it must equal the header's count + 1); writes the rows below the counts of
//     recv_x[E_local, R*M, H] (rows of source s for expert e at first_row[e, s], in token
//     order; rows past recv_count are not written), recv_count, src_rank, src_index (-1
//     past the count), first_row, row_count; resets buffer b's count words and returns the
//     credit (SET n into word (dispatch, b, owner) on every source).
//   combine_send (every rank as an owner, epoch m of the combine op): after every
//     source's credit, a warp per returned row copies it from y into cstage[b] and puts it
//     into crecv[b][owner][j] at its source (j: experts in order, then the row), one count
//     signal per (expert, source) after the last.
//   combine_recv (every rank as a source): positions of its own routing (a warp per
//     expert), waits for every owner's header and count words, checks the owner's count
//     for each of its experts equals what its own routing implies, sums each token's rows
//     k ascending (float32 product rounded, then added, kernels/common/low_latency_math.h;
//     a warp per (token, chunk) item with every row's 16-byte loads in flight before the
//     adds, kernels/cuda/ll_combine_sum.cuh), casts; resets and returns the credit.
//
// Slot reuse: DOUBLE BUFFERING BY EPOCH PARITY, GUARDED BY CREDITS. Epoch n writes buffer
// n & 1 of the reader's areas; before writing it, the writer waits until the reader's
// credit for that buffer says it finished epoch n - 2; the writer's own stages are per
// parity too and rewritten only after that wait, so a send half need not wait for its
// puts to complete (a credit for epoch n - 2 means the reader saw every count signal of
// n - 2, each landed after the rows it counts, so the NIC had read those stage bytes).
// So at most two calls of an op can be in flight per rank (e.g. two dispatch sends before
// their two receives); a third send waits for a credit that only a receive behind it on the stream can give,
// and ends in a timeout error, never a hang or a silent overwrite.
//
// Buffers: one symmetric area per PE, allocated once by Init from (R, M, row bytes, K, E)
// and independent of the call's T (llwire::area_layout). The sticky error record, QP
// handles and the NVSHMEM runtime are the direct mode's (internode::SharedState); a failed
// rank stays silent, so its peers time out, as in the other internode modes.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "kernels/common/dtype_convert.h"

namespace jax_ep {
namespace ll_internode {

struct Limits {
  bool initialized = false;
  int R = 0, M = 0, K = 0, E = 0;
  int64_t row_bytes = 0;
  int64_t area_bytes = 0;
};

// Collective over every PE (nvshmem_malloc), after internode::Init: the area for up to M
// tokens per rank of row_bytes bytes each (H times the largest element size used), top-K
// routing and E experts over the num_ranks PEs. "" on success.
std::string Init(int num_ranks, int max_tokens, int64_t row_bytes, int topk, int num_experts);
Limits GetLimits();
// Collective: frees the area (before internode::Finalize stops NVSHMEM). "" on success.
std::string Finalize();

// One call's shape. S staged tokens (S <= M * K), K' = topk of the staged routing.
struct CallDims {
  int R = 0, rank = 0, E = 0, M = 0;
  int S = 0, K = 0;
  int64_t H = 0;
  int elem_bytes = 4;          // dispatch moves raw rows of any 1, 2 or 4-byte dtype
  int dtype_code = 0;          // the XLA element type (hashed)
  FloatKind elem = FloatKind::kF32;  // combine's arithmetic
  int64_t rows_per_dest = 0;  // combine: rows an owner returns to one source
  int num_ports = 1, qps_per_port = 1;
  int64_t timeout_ns = 0;
  int64_t call_site = 0;      // the send half's call_site (hashed in the header)
  // Dispatch: 0 moves x's rows as they are; 1 casts each row to FP8 in the send kernel
  // (x float32/bfloat16/float16 of kind `elem`, H a multiple of 128) and puts one message
  // per (token, expert): H FP8 values, then H / 128 float32 scales
  // (kernels/common/fp8_quant.h); 2 the same with round_scale. The receive half splits the
  // messages into recv_x (float8_e4m3fn) and recv_scales.
  int fp8 = 0;
  // Receive halves: H, dtype and (combine) S, K of the call; the config hash to check
  // comes from the send half's token.
};

// token: int32[2] device, written by the send half, read by the receive half.
std::string DispatchSend(cudaStream_t stream, const CallDims& d, const void* x,
                         const int32_t* topk_idx, int32_t* token);

struct DispatchRecvOut {
  void* recv_x;          // [E_local, R*M, H]; rows past recv_count are left unwritten
  int32_t* recv_count;   // [E_local]
  int32_t* src_rank;     // [E_local, R*M]
  int32_t* src_index;    // [E_local, R*M]
  int32_t* first_row;    // [E_local, R]
  int32_t* row_count;    // [E_local, R]
  float* recv_scales = nullptr;  // fp8: [E_local, R*M, H / 128]
};
std::string DispatchRecv(cudaStream_t stream, const CallDims& d, const int32_t* token,
                         const DispatchRecvOut& out);

std::string CombineSend(cudaStream_t stream, const CallDims& d, const void* y,
                        const int32_t* first_row, const int32_t* row_count, int32_t* token);
// out[S, H]; topk_idx / topk_weights [S, K].
std::string CombineRecv(cudaStream_t stream, const CallDims& d, const int32_t* token,
                        const int32_t* topk_idx, const float* topk_weights, void* out);

// The sticky error of an earlier call of any internode mode ("" if none), with this
// mode's wait kinds spelled out.
std::string PendingError();

}  // namespace ll_internode
}  // namespace jax_ep
