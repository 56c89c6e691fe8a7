"""Global-view EP ops: the same contract as `jax_ep.dispatch`/`combine` on global arrays
under `jax.jit` with a mesh in context (`jax.set_mesh(mesh)` or `with mesh:`), no user
`shard_map`.

Token arrays are global with dim 0 sharded over `token_axes = batch_axes + (mesh_axis,)`
(S shards; one EP group of R = mesh.shape[mesh_axis] shards per index of the batch axes).
Outputs are global and sharded the same way: `[S * C, ...]` for received rows, `[S]` for
per-shard scalars. Partitioning comes from `custom_partitioning` with a Shardy
`sharding_rule`: each shard runs the per-shard op, and inputs sharded otherwise are
resharded once to `P(token_axes)`.

Backends resolve as in `jax_ep.ops.resolve_backend`. The internode backend's handle
(`DispatchHandle.extra`) travels as two more partitioned arrays in
`ShardedDispatchHandle.extra` (see docs/internode.md).

The low-latency mode's global view is `jax_ep.sharded.low_latency` (the module
`jax_ep._src.sharded_low_latency`); both build on `jax_ep._src.partitioning`.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from jax_ep import fp8, ops

from jax_ep._src import arrival as _arrival

from jax_ep._src import value_check as _value_check
from jax_ep._src import sharded_low_latency as low_latency  # the mode's global view
from jax_ep._src.partitioning import _context_mesh, _group_axes, _partitioned, _spec, _Spec
from jax_ep._src.scope import named
from jax_ep._src.backends import internode
from jax_ep._src.types import HANDLE_ARRAYS, DispatchHandle, DispatchLayout, InternodeHandleParts


@dataclasses.dataclass(frozen=True)
class ShardedDispatchHandle:
    """Global-view handle: the per-shard DispatchHandle fields, concatenated over the S
    shards of the token axes (num_recv, num_dropped: int32[S];
    num_recv_tokens_per_expert: int32[S * E_local]; src_rank, src_index: int32[S * C];
    send_row: int32[N, R]).

    extra: None, except for the internode backend: an `InternodeHandleParts` whose arrays
    are the per-shard ones concatenated the same way (counts: int32[S * R, R]; send_slot:
    int32[N, R]) and whose static rank and topk are those of every shard's handle.
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
    mesh_axis: str
    token_axes: tuple
    extra: Any = None

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.num_ranks


jax.tree_util.register_dataclass(
    ShardedDispatchHandle, data_fields=[*HANDLE_ARRAYS, "extra"],
    meta_fields=["num_experts", "num_ranks", "capacity", "mesh_axis", "token_axes"])


# ----------------------------------------------------------------------------- layout

@functools.cache
def _layout_op(spec: _Spec):
    S, T, R, E = spec.num_shards, spec.tokens_per_shard, spec.num_ranks, spec.num_experts

    def abstract(idx):
        return (jnp.zeros((S * R,), jnp.int32), jnp.zeros((S * E,), jnp.int32),
                jnp.zeros((S * T, R), jnp.bool_))

    def body(idx):
        lay = ops._layout_impl(idx, E, R, spec.backend, check_ids=False)
        return lay.num_tokens_per_rank, lay.num_tokens_per_expert, lay.is_token_in_rank

    # Shardy needs the size of every factor used only inside compound factors (s, and a
    # for the R per-rank counts); r is a whole dimension, sized by the array itself.
    return _partitioned(spec, body, abstract, "(s t) k -> (s a), (s e), (s t) r", 1, 3,
                        need_replication_factors=("k", "a", "e", "r"), s=S, t=T, a=R, e=E)


@named("jax_ep.sharded.get_dispatch_layout")
def get_dispatch_layout(topk_idx, *, num_experts: int, mesh_axis: str, batch_axes=None,
                        backend=None) -> DispatchLayout:
    """Global layout of topk_idx[N, K] int32: num_tokens_per_rank int32[S * R],
    num_tokens_per_expert int32[S * E], is_token_in_rank bool[N, R], one block per shard."""
    topk_idx = jnp.asarray(topk_idx)
    num_experts = ops._static_int("num_experts", num_experts, 1)
    ops._check_routing(topk_idx, None, None, num_experts, 1)
    spec = _spec(topk_idx.shape[0], num_experts, mesh_axis, None, backend, batch_axes)
    if spec.backend in ("reference", "intranode"):
        # Every shard agrees before any raises (the CPU kernel's check stops one alone).
        # The check is a collective: on several processes (CPU) every peer arrives first.
        topk_idx = _arrival.arrive_global("get_dispatch_layout", topk_idx, spec.token_axes)
        topk_idx = ops._check_ids_reference(topk_idx, spec)
    return DispatchLayout(*_layout_op(spec)(topk_idx))


# ----------------------------------------------------------------------------- dispatch

# The internode backend's handle has two more arrays (handle.extra): counts[R, R] per
# shard (global [S * R, R], factor p for its rows) and send_slot[T, R] (global [N, R]).

def _local_handle(spec: _Spec, arrays, internode_meta=None) -> DispatchHandle:
    num_recv, num_dropped, per_expert, src_rank, src_index, send_row = arrays[:6]
    extra = None
    if internode_meta is not None:
        rank, topk = internode_meta
        extra = InternodeHandleParts(arrays[6], arrays[7], rank, topk)
    return DispatchHandle(num_recv.reshape(()), num_dropped.reshape(()), per_expert, src_rank,
                          src_index, send_row, spec.num_experts, spec.num_ranks,
                          spec.capacity, spec.mesh_axis, extra)


def _handle_rule(spec: _Spec):
    rule = "s, s, (s e), (s c), (s c), (s t) r"
    return rule + ", (s p) r, (s t) r" if spec.backend == "internode" else rule


def _handle_factors(spec: _Spec, *replicated):
    """need_replication_factors and factor sizes of the handle's arrays, plus those of
    the other operands (`replicated`)."""
    factors = dict(t=spec.tokens_per_shard, c=spec.capacity, e=spec.experts_per_rank)
    repl = replicated + ("r", "e")
    if spec.backend == "internode":
        factors["p"] = spec.num_ranks
        repl += ("p",)
    return dict(factors, need_replication_factors=repl)


@functools.cache
def _dispatch_op(spec: _Spec, H: int, K: int, dtype):
    S, T, C, R, el = (spec.num_shards, spec.tokens_per_shard, spec.capacity, spec.num_ranks,
                      spec.experts_per_rank)

    with_parts = spec.backend == "internode"

    def abstract(x, idx, w):
        outs = (jnp.zeros((S * C, H), x.dtype), jnp.zeros((S * C, K), jnp.int32),
                jnp.zeros((S * C, K), jnp.float32), jnp.zeros((S,), jnp.int32),
                jnp.zeros((S,), jnp.int32), jnp.zeros((S * el,), jnp.int32),
                jnp.zeros((S * C,), jnp.int32), jnp.zeros((S * C,), jnp.int32),
                jnp.zeros((S * T, R), jnp.int32))
        if with_parts:
            outs += (jnp.zeros((S * R, R), jnp.int32), jnp.zeros((S * T, R), jnp.int32))
        return outs

    def body(x, idx, w):
        rx, ri, rw, h = ops._dispatch_impl(x, idx, w, spec.cfg)
        outs = (rx, ri, rw, h.num_recv[None], h.num_dropped[None],
                h.num_recv_tokens_per_expert, h.src_rank, h.src_index, h.send_row)
        if with_parts:
            outs += (h.extra.counts, h.extra.send_slot)
        return outs

    rule = "(s t) h, (s t) k, (s t) k -> (s c) h, (s c) k, (s c) k, " + _handle_rule(spec)
    return _partitioned(spec, body, abstract, rule, 3, 11 if with_parts else 9,
                        kind="dispatch", **_handle_factors(spec, "h", "k"))


@functools.cache
def _handle_driven_op(spec: _Spec, H: int, dtype, transpose: bool, internode_meta,
                      n_bias: int = 0):
    """combine ([S*C, H] rows -> [S*T, H] tokens) or, with `transpose`, its transpose
    gather ([S*T, H] -> [S*C, H]), both driven by the handle's arrays; internode_meta is
    the static (rank, topk) of handle.extra for the internode backend, else None. A
    combine takes `n_bias` more [S*T, H] operands after the handle's arrays (its bias)."""
    S = spec.num_shards
    rows_out = spec.capacity if transpose else spec.tokens_per_shard
    n_handle = len(HANDLE_ARRAYS) + (2 if spec.backend == "internode" else 0)

    def abstract(v, *rest):
        return jnp.zeros((S * rows_out, H), v.dtype)

    def body(v, *rest):
        handle = _local_handle(spec, rest[:n_handle], internode_meta)
        if transpose:
            return ops._gather_impl(v, handle, spec.backend, spec.group_axes)
        return ops._combine_impl(v, handle, spec.backend, spec.group_axes,
                                 bias=tuple(rest[n_handle:]))

    rows, tokens = "(s c) h", "(s t) h"
    src, dst = (tokens, rows) if transpose else (rows, tokens)
    bias_rule = "".join(f", {tokens}" for _ in range(n_bias))
    rule = f"{src}, {_handle_rule(spec)}{bias_rule} -> {dst}"
    n_in = 1 + n_handle + n_bias
    return _partitioned(spec, body, abstract, rule, n_in, 1,
                        kind="gather" if transpose else "combine",
                        **_handle_factors(spec, "h"))


def _internode_parts(h: ShardedDispatchHandle, what: str) -> InternodeHandleParts:
    if not isinstance(h.extra, InternodeHandleParts):
        raise ValueError(
            f"the internode {what} needs the handle of an internode dispatch (its "
            f"handle.extra holds the transport's counts and send slots); this handle has "
            f"extra={type(h.extra).__name__}. Use the same backend for dispatch and {what}.")
    return h.extra


def _handle_driven(v, h: ShardedDispatchHandle, spec: _Spec, transpose: bool, bias=()):
    arrays = tuple(getattr(h, f) for f in HANDLE_ARRAYS)
    meta = None
    if spec.backend == "internode":
        parts = _internode_parts(h, "gather" if transpose else "combine")
        arrays += (parts.counts, parts.send_slot)
        meta = (parts.rank, parts.topk)
    op = _handle_driven_op(spec, v.shape[1], jnp.dtype(v.dtype), transpose, meta, len(bias))
    return op(v, *arrays, *bias)


def _sharded_combine(y, h: ShardedDispatchHandle, spec: _Spec, bias=()):
    return _handle_driven(y, h, spec, False, bias)


def _sharded_gather(g, h: ShardedDispatchHandle, spec: _Spec):
    return _handle_driven(g, h, spec, True)


def _dispatch_fwd_impl(x, idx, w, spec: _Spec):
    outs = _dispatch_op(spec, x.shape[1], idx.shape[1], jnp.dtype(x.dtype))(x, idx, w)
    extra = None
    if spec.backend == "internode":
        # The same static rank each shard's body gets (the NVSHMEM PE index).
        extra = InternodeHandleParts(outs[9], outs[10],
                                     internode.ep_rank(spec.mesh_axis, spec.num_ranks),
                                     idx.shape[1])
    handle = ShardedDispatchHandle(*outs[3:9], spec.num_experts, spec.num_ranks,
                                   spec.capacity, spec.mesh_axis, spec.token_axes, extra)
    return outs[0], outs[1], outs[2], handle


def _dispatch_fwd(x, idx, w, spec):
    out = _dispatch_fwd_impl(x, idx, w, spec)
    return out, (out[1], out[3])


def _dispatch_bwd(spec, res, cts):
    recv_idx, handle = res
    return ops.dispatch_transpose(lambda v: _sharded_combine(v, handle, spec), recv_idx, cts)


_dispatch = jax.custom_vjp(_dispatch_fwd_impl, nondiff_argnums=(3,))
_dispatch.defvjp(_dispatch_fwd, _dispatch_bwd)


@named("jax_ep.sharded.dispatch")
def dispatch(x, topk_idx, topk_weights, *, num_experts: int, mesh_axis: str, capacity=None,
             backend=None, batch_axes=None):
    """Global-view dispatch.

    Args:
      x: [N, H] float32/bfloat16/float16, N = S * T tokens sharded over the token axes;
        or an FP8 pair (x_fp8 [N, H], scales [N, H // block]) from jax_ep.fp8.quantize,
        received as the pair (recv_x_fp8 [S * C, H], recv_scales [S * C, H // block]).
      topk_idx: [N, K] int32 in [-1, E). topk_weights: [N, K] float32.
      mesh_axis: the EP axis of the mesh in context (R = its size).
      capacity: C rows received per shard (default R * T).
      batch_axes: mesh axes that, with mesh_axis, shard the tokens (default: the axes
        before mesh_axis in the mesh); one EP group per index of them.
      backend: as for `jax_ep.dispatch` (`jax_ep.resolve_backend`).
    Returns:
      recv_x [S * C, H], recv_topk_idx [S * C, K] int32, recv_topk_weights [S * C, K]
      float32 and a ShardedDispatchHandle; block s of each is shard s's per-shard result.
    """
    x, block = ops.as_payload(x)
    topk_idx, topk_weights = map(jnp.asarray, (topk_idx, topk_weights))
    ops._check_tokens("x", x)
    num_experts = ops._static_int("num_experts", num_experts, 1)
    ops._check_routing(topk_idx, topk_weights, x.shape[0], num_experts, 1)
    spec = _spec(x.shape[0], num_experts, mesh_axis, capacity, backend, batch_axes)
    # Several processes on CPU: every peer arrives before the check's collective and the
    # exchange (jax_ep/_src/arrival.py), one barrier for both.
    x, topk_idx, topk_weights = _arrival.arrive_global(
        "dispatch", (x, topk_idx, topk_weights), spec.token_axes)
    if _value_check.global_check_needed(spec):
        topk_idx = ops._check_ids_reference(topk_idx, spec)
    with _arrival.covered():
        recv_x, recv_idx, recv_w, handle = _dispatch(x, topk_idx, topk_weights, spec)
    if block is not None:
        recv_x = fp8.unpack(recv_x, block=block)
    return recv_x, recv_idx, recv_w, handle


def _make_combine(bias_dtypes):
    def primal(y, bias, handle, spec):
        return _sharded_combine(y, handle, spec, bias)

    def fwd(y, bias, handle, spec):
        return _sharded_combine(y, handle, spec, bias), handle

    def bwd(spec, handle, d_out):
        dy = _sharded_gather(d_out, handle, spec)
        zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, jax.dtypes.float0), handle)
        return dy, ops._bias_cotangent(d_out, bias_dtypes), zeros

    f = jax.custom_vjp(primal, nondiff_argnums=(3,))
    f.defvjp(fwd, bwd)
    return f


_combine_for = functools.cache(_make_combine)


@named("jax_ep.sharded.combine")
def combine(y, handle: ShardedDispatchHandle, *, bias=None, backend=None):
    """Global-view combine: y [S * C, H] -> out [N, H] (y's dtype), sharded like x.

    bias: None, or one array or a pair of arrays [N, H] (any float dtype), added in
    float32 to each token's sum before the single cast, as in `jax_ep.combine`.
    """
    if not isinstance(handle, ShardedDispatchHandle):
        raise TypeError("handle must be the ShardedDispatchHandle returned by "
                        f"jax_ep.sharded.dispatch, got {type(handle).__name__}")
    y = jnp.asarray(y)
    ops._check_tokens("y", y)
    S = handle.num_recv.shape[0]
    if y.shape[0] != S * handle.capacity:
        raise ValueError(f"y must have S * capacity = {S * handle.capacity} rows, got "
                         f"shape {y.shape}")
    bias = ops.check_bias(bias, (handle.send_row.shape[0], y.shape[1]))
    mesh = _context_mesh()
    spec = _Spec(handle.num_experts, handle.num_ranks, handle.capacity, handle.mesh_axis,
                 handle.token_axes, S, handle.send_row.shape[0] // S,
                 ops.resolve_backend(backend), _group_axes(mesh, handle.mesh_axis))
    if int(mesh.shape[handle.mesh_axis]) != handle.num_ranks:
        raise ValueError("the mesh in context does not match the handle's mesh")
    if spec.backend == "internode":
        _internode_parts(handle, "combine")
    f = _combine_for(tuple(jnp.dtype(b.dtype) for b in bias))
    return f(y, bias, handle, spec)
