"""Global-view low-latency mode (`jax_ep._src.sharded_low_latency`): the per-shard contract
of `jax_ep.low_latency` on global arrays under `jax.jit` with a mesh in context, no user
`shard_map`, partitioned like `jax_ep.sharded` (dim 0 over the token axes, S shards).

  dispatch(x[N, H], topk_idx[N, K]) -> recv_x[S * E_local, R * M, H] (or the FP8 pair),
    recv_count int32[S * E_local], ShardedLowLatencyHandle
  combine(y[S * E_local, R * M, H], topk_idx[N, K], topk_weights[N, K], handle) -> [N, H]

Block s of each result is shard s's per-shard result (N = S * T, T <= M per shard).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from jax_ep._src import arrival as _arrival
from jax_ep import low_latency as ll
from jax_ep import ops
from jax_ep._src import partitioning as _sh
from jax_ep._src.scope import named
from jax_ep._src.value_check import checked_global, global_check_needed

__all__ = ["ShardedLowLatencyHandle", "dispatch", "combine"]


@dataclasses.dataclass(frozen=True)
class ShardedLowLatencyHandle:
    """The per-shard LowLatencyHandle arrays concatenated over the S shards:
    src_rank, src_index int32[S * E_local, R * M]; first_row, row_count int32[S * E_local, R].
    """

    src_rank: jax.Array
    src_index: jax.Array
    first_row: jax.Array
    row_count: jax.Array
    num_experts: int
    num_ranks: int
    max_tokens_per_rank: int
    mesh_axis: str
    token_axes: tuple
    num_tokens: int  # N
    topk: int
    spec: Any = None


jax.tree_util.register_dataclass(
    ShardedLowLatencyHandle, data_fields=["src_rank", "src_index", "first_row", "row_count"],
    meta_fields=["num_experts", "num_ranks", "max_tokens_per_rank", "mesh_axis",
                 "token_axes", "num_tokens", "topk", "spec"])


# Row functions with the signatures of ll.dispatch_rows / ll.combine_rows, over global
# arrays; `spec` (a sharded._Spec, capacity = M) stands in for the per-shard Cfg.

@functools.cache
def _dispatch_op(spec, T: int, K: int, H: int, dtype, stage_rows: int):
    S, R, M, el = spec.num_shards, spec.num_ranks, spec.capacity, spec.experts_per_rank

    def abstract(x, idx):
        i32 = jnp.int32
        return (jnp.zeros((S * el, R * M, H), x.dtype), jnp.zeros((S * el,), i32),
                jnp.zeros((S * el, R * M), i32), jnp.zeros((S * el, R * M), i32),
                jnp.zeros((S * el, R), i32), jnp.zeros((S * el, R), i32))

    def body(x, idx):
        return ll.dispatch_rows(x, idx, spec.cfg, stage_rows)

    rule = "(s t) h, (s t) k -> (s e) m h, (s e), (s e) m, (s e) m, (s e) r, (s e) r"
    return _sh._partitioned(spec, body, abstract, rule, 2, 6, kind="low_latency.dispatch",
                            s=S, t=T, e=el,
                            need_replication_factors=("h", "k", "m", "r", "e"))


def dispatch_rows(x, idx, spec, stage_rows):
    T = x.shape[0] // spec.num_shards
    op = _dispatch_op(spec, T, idx.shape[1], x.shape[1], jnp.dtype(x.dtype), stage_rows)
    return op(x, idx)


@functools.cache
def _dispatch_fp8_op(spec, T: int, K: int, H: int, dtype, stage_rows: int, round_scale: bool):
    S, R, M, el = spec.num_shards, spec.num_ranks, spec.capacity, spec.experts_per_rank

    def abstract(x, idx):
        i32 = jnp.int32
        return (jnp.zeros((S * el, R * M, H), jnp.float8_e4m3fn),
                jnp.zeros((S * el, R * M, H // ll.FP8_BLOCK), jnp.float32),
                jnp.zeros((S * el,), i32), jnp.zeros((S * el, R * M), i32),
                jnp.zeros((S * el, R * M), i32), jnp.zeros((S * el, R), i32),
                jnp.zeros((S * el, R), i32))

    def body(x, idx):
        outs = ll.dispatch_rows_fp8(x, idx, spec.cfg, stage_rows, round_scale)
        return tuple(outs[0]) + tuple(outs[1:])

    rule = ("(s t) h, (s t) k -> (s e) m h, (s e) m b, (s e), (s e) m, (s e) m, (s e) r, "
            "(s e) r")
    return _sh._partitioned(spec, body, abstract, rule, 2, 7,
                            kind="low_latency.dispatch_fp8", s=S, t=T, e=el,
                            need_replication_factors=("h", "k", "m", "r", "e", "b"))


def dispatch_rows_fp8(x, idx, spec, stage_rows, round_scale):
    T = x.shape[0] // spec.num_shards
    op = _dispatch_fp8_op(spec, T, idx.shape[1], x.shape[1], jnp.dtype(x.dtype), stage_rows,
                          bool(round_scale))
    outs = op(x, idx)
    return ((outs[0], outs[1]),) + tuple(outs[2:])


@functools.cache
def _combine_op(spec, T: int, K: int, H: int, dtype, stage_rows: int, topk: int):
    S, R, M, el = spec.num_shards, spec.num_ranks, spec.capacity, spec.experts_per_rank

    def abstract(y, idx, w, first, count):
        return jnp.zeros((S * T, H), y.dtype)

    def body(y, idx, w, first, count):
        return ll.combine_rows(y, idx, w, first, count, spec.cfg, stage_rows, topk)

    rule = "(s e) m h, (s t) k, (s t) k, (s e) r, (s e) r -> (s t) h"
    return _sh._partitioned(spec, body, abstract, rule, 5, 1, kind="low_latency.combine",
                            s=S, t=T, e=el,
                            need_replication_factors=("h", "k", "m", "r", "e"))


def combine_rows(y, idx, w, first, count, spec, stage_rows, topk):
    T = idx.shape[0] // spec.num_shards
    op = _combine_op(spec, T, idx.shape[1], y.shape[-1], jnp.dtype(y.dtype), stage_rows, topk)
    return op(y, idx, w, first, count)


_dispatch, _combine = ll.make_differentiable(dispatch_rows, combine_rows)
_fp8_dispatch = ll.make_fp8_dispatch(dispatch_rows_fp8)


@named("jax_ep.sharded.low_latency.dispatch")
def dispatch(x, topk_idx, *, num_experts: int, mesh_axis: str, max_tokens_per_rank: int,
             fp8: bool = False, round_scale: bool = False, backend=None, batch_axes=None):
    """Global-view low-latency dispatch.

    Args:
      x: [N, H] float32/bfloat16/float16, N = S * T tokens sharded over the token axes
        (T <= max_tokens_per_rank per shard).
      topk_idx: [N, K] int32 in [-1, E), no id twice in a row.
      mesh_axis, batch_axes, backend: as for `jax_ep.sharded.dispatch`.
      max_tokens_per_rank, fp8, round_scale: as for `jax_ep.low_latency.dispatch`.
    Returns:
      recv_x [S * E_local, R * M, H] (or the FP8 pair), recv_count int32[S * E_local] and
      a ShardedLowLatencyHandle; block s of each is shard s's per-shard result.
    """
    x, topk_idx = jnp.asarray(x), jnp.asarray(topk_idx)
    E, M = ll.check_dispatch_args(x, topk_idx, num_experts, 1, max_tokens_per_rank, fp8)
    spec = _sh._spec(x.shape[0], E, mesh_axis, M, backend, batch_axes)
    ll._check_T(spec.tokens_per_shard, M)
    # Several processes on CPU: every peer arrives before the check's collective and the
    # exchange (jax_ep/_src/arrival.py), one barrier for both.
    x, topk_idx = _arrival.arrive_global("low_latency.dispatch", (x, topk_idx),
                                         spec.token_axes)
    if global_check_needed(spec):
        # Agreed by every shard before the partitioned op (jax_ep/_src/value_check.py).
        topk_idx = checked_global(topk_idx, spec, repeats=True, where="jax_ep.low_latency")
    with _arrival.covered():
        outs = (_fp8_dispatch(x, topk_idx, spec, bool(round_scale)) if fp8
                else _dispatch(x, topk_idx, spec))
    handle = ShardedLowLatencyHandle(outs[2], outs[3], outs[4], outs[5], E, spec.num_ranks,
                                     M, mesh_axis, spec.token_axes, x.shape[0],
                                     topk_idx.shape[1], spec)
    return outs[0], outs[1], handle


@named("jax_ep.sharded.low_latency.combine")
def combine(y, topk_idx, topk_weights, handle: ShardedLowLatencyHandle, *, backend=None):
    """Global-view low-latency combine: y [S * E_local, R * M, H] -> out [N, H] in y's
    dtype, sharded like x (per shard as `jax_ep.low_latency.combine`)."""
    if not isinstance(handle, ShardedLowLatencyHandle):
        raise TypeError("handle must be the ShardedLowLatencyHandle returned by "
                        f"jax_ep._src.sharded_low_latency.dispatch, got {type(handle).__name__}")
    y, topk_idx, topk_weights = map(jnp.asarray, (y, topk_idx, topk_weights))
    spec = handle.spec
    S, el = spec.num_shards, spec.experts_per_rank
    ll.check_combine_args(y, topk_idx, topk_weights, S * el,
                          handle.num_ranks * handle.max_tokens_per_rank, handle.num_tokens,
                          handle.topk)
    mesh = _sh._context_mesh()
    if int(mesh.shape[handle.mesh_axis]) != handle.num_ranks:
        raise ValueError("the mesh in context does not match the handle's mesh")
    spec = dataclasses.replace(spec, backend=ops.resolve_backend(backend))
    first_row, row_count = handle.first_row, handle.row_count
    y, topk_idx, topk_weights, first_row, row_count = _arrival.arrive_global(
        "low_latency.combine", (y, topk_idx, topk_weights, first_row, row_count),
        spec.token_axes)
    if global_check_needed(spec):
        topk_idx = checked_global(topk_idx, spec, repeats=True, where="jax_ep.low_latency")
    with _arrival.covered():
        return _combine(y, topk_idx, topk_weights, first_row, row_count, spec)
