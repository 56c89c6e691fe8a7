// CPU compute kernels of the EP ops. They take plain pointers, including peers'
// buffers (virtual CPU devices of one process share memory); the FFI handlers in
// xla_ffi/ own validation and the rendezvous that hands these pointers out.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "kernels/common/dtype_convert.h"

namespace jax_ep {

struct RoutingShape {
  int num_ranks;    // R
  int num_experts;  // E
  int num_tokens;   // T
  int topk;         // K
  int capacity;     // C
  int experts_per_rank() const { return num_experts / num_ranks; }
};

// Returns "" if every id of topk_idx[T, K] is in [-1, E), else a message naming the
// first offending token, slot and value.
std::string CheckTopkIds(const int32_t* topk_idx, int T, int K, int E);

// Layout of one rank's routing: tokens per destination rank [R], slots per expert [E],
// is_token_in_rank [T, R] (one byte per bool). Assumes ids are valid.
void LayoutCpu(const int32_t* topk_idx, const RoutingShape& s, int32_t* tokens_per_rank,
               int32_t* tokens_per_expert, bool* is_token_in_rank);

// Tokens this rank sends each rank, per[R] (each token at most once per rank): the
// per-destination counts a source publishes before its peers compute row offsets.
void TokensPerRankCpu(const int32_t* topk_idx, const RoutingShape& s, int32_t* per_rank);

// Receiver side of dispatch on rank `rank`. `peer_x[s]`, `peer_idx[s]`, `peer_w[s]` are
// source s's inputs; `counts` is the [R_src, R_dst] token-count matrix.
void DispatchRecvCpu(int rank, const RoutingShape& s, size_t row_bytes,
                     const void* const* peer_x, const int32_t* const* peer_idx,
                     const float* const* peer_w, const int32_t* counts, void* recv_x,
                     int32_t* recv_idx, float* recv_w, int32_t* src_rank,
                     int32_t* src_index, int32_t* num_recv, int32_t* num_dropped,
                     int32_t* recv_per_expert);

// Sender side of dispatch on rank `rank`: send_row[T, R] is the row each token occupies
// on each receiver, -1 where not sent or dropped by capacity.
void DispatchSendRowsCpu(int rank, const RoutingShape& s, const int32_t* topk_idx,
                         const int32_t* counts, int32_t* send_row);

// One bias term of combine: a [T, H] array of `kind`, added to each token's float32 sum.
struct CombineBias {
  FloatKind kind;
  const void* data;
};

// Combine on one source rank: out[t] = the float32 sum of peer_y[r][send_row[t, r]] over
// the r with send_row[t, r] >= 0 in combine's order (kernels/common/combine_order.h: per
// node of `node_size` ranks ascending, node partials rounded to the element type when
// there are several nodes, then nodes ascending; node_size <= 0 or >= R: one node), then
// plus bias[0][t], bias[1][t], ... (each converted to float32), cast once to the element
// type.
void CombineCpu(FloatKind kind, int num_ranks, int T, int H, const int32_t* send_row,
                const void* const* peer_y, void* out, const CombineBias* bias = nullptr,
                int num_bias = 0, int node_size = 0);

// Hints the kernel to back [p, p + n) with transparent huge pages (Linux; no-op elsewhere).
void AdviseHugePages(void* p, size_t n);

// Handle-driven gather (the transpose of combine): out[i] = peer_g[src_rank[i]][src_index[i]]
// for rows with src_rank[i] >= 0, zero elsewhere.
void GatherByHandleCpu(int C, size_t row_bytes, const int32_t* src_rank,
                       const int32_t* src_index, const void* const* peer_g, void* out);

}  // namespace jax_ep
