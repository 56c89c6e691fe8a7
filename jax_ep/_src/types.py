"""Pytrees returned by the ops: the dispatch layout and the dispatch handle."""
from __future__ import annotations

import dataclasses
from typing import Any

import jax


@dataclasses.dataclass(frozen=True)
class DispatchLayout:
    """Routing statistics of one rank (no communication).

    num_tokens_per_rank: int32[R], tokens sent to each rank (each at most once).
    num_tokens_per_expert: int32[E], top-k slots per expert.
    is_token_in_rank: bool[T, R], token t has at least one expert on rank r.
    """

    num_tokens_per_rank: jax.Array
    num_tokens_per_expert: jax.Array
    is_token_in_rank: jax.Array


jax.tree_util.register_dataclass(
    DispatchLayout,
    data_fields=["num_tokens_per_rank", "num_tokens_per_expert", "is_token_in_rank"],
    meta_fields=[],
)


# The arrays of a dispatch handle, shared by the per-shard and the global-view handles.
HANDLE_ARRAYS = ("num_recv", "num_dropped", "num_recv_tokens_per_expert", "src_rank",
                 "src_index", "send_row")


@dataclasses.dataclass(frozen=True)
class DispatchHandle:
    """What `combine` and the gradients need to send rows back, without a new layout.

    num_recv: int32[], rows kept on this rank (<= capacity).
    num_dropped: int32[], rows that arrived past the capacity and were dropped.
    num_recv_tokens_per_expert: int32[E_local], top-k slots of kept rows per local expert.
    src_rank, src_index: int32[C], source rank and token of each kept row, -1 past num_recv.
    send_row: int32[T, R], the row each of this rank's tokens occupies on each receiver,
      -1 where it was not sent there or was dropped.
    extra: backend-specific parts combine needs beyond the fields above (a pytree; None
      for the reference and intranode backends, an `InternodeHandleParts` for the
      internode one).
    Static: num_experts, num_ranks, capacity, axis_name, backend (the canonical backend
    that made it, 'reference', 'intranode' or 'internode'; combine with backend=None uses
    it).
    """

    num_recv: jax.Array
    num_dropped: jax.Array
    num_recv_tokens_per_expert: jax.Array
    src_rank: jax.Array
    src_index: jax.Array
    send_row: jax.Array
    num_experts: int
    num_ranks: int
    capacity: int
    axis_name: Any
    extra: Any = None
    backend: str | None = None

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.num_ranks


jax.tree_util.register_dataclass(
    DispatchHandle,
    data_fields=[*HANDLE_ARRAYS, "extra"],
    meta_fields=["num_experts", "num_ranks", "capacity", "axis_name", "backend"],
)


@dataclasses.dataclass(frozen=True)
class InternodeHandleParts:
    """What the internode (NVSHMEM) combine and gather need, in `DispatchHandle.extra`.

    counts: int32[R, R], counts[s, d] = rows rank s sent rank d (before dropping).
    send_slot: int32[T, R], each token's position among the rows this rank sent rank d,
      -1 where not sent there (dropped rows keep their slot; send_row says -1).
    Static: rank (this process's rank = its NVSHMEM PE), topk (K, sizes the heap rows).
    """

    counts: jax.Array
    send_slot: jax.Array
    rank: int
    topk: int


jax.tree_util.register_dataclass(
    InternodeHandleParts, data_fields=["counts", "send_slot"], meta_fields=["rank", "topk"])
