"""The EP ops, per shard (inside `shard_map`): the contract. Each op owns its argument
checks, the backend choice and its autodiff; the backends (`jax_ep._src.backends`) do the
work, with one set of signatures.

Shapes (R ranks on `axis_name`, E experts, E_local = E // R, C = capacity):
  x[T, H] float32/bfloat16/float16, topk_idx[T, K] int32 in [-1, E), topk_weights[T, K]
  float32 -> recv_x[C, H], recv_topk_idx[C, K] int32 (local ids), recv_topk_weights[C, K]
  float32, DispatchHandle; combine(y[C, H], handle) -> out[T, H].
Tokens may carry leading dims (x[..., H], routing [..., K], out[..., H]; T = their
product), and x may be an FP8 pair (x_fp8 [..., H], scales [..., H // block]) from
`jax_ep.fp8.quantize`, received as a pair.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import operator
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from jax_ep import fp8

from jax_ep._src import arrival as _arrival

from jax_ep._src import cpu_pool as _cpu_pool

from jax_ep._src import ext as _ext

from jax_ep._src import value_check as _value_check

from jax_ep._src import backends
from jax_ep._src.common import FLOAT_DTYPES, Cfg, after, ep_size, unify_varying
from jax_ep._src.scope import named
from jax_ep._src.types import DispatchHandle, DispatchLayout
from jax_ep import nvshmem_bootstrap as nvshmem

# The backends (resolve_backend says what each name resolves to): "reference" (pure JAX),
# "intranode" (the FFI kernels within one process/node: CPU transport or CUDA peer
# pointers), "internode" (NVSHMEM, one process per GPU; docs/internode.md). "auto" (or
# None) picks one; "ffi" is the deprecated name of "intranode".
CANONICAL_BACKENDS = ("reference", "intranode", "internode")
BACKENDS = ("reference", "intranode", "internode", "auto", "ffi")

# Before JAX creates its CPU client: give the CPU transport enough pool threads (see
# jax_ep/_src/cpu_pool.py; pipelined calls stall on a pool of one thread per device).
_cpu_pool.install()


# ----------------------------------------------------------------------------- checks

def _static_int(name, value, minimum=None):
    try:
        v = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be a static Python int, got {value!r}") from None
    if minimum is not None and v < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {v}")
    return v


def _check_routing(topk_idx, topk_weights, num_tokens, num_experts, num_ranks):
    if topk_idx.ndim != 2:
        raise ValueError(f"topk_idx must be rank 2 [T, K], got shape {topk_idx.shape}")
    if topk_idx.dtype != jnp.int32:
        raise TypeError(f"topk_idx must be int32, got {topk_idx.dtype}")
    if num_tokens is not None and topk_idx.shape[0] != num_tokens:
        raise ValueError(f"topk_idx has {topk_idx.shape[0]} rows but x has {num_tokens} "
                         "tokens")
    if topk_weights is not None:
        if topk_weights.shape != topk_idx.shape:
            raise ValueError(f"topk_weights must have topk_idx's shape {topk_idx.shape}, "
                             f"got {topk_weights.shape}")
        if topk_weights.dtype != jnp.float32:
            raise TypeError(f"topk_weights must be float32, got {topk_weights.dtype}")
    if num_experts % num_ranks != 0:
        raise ValueError(f"num_experts={num_experts} must be divisible by the number of "
                         f"ranks R={num_ranks} on the EP axis (E % R != 0)")


def _check_tokens(name, x):
    if x.ndim != 2:
        raise ValueError(f"{name} must be rank 2 [T, H], got shape {x.shape}")
    if jnp.dtype(x.dtype) not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32, bfloat16 or float16, got {x.dtype}")


# ----------------------------------------------------------------------------- backends

def _transport_started() -> bool:
    """An internode transport runs in this process: NVSHMEM or NCCL GIN."""
    from jax_ep import nccl_bootstrap
    return nvshmem.is_initialized() or nccl_bootstrap.is_initialized()


def _internode_ready(platform) -> bool:
    """The internode transport is the GPU path: a transport started here, several
    processes."""
    return platform == "gpu" and jax.process_count() > 1 and _transport_started()


_warned_ffi = False


def _handle_backend(backend, handle):
    """`backend`, or for None the backend recorded in `handle` (None where it has none)."""
    return getattr(handle, "backend", None) if backend is None else backend


def _warn_ffi_alias():
    global _warned_ffi
    if not _warned_ffi:
        _warned_ffi = True
        warnings.warn("jax_ep: backend='ffi' is a deprecated name of backend='intranode' "
                      "(the FFI kernels within one process/node); it never selects "
                      "'internode'", DeprecationWarning, stacklevel=3)


def resolve_backend(backend) -> str:
    """The canonical backend, 'reference', 'intranode' or 'internode', for `backend`:

    - 'reference', 'intranode', 'internode': that backend (an error where it cannot run
      here: 'intranode' without kernels for this platform or across CPU processes,
      'internode' without GPUs, an NVSHMEM build or NVSHMEM started in this process).
    - 'ffi': deprecated name of 'intranode' (a DeprecationWarning, once per process); it
      is 'intranode' always, never 'internode'.
    - None or 'auto': 'internode' on GPUs with NVSHMEM started in this process and several
      processes; else 'intranode' where this build has kernels for the platform (and, on
      CPU, one process); else 'reference'.
    """
    if backend is None:
        backend = "auto"
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}")
    if backend == "ffi":
        _warn_ffi_alias()
        backend = "intranode"
    platform = jax.default_backend()
    available = _ext.registered_platforms()
    if backend == "internode":
        if platform != "gpu" or "gpu" not in available or not _ext.build_info()["nvshmem"]:
            raise NotImplementedError(
                f"backend='internode' needs GPUs and a build with NVSHMEM (platform "
                f"{platform!r}, build: {_ext.build_info()}); use backend='reference'")
        if not _transport_started():
            raise NotImplementedError(
                "backend='internode' needs its transport running in this process: call "
                "jax_ep.nvshmem_bootstrap.initialize(...) or "
                "jax_ep.nccl_bootstrap.initialize(...) before jit")
        return "internode"
    if backend == "auto":
        if platform not in available:
            return "reference"
        if platform == "cpu" and jax.process_count() > 1:
            return "reference"  # the CPU transport meets peers inside one process only
        if _internode_ready(platform):
            return "internode"
        backend = "intranode"
    if backend == "intranode":
        if platform not in available:
            raise NotImplementedError(
                f"backend='intranode' has no kernels for platform {platform!r} in this "
                f"build (built: {_ext.build_info()}); use backend='reference' or 'auto'")
        if platform == "cpu" and jax.process_count() > 1:
            raise NotImplementedError(
                "backend='intranode' on CPU moves rows between the devices of one process; "
                f"with {jax.process_count()} processes use backend='reference' or 'auto'")
        if platform == "cpu":
            _cpu_pool.check(jax.local_device_count())
    return backend


def _check_ids_reference(topk_idx, spec):
    """The global view's agreed id check (the reference backend's, and ffi's across EP
    groups; see jax_ep/_src/value_check.py): global topk_idx[N, K] made to depend on the
    check every shard agrees on, run before the partitioned op."""
    return _value_check.checked_global(topk_idx, spec)


# ----------------------------------------------------------------------------- layout

@named("jax_ep.get_dispatch_layout")
def get_dispatch_layout(topk_idx, *, num_experts: int, num_ranks: int,
                        backend=None) -> DispatchLayout:
    """Routing statistics of one rank's topk_idx[T, K] int32, no communication.

    Returns DispatchLayout(num_tokens_per_rank int32[R], num_tokens_per_expert int32[E],
    is_token_in_rank bool[T, R]).
    """
    num_experts = _static_int("num_experts", num_experts, 1)
    num_ranks = _static_int("num_ranks", num_ranks, 1)
    topk_idx = jnp.asarray(topk_idx)
    _check_routing(topk_idx, None, None, num_experts, num_ranks)
    return _layout_impl(topk_idx, num_experts, num_ranks, resolve_backend(backend))


def _layout_impl(topk_idx, num_experts, num_ranks, backend, check_ids=True):
    if check_ids and backend in ("reference", "intranode"):
        # No exchange follows in the op, but the program's next collective does: inside
        # shard_map every shard agrees on the check first, so all raise or none does
        # (the CPU kernel's own check would stop one shard alone). Its all-gather is a
        # collective: on several processes (CPU) every peer arrives first.
        topk_idx = _arrival.arrive("get_dispatch_layout", topk_idx,
                                   f"; num_experts={num_experts}, num_ranks={num_ranks}")
        check = functools.partial(_value_check.checked, num_experts=num_experts)
        # The intranode GPU kernel treats a bad id as unused and records it: no rank
        # stops, so only CPU programs need the agreement (and its collective).
        topk_idx = (check(topk_idx) if backend == "reference"
                    else _value_check.on_cpu(check, topk_idx))
    cfg = Cfg(num_experts, num_ranks, backend=backend, check_ids=check_ids)
    return backends.get(backend).layout(topk_idx, cfg)


# ----------------------------------------------------------------------------- dispatch

def _empty_dispatch(x, topk_idx, topk_weights, cfg: Cfg):
    """Dispatch with T == 0 on every rank (T is static, so all ranks agree): nothing is
    sent or received, so the result needs no exchange."""
    C, R, el, K, H = (cfg.capacity, cfg.num_ranks, cfg.experts_per_rank, topk_idx.shape[1],
                      x.shape[1])
    out = (jnp.zeros((C, H), x.dtype), jnp.full((C, K), -1, jnp.int32),
           jnp.zeros((C, K), jnp.float32), jnp.zeros((), jnp.int32),
           jnp.zeros((), jnp.int32), jnp.zeros((el,), jnp.int32),
           jnp.full((C,), -1, jnp.int32), jnp.full((C,), -1, jnp.int32),
           jnp.zeros((0, R), jnp.int32))
    # Results vary over the mesh axes like the inputs (shard_map's type checks).
    out = unify_varying(x, topk_idx, topk_weights, *out)[3:]
    handle = DispatchHandle(*out[3:], cfg.num_experts, R, C, cfg.axis_name)
    return out[0], out[1], out[2], handle


def _dispatch_impl(x, topk_idx, topk_weights, cfg: Cfg):
    if x.shape[0] == 0 and cfg.backend != "internode":
        return _empty_dispatch(x, topk_idx, topk_weights, cfg)
    return backends.get(cfg.backend).dispatch(x, topk_idx, topk_weights, cfg)


def _dispatch_fwd(x, topk_idx, topk_weights, cfg):
    # symbolic_zeros: each differentiable argument comes wrapped with whether it is
    # perturbed. x is not when only the weights' gradient is asked for (a layer's tokens
    # under a gradient over its parameters): its cotangent, a whole combine of the
    # received rows, is then skipped (`want_x` None), and XLA drops the rows' cotangent.
    out = _dispatch_impl(x.value, topk_idx.value, topk_weights.value, cfg)
    return out, (out[1], out[3], () if x.perturbed else None)


def dispatch_transpose(combine_fn, recv_idx, cts, want_x=True):
    """Cotangents (x, topk_idx, topk_weights) of dispatch from those of its outputs, for
    a `combine_fn(rows) -> tokens` bound to the dispatch's handle (per shard or global).
    With `want_x` False (x not differentiated) x's cotangent is None and its combine is
    not run."""
    d_recv_x, _, d_recv_w, _ = cts
    d_x = combine_fn(d_recv_x) if want_x else None
    # Each slot's weight lives on exactly one rank: masking the others and summing over
    # ranks returns the owner's cotangent exactly (zero where dropped). The two combines
    # are independent: chain them so they never run at once (they share transport state).
    masked = jnp.where(recv_idx >= 0, d_recv_w, 0.0)
    d_w = combine_fn(masked if d_x is None else after(d_x, masked))
    return d_x, None, d_w


def _dense_ct(ct, recv_idx):
    """A cotangent of dispatch's rows or weights as an array: a symbolic zero (an output
    the loss does not use) becomes zeros of its shape, varying like `recv_idx` (shard_map's
    checks)."""
    if not isinstance(ct, jax.custom_derivatives.SymbolicZero):
        return ct
    return jnp.zeros(ct.shape, ct.dtype) + jnp.zeros_like(recv_idx[..., :1], ct.dtype)


def _dispatch_bwd(cfg, res, cts):
    recv_idx, handle, want_x = res
    d_recv_x, d_idx, d_recv_w, d_handle = cts
    zero = jax.custom_derivatives.SymbolicZero
    if want_x is None and isinstance(d_recv_w, zero):
        return None, None, None
    cts = (None if want_x is None else _dense_ct(d_recv_x, recv_idx), d_idx,
           _dense_ct(d_recv_w, recv_idx), d_handle)
    return dispatch_transpose(
        lambda v: _combine_impl(v, handle, cfg.backend, cfg.group_axes), recv_idx, cts,
        want_x=want_x is not None)


_dispatch = jax.custom_vjp(_dispatch_impl, nondiff_argnums=(3,))
_dispatch.defvjp(_dispatch_fwd, _dispatch_bwd, symbolic_zeros=True)


def as_payload(x):
    """x as the rows dispatch moves: an FP8 pair (x_fp8 [..., H], scales [..., H // b])
    becomes its packed PAYLOAD_DTYPE rows [..., W] (bit for bit); anything else is
    returned as an array. Returns (rows, block or None)."""
    if isinstance(x, (tuple, list)):
        if len(x) != 2:
            raise TypeError(f"x must be an array or an FP8 pair (x_fp8, scales), got a "
                            f"sequence of {len(x)}")
        x_fp8, scales = jnp.asarray(x[0]), jnp.asarray(x[1])
        if x_fp8.ndim >= 1 and scales.ndim == x_fp8.ndim and scales.shape[-1] >= 1:
            block = x_fp8.shape[-1] // scales.shape[-1]
        else:
            block = None
        payload = fp8.pack(x_fp8, scales)  # checks dtypes and shapes, naming them
        return payload, block
    return jnp.asarray(x), None


def _check_token_shapes(x, topk_idx, topk_weights):
    """x[..., H] with topk_idx/topk_weights [..., K] of the same leading shape (rank 2,
    [T, H] and [T, K], is the common case)."""
    if x.ndim < 2:
        raise ValueError(f"x must be rank 2 [T, H] (or [..., H] with leading dims), got "
                         f"shape {x.shape}")
    if topk_idx.ndim < 2:
        raise ValueError(f"topk_idx must be rank 2 [T, K] (or [..., K] with x's leading "
                         f"dims), got shape {topk_idx.shape}")
    if x.ndim == 2 and topk_idx.ndim == 2:
        return  # _check_routing compares the token counts
    if x.shape[:-1] != topk_idx.shape[:-1]:
        which = "x must be rank 2 [T, H] like topk_idx" if x.ndim > topk_idx.ndim else \
            "topk_idx must have x's leading dims"
        raise ValueError(f"{which}: x[..., H] and topk_idx[..., K] need the same leading "
                         f"shape, got x {x.shape} and topk_idx {topk_idx.shape}")
    if topk_weights.shape != topk_idx.shape:
        raise ValueError(f"topk_weights must have topk_idx's shape {topk_idx.shape}, "
                         f"got {topk_weights.shape}")


@named("jax_ep.dispatch")
def dispatch(x, topk_idx, topk_weights, *, num_experts: int, axis_name, capacity=None,
             backend=None):
    """Sends each token to the ranks that hold its top-k experts (inside shard_map).

    Args:
      x: [T, H] float32, bfloat16 or float16, or [..., H] with leading dims; or an FP8
        pair (x_fp8 float8_e4m3fn [..., H], scales float32 [..., H // block]) from
        `jax_ep.fp8.quantize`, moved as one row of H + 4 H / block bytes per token.
      topk_idx: [T, K] (or [..., K], x's leading dims) int32 expert ids in [-1, E); -1 is
        an unused slot.
      topk_weights: float32, topk_idx's shape.
      num_experts: E, a multiple of the EP axis size R.
      axis_name: the EP mesh axis (or tuple of axes).
      capacity: C, rows received per rank (default R * T, which never overflows).
      backend: 'reference', 'intranode', 'internode' or None/'auto' ('ffi': deprecated
        name of 'intranode'); `resolve_backend` says what each resolves to. The handle
        records the resolved backend (`handle.backend`).

    Returns:
      recv_x [C, H] (x's dtype; for an FP8 pair the pair (recv_x_fp8 [C, H], recv_scales
      [C, H // block]), both bit-exact copies), recv_topk_idx [C, K] int32 (local expert
      ids, -1 where the expert is elsewhere or the row is empty), recv_topk_weights [C, K]
      float32, and a DispatchHandle (with leading dims, its send_row is [..., R]). Rows
      are ordered by source rank, then source token (leading dims flattened row-major);
      rows past capacity are dropped (counted in handle.num_dropped).
    """
    x, block = as_payload(x)
    topk_idx = jnp.asarray(topk_idx)
    topk_weights = jnp.asarray(topk_weights)
    _check_token_shapes(x, topk_idx, topk_weights)
    _check_tokens("x", x.reshape(-1, x.shape[-1]) if x.ndim > 2 else x)
    lead = x.shape[:-1]
    T = math.prod(lead)
    x = x.reshape(T, x.shape[-1])
    if topk_idx.ndim > 2:
        topk_idx = topk_idx.reshape(T, topk_idx.shape[-1])
        topk_weights = topk_weights.reshape(T, topk_weights.shape[-1])
    num_experts = _static_int("num_experts", num_experts, 1)
    R = ep_size(axis_name)
    _check_routing(topk_idx, topk_weights, T, num_experts, R)
    C = R * T if capacity is None else _static_int("capacity", capacity, 1)
    if C < 1:
        raise ValueError("the default capacity R * T is 0 (T == 0 tokens): pass "
                         "capacity >= 1")
    cfg = Cfg(num_experts, R, C, axis_name, resolve_backend(backend))
    recv_x, recv_idx, recv_w, handle = _dispatch(x, topk_idx, topk_weights, cfg)
    handle = dataclasses.replace(handle, backend=cfg.backend)
    if len(lead) != 1:
        handle = dataclasses.replace(handle, send_row=handle.send_row.reshape(*lead, R))
    if block is not None:
        recv_x = fp8.unpack(recv_x, block=block)
    return recv_x, recv_idx, recv_w, handle


# ----------------------------------------------------------------------------- combine

def _native_bias(backend) -> bool:
    """Backends that add the bias inside their float32 accumulation (their module has
    `combine_with_bias`; for 'intranode' only the CPU kernel takes it)."""
    if not hasattr(backends.get(backend), "combine_with_bias"):
        return False
    return backend != "intranode" or jax.default_backend() == "cpu"


def _combine_impl(y, handle, backend, group_axes=None, bias=()):
    T = handle.send_row.shape[0]
    if T == 0 and backend != "internode":
        return unify_varying(y, jnp.zeros((0, y.shape[1]), y.dtype))[1]
    cfg = Cfg.for_handle(handle, backend, group_axes)
    impl = backends.get(backend)
    if not bias:
        return impl.combine(y, handle, cfg)
    if _native_bias(backend):
        return impl.combine_with_bias(y, handle, cfg, tuple(bias))
    # The same bits without native support: float32 rows sum exactly as the kernel's
    # float32 accumulator does, then the bias, then the one cast. Costs a float32 copy of
    # y and twice y's bytes on the wire.
    acc = impl.combine(y.astype(jnp.float32), handle, cfg)
    for b in bias:
        acc = acc + b.astype(jnp.float32)
    return acc.astype(y.dtype)


def _gather_impl(g, handle, backend, group_axes=None):
    if handle.send_row.shape[0] == 0 and backend != "internode":
        return unify_varying(g, jnp.zeros((handle.capacity, g.shape[1]), g.dtype))[1]
    return backends.get(backend).gather(g, handle, Cfg.for_handle(handle, backend, group_axes))


def _combine_fwd(y, bias, handle, backend):
    return _combine_impl(y, handle, backend, bias=bias), handle


def _bias_cotangent(d_out, dtypes):
    # out = cast(sum + bias): the bias passes its cotangent straight through.
    return tuple(d_out.astype(d) for d in dtypes)


def _make_combine(bias_dtypes):
    def primal(y, bias, handle, backend):
        # Exactly the fwd's arguments: custom_vjp fills in defaulted parameters of the
        # primal (like _combine_impl's group_axes) and would pass them on to the fwd.
        return _combine_impl(y, handle, backend, bias=bias)

    def bwd(backend, handle, d_out):
        dy = _gather_impl(d_out, handle, backend)
        zeros = jax.tree.map(lambda a: np.zeros(a.shape, jax.dtypes.float0), handle)
        return dy, _bias_cotangent(d_out, bias_dtypes), zeros

    f = jax.custom_vjp(primal, nondiff_argnums=(3,))
    f.defvjp(_combine_fwd, bwd)
    return f


_combine_for = functools.cache(_make_combine)


def check_bias(bias, shape):
    """bias None, one array or a pair, each of `shape` ([..., H], out's shape) and a float
    dtype -> a tuple of arrays in float32, bfloat16 or float16 (others are converted to
    float32 here, which is what adding them in float32 does)."""
    if bias is None:
        return ()
    terms = tuple(bias) if isinstance(bias, (tuple, list)) else (bias,)
    if not 1 <= len(terms) <= 2:
        raise ValueError(f"bias must be one array or a pair of arrays, got {len(terms)}")
    out = []
    for i, b in enumerate(terms):
        name = "bias" if len(terms) == 1 else f"bias[{i}]"
        b = jnp.asarray(b)
        if tuple(b.shape) != tuple(shape):
            raise ValueError(f"{name} must have the combined output's shape {tuple(shape)}, "
                             f"got {b.shape}")
        if not jnp.issubdtype(b.dtype, jnp.floating):
            raise TypeError(f"{name} must be a float array, got {b.dtype}")
        out.append(b if jnp.dtype(b.dtype) in FLOAT_DTYPES else b.astype(jnp.float32))
    return tuple(out)


@named("jax_ep.combine")
def combine(y, handle: DispatchHandle, *, bias=None, backend=None):
    """Sums expert outputs back onto the ranks their tokens came from (inside shard_map).

    Args:
      y: [C, H] float32, bfloat16 or float16; row i belongs to the handle's row i. Rows
        past handle.num_recv are ignored.
      handle: the DispatchHandle from `dispatch`.
      backend: None (the handle's backend, `handle.backend`) or a name as for `dispatch`.
      bias: None, or one array or a pair of arrays of out's shape ([T, H], or [..., H]
        with dispatch's leading dims), any float dtype: added in float32 to each token's
        sum (after the ranks, in order) before the single cast to y's dtype. Gradients
        flow to it.
    Returns:
      out [T, H] (or [..., H]) in y's dtype: for each token, the float32 sum in ascending
      rank order of the rows that ranks kept for it, plus the bias; zero (or the bias) for
      tokens sent nowhere.
    """
    if not isinstance(handle, DispatchHandle):
        raise TypeError(f"handle must be the DispatchHandle returned by dispatch, got "
                        f"{type(handle).__name__}")
    y = jnp.asarray(y)
    _check_tokens("y", y)
    if y.shape[0] != handle.capacity:
        raise ValueError(f"y must have the handle's capacity {handle.capacity} rows, got "
                         f"shape {y.shape}")
    R = ep_size(handle.axis_name)
    if R != handle.num_ranks:
        raise ValueError(f"handle was made for {handle.num_ranks} ranks but axis "
                         f"{handle.axis_name!r} has {R}")
    lead = handle.send_row.shape[:-1]
    H = y.shape[1]
    bias = check_bias(bias, (*lead, H))
    T = math.prod(lead)
    if len(lead) != 1:
        handle = dataclasses.replace(handle, send_row=handle.send_row.reshape(T, R))
        bias = tuple(b.reshape(T, H) for b in bias)
    f = _combine_for(tuple(jnp.dtype(b.dtype) for b in bias))
    out = f(y, bias, handle, resolve_backend(_handle_backend(backend, handle)))
    return out.reshape(*lead, H)


# ----------------------------------------------------------------------------- cached dispatch

def _cached_primal(x, handle, backend):
    return _gather_impl(x, handle, backend)


def _cached_fwd(x, handle, backend):
    return _gather_impl(x, handle, backend), handle


def _cached_bwd(backend, handle, d_rows):
    zeros = jax.tree.map(lambda a: np.zeros(a.shape, jax.dtypes.float0), handle)
    return _combine_impl(d_rows, handle, backend), zeros


_cached = jax.custom_vjp(_cached_primal, nondiff_argnums=(2,))
_cached.defvjp(_cached_fwd, _cached_bwd)


@named("jax_ep.cached_dispatch")
def cached_dispatch(x, handle: DispatchHandle, *, backend=None):
    """Dispatches another x through an existing handle: the same rows land in the same
    places, with no layout recomputed (DeepEP's `dispatch(x, handle=handle)`).

    Args:
      x: [T, H] (or [..., H], the dispatch's leading dims) float32/bfloat16/float16, or
        an FP8 pair (x_fp8, scales) as for `dispatch`.
      handle: the DispatchHandle of a `dispatch` of the same tokens.
    Returns:
      recv_x [C, H] (or the received FP8 pair), row i = the row the handle put there.
      Its gradient is the combine of the cotangent.
    """
    if not isinstance(handle, DispatchHandle):
        raise TypeError(f"handle must be the DispatchHandle returned by dispatch, got "
                        f"{type(handle).__name__}")
    x, block = as_payload(x)
    lead = handle.send_row.shape[:-1]
    if x.shape[:-1] != lead:
        raise ValueError(f"x must have the dispatched tokens' leading shape {lead} (+ H), "
                         f"got {x.shape}")
    _check_tokens("x", x.reshape(-1, x.shape[-1]))
    R = ep_size(handle.axis_name)
    if R != handle.num_ranks:
        raise ValueError(f"handle was made for {handle.num_ranks} ranks but axis "
                         f"{handle.axis_name!r} has {R}")
    T = math.prod(lead)
    if len(lead) != 1:
        handle = dataclasses.replace(handle, send_row=handle.send_row.reshape(T, R))
    rows = _cached(x.reshape(T, x.shape[-1]), handle,
                   resolve_backend(_handle_backend(backend, handle)))
    return fp8.unpack(rows, block=block) if block is not None else rows
