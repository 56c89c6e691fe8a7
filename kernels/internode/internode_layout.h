// Layout of the NVSHMEM symmetric heap used by the internode kernels. Pure functions:
// the CUDA code carves the heap with them and `jax_ep.nvshmem_bootstrap.heap_bytes_for`
// sizes it with them (bound as internode_heap_bytes, xla_ffi/common/striping_bindings.cc).
//
// R ranks, T = most tokens per rank, C = capacity (received rows per rank), K = top-k.
// A rank sends each token to at most min(K, R) ranks, so its packed send rows number at
// most T * min(K, R). The heap is two equal halves; call n (dispatch or combine) uses
// half n % 2, so a fast peer already in the next call never writes into memory this PE
// still reads. Within a half, signals and counts come first at offsets that depend on R
// only (they must stay put from call to call, and are zero between calls):
//
//   sigs   [4][R][64] uint64      signal words [kind][source][logical QP]
//                                 (kernels/internode/wire_protocol.h)
//   hdr    [R] 64-byte headers    per-call header of each source (seq, config, error)
//   counts [R][R] int32           counts[s][d]: rows s sends d (all-gathered per call)
//   recv   [C] dispatch rows      rows received by dispatch, in contract order
//   back   [T*min(K,R)] combine rows   rows returned by combine, in send order
//   stage  [T*min(K,R)] dispatch rows  packed rows to send
//   cstage [C] combine rows            y rows to return
#pragma once

#include <cstdint>

#include "kernels/internode/wire_protocol.h"

#if defined(__CUDACC__)
#define JEP_LAYOUT_HD __host__ __device__ __forceinline__
#else
#define JEP_LAYOUT_HD inline
#endif

namespace jax_ep {

constexpr int64_t kHeapAlign = 256;
// Room NVSHMEM and the kernels' bookkeeping may use beyond the regions above.
constexpr int64_t kHeapSlackBytes = 32ll << 20;

JEP_LAYOUT_HD int64_t round_up(int64_t v, int64_t a) { return (v + a - 1) / a * a; }

// Bytes of each of the two heap halves the calls alternate over, in a heap (symmetric heap
// or NCCL window) of heap_bytes: what is left past the slack, halved, aligned down.
JEP_LAYOUT_HD int64_t heap_half_bytes(int64_t heap_bytes) {
  return ((heap_bytes - kHeapSlackBytes) / 2) / kHeapAlign * kHeapAlign;
}

// One dispatched row: the token's bytes, padded to 16 so the int32 metadata that
// follows is aligned (odd H in 16-bit dtypes), then K global expert ids (int32), K
// weights (f32) and the source token index (int32), padded to 16 bytes.
JEP_LAYOUT_HD int64_t dispatch_meta_offset(int64_t hidden_bytes) { return round_up(hidden_bytes, 16); }
JEP_LAYOUT_HD int64_t dispatch_row_stride(int64_t hidden_bytes, int64_t topk) {
  return round_up(dispatch_meta_offset(hidden_bytes) + 8 * topk + 4, 16);
}
JEP_LAYOUT_HD int64_t combine_row_stride(int64_t hidden_bytes) { return round_up(hidden_bytes, 16); }
// A striped chunk on the wire: the plan's chunk_bytes rounded up to 16 bytes, so every
// put stays 16-byte aligned.
JEP_LAYOUT_HD int64_t wire_chunk_bytes(int64_t chunk_bytes) { return round_up(chunk_bytes, 16); }

JEP_LAYOUT_HD int64_t send_rows(int64_t max_tokens, int64_t topk, int64_t num_ranks) {
  return max_tokens * (topk < num_ranks ? topk : num_ranks);
}

struct HeapLayout {
  int64_t sigs, hdr, counts, recv, back, stage, cstage;  // byte offsets within a half
  int64_t total;                                     // bytes of one half
};

// x_bytes / y_bytes: bytes per hidden element of dispatch's x and combine's y.
JEP_LAYOUT_HD HeapLayout heap_layout(int64_t num_ranks, int64_t max_tokens, int64_t capacity,
                                     int64_t hidden, int64_t topk, int64_t x_bytes,
                                     int64_t y_bytes) {
  HeapLayout L{};
  const int64_t ds = dispatch_row_stride(hidden * x_bytes, topk);
  const int64_t cs = combine_row_stride(hidden * y_bytes);
  const int64_t sr = send_rows(max_tokens, topk, num_ranks);
  int64_t off = 0;
  L.sigs = off;   off += round_up(wire::sig_words(static_cast<int>(num_ranks)) * 8, kHeapAlign);
  L.hdr = off;    off += round_up(num_ranks * wire::kHeaderBytes, kHeapAlign);
  L.counts = off; off += round_up(num_ranks * num_ranks * 4, kHeapAlign);
  L.recv = off;   off += round_up(capacity * ds, kHeapAlign);
  L.back = off;   off += round_up(sr * cs, kHeapAlign);
  L.stage = off;  off += round_up(sr * ds, kHeapAlign);
  L.cstage = off; off += round_up(capacity * cs, kHeapAlign);
  L.total = off;
  return L;
}

// NVSHMEM symmetric heap size (NVSHMEM_SYMMETRIC_SIZE) for these limits: two halves
// plus slack, in 2 MiB units. hier_half_bytes: the hierarchical mode's rings in one half
// (hier::layout(...).total, kernels/internode/hierarchical_layout.h), 0 without that
// mode; they sit after the direct mode's regions in each half (hierarchical_kernels.cu
// carves them from the end), so calls of both modes fit one heap.
JEP_LAYOUT_HD int64_t heap_bytes(int64_t num_ranks, int64_t max_tokens, int64_t capacity,
                                 int64_t hidden, int64_t topk, int64_t x_bytes, int64_t y_bytes,
                                 int64_t hier_half_bytes = 0) {
  const HeapLayout L =
      heap_layout(num_ranks, max_tokens, capacity, hidden, topk, x_bytes, y_bytes);
  return round_up(2 * (L.total + hier_half_bytes) + kHeapSlackBytes, 2ll << 20);
}

}  // namespace jax_ep
