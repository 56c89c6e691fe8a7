"""Pure-JAX reference backend: dense `all_to_all` padded to the worst case.

Correct on every platform and across processes, and the oracle of the tests. Every
function runs per shard, inside `shard_map`, like the `jax.lax` collectives, and has the
signature every backend module shares: `layout(topk_idx, cfg)`, `dispatch(x, topk_idx,
topk_weights, cfg)`, `combine(y, handle, cfg)`, `gather(g, handle, cfg)` with cfg a
`jax_ep._src.common.Cfg`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_ep._src import arrival as _arrival
from jax_ep._src.common import Cfg, axis_names
from jax_ep._src.value_check import checked, neutralized
from jax_ep._src.types import DispatchHandle, DispatchLayout


def _owner(topk_idx, experts_per_rank):
    return jnp.where(topk_idx >= 0, topk_idx // experts_per_rank, -1)


def is_token_in_rank(topk_idx, num_experts, num_ranks):
    """bool[T, R]: token t has an expert on rank r."""
    owner = _owner(topk_idx, num_experts // num_ranks)
    return jnp.any(owner[:, :, None] == jnp.arange(num_ranks, dtype=owner.dtype), axis=1)


def layout(topk_idx, cfg: Cfg) -> DispatchLayout:
    num_experts, num_ranks = cfg.num_experts, cfg.num_ranks
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


def _static(cfg: Cfg, handle: DispatchHandle | None = None) -> str:
    """The static attributes every rank of one call must share (the arrival barrier's
    signature): cfg's, or the handle's where the caller passes no cfg (combine and
    gather may)."""
    src = cfg if cfg is not None else handle
    return (f"; num_experts={src.num_experts}, num_ranks={src.num_ranks}, "
            f"capacity={src.capacity}, axis_name={src.axis_name!r}")


def dispatch(x, topk_idx, topk_weights, cfg: Cfg):
    num_experts, R, C, axis_name = cfg.num_experts, cfg.num_ranks, cfg.capacity, cfg.axis_name
    # Several processes on CPU: every peer has arrived before the first collective
    # (jax_ep/_src/arrival.py); elsewhere a no-op.
    x, topk_idx, topk_weights = _arrival.arrive("dispatch", (x, topk_idx, topk_weights),
                                                _static(cfg))
    if cfg.check_ids:
        # Agreed on every rank before the first all_to_all (jax_ep/_src/value_check.py).
        topk_idx = checked(topk_idx, num_experts, axis_name=axis_name, groups=cfg.group_axes)
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


def combine_node_size(num_ranks: int) -> int:
    """G of combine's summation order on this platform (jax_ep.network.topology
    .combine_node_size: JAX_EP_GPUS_PER_NODE, else one node on CPU, else the topology)."""
    from jax_ep.network import topology
    return topology.combine_node_size(num_ranks, jax.default_backend())


def combine(y, handle: DispatchHandle, cfg: Cfg):
    """out[T, H]: float32 sums in combine's order (kernels/common/combine_order.h: per node
    of G ranks ascending, node partials rounded to y.dtype when there are several nodes,
    then nodes ascending), cast to y.dtype."""
    return combine_with_bias(y, handle, cfg, ())


def combine_with_bias(y, handle: DispatchHandle, cfg: Cfg, bias, node_size=None):
    """combine, plus each [T, H] array of `bias` in order, added in float32 before the
    cast to y.dtype. node_size: G of the order (None: combine_node_size)."""
    y, handle, bias = _arrival.arrive("combine", (y, handle, tuple(bias)),
                                      _static(cfg, handle))
    R = handle.num_ranks
    G = combine_node_size(R) if node_size is None else int(node_size)
    G = R if G <= 0 or G >= R else G
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
    def node_sum(ranks):
        acc = jnp.zeros((T, H), jnp.float32)
        for r in ranks:
            acc = acc + jnp.where(handle.send_row[:, r:r + 1] >= 0,
                                  back[r].astype(jnp.float32), 0.0)
        return acc

    if G == R:  # one node: the plain ascending sum
        acc = node_sum(range(R))
    else:
        # Each node's partial crosses the network in y's dtype: rounded before the sum.
        acc = jnp.zeros((T, H), jnp.float32)
        for n in range(0, R, G):
            part = node_sum(range(n, min(n + G, R)))
            acc = acc + part.astype(y.dtype).astype(jnp.float32)
    for b in bias:
        acc = acc + b.astype(jnp.float32)
    return acc.astype(y.dtype)


def gather(g, handle: DispatchHandle, cfg: Cfg):
    """Transpose of combine: out[C, H] with out[i] = g_{src_rank[i]}[src_index[i]]."""
    g, handle = _arrival.arrive("gather", (g, handle), _static(cfg, handle))
    R = handle.num_ranks
    mask = (handle.send_row >= 0).T  # [R(dest), T]
    gb = _as_bits(g)
    send = jnp.where(mask[:, :, None], gb[None], jnp.zeros((), gb.dtype))
    recv = _a2a(send, handle.axis_name)  # [R(source), T, H]
    kept = handle.src_rank >= 0
    rows = recv[jnp.where(kept, handle.src_rank, 0), jnp.where(kept, handle.src_index, 0)]
    return jax.lax.bitcast_convert_type(
        jnp.where(kept[:, None], rows, jnp.zeros((), gb.dtype)), g.dtype)


# ============================================================================
# --- low-latency mode (jax_ep.low_latency): per-expert rows, fixed [E_local, R * M, H]
# receive blocks. Functions (shared by every backend module, cfg.capacity = M):
#   ll_dispatch_send(x[S, H], topk_idx[S, K], cfg) -> sent (tuple of arrays)
#   ll_dispatch_recv(sent, cfg) -> (recv_x[E_local, R*M, H], recv_count[E_local],
#       src_rank[E_local, R*M], src_index[E_local, R*M], first_row[E_local, R],
#       row_count[E_local, R])
#   ll_dispatch_send_fp8(x[S, H], topk_idx[S, K], cfg, round_scale) -> sent: x cast to
#       FP8 (jax_ep.fp8.quantize, 1 x 128 blocks) and sent as one message per (token,
#       expert), values and scales together
#   ll_dispatch_recv_fp8(sent, cfg, hidden) -> ((recv_x_fp8[E_local, R*M, H] float8_e4m3fn,
#       recv_scales[E_local, R*M, H // 128] float32), recv_count, ... as ll_dispatch_recv)
#   ll_combine_send(y[E_local, R*M, H], first_row, row_count, rows_per_dest, cfg) -> sent
#   ll_combine_recv(sent, topk_idx[S, K], topk_weights[S, K], cfg) -> out[S, H]
# Here the send halves hold the all_to_all and the receive halves the local packing.
# ============================================================================

from jax_ep._src.common import unify_varying  # noqa: E402 - low-latency section only


def ll_slot_positions(topk_idx, num_experts):
    """(pos[S, K], count[E]) int32: pos is the slot's row among this rank's tokens that
    pick the same expert (token order), count the tokens per expert; 0 in -1 slots."""
    valid = topk_idx >= 0
    hit = jnp.sum(topk_idx[:, :, None] == jnp.arange(num_experts, dtype=jnp.int32), axis=1,
                  dtype=jnp.int32)  # [S, E]
    before = jnp.cumsum(hit, axis=0, dtype=jnp.int32) - hit
    pos = jnp.take_along_axis(before, jnp.where(valid, topk_idx, 0), axis=1)
    return jnp.where(valid, pos, 0), jnp.sum(hit, axis=0, dtype=jnp.int32)


def ll_dispatch_send(x, topk_idx, cfg: Cfg):
    E, R, M = cfg.num_experts, cfg.num_ranks, cfg.capacity
    el = E // R
    x, topk_idx = _arrival.arrive("low_latency.dispatch_send", (x, topk_idx), _static(cfg))
    if cfg.check_ids:
        # Agreed on every rank before the all_to_all (jax_ep/_src/value_check.py).
        topk_idx = checked(topk_idx, E, axis_name=cfg.axis_name, groups=cfg.group_axes,
                           repeats=True, where="jax_ep.low_latency")
    S, H = x.shape
    K = topk_idx.shape[1]
    pos, count = ll_slot_positions(topk_idx, E)
    ok = (topk_idx >= 0) & (pos < M)
    dest = jnp.where(ok, topk_idx * M + pos, E * M).reshape(-1)  # E * M: dropped
    xb = _as_bits(x)
    rows = jnp.broadcast_to(xb[:, None, :], (S, K, H)).reshape(S * K, H)
    tok = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32)[:, None], (S, K)).reshape(-1)
    send_x = jnp.zeros((E * M, H), xb.dtype).at[dest].set(rows, mode="drop")
    send_tok = jnp.full((E * M,), -1, jnp.int32).at[dest].set(tok, mode="drop")
    # [R(dest), E_local, M, ...] -> [R(source), E_local, M, ...]
    recv_x = _a2a(send_x.reshape(R, el, M, H), cfg.axis_name)
    recv_tok = _a2a(send_tok.reshape(R, el, M), cfg.axis_name)
    recv_cnt = _a2a(jnp.minimum(count, M).reshape(R, el), cfg.axis_name)
    return jax.lax.bitcast_convert_type(recv_x, x.dtype), recv_tok, recv_cnt


def ll_dispatch_recv(sent, cfg: Cfg):
    recv_x, recv_tok, recv_cnt = sent
    dtype = recv_x.dtype
    recv_x = _as_bits(recv_x)
    R, M = cfg.num_ranks, cfg.capacity
    el = cfg.experts_per_rank
    H = recv_x.shape[-1]
    row_count = recv_cnt.T  # [E_local, R]
    first_row = jnp.cumsum(row_count, axis=1, dtype=jnp.int32) - row_count
    j = jnp.arange(M, dtype=jnp.int32)
    keep = j[None, None, :] < row_count[:, :, None]  # [E_local, R, M]
    e_ix = jnp.arange(el, dtype=jnp.int32)[:, None, None]
    dest = jnp.where(keep, e_ix * (R * M) + first_row[:, :, None] + j, el * R * M).reshape(-1)
    data = jnp.transpose(recv_x, (1, 0, 2, 3)).reshape(el * R * M, H)
    out_x = jnp.zeros((el * R * M, H), recv_x.dtype).at[dest].set(data, mode="drop")
    src = jnp.broadcast_to(jnp.arange(R, dtype=jnp.int32)[None, :, None], (el, R, M))
    src_rank = jnp.full((el * R * M,), -1, jnp.int32).at[dest].set(src.reshape(-1), mode="drop")
    src_index = jnp.full((el * R * M,), -1, jnp.int32).at[dest].set(
        jnp.transpose(recv_tok, (1, 0, 2)).reshape(-1), mode="drop")
    return (jax.lax.bitcast_convert_type(out_x, dtype).reshape(el, R * M, H),
            jnp.sum(row_count, axis=1, dtype=jnp.int32), src_rank.reshape(el, R * M),
            src_index.reshape(el, R * M), first_row, row_count)


def ll_dispatch_send_fp8(x, topk_idx, cfg: Cfg, round_scale: bool):
    """Here the message is jax_ep.fp8.pack's row (values, then scales), one all_to_all."""
    from jax_ep import fp8
    q, s = fp8.quantize(x, block=fp8.DEFAULT_BLOCK, round_scale=round_scale)
    return ll_dispatch_send(fp8.pack(q, s), topk_idx, cfg)


def ll_dispatch_recv_fp8(sent, cfg: Cfg, hidden: int):
    from jax_ep import fp8
    outs = ll_dispatch_recv(sent, cfg)
    pair = fp8.unpack(outs[0], block=fp8.DEFAULT_BLOCK)
    assert pair[0].shape[-1] == hidden
    return (pair,) + tuple(outs[1:])


def ll_combine_send(y, first_row, row_count, rows_per_dest, cfg: Cfg):
    y, first_row, row_count = _arrival.arrive("low_latency.combine_send",
                                              (y, first_row, row_count), _static(cfg))
    R, M = cfg.num_ranks, cfg.capacity
    el, RM, H = y.shape
    j = jnp.arange(M, dtype=jnp.int32)
    keep = j[None, None, :] < row_count[:, :, None]  # [E_local, R(dest), M]
    row = jnp.where(keep, first_row[:, :, None] + j, 0)
    yb = _as_bits(y)
    rows = yb[jnp.arange(el)[:, None, None], row]  # [E_local, R, M, H]
    rows = jnp.where(keep[..., None], rows, jnp.zeros((), yb.dtype))
    back = _a2a(jnp.transpose(rows, (1, 0, 2, 3)), cfg.axis_name)  # [R(owner), E_local, M, H]
    return (jax.lax.bitcast_convert_type(back, y.dtype),)


def ll_combine_recv(sent, topk_idx, topk_weights, cfg: Cfg):
    """out[S, H]: sum over k ascending of w[t, k] * row(t, k) in float32, cast to y's
    dtype; -1 slots are skipped."""
    if cfg.check_ids:
        # The check's all-gather is a collective of its own: the split API's
        # combine_recv has a barrier too (`combine` covers it with its send's).
        sent, topk_idx, topk_weights = _arrival.arrive(
            "low_latency.combine_recv", (sent, topk_idx, topk_weights), _static(cfg))
    (back,) = sent
    el = cfg.experts_per_rank
    M = cfg.capacity
    if cfg.check_ids:
        # The ids come after the exchange here: the agreement waits for it (so no rank
        # can be left in it), every rank raises after it, and rejected ids read no row.
        ids = checked(topk_idx, cfg.num_experts, axis_name=cfg.axis_name,
                      groups=cfg.group_axes, repeats=True, where="jax_ep.low_latency",
                      wait_for=(back,))
        topk_idx = neutralized(ids, cfg.num_experts, repeats=True)
    pos, _ = ll_slot_positions(topk_idx, cfg.num_experts)
    valid = (topk_idx >= 0) & (pos < M)  # rows past M were never sent
    g = jnp.where(valid, topk_idx, 0)
    rows = back[g // el, g % el, jnp.minimum(pos, M - 1)]  # [S, K, H]
    terms = jnp.where(valid[:, :, None], topk_weights[:, :, None] * rows.astype(jnp.float32),
                      0.0)
    # The products are materialized before a loop adds them, k ascending: fused into one
    # loop body, XLA on CPU contracts product and add into a fused multiply-add, which
    # rounds once instead of twice and differs from the kernels in the last bit.
    zero, terms = unify_varying(jnp.zeros(terms[:, 0].shape, jnp.float32), terms)
    acc, _ = jax.lax.scan(lambda a, v: (a + v, None), zero, jnp.moveaxis(terms, 1, 0))
    return acc.astype(back.dtype)
