// CPU kernels of the low-latency mode (jax_ep.low_latency). Like cpu_kernels.h they take
// plain pointers, peers' included; xla_ffi/cpu/low_latency_handlers.cc validates and
// meets the peers.
//
// Buffers (fixed from R, M, H, K, E; S = staged rows, M for the ops):
//   dispatch stage   x[S, H], topk_idx[S, K], expert_count[E]    (per source)
//   dispatch recv    recv_x[E_local, R * M, H], src_rank/src_index[E_local, R * M],
//                    first_row/row_count[E_local, R], recv_count[E_local]
//   combine stage    [R(destination), rows_per_dest, H]           (per expert owner)
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "kernels/common/dtype_convert.h"

namespace jax_ep {

struct LowLatencyShape {
  int num_ranks;         // R
  int num_experts;       // E
  int max_tokens;        // M: rows per (local expert, source rank)
  int stage_rows;        // S: staged tokens per rank
  int topk;              // K of the staged routing
  int64_t hidden;        // H
  size_t row_bytes;      // H * element size
  int experts_per_rank() const { return num_experts / num_ranks; }
  int64_t block_rows() const { return static_cast<int64_t>(num_ranks) * max_tokens; }
};

// "" if every id of topk_idx[S, K] is in [-1, E) and no id repeats within a token; else
// a message naming the first offending token.
std::string CheckLowLatencyIds(const int32_t* topk_idx, int S, int K, int E);

// Tokens of topk_idx[S, K] that name each expert, counts[E]. Assumes valid ids.
void ExpertCountsCpu(const int32_t* topk_idx, int S, int K, int E, int32_t* counts);

// Receiver `me` pulls its rows from every source s (x_s[S, H], idx_s[S, K], counts_s[E])
// into its per-expert blocks, zero past each expert's count.
void LowLatencyDispatchRecvCpu(int me, const LowLatencyShape& s, const void* const* src_x,
                               const int32_t* const* src_idx,
                               const int32_t* const* src_counts, void* recv_x,
                               int32_t* recv_count, int32_t* src_rank, int32_t* src_index,
                               int32_t* first_row, int32_t* row_count);

// Expert owner: stage[d] = for each local expert e in order, its rows from source d
// (y[e, first_row[e, d] .. + row_count[e, d])), packed. Returns "" or an error for a
// handle that does not fit y.
std::string LowLatencyCombineStageCpu(const LowLatencyShape& s, const void* y,
                                      const int32_t* first_row, const int32_t* row_count,
                                      int64_t rows_per_dest, void* stage);

// Source `me`: out[t] = sum over k ascending of w[t, k] * row(t, k) in float32, where
// row(t, k) is read from the owner's stage (peer_stage[r]); -1 slots skipped.
void LowLatencyCombineRecvCpu(int me, FloatKind kind, const LowLatencyShape& s,
                              int64_t rows_per_dest, const void* const* peer_stage,
                              const int32_t* topk_idx, const float* topk_w, void* out);

}  // namespace jax_ep
