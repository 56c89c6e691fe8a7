"""The hierarchical mode's ring sizes, row strides and the bytes of one heap half:
kernels/internode/hierarchical_layout.h through its bindings (hier_*), so the heap sizing
(`jax_ep.nvshmem_bootstrap.heap_bytes_for`) and the model (`jax_ep.network.modes`, which
re-exports these names) use the kernels' own functions."""
from __future__ import annotations

import dataclasses

from jax_ep._src.ext import require_ext

_ext = require_ext()
_C = _ext.hier_layout_constants()
RDMA_CHUNK_ROWS: int = _C["rdma_chunk_rows"]    # rows per RDMA chunk (one put)
RDMA_RING_CHUNKS: int = _C["rdma_ring_chunks"]  # chunks per RDMA ring
NVL_RING_ROWS: int = _C["nvl_ring_rows"]        # rows per NVLink ring
MAX_GPUS_PER_NODE: int = _C["max_gpus_per_node"]  # a row's node mask is one 32-bit word
META_WORDS: int = _C["meta_words"]              # int32 words after a row's payload


def hier_meta_offset(hidden_bytes: int) -> int:
    """Offset of a row's int32 metadata: the payload rounded up to 16 bytes."""
    return _ext.hier_meta_offset(int(hidden_bytes))


def hier_dispatch_row_stride(hidden_bytes: int, topk: int) -> int:
    """Bytes of a dispatch row: payload, topk ids and weights, metadata words."""
    return _ext.hier_dispatch_row_stride(int(hidden_bytes), int(topk))


def hier_combine_row_stride(hidden_bytes: int) -> int:
    """Bytes of a combine row: payload and metadata words."""
    return _ext.hier_combine_row_stride(int(hidden_bytes))


@dataclasses.dataclass(frozen=True)
class HierLayout:
    """Byte offsets of one heap half (see the header) and its sizes."""

    sig_data: int
    sig_credit: int
    sig_counts: int
    nvl_head: int
    nvl_tail: int
    counts: int
    rdma_send: int
    rdma_recv: int
    nvl_recv: int
    row_stride: int
    rdma_bytes: int
    nvl_bytes: int
    total: int


def hier_layout(num_ranks, gpus_per_node, num_qps, hidden, topk, x_bytes, y_bytes) -> HierLayout:
    """One heap half for R ranks in nodes of G GPUs, Q QPs per peer, rows of `hidden`
    elements of x_bytes (dispatch) and y_bytes (combine) bytes, top-k routing."""
    return HierLayout(**_ext.hier_layout(*(int(v) for v in (
        num_ranks, gpus_per_node, num_qps, hidden, topk, x_bytes, y_bytes))))


def hier_state_bytes(num_ranks, gpus_per_node, num_qps, hidden, topk, x_bytes, y_bytes) -> int:
    """Symmetric memory per GPU of the hierarchical mode (two halves); no T or C in it."""
    return _ext.hier_state_bytes(*(int(v) for v in (
        num_ranks, gpus_per_node, num_qps, hidden, topk, x_bytes, y_bytes)))
