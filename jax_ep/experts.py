"""Grouped experts on one shard: per-expert blocks, batched SwiGLU, and back.

After `jax_ep.dispatch`, a rank holds rows `x[C, H]` with up to K local expert ids each
(`topk_idx[C, K]`, -1 where the slot's expert lives elsewhere) and their weights. The
experts' work is one SwiGLU per (row, slot) pair. This module gives that work a static
shape that follows the routing instead of the worst case:

  group_by_expert   (row, slot) pairs -> `Groups`: for each local expert e, the rows of
                    its pairs in received order, packed into `rows[E_local, cap]` (a
                    sentinel past the last), their weights, and the pairs over `cap`
                    counted as dropped
  gather_blocks     x[C, H] -> blocks[E_local, cap, H] (zero in empty places)
  swiglu_blocks     blocks[E_local, N, H] -> [E_local, N, H]: every expert's SwiGLU, as
                    batched matmuls, or with `counts` only on the tiles of rows in use
                    (the layout of the low-latency mode's receive buffer too)
  scatter_blocks    blocks[E_local, cap, H] -> y[C, H] float32, each pair's output scaled
                    by its weight and summed onto its row
  grouped_swiglu    what the MoE layer calls: group_by_expert, the kept pairs packed
                    expert after expert with each run rounded up to a tile
                    (`aligned_pairs`), then one loop over the experts and over chunks
                    of up to `max_chunk` rows of each run (largest first), gathering a
                    chunk's rows from x, running the SwiGLU and adding the weighted
                    outputs onto y in place; its backward is the same loop, hand-written

All of it is pure JAX (one sort, gathers, scatter-adds, matmuls, `lax.scan`/`lax.cond`),
differentiable in every float argument (reverse mode), the same on every platform. Work
follows the routed pairs: each expert computes `ceil(pairs / tile) * tile` rows, whatever
`cap` is.

`grouped_swiglu(..., matmul="ragged_dot")` is the GPU choice: the kept pairs packed
expert after expert (`packed_pairs`, `[E_local * cap]` rows) and three
`jax.lax.ragged_dot`s, with no data-dependent loop (a `lax.cond` per tile makes XLA:GPU
read its predicate back to the host each time). XLA:CPU computes a ragged dot as every
group over every row, about E_local times the work (docs/performance.md), so "tiles" is
the CPU default (`default_expert_matmul`).

Capacity. `cap` is static. `expert_capacity(num_slots, num_local_experts, factor)` is
`ceil(factor * num_slots / E_local)` rounded up to a multiple of 8: `factor` times the mean
load of a local expert. Pairs of an expert past its first `cap` (in received order: source
rank, then source token) are dropped. `cap = C` (one place per received row) never drops,
since a row names an expert at most once.
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

__all__ = ["Groups", "expert_capacity", "group_by_expert", "gather_blocks",
           "swiglu_blocks", "scatter_blocks", "grouped_swiglu", "packed_pairs",
           "aligned_pairs", "default_expert_matmul", "EXPERT_MATMULS"]


class Groups(NamedTuple):
    """Where each local expert's (row, slot) pairs are, as static blocks.

    rows: int32[E_local, cap], the received row of each place; C (one past the last row)
      in empty places. Within an expert, rows ascend (the received order).
    weights: float32[E_local, cap], the pair's top-k weight; 0 in empty places.
    counts: int32[E_local], pairs naming each expert (kept or not).
    dropped: int32 scalar, pairs past their expert's capacity.
    """
    rows: jax.Array
    weights: jax.Array
    counts: jax.Array
    dropped: jax.Array


def expert_capacity(num_slots: int, num_local_experts: int, factor: float, *,
                    limit: int | None = None, multiple: int = 8) -> int:
    """Static places per local expert: `ceil(factor * num_slots / num_local_experts)`,
    rounded up to a multiple of `multiple`, at least 1, at most `limit` (when given).

    `num_slots` is the (row, slot) pairs a rank expects for its experts with balanced
    routing: tokens of the EP group times top_k over R (`T * K` for T tokens per rank)."""
    if not isinstance(factor, (int, float)) or isinstance(factor, bool) or factor <= 0:
        raise ValueError(f"capacity_factor must be a positive number, got {factor!r}")
    if num_local_experts < 1:
        raise ValueError(f"num_local_experts must be >= 1, got {num_local_experts}")
    cap = math.ceil(factor * num_slots / num_local_experts)
    cap = multiple * math.ceil(cap / multiple) if multiple > 1 else cap
    if limit is not None:
        cap = min(cap, limit)
    return max(1, int(cap))


def _starts(sizes):
    """int32[E] -> int32[E]: the exclusive prefix sum (where each expert's places begin).
    A log-depth scan of slices: `jnp.cumsum` exports, from jax 0.12 on, as a composite
    whose fallback is a `while` loop, and the GPU path must hold no loop."""
    sizes = sizes.astype(jnp.int32)
    return jax.lax.associative_scan(jnp.add, sizes) - sizes


def group_by_expert(topk_idx, topk_weights, num_local_experts: int, capacity: int) -> Groups:
    """Packs the (row, slot) pairs of `topk_idx[C, K]` (int32 local ids in
    [-1, num_local_experts); -1 = not here) by expert into `[num_local_experts, capacity]`
    places. `topk_weights[C, K]` float32. No float math: the result only moves data."""
    if topk_idx.ndim != 2:
        raise ValueError(f"topk_idx must be [C, K], got shape {topk_idx.shape}")
    if topk_weights.shape != topk_idx.shape:
        raise ValueError(f"topk_weights must have topk_idx's shape {topk_idx.shape}, got "
                         f"{topk_weights.shape}")
    capacity = int(capacity)
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1, got {capacity}")
    C, K = topk_idx.shape
    el = int(num_local_experts)
    key = jnp.where(topk_idx >= 0, topk_idx, el).reshape(-1)      # [C*K]
    counts = jnp.sum(key[:, None] == jnp.arange(el, dtype=key.dtype), axis=0,
                     dtype=jnp.int32)                                # [el]
    # Stable: within an expert, pairs stay in (row, slot) order, i.e. received order.
    order = jnp.argsort(key, stable=True).astype(jnp.int32)
    starts = _starts(counts)
    place = jnp.arange(capacity, dtype=jnp.int32)
    valid = place[None, :] < counts[:, None]                         # [el, cap]
    pos = jnp.minimum(starts[:, None] + place[None, :], C * K - 1)
    pair = order[pos]
    rows = jnp.where(valid, pair // K, C).astype(jnp.int32)
    weights = jnp.where(valid, topk_weights.reshape(-1)[pair], 0.0).astype(jnp.float32)
    dropped = jnp.sum(jnp.maximum(counts - capacity, 0), dtype=jnp.int32)
    return Groups(rows, weights, counts, dropped)


def gather_blocks(x, rows):
    """x[C, H] -> [E_local, cap, H]: row `rows[e, j]` of x, zero where it is C (empty)."""
    return jnp.take(x, rows, axis=0, mode="fill", fill_value=0)


def _check_blocks(xb, w_gate, w_up, w_down):
    if xb.ndim != 3 or w_gate.ndim != 3 or w_up.shape != w_gate.shape or w_down.ndim != 3:
        raise ValueError(f"swiglu_blocks wants xb[E, N, H], w_gate/w_up[E, H, F], "
                         f"w_down[E, F, H]; got {xb.shape}, {w_gate.shape}, {w_up.shape}, "
                         f"{w_down.shape}")
    e, _, h = xb.shape
    if w_gate.shape[:2] != (e, h) or w_down.shape != (e, w_gate.shape[2], h):
        raise ValueError(f"expert weights do not match xb[{e}, N, {h}]: w_gate "
                         f"{w_gate.shape}, w_down {w_down.shape}")


def swiglu_blocks(xb, w_gate, w_up, w_down, counts=None, *, tile: int = 128):
    """Each expert's SwiGLU on its own rows: xb[E_local, N, H], w_gate/w_up[E_local, H, F],
    w_down[E_local, F, H] -> [E_local, N, H] in xb's dtype (weights cast to it);
    `down(silu(x @ gate) * (x @ up))` per expert.

    counts: None, or int32[E_local] rows in use per expert (rows `counts[e]..N-1` of
    expert e are then taken as empty: their output is zero and they get no gradient).
    Without counts, every row is computed, as batched matmuls. With counts, the rows
    are cut into tiles of `tile` and only tiles holding a row in use are computed,
    forward and backward (a loop over tiles with a hand-written backward), so the work
    follows the routed rows (rounded up to a tile per expert), not N.
    """
    _check_blocks(xb, w_gate, w_up, w_down)
    dt = xb.dtype
    w_gate, w_up, w_down = (w.astype(dt) for w in (w_gate, w_up, w_down))
    if counts is None:
        g = jnp.einsum("enh,ehf->enf", xb, w_gate)
        u = jnp.einsum("enh,ehf->enf", xb, w_up)
        return jnp.einsum("enf,efh->enh", jax.nn.silu(g) * u, w_down)
    if counts.shape != (xb.shape[0],):
        raise ValueError(f"counts must be [E_local={xb.shape[0]}], got {counts.shape}")
    tile = int(tile)
    if tile < 1:
        raise ValueError(f"tile must be >= 1, got {tile}")
    n = xb.shape[1]
    tile = min(tile, n)
    pad = -n % tile
    if pad:
        xb = jnp.pad(xb, ((0, 0), (0, pad), (0, 0)))
    # One varying-axis set for all inputs, taken outside the custom_vjp so that autodiff
    # sums the weights' cotangents over the axes the weights do not vary over.
    axes = frozenset().union(*(_varying(a) for a in (xb, counts, w_gate, w_up, w_down)))
    xb, counts, w_gate, w_up, w_down = (_vary(a, axes) for a in
                                        (xb, counts.astype(jnp.int32), w_gate, w_up,
                                         w_down))
    y = _swiglu_tiles(xb, counts, w_gate, w_up, w_down, tile)
    return y[:, :n] if pad else y


def _varying(a) -> frozenset:
    """The manual mesh axes `a` varies over (inside shard_map; empty outside)."""
    t = jax.typeof(a)
    mat = getattr(t, "manual_axis_type", None)
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(t, "vma", frozenset()) or ())


def _vary(a, axes):
    """`a` marked varying over `axes` too (shard_map types loop carries and branches by
    the axes they vary over, so all must agree)."""
    missing = tuple(sorted(frozenset(axes) - _varying(a)))
    return jax.lax.pcast(a, missing, to="varying") if missing else a


def _tile_mask(i, tile, count):
    """bool[tile, 1]: rows of tile i below `count`."""
    return (i * tile + jnp.arange(tile))[:, None] < count


def _swiglu_tiles_fwd_loop(xb, counts, w_gate, w_up, w_down, tile):
    e, n, h = xb.shape
    nt = n // tile

    def per_expert(_, a):
        x, wg, wu, wd, c = a

        def per_tile(_, b):
            xt, i = b

            def on():
                y = (jax.nn.silu(xt @ wg) * (xt @ wu)) @ wd
                return jnp.where(_tile_mask(i, tile, c), y, 0).astype(xt.dtype)

            return None, jax.lax.cond(i * tile < c, on, lambda: jnp.zeros_like(xt))

        _, y = jax.lax.scan(per_tile, None, (x.reshape(nt, tile, h), jnp.arange(nt)))
        return None, y.reshape(n, h)

    return jax.lax.scan(per_expert, None, (xb, w_gate, w_up, w_down, counts))[1]


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _swiglu_tiles(xb, counts, w_gate, w_up, w_down, tile):
    return _swiglu_tiles_fwd_loop(xb, counts, w_gate, w_up, w_down, tile)


def _swiglu_tiles_fwd(xb, counts, w_gate, w_up, w_down, tile):
    # Residuals are the inputs; the backward recomputes x @ gate and x @ up per tile
    # (two of the forward's three matmuls) instead of holding [E, N, F] activations.
    y = _swiglu_tiles_fwd_loop(xb, counts, w_gate, w_up, w_down, tile)
    return y, (xb, counts, w_gate, w_up, w_down)


def _swiglu_tiles_bwd(tile, res, dy):
    xb, counts, w_gate, w_up, w_down = res
    e, n, h = xb.shape
    f = w_gate.shape[2]
    nt = n // tile
    f32 = jnp.float32

    def per_expert(_, a):
        x, dyy, wg, wu, wd, c = a

        def per_tile(acc, b):
            xt, dyt, i = b

            def on(acc):
                dwg, dwu, dwd = acc
                # rows past the count may hold anything (NaN included: the GPU
                # low-latency dispatch leaves them unwritten); 0 * NaN would reach the
                # weights' gradients
                xm = jnp.where(_tile_mask(i, tile, c), xt, 0)
                dyt_ = jnp.where(_tile_mask(i, tile, c), dyt, 0)
                g = jnp.matmul(xm, wg, preferred_element_type=f32)
                u = jnp.matmul(xm, wu, preferred_element_type=f32)
                s = jax.nn.sigmoid(g)
                act = g * s
                hid = (act * u).astype(xt.dtype)
                dh = jnp.matmul(dyt_, wd.T, preferred_element_type=f32)
                du = (dh * act).astype(xt.dtype)
                dg = (dh * u * (s * (1 + g * (1 - s)))).astype(xt.dtype)
                dx = (jnp.matmul(dg, wg.T, preferred_element_type=f32)
                      + jnp.matmul(du, wu.T, preferred_element_type=f32))
                acc = (dwg + jnp.matmul(xm.T, dg, preferred_element_type=f32),
                       dwu + jnp.matmul(xm.T, du, preferred_element_type=f32),
                       dwd + jnp.matmul(hid.T, dyt_, preferred_element_type=f32))
                return acc, dx.astype(xt.dtype)

            return jax.lax.cond(i * tile < c, on, lambda acc: (acc, jnp.zeros_like(xt)),
                                acc)

        axes = _varying(x)
        zero = tuple(_vary(jnp.zeros(shape, f32), axes) for shape in ((h, f), (h, f), (f, h)))
        (dwg, dwu, dwd), dx = jax.lax.scan(
            per_tile, zero, (x.reshape(nt, tile, h), dyy.reshape(nt, tile, h),
                             jnp.arange(nt)))
        return None, (dx.reshape(n, h), dwg.astype(wg.dtype), dwu.astype(wu.dtype),
                      dwd.astype(wd.dtype))

    _, (dx, dwg, dwu, dwd) = jax.lax.scan(per_expert, None,
                                          (xb, dy, w_gate, w_up, w_down, counts))
    return dx, None, dwg, dwu, dwd


_swiglu_tiles.defvjp(_swiglu_tiles_fwd, _swiglu_tiles_bwd)


def scatter_blocks(yb, groups: Groups, num_rows: int):
    """yb[E_local, cap, H] -> float32[num_rows, H]: row i is the sum, over the places
    holding row i, of weight * yb (in float32, experts ascending); empty places add
    nothing."""
    h = yb.shape[-1]
    vals = yb.astype(jnp.float32) * groups.weights[..., None]
    return jnp.zeros((num_rows, h), jnp.float32).at[groups.rows.reshape(-1)].add(
        vals.reshape(-1, h), mode="drop")


def aligned_pairs(groups: Groups, tile: int, num_rows: int):
    """The kept pairs of `groups` packed expert after expert, each expert's run starting
    at a multiple of `tile`: (rows int32[M], weights float32[M], starts int32[E_local],
    sizes int32[E_local]) with M = E_local * ceil(cap / tile) * tile; expert e's pairs
    are rows `starts[e] .. starts[e] + kept_e - 1` and its run is `sizes[e]` (kept_e
    rounded up to a multiple of `tile`) long; gaps hold row `num_rows` (empty) and
    weight 0."""
    el, cap = groups.rows.shape
    tile = int(tile)
    capr = -(-cap // tile) * tile
    kept = jnp.minimum(groups.counts, cap).astype(jnp.int32)
    sizes = (kept + tile - 1) // tile * tile
    starts = _starts(sizes)
    m = el * capr
    place = jnp.arange(cap, dtype=jnp.int32)
    dest = jnp.where(place[None, :] < kept[:, None], starts[:, None] + place[None, :],
                     m).reshape(-1)
    rows = jnp.full((m,), num_rows, jnp.int32).at[dest].set(groups.rows.reshape(-1),
                                                            mode="drop")
    weights = jnp.zeros((m,), jnp.float32).at[dest].set(groups.weights.reshape(-1),
                                                        mode="drop")
    return rows, weights, starts, sizes


def _chunk_sizes(tile, max_chunk, m):
    """Static chunk lengths: tile, 2 tile, 4 tile, ... up to max(tile, max_chunk), each
    below m (the packed length) but the first.

    Never a chunk of all m rows: its slices of the packed arrays would be the whole
    arrays (a dynamic slice of full length has a constant offset), so XLA's loop-invariant
    code motion hoists that chunk's gathers and matmuls out of its while loop, and they
    run on every call even when no run is that long. At the demo's shape (m = 1024 =
    max_chunk) that tripled the layer's forward+backward (docs/performance.md);
    tests/test_experts.py checks that no matmul sits outside the loops."""
    sizes = [tile]
    while sizes[-1] * 2 <= max(tile, max_chunk) and sizes[-1] * 2 < m:
        sizes.append(sizes[-1] * 2)
    return tuple(sizes)


def _over_chunks(start, size, sizes, step, carry):
    """Runs `step(S)((offset, *carry))` over one expert's run [start, start + size),
    largest chunks first: for each S in `sizes` descending, a while loop takes chunks of
    S while at least S rows are left. A run is a multiple of the smallest size, so the
    chunks cover it exactly, and at most one chunk of each smaller size is taken. Plain
    while loops (no `lax.switch` between sizes): XLA:CPU updates their carried buffers in
    place, where a switch whose branches all write a buffer copies it on every step."""
    end = start + size
    c = (start, *carry)
    for s in reversed(sizes):
        c = jax.lax.while_loop(lambda c, s=s: end - c[0] >= s, step(s), c)
    return c[1:]


def _chunk_fwd_loop(x, rows, weights, starts, sizes, w_gate, w_up, w_down, tile,
                    max_chunk, save):
    """y float32[C, H] and (when `save`) x @ [gate | up] of every packed place
    [M, 2F] (zero in places past each expert's run)."""
    c_rows, h = x.shape
    m = rows.shape[0]
    f = w_gate.shape[2]
    chunks = _chunk_sizes(tile, max_chunk, m)
    axes = _varying(x)

    def per_expert(carry, a):
        wg, wu, wd, start, size = a
        # [gate | up] of one expert, built in the loop body: its buffer is reused by
        # every expert (a stacked [E, H, 2F] copy is a fresh allocation per call, and
        # XLA:CPU's fresh temporaries cost page faults).
        wgu = jnp.concatenate([wg, wu], axis=-1)

        def step(s):
            def run(c):
                o, y, gus = c
                rt = jax.lax.dynamic_slice_in_dim(rows, o, s)
                wt = jax.lax.dynamic_slice_in_dim(weights, o, s)
                xt = jnp.take(x, rt, axis=0, mode="fill", fill_value=0)
                gu = xt @ wgu                       # gate and up as one [s, 2F] matmul
                out = (jax.nn.silu(gu[:, :f]) * gu[:, f:]) @ wd
                y = y.at[rt].add(out.astype(jnp.float32) * wt[:, None], mode="drop")
                if save:
                    gus = jax.lax.dynamic_update_slice_in_dim(gus, gu, o, 0)
                return o + s, y, gus
            return run

        return _over_chunks(start, size, chunks, step, carry), None

    y0 = _vary(jnp.zeros((c_rows, h), jnp.float32), axes)
    # Without `save` (no gradient asked) the buffer is empty: a while loop's carry is
    # never pruned, so an unused [M, 2F] buffer would still be filled.
    g0 = _vary(jnp.zeros((m if save else 0, 2 * f), x.dtype), axes)
    (y, gus), _ = jax.lax.scan(per_expert, (y0, g0), (w_gate, w_up, w_down, starts, sizes))
    return y, gus


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9, 10))
def _chunked(x, rows, weights, starts, sizes, w_gate, w_up, w_down, tile, max_chunk,
             need_dx):
    return _chunk_fwd_loop(x, rows, weights, starts, sizes, w_gate, w_up, w_down, tile,
                           max_chunk, save=False)[0]


def _chunked_fwd(x, rows, weights, starts, sizes, w_gate, w_up, w_down, tile, max_chunk,
                 need_dx):
    y, gus = _chunk_fwd_loop(x, rows, weights, starts, sizes, w_gate, w_up, w_down, tile,
                             max_chunk, save=True)
    return y, (x, rows, weights, starts, sizes, w_gate, w_up, w_down, gus)


def _chunked_bwd(tile, max_chunk, need_dx, res, dy):
    x, rows, weights, starts, sizes, w_gate, w_up, w_down, gus = res
    c_rows, h = x.shape
    m = rows.shape[0]
    f = w_gate.shape[2]
    f2 = 2 * f
    chunks = _chunk_sizes(tile, max_chunk, m)
    axes = _varying(x)
    f32, dt = jnp.float32, x.dtype

    def per_expert(carry, a):
        wg, wu, wd, start, size = a
        # The transposed weights of one expert, once per expert (XLA:CPU's matmul with
        # a transposed right operand ran at about half the speed of the plain layout),
        # in the loop body so that one buffer serves every expert.
        wgu_t = jnp.concatenate([wg.T, wu.T], axis=0) if need_dx else None  # [2F, H]
        wd_t = wd.T                                             # [H, F]

        def step(s):
            def run(c):
                o, dx, dpw, dwgu, dwd = c
                rt = jax.lax.dynamic_slice_in_dim(rows, o, s)
                wt = jax.lax.dynamic_slice_in_dim(weights, o, s)
                xt = jnp.take(x, rt, axis=0, mode="fill", fill_value=0)
                dyt = jnp.take(dy, rt, axis=0, mode="fill", fill_value=0)
                gu = jax.lax.dynamic_slice_in_dim(gus, o, s).astype(f32)
                g, u = gu[:, :f], gu[:, f:]
                sg = jax.nn.sigmoid(g)
                act = g * sg
                hid = act * u
                dh0 = jnp.matmul(dyt.astype(dt), wd_t, preferred_element_type=f32)
                dsc = jnp.sum(dh0 * hid, axis=-1)   # <dy, out> = <dy @ wd^T, hid>
                dh = dh0 * wt[:, None]
                dyw = (dyt * wt[:, None]).astype(dt)
                dgu = jnp.concatenate([dh * u * (sg * (1 + g * (1 - sg))), dh * act],
                                      axis=1).astype(dt)
                dwgu = dwgu + jnp.matmul(xt.T, dgu, preferred_element_type=f32)
                dwd = dwd + jnp.matmul(hid.astype(dt).T, dyw, preferred_element_type=f32)
                if need_dx:  # a third of the backward's matmuls
                    dxt = jnp.matmul(dgu, wgu_t, preferred_element_type=f32)
                    dx = dx.at[rt].add(dxt, mode="drop")
                dpw = jax.lax.dynamic_update_slice_in_dim(dpw, dsc, o, 0)
                return o + s, dx, dpw, dwgu, dwd
            return run

        zero = tuple(_vary(jnp.zeros(sh, f32), axes) for sh in ((h, f2), (f, h)))
        dx, dpw, dwgu, dwd = _over_chunks(start, size, chunks, step, (*carry, *zero))
        return (dx, dpw), (dwgu[:, :f].astype(wg.dtype), dwgu[:, f:].astype(wu.dtype),
                           dwd.astype(wd.dtype))

    # Without need_dx the rows' cotangent stays zero: a [0, H] carry, nothing to fill.
    dx0 = _vary(jnp.zeros((c_rows if need_dx else 0, h), f32), axes)
    dp0 = _vary(jnp.zeros((m,), f32), axes)
    (dx, dpw), (dwg, dwu, dwd) = jax.lax.scan(per_expert, (dx0, dp0),
                                              (w_gate, w_up, w_down, starts, sizes))
    dx = dx if need_dx else _vary(jnp.zeros((c_rows, h), f32), axes)
    return dx.astype(dt), None, dpw, None, None, dwg, dwu, dwd


_chunked.defvjp(_chunked_fwd, _chunked_bwd)


EXPERT_MATMULS = ("tiles", "ragged_dot")


def default_expert_matmul(platform: str | None = None) -> str:
    """The grouped-matmul choice for `platform` (default: JAX's default backend): "tiles"
    on CPU, "ragged_dot" elsewhere (GPU), where a data-dependent loop would read its
    predicate back to the host once per tile."""
    platform = jax.default_backend() if platform is None else platform
    return "tiles" if platform == "cpu" else "ragged_dot"


def check_expert_matmul(expert_matmul) -> str:
    """`expert_matmul` resolved: None/"auto" -> `default_expert_matmul()`; else one of
    EXPERT_MATMULS."""
    if expert_matmul is None or expert_matmul == "auto":
        return default_expert_matmul()
    if expert_matmul not in EXPERT_MATMULS:
        raise ValueError(f"expert_matmul must be None, 'auto' or one of {EXPERT_MATMULS}, "
                         f"got {expert_matmul!r}")
    return expert_matmul


def packed_pairs(groups: Groups, num_rows: int):
    """The kept pairs of `groups`, expert after expert with no gap: (rows int32[M],
    weights float32[M], sizes int32[E_local]) with M = E_local * cap; expert e's pairs
    are `sizes[e]` consecutive entries; the unused tail holds row `num_rows` (empty) and
    weight 0."""
    el, cap = groups.rows.shape
    sizes = jnp.minimum(groups.counts, cap).astype(jnp.int32)
    starts = _starts(sizes)
    place = jnp.arange(cap, dtype=jnp.int32)
    m = el * cap
    dest = jnp.where(place[None, :] < sizes[:, None], starts[:, None] + place[None, :], m)
    dest = dest.reshape(-1)
    rows = jnp.full((m,), num_rows, jnp.int32).at[dest].set(groups.rows.reshape(-1),
                                                            mode="drop")
    weights = jnp.zeros((m,), jnp.float32).at[dest].set(groups.weights.reshape(-1),
                                                         mode="drop")
    return rows, weights, sizes


def _ragged_swiglu(x, rows, weights, sizes, w_gate, w_up, w_down):
    """y float32[C, H]: the SwiGLU of each packed pair (`packed_pairs`) as three
    `jax.lax.ragged_dot`s over the experts' consecutive groups, scaled by the pair's
    weight and added onto its row. No loop: one grouped matmul per weight."""
    xs = jnp.take(x, rows, axis=0, mode="fill", fill_value=0)           # [M, H]
    g = jax.lax.ragged_dot(xs, w_gate, sizes)
    u = jax.lax.ragged_dot(xs, w_up, sizes)
    out = jax.lax.ragged_dot(jax.nn.silu(g) * u, w_down, sizes)          # [M, H]
    vals = out.astype(jnp.float32) * weights[:, None]
    return jnp.zeros(x.shape, jnp.float32).at[rows].add(vals, mode="drop")


def grouped_swiglu(x, topk_idx, topk_weights, w_gate, w_up, w_down, *, capacity: int,
                   tile: int = 32, max_chunk: int = 1024, matmul: str = "tiles",
                   need_dx: bool = True):
    """The experts' part of an MoE layer on one rank.

    x[C, H] (received rows), topk_idx[C, K] int32 local ids (-1: elsewhere),
    topk_weights[C, K] float32, w_gate/w_up[E_local, H, F], w_down[E_local, F, H];
    `capacity` static places per expert. Returns (y float32[C, H], groups): y[i] =
    sum over the kept pairs (i, k) of topk_weights[i, k] * SwiGLU_{topk_idx[i, k]}(x[i]).

    matmul="tiles": the kept pairs packed expert after expert, each expert's run
    rounded up to a multiple of `tile` (`aligned_pairs`); one loop over the experts and,
    per expert, over chunks of its run of `tile * 2^j` rows (at most `max_chunk`,
    largest first), so an expert with n pairs computes ceil(n / tile) * tile rows in a
    few large matmuls. A chunk gathers its rows from x, runs gate and up as one
    `[chunk, H] x [H, 2F]` matmul, then down, and adds its weighted outputs onto y in
    place; the backward is the same loop, hand-written. x @ [gate | up] of the places
    (`[E_local * capacity, 2F]`) is kept for it. Suits CPU.
    matmul="ragged_dot": the kept pairs packed expert after expert (`packed_pairs`) and
    three `jax.lax.ragged_dot`s; no data-dependent loop (for GPU, where XLA lowers it to
    grouped GEMMs). Its rows are `E_local * capacity`; the same numbers to float32
    rounding. `matmul=None` picks by platform (`default_expert_matmul`).

    `need_dx=False`: the caller never uses x's cotangent (x is stop_gradient'ed
    upstream); "tiles" then returns zeros for it and skips its matmuls (a third of the
    backward's).

    `tile` 32: a run's last rows go in chunks of 32, 64, ... so an expert computes at
    most 31 padding rows (128 padded about 6% of the work at 1024 pairs an expert, and
    measured slower on CPU; 16 was slower again: docs/performance.md).
    """
    matmul = check_expert_matmul(matmul)
    if x.ndim != 2:
        raise ValueError(f"x must be [C, H], got shape {x.shape}")
    _check_blocks(jnp.zeros((w_gate.shape[0], 0, x.shape[1]), x.dtype), w_gate, w_up,
                  w_down)
    groups = group_by_expert(topk_idx, topk_weights, w_gate.shape[0], capacity)
    dt = x.dtype
    if matmul == "ragged_dot":
        rows, weights, sizes = packed_pairs(groups, x.shape[0])
        y = _ragged_swiglu(x, rows, weights, sizes, *(w.astype(dt) for w in
                                                      (w_gate, w_up, w_down)))
        return y, groups
    tile = max(1, min(int(tile), capacity))
    if int(max_chunk) < 1:
        raise ValueError(f"max_chunk must be >= 1, got {max_chunk}")
    rows, weights, starts, sizes = aligned_pairs(groups, tile, x.shape[0])
    # Packed outside the custom_vjp: autodiff carries the weights' cotangent back from
    # the packed places to topk_weights.
    args = (x, rows, weights, starts, sizes, *(w.astype(dt) for w in (w_gate, w_up,
                                                                        w_down)))
    axes = frozenset().union(*(_varying(a) for a in args))
    y = _chunked(*(_vary(a, axes) for a in args), tile, int(max_chunk), bool(need_dx))
    return y, groups
