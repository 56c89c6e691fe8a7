"""Python mirror of kernels/internode/hierarchical_layout.h: the hierarchical mode's ring
sizes, row strides and the bytes of one heap half (tests compile the header and compare).
Pure arithmetic with no imports from the package, so the heap sizing
(`jax_ep.runtime.nvshmem.heap_bytes_for`) and the model (`jax_ep.network.modes`, which
re-exports these names) can both use it."""
from __future__ import annotations

import dataclasses

# --- mirror of kernels/internode/hierarchical_layout.h (tests compare the two) -------
RDMA_CHUNK_ROWS = 16
RDMA_RING_CHUNKS = 8
NVL_RING_ROWS = 64
MAX_GPUS_PER_NODE = 32
META_WORDS = 4
_ALIGN = 256


def _round_up(v: int, a: int) -> int:
    return (v + a - 1) // a * a


def hier_meta_offset(hidden_bytes: int) -> int:
    """Offset of a row's int32 metadata: the payload rounded up to 16 bytes."""
    return _round_up(hidden_bytes, 16)


def hier_dispatch_row_stride(hidden_bytes: int, topk: int) -> int:
    return _round_up(hier_meta_offset(hidden_bytes) + 8 * topk + 4 * META_WORDS, 16)


def hier_combine_row_stride(hidden_bytes: int) -> int:
    return _round_up(hier_meta_offset(hidden_bytes) + 4 * META_WORDS, 16)


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
    nodes = num_ranks // gpus_per_node
    ds = hier_dispatch_row_stride(hidden * x_bytes, topk)
    cs = hier_combine_row_stride(hidden * y_bytes)
    stride = max(ds, cs)
    off = 0
    o = {}
    for name, size in (("sig_data", nodes * num_qps * 8), ("sig_credit", nodes * 8),
                       ("sig_counts", num_ranks * 8), ("nvl_head", gpus_per_node * nodes * 8),
                       ("nvl_tail", gpus_per_node * nodes * 8),
                       ("counts", num_ranks * (num_ranks + nodes) * 4)):
        o[name] = off
        off += _round_up(size, _ALIGN)
    ring = _round_up(RDMA_CHUNK_ROWS * RDMA_RING_CHUNKS * stride, _ALIGN)
    o["rdma_send"] = off
    off += nodes * ring
    o["rdma_recv"] = off
    off += nodes * ring
    o["nvl_recv"] = off
    off += gpus_per_node * nodes * _round_up(NVL_RING_ROWS * stride, _ALIGN)
    return HierLayout(row_stride=stride, rdma_bytes=2 * nodes * ring,
                      nvl_bytes=off - o["nvl_recv"], total=off, **o)


def hier_state_bytes(num_ranks, gpus_per_node, num_qps, hidden, topk, x_bytes, y_bytes) -> int:
    """Symmetric memory per GPU of the hierarchical mode (two halves); no T or C in it."""
    return 2 * hier_layout(num_ranks, gpus_per_node, num_qps, hidden, topk, x_bytes,
                           y_bytes).total
