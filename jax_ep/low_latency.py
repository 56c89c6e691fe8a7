"""Low-latency mode for decoding, per shard (inside `shard_map`): the contract.

Each local expert gets its own block of rows: no layout pass, no per-rank
deduplication, and buffers whose sizes depend only on (R, M, H, K, E), never on the
call's T. Shapes (R ranks on `axis_name`, E experts, E_local = E // R, M =
max_tokens_per_rank):

  dispatch(x[T, H], topk_idx[T, K] int32) -> recv_x[E_local, R * M, H] (or, with fp8,
    the pair (recv_x_fp8 float8_e4m3fn [E_local, R * M, H], recv_scales float32
    [E_local, R * M, H // 128])), recv_count int32[E_local], LowLatencyHandle.
    Expert e's rows are every (s, t, k) with topk_idx_s[t, k] == rank * E_local + e,
    ordered by source rank s, then token t, packed from row 0; rows past recv_count[e]
    are unspecified on GPU backends (the reference and CPU backends keep zeros there):
    read only the first recv_count[e] rows.
  combine(y[E_local, R * M, H], topk_idx[T, K], topk_weights[T, K] float32, handle)
    -> out[T, H]: out[t] = sum over k ascending of topk_weights[t, k] * y_row(t, k),
    accumulated in float32, cast to y's dtype; -1 slots skipped; zero for tokens with no
    expert.

Overlap: `dispatch_send` / `dispatch_recv` and `combine_send` / `combine_recv` are the two
halves of each op as separate custom calls, so XLA can place independent work between
them; `dispatch`/`combine` are the halves together, and only they are differentiable.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_ep._src import arrival as _arrival

from jax_ep._src import backends
from jax_ep._src.common import Cfg, after, ep_size
from jax_ep._src.ext import ffi_call
from jax_ep._src.scope import named
from jax_ep.ops import _check_tokens, _static_int, resolve_backend

__all__ = ["LowLatencyHandle", "DispatchSendState", "CombineSendState", "dispatch",
           "combine", "dispatch_send", "dispatch_recv", "combine_send", "combine_recv",
           "buffer_shapes"]

# FP8 scales cover 1 x 128 runs of a row (the jax_ep.fp8 default block).
FP8_BLOCK = 128


@dataclasses.dataclass(frozen=True)
class LowLatencyHandle:
    """What `combine` and the gradients need from a low-latency dispatch.

    src_rank, src_index: int32[E_local, R * M], source rank and token of each row, -1 in
      empty rows.
    first_row, row_count: int32[E_local, R], where each source rank's rows start in a
      local expert's block and how many there are.
    Static: num_experts, num_ranks, max_tokens_per_rank, axis_name, num_tokens (T),
    topk (K), backend (the canonical backend that made it; combine with backend=None
    uses it).
    """

    src_rank: jax.Array
    src_index: jax.Array
    first_row: jax.Array
    row_count: jax.Array
    num_experts: int
    num_ranks: int
    max_tokens_per_rank: int
    axis_name: Any
    num_tokens: int
    topk: int
    backend: str | None = None

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.num_ranks


jax.tree_util.register_dataclass(
    LowLatencyHandle, data_fields=["src_rank", "src_index", "first_row", "row_count"],
    meta_fields=["num_experts", "num_ranks", "max_tokens_per_rank", "axis_name",
                 "num_tokens", "topk", "backend"])


@dataclasses.dataclass(frozen=True)
class DispatchSendState:
    """The in-flight half of a dispatch: pass it to `dispatch_recv`."""

    sent: Any
    topk_idx: jax.Array
    cfg: Cfg
    num_tokens: int
    hidden: int
    fp8: bool


jax.tree_util.register_dataclass(
    DispatchSendState, data_fields=["sent", "topk_idx"],
    meta_fields=["cfg", "num_tokens", "hidden", "fp8"])


@dataclasses.dataclass(frozen=True)
class CombineSendState:
    """The in-flight half of a combine: pass it to `combine_recv`."""

    sent: Any
    topk_idx: jax.Array
    topk_weights: jax.Array
    cfg: Cfg
    num_tokens: int


jax.tree_util.register_dataclass(
    CombineSendState, data_fields=["sent", "topk_idx", "topk_weights"],
    meta_fields=["cfg", "num_tokens"])


def buffer_shapes(*, num_ranks: int, max_tokens_per_rank: int, hidden: int, topk: int,
                  num_experts: int) -> dict:
    """Shapes (rows, row elements) of the fixed per-rank buffers of the mode, a function
    of (R, M, H, K, E) only: the dispatch staging, the per-expert receive blocks and the
    combine staging (rows each rank returns to one source rank, at most
    M * min(K, E_local))."""
    R, M, H, K, E = num_ranks, max_tokens_per_rank, hidden, topk, num_experts
    el = E // R
    return {"dispatch_send": (M, H), "dispatch_recv": (el * R * M, H),
            "combine_send": (R * M * min(K, el), H), "combine_recv": (M, H)}


# ----------------------------------------------------------------------------- core
# Row functions take unpadded tokens x[T, H] with T <= stage_rows and pad them to the
# fixed stage_rows (M for the ops, M * K for the gradients' one-slot-per-token calls).

def _pad_rows(a, rows, value):
    extra = rows - a.shape[0]
    if extra == 0:
        return a
    return jnp.pad(a, ((0, extra),) + ((0, 0),) * (a.ndim - 1), constant_values=value)


def _send_dispatch(x, idx, cfg: Cfg, stage_rows: int):
    return backends.get(cfg.backend).ll_dispatch_send(
        _pad_rows(x, stage_rows, 0), _pad_rows(idx, stage_rows, -1), cfg)


def _recv_dispatch(sent, cfg: Cfg):
    return backends.get(cfg.backend).ll_dispatch_recv(sent, cfg)


def dispatch_rows(x, idx, cfg: Cfg, stage_rows: int):
    """x[T, H], idx[T, K] -> (recv_x, recv_count, src_rank, src_index, first_row,
    row_count), per shard, no autodiff."""
    return _recv_dispatch(_send_dispatch(x, idx, cfg, stage_rows), cfg)


def _send_dispatch_fp8(x, idx, cfg: Cfg, stage_rows: int, round_scale: bool):
    """x[T, H] -> the backend's in-flight FP8 send: one call, x cast to FP8 in the send
    half, one message per (token, expert) holding the values and the 1 x 128 scales."""
    return backends.get(cfg.backend).ll_dispatch_send_fp8(
        _pad_rows(x, stage_rows, 0), _pad_rows(idx, stage_rows, -1), cfg, round_scale)


def _recv_dispatch_fp8(sent, cfg: Cfg, hidden: int):
    """-> ((recv_x_fp8, recv_scales), recv_count, src_rank, src_index, first_row,
    row_count)."""
    return backends.get(cfg.backend).ll_dispatch_recv_fp8(sent, cfg, hidden)


def dispatch_rows_fp8(x, idx, cfg: Cfg, stage_rows: int, round_scale: bool):
    """x[T, H], idx[T, K] -> ((recv_x_fp8, recv_scales), recv_count, src_rank, src_index,
    first_row, row_count), per shard, no autodiff: one dispatch whose send half casts x
    to FP8 (jax_ep.fp8.quantize's rule) and sends one message per (token, expert)."""
    return _recv_dispatch_fp8(_send_dispatch_fp8(x, idx, cfg, stage_rows, round_scale), cfg,
                              x.shape[1])


def _rows_per_dest(cfg: Cfg, topk: int) -> int:
    return cfg.capacity * min(topk, cfg.experts_per_rank)


def _send_combine(y, first_row, row_count, cfg: Cfg, topk: int):
    return backends.get(cfg.backend).ll_combine_send(y, first_row, row_count,
                                                     _rows_per_dest(cfg, topk), cfg)


def _recv_combine(sent, idx, w, cfg: Cfg, stage_rows: int):
    T = idx.shape[0]
    out = backends.get(cfg.backend).ll_combine_recv(
        sent, _pad_rows(idx, stage_rows, -1), _pad_rows(w, stage_rows, 0.0), cfg)
    return out[:T]


def combine_rows(y, idx, w, first_row, row_count, cfg: Cfg, stage_rows: int, topk: int):
    """y[E_local, R*M, H], idx/w[T, K'] -> out[T, H], per shard, no autodiff. `topk` is
    the K of the dispatch that made the handle (it bounds the rows per destination)."""
    sent = _send_combine(y, first_row, row_count, cfg, topk)
    with _arrival.covered():  # the send half's arrival barrier covers the whole call
        return _recv_combine(sent, idx, w, cfg, stage_rows)


def make_differentiable(dispatch_fn, combine_fn):
    """custom_vjp'd (dispatch, combine) over row functions with the signatures of
    `dispatch_rows` and `combine_rows` (per shard here; the global view passes its
    partitioned ones). The transposes reuse the forward ops:
      d x       = combine of d recv_x with unit weights;
      d y       = dispatch of the one-slot tokens w[t, k] * d out[t] ([T * K, H], one
                  expert each; they land in the forward's rows);
      d weights = <d out[t], y_row(t, k)>, the rows brought back by a combine of the
                  one-slot tokens with unit weights.
    """

    def d_impl(x, idx, cfg):
        return dispatch_fn(x, idx, cfg, cfg.capacity)

    def d_fwd(x, idx, cfg):
        out = d_impl(x, idx, cfg)
        return out, (idx, out[4], out[5])

    def d_bwd(cfg, res, cts):
        idx, first_row, row_count = res
        d_recv = cts[0]
        ones = jnp.ones(idx.shape, jnp.float32)
        d_x = combine_fn(d_recv, idx, ones, first_row, row_count, cfg, cfg.capacity,
                         idx.shape[1])
        return d_x, None

    d = jax.custom_vjp(d_impl, nondiff_argnums=(2,))
    d.defvjp(d_fwd, d_bwd)

    def c_impl(y, idx, w, first_row, row_count, cfg):
        return combine_fn(y, idx, w, first_row, row_count, cfg, cfg.capacity, idx.shape[1])

    def c_fwd(y, idx, w, first_row, row_count, cfg):
        return c_impl(y, idx, w, first_row, row_count, cfg), (y, idx, w, first_row,
                                                              row_count)

    def c_bwd(cfg, res, d_out):
        y, idx, w, first_row, row_count = res
        T, K = idx.shape
        H = y.shape[-1]
        g = d_out.astype(jnp.float32)
        one_slot = (w[:, :, None] * g[:, None, :]).astype(y.dtype).reshape(T * K, H)
        idx1 = idx.reshape(T * K, 1)
        stage = cfg.capacity * K
        d_y = dispatch_fn(one_slot, idx1, cfg, stage)[0]
        # d_y's rows past the counts are unspecified on GPU (never written): zero, as
        # the rows of y there never reach the output
        used = jnp.arange(d_y.shape[1])[None, :] < jnp.sum(row_count, axis=1)[:, None]
        d_y = jnp.where(used[..., None], d_y, jnp.zeros((), d_y.dtype))
        # Independent EP calls, chained so they never run at once.
        rows = combine_fn(y, after(d_y, idx1), jnp.ones((T * K, 1), jnp.float32), first_row,
                          row_count, cfg, stage, K)
        d_w = jnp.sum(g[:, None, :] * rows.reshape(T, K, H).astype(jnp.float32), axis=-1)
        d_w = jnp.where(idx >= 0, d_w, 0.0)
        zeros = lambda a: np.zeros(a.shape, jax.dtypes.float0)  # noqa: E731
        return d_y, zeros(idx), d_w, zeros(first_row), zeros(row_count)

    c = jax.custom_vjp(c_impl, nondiff_argnums=(5,))
    c.defvjp(c_fwd, c_bwd)
    return d, c


_dispatch, _combine = make_differentiable(dispatch_rows, combine_rows)


def make_fp8_dispatch(fp8_rows_fn):
    """FP8 dispatch over a row function like `dispatch_rows_fp8` (x cast to FP8 in the
    send half, values and 1 x 128 scales in one message per (token, expert)).
    Differentiating it raises."""

    def impl(x, idx, cfg, round_scale):
        return fp8_rows_fn(x, idx, cfg, cfg.capacity, round_scale)

    def fwd(x, idx, cfg, round_scale):
        return impl(x, idx, cfg, round_scale), None

    def bwd(cfg, round_scale, res, cts):
        raise NotImplementedError(
            "jax_ep.low_latency.dispatch(fp8=True) has no gradient (FP8 dispatch is for "
            "inference); dispatch with fp8=False to differentiate")

    f = jax.custom_vjp(impl, nondiff_argnums=(2, 3))
    f.defvjp(fwd, bwd)
    return f


_fp8_dispatch = make_fp8_dispatch(dispatch_rows_fp8)


# ----------------------------------------------------------------------------- checks

def check_dispatch_args(x, topk_idx, num_experts, num_ranks, max_tokens_per_rank, fp8):
    """Static argument checks shared by both views; returns (E, M)."""
    _check_tokens("x", x)
    num_experts = _static_int("num_experts", num_experts, 1)
    M = _static_int("max_tokens_per_rank", max_tokens_per_rank, 1)
    if topk_idx.ndim != 2:
        raise ValueError(f"topk_idx must be rank 2 [T, K], got shape {topk_idx.shape}")
    if topk_idx.dtype != jnp.int32:
        raise TypeError(f"topk_idx must be int32, got {topk_idx.dtype}")
    if topk_idx.shape[0] != x.shape[0]:
        raise ValueError(f"topk_idx has {topk_idx.shape[0]} rows but x has {x.shape[0]} "
                         "tokens")
    if num_experts % num_ranks != 0:
        raise ValueError(f"num_experts={num_experts} must be divisible by the number of "
                         f"ranks R={num_ranks} on the EP axis (E % R != 0)")
    if fp8 and x.shape[1] % FP8_BLOCK != 0:
        raise ValueError(f"fp8=True needs x's hidden size H={x.shape[1]} to be a multiple "
                         f"of {FP8_BLOCK}")
    return num_experts, M


def _check_T(T, M):
    if T > M:
        raise ValueError(f"x has T={T} tokens per rank, more than max_tokens_per_rank={M} "
                         "(T > M): the low-latency buffers are sized for M tokens")


def check_combine_args(y, topk_idx, topk_weights, el, RM, T, K):
    _check_tokens_3d(y)
    if y.shape[:2] != (el, RM):
        raise ValueError(f"y must be [E_local, R * M, H] = [{el}, {RM}, H] like the "
                         f"dispatch's recv_x, got shape {y.shape}")
    if topk_idx.shape != (T, K) or topk_idx.dtype != jnp.int32:
        raise ValueError(f"topk_idx must be the dispatch's int32 [{T}, {K}], got "
                         f"{topk_idx.dtype} {topk_idx.shape}")
    if topk_weights.shape != (T, K):
        raise ValueError(f"topk_weights must have topk_idx's shape {(T, K)}, got "
                         f"{topk_weights.shape}")
    if topk_weights.dtype != jnp.float32:
        raise TypeError(f"topk_weights must be float32, got {topk_weights.dtype}")


def _check_tokens_3d(y):
    if y.ndim != 3:
        raise ValueError(f"y must be rank 3 [E_local, R * M, H], got shape {y.shape}")
    _check_tokens("y", y.reshape(-1, y.shape[-1]))


def _cfg(x, topk_idx, num_experts, axis_name, max_tokens_per_rank, fp8, backend):
    R = ep_size(axis_name)
    E, M = check_dispatch_args(x, topk_idx, num_experts, R, max_tokens_per_rank, fp8)
    _check_T(x.shape[0], M)
    return Cfg(E, R, M, axis_name, resolve_backend(backend))


def _handle(outs, cfg: Cfg, T, K):
    return LowLatencyHandle(outs[2], outs[3], outs[4], outs[5], cfg.num_experts,
                            cfg.num_ranks, cfg.capacity, cfg.axis_name, T, K, cfg.backend)


def _recv_result(outs, cfg, T, K):
    return outs[0], outs[1], _handle(outs, cfg, T, K)


# ----------------------------------------------------------------------------- dispatch

@named("jax_ep.low_latency.dispatch")
def dispatch(x, topk_idx, *, num_experts: int, axis_name, max_tokens_per_rank: int,
             fp8: bool = False, round_scale: bool = False, backend=None):
    """Sends each (token, top-k slot) to its expert's block (inside shard_map).

    Args:
      x: [T, H] float32, bfloat16 or float16, T <= max_tokens_per_rank.
      topk_idx: [T, K] int32 in [-1, E); -1 is an unused slot; no id twice in a row.
      num_experts: E, a multiple of the EP axis size R.
      axis_name: the EP mesh axis (or tuple of axes).
      max_tokens_per_rank: M, fixes every buffer's size.
      fp8: send block-scaled FP8 (jax_ep.fp8, 1 x 128 blocks) instead of x's dtype.
      round_scale: with fp8, round scales up to powers of two.
      backend: 'reference', 'intranode', 'internode' or None/'auto' (as jax_ep.dispatch).

    Returns:
      recv_x [E_local, R * M, H] in x's dtype, or with fp8 the pair (float8_e4m3fn
      [E_local, R * M, H], float32 scales [E_local, R * M, H // 128]); recv_count
      int32[E_local]; a LowLatencyHandle. Rows of expert e's block past recv_count[e]
      are unspecified on GPU backends.
    """
    x = jnp.asarray(x)
    topk_idx = jnp.asarray(topk_idx)
    cfg = _cfg(x, topk_idx, num_experts, axis_name, max_tokens_per_rank, fp8, backend)
    T, K = topk_idx.shape
    if fp8:
        return _recv_result(_fp8_dispatch(x, topk_idx, cfg, bool(round_scale)), cfg, T, K)
    return _recv_result(_dispatch(x, topk_idx, cfg), cfg, T, K)


@named("jax_ep.low_latency.dispatch_send")
def dispatch_send(x, topk_idx, *, num_experts: int, axis_name, max_tokens_per_rank: int,
                  fp8: bool = False, round_scale: bool = False,
                  backend=None) -> DispatchSendState:
    """The first half of `dispatch` (same arguments): stages and sends; returns the state
    `dispatch_recv` completes. Not differentiable (use `dispatch`)."""
    x = jnp.asarray(x)
    topk_idx = jnp.asarray(topk_idx)
    cfg = _cfg(x, topk_idx, num_experts, axis_name, max_tokens_per_rank, fp8, backend)
    if fp8:  # cast in the send half, one message per (token, expert)
        sent = _send_dispatch_fp8(x, topk_idx, cfg, cfg.capacity, bool(round_scale))
    else:
        sent = _send_dispatch(x, topk_idx, cfg, cfg.capacity)
    return DispatchSendState(sent, topk_idx, cfg, x.shape[0], x.shape[1], bool(fp8))


@named("jax_ep.low_latency.dispatch_recv")
def dispatch_recv(state: DispatchSendState):
    """The second half of `dispatch`: waits for the rows; returns what `dispatch` does."""
    if not isinstance(state, DispatchSendState):
        raise TypeError(f"state must be the DispatchSendState from dispatch_send, got "
                        f"{type(state).__name__}")
    if state.fp8:
        outs = _recv_dispatch_fp8(state.sent, state.cfg, state.hidden)
    else:
        outs = _recv_dispatch(state.sent, state.cfg)
    T, K = state.topk_idx.shape
    return _recv_result(outs, state.cfg, T, K)


# ----------------------------------------------------------------------------- combine

def _combine_cfg(y, topk_idx, topk_weights, handle, backend):
    if not isinstance(handle, LowLatencyHandle):
        raise TypeError(f"handle must be the LowLatencyHandle returned by "
                        f"jax_ep.low_latency.dispatch, got {type(handle).__name__}")
    R = ep_size(handle.axis_name)
    if R != handle.num_ranks:
        raise ValueError(f"handle was made for {handle.num_ranks} ranks but axis "
                         f"{handle.axis_name!r} has {R}")
    check_combine_args(y, topk_idx, topk_weights, handle.experts_per_rank,
                       R * handle.max_tokens_per_rank, handle.num_tokens, handle.topk)
    if backend is None:
        backend = handle.backend  # the dispatch's backend
    return Cfg(handle.num_experts, R, handle.max_tokens_per_rank, handle.axis_name,
               resolve_backend(backend))


@named("jax_ep.low_latency.combine")
def combine(y, topk_idx, topk_weights, handle: LowLatencyHandle, *, backend=None):
    """Weighted sum of each token's expert rows, back on its rank (inside shard_map).

    Args:
      y: [E_local, R * M, H] float32, bfloat16 or float16, rows as dispatch's recv_x.
      topk_idx, topk_weights: the dispatch's [T, K] int32 ids and [T, K] float32 weights.
      handle: the LowLatencyHandle from `dispatch`.
    Returns:
      out [T, H] in y's dtype: sum over k ascending of topk_weights[t, k] *
      y_row(t, k) in float32; -1 slots skipped, zero for tokens with no expert.
    """
    y, topk_idx, topk_weights = map(jnp.asarray, (y, topk_idx, topk_weights))
    cfg = _combine_cfg(y, topk_idx, topk_weights, handle, backend)
    return _combine(y, topk_idx, topk_weights, handle.first_row, handle.row_count, cfg)


@named("jax_ep.low_latency.combine_send")
def combine_send(y, topk_idx, topk_weights, handle: LowLatencyHandle, *,
                 backend=None) -> CombineSendState:
    """The first half of `combine` (same arguments): sends each row back to its source;
    returns the state `combine_recv` completes. Not differentiable (use `combine`)."""
    y, topk_idx, topk_weights = map(jnp.asarray, (y, topk_idx, topk_weights))
    cfg = _combine_cfg(y, topk_idx, topk_weights, handle, backend)
    sent = _send_combine(y, handle.first_row, handle.row_count, cfg, handle.topk)
    return CombineSendState(sent, topk_idx, topk_weights, cfg, topk_idx.shape[0])


@named("jax_ep.low_latency.combine_recv")
def combine_recv(state: CombineSendState):
    """The second half of `combine`: waits for the rows and reduces; returns out[T, H]."""
    if not isinstance(state, CombineSendState):
        raise TypeError(f"state must be the CombineSendState from combine_send, got "
                        f"{type(state).__name__}")
    return _recv_combine(state.sent, state.topk_idx, state.topk_weights, state.cfg,
                         state.cfg.capacity)


# ----------------------------------------------------------------------------- GPU harness

def _harness_attrs(E, M, K):
    return dict(num_experts=E, max_tokens=M, topk_max=K)


def harness_dispatch(x, topk_idx, *, num_experts: int, max_tokens_per_rank: int):
    """The CUDA low-latency kernels with R virtual ranks on one GPU (no shard_map):
    x[R, T, H], topk_idx[R, T, K] int32 stacked per rank -> (recv_x [R, E_local, R * M, H],
    recv_count [R, E_local], src_rank, src_index [R, E_local, R * M], first_row,
    row_count [R, E_local, R]), each rank's block as `dispatch` returns it. For tests and
    benchmarks on one GPU; the send and receive halves are two custom calls."""
    x, topk_idx = jnp.asarray(x), jnp.asarray(topk_idx)
    R, T, H = x.shape
    K = topk_idx.shape[-1]
    E, M = num_experts, max_tokens_per_rank
    _check_T(T, M)
    el = E // R
    pad = ((0, 0), (0, M - T), (0, 0))
    xp, ip = jnp.pad(x, pad), jnp.pad(topk_idx, pad, constant_values=-1)
    token = ffi_call("jax_ep_ll_harness_dispatch_send", jax.ShapeDtypeStruct((R,), jnp.int32))(
        x=xp, topk_idx=ip, **_harness_attrs(E, M, K))
    i32 = jnp.int32
    return ffi_call(
        "jax_ep_ll_harness_dispatch_recv",
        (jax.ShapeDtypeStruct((R, el, R * M, H), x.dtype), jax.ShapeDtypeStruct((R, el), i32),
         jax.ShapeDtypeStruct((R, el, R * M), i32), jax.ShapeDtypeStruct((R, el, R * M), i32),
         jax.ShapeDtypeStruct((R, el, R), i32), jax.ShapeDtypeStruct((R, el, R), i32)))(
        token=token, **_harness_attrs(E, M, K))


def harness_combine(y, topk_idx, topk_weights, first_row, row_count, *, num_experts: int,
                    max_tokens_per_rank: int):
    """`combine` through the CUDA harness: y[R, E_local, R * M, H], topk_idx/topk_weights
    [R, T, K], first_row/row_count [R, E_local, R] from `harness_dispatch` -> out
    [R, T, H]."""
    y, topk_idx, topk_weights = map(jnp.asarray, (y, topk_idx, topk_weights))
    R, T, K = topk_idx.shape
    E, M = num_experts, max_tokens_per_rank
    _check_T(T, M)
    token = ffi_call("jax_ep_ll_harness_combine_send", jax.ShapeDtypeStruct((R,), jnp.int32))(
        y=y, first_row=first_row, row_count=row_count, **_harness_attrs(E, M, K))
    pad = ((0, 0), (0, M - T), (0, 0))
    out = ffi_call("jax_ep_ll_harness_combine_recv",
                   jax.ShapeDtypeStruct((R, M, y.shape[-1]), y.dtype))(
        token=token, topk_idx=jnp.pad(topk_idx, pad, constant_values=-1),
        topk_weights=jnp.pad(topk_weights, pad), **_harness_attrs(E, M, K))
    return out[:, :T]
