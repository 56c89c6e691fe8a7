// Layout of the hierarchical internode mode: ring sizes, row strides, signal words and
// the bytes of symmetric memory one GPU needs. Pure functions and constants of the CUDA
// code, which Python (`jax_ep.network.hier_layout`, the heap sizing, the model in
// `jax_ep.network.modes` and the host protocol simulator tests/sim/hierarchical_sim.py)
// calls through its bindings (xla_ffi/common/layout_bindings.cc): one definition.
//
// Ranks are node-major: rank = node * G + local. Paths of one call:
//   dispatch  source s=(n,g) --RDMA--> rail peer f=(m,g) --NVLink--> receivers (m,*)
//             (for m == n the source is its own forwarder: NVLink only)
//   combine   receivers (m,*) --NVLink--> f=(m,g) --RDMA--> source s=(n,g)
//             (f sums its node's rows of a token and sends one row: the node partial)
// Every hop is a ring of fixed size with head/tail credits, so memory does not depend on
// the number of tokens T or the capacity C:
//   RDMA ring      per (remote node, direction): kRdmaRingChunks chunks of kRdmaChunkRows
//                  rows; a sender keeps a staging ring of the same shape per destination
//                  node (a slot is reusable once the receiver's credit covers it).
//   NVLink ring    per (forwarder on this node, source node): kNvlRingRows rows, written
//                  through peer pointers by the forwarder and drained by the receiver.
// Rows carry their own metadata (token, source, destination row or reduction slot), so
// rows from different streams may interleave in a ring without changing the result.
//
// The heap holds two equal halves, used by calls of alternating parity (as in direct
// mode), so a peer already in the next call never writes memory this GPU still reads.
#pragma once

#include <cstdint>

#include "kernels/common/striping_plan.h"

#if defined(__CUDACC__)
#define JEP_HIER_HD __host__ __device__ __forceinline__
#else
#define JEP_HIER_HD inline
#endif

namespace jax_ep {
namespace hier {

// Rows per RDMA chunk (one put-with-signal on one QP) and chunks per RDMA ring. A build
// may shrink them (-DJAX_EP_HIER_CHUNK_ROWS=..., the emulated GPU's small-ring tests) to
// make the rings wrap and fill with few tokens. 16-row chunks (DeepEP's EP16 preset
// sends 20 tokens a chunk) halve the forwarders' per-chunk fence, release and credit
// against 8; 64-row NVLink rings let a combine pusher write a forwarder's whole chunk of
// its ring between two head releases instead of a few rows (docs/performance.md counts
// both). At H = 7168 bf16, top-8, 2 x 8 GPUs, one heap half then holds per GPU a staging
// and a receiving RDMA ring of 1.8 MiB per remote node and 16 NVLink rings of 0.9 MiB.
#ifndef JAX_EP_HIER_CHUNK_ROWS
#define JAX_EP_HIER_CHUNK_ROWS 16
#endif
#ifndef JAX_EP_HIER_RING_CHUNKS
#define JAX_EP_HIER_RING_CHUNKS 8
#endif
#ifndef JAX_EP_HIER_NVL_ROWS
#define JAX_EP_HIER_NVL_ROWS 64
#endif
constexpr int32_t kRdmaChunkRows = JAX_EP_HIER_CHUNK_ROWS;
constexpr int32_t kRdmaRingChunks = JAX_EP_HIER_RING_CHUNKS;
// Rows per NVLink ring.
constexpr int32_t kNvlRingRows = JAX_EP_HIER_NVL_ROWS;
// Most GPUs per node (the node mask of a row is one 32-bit word).
constexpr int32_t kMaxGpusPerNode = 32;

// The combine's credit invariant. Each node's RDMA stream to a source carries at most one
// row per token (the node partial). The source reads a token in pieces: a piece ends
// before the first row of a new RDMA chunk when it already holds rows, and is summed and
// credited before the source waits for that chunk (hierarchical_kernels.cu, SourceRole).
// So while it waits it holds rows of at most one chunk per node, every earlier chunk is
// credited, and the forwarder (which may write chunk c once chunk c - kRdmaRingChunks is
// credited) can put the chunk it waits for. Two chunks per ring suffice.
static_assert(kRdmaRingChunks >= 2 && kRdmaChunkRows >= 1 && kNvlRingRows >= 1,
              "the combine's credit invariant: an RDMA ring holds the chunk the source "
              "reads and one the forwarder writes");
// Most logical QPs per peer.
using ::jax_ep::kMaxQps;  // kernels/common/striping_plan.h
// int32 metadata words after a row's payload: token index, source rank, node mask of
// the receivers that keep it, destination row (dispatch) or contributor rank (combine).
constexpr int32_t kMetaWords = 4;
constexpr int64_t kAlign = 256;

JEP_HIER_HD int64_t round_up(int64_t v, int64_t a) { return (v + a - 1) / a * a; }

// Byte offset of a row's metadata: the payload rounded up to 16 bytes, so the int32
// words stay aligned whatever H and the dtype (odd H in 16-bit types included).
JEP_HIER_HD int64_t meta_offset(int64_t hidden_bytes) { return round_up(hidden_bytes, 16); }
// A dispatch row: payload, K ids (int32), K weights (float32), kMetaWords int32; 16 B units.
JEP_HIER_HD int64_t dispatch_row_stride(int64_t hidden_bytes, int64_t topk) {
  return round_up(meta_offset(hidden_bytes) + 8 * topk + 4 * kMetaWords, 16);
}
// A combine row: y payload and kMetaWords int32.
JEP_HIER_HD int64_t combine_row_stride(int64_t hidden_bytes) {
  return round_up(meta_offset(hidden_bytes) + 4 * kMetaWords, 16);
}
JEP_HIER_HD int64_t rdma_ring_rows() {
  return static_cast<int64_t>(kRdmaChunkRows) * kRdmaRingChunks;
}

// Signal words of one half (uint64 each), at offsets that depend on (R, nodes, QPs) only:
//   data    [nodes][Q]   chunks landed from the rail peer of each node, per QP: each word
//                        has one writer (that peer) and one QP (the put's own)
//   credit  [nodes]      RDMA ring slots freed by the rail peer of each node (one QP)
//   counts  [R]          count rows landed from each rank
//   nvl_head/tail [G][nodes]   NVLink ring positions (written by peer stores)
struct Layout {
  int64_t sig_data, sig_credit, sig_counts, nvl_head, nvl_tail;  // byte offsets
  int64_t counts;         // int32 [R][R + nodes]: rows per rank, then tokens per node
  int64_t rdma_send;      // [nodes][rdma_ring_rows] rows (staging; own node unused)
  int64_t rdma_recv;      // [nodes][rdma_ring_rows] rows (own node unused)
  int64_t nvl_recv;       // [G][nodes][kNvlRingRows] rows
  int64_t row_stride;     // max(dispatch, combine) stride: a half serves either call
  int64_t rdma_bytes;     // bytes of the RDMA regions (send + recv) in one half
  int64_t nvl_bytes;      // bytes of the NVLink rings in one half
  int64_t total;          // bytes of one half
};

JEP_HIER_HD Layout layout(int64_t num_ranks, int64_t gpus_per_node, int64_t num_qps,
                          int64_t hidden, int64_t topk, int64_t x_bytes, int64_t y_bytes) {
  Layout L{};
  const int64_t nodes = num_ranks / gpus_per_node;
  const int64_t ds = dispatch_row_stride(hidden * x_bytes, topk);
  const int64_t cs = combine_row_stride(hidden * y_bytes);
  L.row_stride = ds > cs ? ds : cs;
  int64_t off = 0;
  L.sig_data = off;   off += round_up(nodes * num_qps * 8, kAlign);
  L.sig_credit = off; off += round_up(nodes * 8, kAlign);
  L.sig_counts = off; off += round_up(num_ranks * 8, kAlign);
  L.nvl_head = off;   off += round_up(gpus_per_node * nodes * 8, kAlign);
  L.nvl_tail = off;   off += round_up(gpus_per_node * nodes * 8, kAlign);
  L.counts = off;     off += round_up(num_ranks * (num_ranks + nodes) * 4, kAlign);
  const int64_t rdma_ring = round_up(rdma_ring_rows() * L.row_stride, kAlign);
  L.rdma_send = off;  off += nodes * rdma_ring;
  L.rdma_recv = off;  off += nodes * rdma_ring;
  L.nvl_recv = off;
  off += gpus_per_node * nodes * round_up(static_cast<int64_t>(kNvlRingRows) * L.row_stride,
                                          kAlign);
  L.rdma_bytes = 2 * nodes * rdma_ring;
  L.nvl_bytes = off - L.nvl_recv;
  L.total = off;
  return L;
}

// Symmetric memory one GPU needs for the hierarchical mode: two halves. Independent of
// the token count and the capacity.
JEP_HIER_HD int64_t state_bytes(int64_t num_ranks, int64_t gpus_per_node, int64_t num_qps,
                                int64_t hidden, int64_t topk, int64_t x_bytes,
                                int64_t y_bytes) {
  return 2 * layout(num_ranks, gpus_per_node, num_qps, hidden, topk, x_bytes, y_bytes).total;
}

// Ring slot of chunk `c` of an RDMA stream, and the chunk a sender may write only once
// the receiver's credit (chunks freed) reaches `credit_needed(c)`.
JEP_HIER_HD int64_t rdma_slot(int64_t chunk) { return chunk % kRdmaRingChunks; }
JEP_HIER_HD int64_t credit_needed(int64_t chunk) {
  return chunk < kRdmaRingChunks ? 0 : chunk - kRdmaRingChunks + 1;
}
JEP_HIER_HD int64_t nvl_slot(int64_t row) { return row % kNvlRingRows; }

}  // namespace hier
}  // namespace jax_ep
