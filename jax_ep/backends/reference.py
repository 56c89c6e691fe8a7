"""Pure-JAX reference backend: dense `all_to_all` padded to the worst case.

Correct on every platform and across processes, and the oracle of the tests. Every
function runs per shard, inside `shard_map`, like the `jax.lax` collectives, and has the
signature every backend module shares: `layout(topk_idx, cfg)`, `dispatch(x, topk_idx,
topk_weights, cfg)`, `combine(y, handle, cfg)`, `gather(g, handle, cfg)` with cfg a
`jax_ep._common.Cfg`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_ep._common import Cfg, axis_names
from jax_ep._types import DispatchHandle, DispatchLayout


def check_ids(topk_idx, num_experts):
    """Value check on the host: raises if an id is outside [-1, E) (the ffi backends
    check inside their kernels). A host round trip per call: the reference is the oracle,
    not the fast path."""
    if topk_idx.size == 0:
        return
    bad = (topk_idx < -1) | (topk_idx >= num_experts)
    flat = jnp.argmax(bad.reshape(-1))
    value = topk_idx.reshape(-1)[flat]

    def _raise(any_bad, pos, val):
        if bool(any_bad):
            k = topk_idx.shape[1]
            raise ValueError(f"jax_ep: topk_idx[{int(pos) // k}, {int(pos) % k}] = {int(val)}"
                             f" is outside [-1, {num_experts}) (num_experts={num_experts})")

    jax.debug.callback(_raise, jnp.any(bad), flat, value)


def _owner(topk_idx, experts_per_rank):
    return jnp.where(topk_idx >= 0, topk_idx // experts_per_rank, -1)


def is_token_in_rank(topk_idx, num_experts, num_ranks):
    """bool[T, R]: token t has an expert on rank r."""
    owner = _owner(topk_idx, num_experts // num_ranks)
    return jnp.any(owner[:, :, None] == jnp.arange(num_ranks, dtype=owner.dtype), axis=1)


def layout(topk_idx, cfg: Cfg) -> DispatchLayout:
    num_experts, num_ranks = cfg.num_experts, cfg.num_ranks
    if cfg.check_ids:
        check_ids(topk_idx, num_experts)
    in_rank = is_token_in_rank(topk_idx, num_experts, num_ranks)
    valid = topk_idx >= 0
    per_expert = jnp.zeros((num_experts,), jnp.int32).at[
        jnp.where(valid, topk_idx, num_experts).reshape(-1)].add(1, mode="drop")
    return DispatchLayout(
        num_tokens_per_rank=jnp.sum(in_rank, axis=0, dtype=jnp.int32),
        num_tokens_per_expert=per_expert,
        is_token_in_rank=in_rank,
    )


def _as_bits(x):
    """x viewed as unsigned ints of its width: moving bits, not floats, keeps every
    payload exact (XLA on CPU computes bfloat16 selects in float32, which would
    canonicalize NaNs)."""
    return jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}"))


def _a2a(v, axis_name):
    # [R(dest), ...] -> [R(source), ...]
    return jax.lax.all_to_all(v, axis_name, 0, 0, tiled=False)


def dispatch(x, topk_idx, topk_weights, cfg: Cfg):
    num_experts, R, C, axis_name = cfg.num_experts, cfg.num_ranks, cfg.capacity, cfg.axis_name
    if cfg.check_ids:
        check_ids(topk_idx, num_experts)
    rank = jax.lax.axis_index(axis_names(axis_name))
    T, H = x.shape
    K = topk_idx.shape[1]
    el = num_experts // R
    in_rank = is_token_in_rank(topk_idx, num_experts, R)  # [T, R]
    mask = in_rank.T  # [R(dest), T]
    xb = _as_bits(x)
    send_x = jnp.where(mask[:, :, None], xb[None], jnp.zeros((), xb.dtype))
    send_idx = jnp.where(mask[:, :, None], topk_idx[None], -1)
    send_w = jnp.where(mask[:, :, None], topk_weights[None], 0.0)
    recv_x = _a2a(send_x, axis_name).reshape(R * T, H)
    recv_idx = _a2a(send_idx, axis_name).reshape(R * T, K)
    recv_w = _a2a(send_w, axis_name).reshape(R * T, K)
    recv_mask = _a2a(mask, axis_name).reshape(R * T)

    pos = jnp.cumsum(recv_mask.astype(jnp.int32)) - 1
    keep = recv_mask & (pos < C)
    total = jnp.sum(recv_mask, dtype=jnp.int32)
    num_recv = jnp.minimum(total, C).astype(jnp.int32)
    dest = jnp.where(keep, pos, C)  # C is out of bounds: dropped by the scatter

    local = jnp.where(_owner(recv_idx, el) == rank, recv_idx - rank * el, -1)
    local_w = jnp.where(local >= 0, recv_w, 0.0)
    src = jnp.arange(R * T, dtype=jnp.int32)
    out_x = jax.lax.bitcast_convert_type(
        jnp.zeros((C, H), xb.dtype).at[dest].set(recv_x, mode="drop"), x.dtype)
    out_idx = jnp.full((C, K), -1, jnp.int32).at[dest].set(local, mode="drop")
    out_w = jnp.zeros((C, K), jnp.float32).at[dest].set(local_w, mode="drop")
    src_rank = jnp.full((C,), -1, jnp.int32).at[dest].set(src // T, mode="drop")
    src_index = jnp.full((C,), -1, jnp.int32).at[dest].set(src % T, mode="drop")
    per_expert = jnp.zeros((el,), jnp.int32).at[
        jnp.where(out_idx >= 0, out_idx, el).reshape(-1)].add(1, mode="drop")

    # Tell each source where its rows landed: [R(source), T] -> [R(receiver), T].
    landed = jnp.where(keep, pos, -1).reshape(R, T)
    send_row = _a2a(landed, axis_name).T  # [T, R]
    handle = DispatchHandle(
        num_recv=num_recv, num_dropped=(total - num_recv).astype(jnp.int32),
        num_recv_tokens_per_expert=per_expert, src_rank=src_rank, src_index=src_index,
        send_row=send_row, num_experts=num_experts, num_ranks=R, capacity=C,
        axis_name=axis_name)
    return out_x, out_idx, out_w, handle


def combine(y, handle: DispatchHandle, cfg: Cfg):
    """out[T, H]: float32 sum over receivers in ascending rank order, cast to y.dtype."""
    R = handle.num_ranks
    T = handle.send_row.shape[0]
    H = y.shape[1]
    kept = handle.src_rank >= 0
    # Rows past num_recv are ignored: route them out of bounds.
    r_idx = jnp.where(kept, handle.src_rank, R)
    t_idx = jnp.where(kept, handle.src_index, 0)
    yb = _as_bits(y)
    buf = jnp.zeros((R, T, H), yb.dtype).at[r_idx, t_idx].set(yb, mode="drop")
    # [R(receiver), T, H]
    back = jax.lax.bitcast_convert_type(_a2a(buf, handle.axis_name), y.dtype)
    # Explicit ascending order; adding the zeros of absent rows leaves the sum unchanged.
    acc = jnp.zeros((T, H), jnp.float32)
    for r in range(R):
        acc = acc + jnp.where(handle.send_row[:, r:r + 1] >= 0,
                              back[r].astype(jnp.float32), 0.0)
    return acc.astype(y.dtype)


def gather(g, handle: DispatchHandle, cfg: Cfg):
    """Transpose of combine: out[C, H] with out[i] = g_{src_rank[i]}[src_index[i]]."""
    R = handle.num_ranks
    mask = (handle.send_row >= 0).T  # [R(dest), T]
    gb = _as_bits(g)
    send = jnp.where(mask[:, :, None], gb[None], jnp.zeros((), gb.dtype))
    recv = _a2a(send, handle.axis_name)  # [R(source), T, H]
    kept = handle.src_rank >= 0
    rows = recv[jnp.where(kept, handle.src_rank, 0), jnp.where(kept, handle.src_index, 0)]
    return jax.lax.bitcast_convert_type(
        jnp.where(kept[:, None], rows, jnp.zeros((), gb.dtype)), g.dtype)
