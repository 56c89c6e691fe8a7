"""The EP ops, per shard (inside `shard_map`): the contract. Each op owns its argument
checks, the backend choice and its autodiff; the backends (`jax_ep.backends`) do the
work, with one set of signatures.

Shapes (R ranks on `axis_name`, E experts, E_local = E // R, C = capacity):
  x[T, H] float32/bfloat16/float16, topk_idx[T, K] int32 in [-1, E), topk_weights[T, K]
  float32 -> recv_x[C, H], recv_topk_idx[C, K] int32 (local ids), recv_topk_weights[C, K]
  float32, DispatchHandle; combine(y[C, H], handle) -> out[T, H].
"""
from __future__ import annotations

import operator

import jax
import jax.numpy as jnp
import numpy as np

from jax_ep import _cpu_pool, _ext, backends
from jax_ep._common import FLOAT_DTYPES, Cfg, after, ep_size
from jax_ep._types import DispatchHandle, DispatchLayout
from jax_ep.backends import reference
from jax_ep.runtime import nvshmem

# "internode" (NVSHMEM, one process per GPU; see docs/internode.md) is also what "ffi" and
# "auto" resolve to on GPUs when NVSHMEM runs in this process and there are >1 processes.
BACKENDS = ("reference", "ffi", "auto", "internode")

# Before JAX creates its CPU client: give the CPU transport enough pool threads (see
# jax_ep/_cpu_pool.py; pipelined calls stall on a pool of one thread per device).
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

def _internode_ready(platform) -> bool:
    """The internode transport is the GPU path: NVSHMEM started here, several processes."""
    return (platform == "gpu" and jax.process_count() > 1
            and nvshmem.is_initialized())


def resolve_backend(backend) -> str:
    """'reference', 'ffi' (intranode kernels) or 'internode' (NVSHMEM kernels) for
    `backend` in {None, 'auto', 'reference', 'ffi', 'internode'}."""
    if backend is None:
        backend = "auto"
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}")
    platform = jax.default_backend()
    available = _ext.registered_platforms()
    if backend == "internode":
        if platform != "gpu" or "gpu" not in available or not _ext.build_info()["nvshmem"]:
            raise NotImplementedError(
                f"backend='internode' needs GPUs and a build with NVSHMEM (platform "
                f"{platform!r}, build: {_ext.build_info()}); use backend='reference'")
        if not nvshmem.is_initialized():
            raise NotImplementedError(
                "backend='internode' needs NVSHMEM running in this process: call "
                "jax_ep.nvshmem_bootstrap.initialize(...) before jit")
        return "internode"
    if backend == "auto":
        if platform not in available:
            return "reference"
        if platform == "cpu" and jax.process_count() > 1:
            return "reference"  # the CPU transport meets peers inside one process only
        if _internode_ready(platform):
            return "internode"
        backend = "ffi"
    if backend == "ffi":
        if platform not in available:
            raise NotImplementedError(
                f"backend='ffi' has no kernels for platform {platform!r} in this build "
                f"(built: {_ext.build_info()}); use backend='reference' or 'auto'")
        if platform == "cpu" and jax.process_count() > 1:
            raise NotImplementedError(
                "backend='ffi' on CPU moves rows between the devices of one process; with "
                f"{jax.process_count()} processes use backend='reference' or 'auto'")
        if _internode_ready(platform):
            return "internode"
    if backend == "ffi" and platform == "cpu":
        _cpu_pool.check(jax.local_device_count())
    return backend


def _check_ids_reference(topk_idx, num_experts):
    """The reference backend's host-side id check, for callers that run it before
    partitioning (the global view)."""
    reference.check_ids(topk_idx, num_experts)


# ----------------------------------------------------------------------------- layout

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
    cfg = Cfg(num_experts, num_ranks, backend=backend, check_ids=check_ids)
    return backends.get(backend).layout(topk_idx, cfg)


# ----------------------------------------------------------------------------- dispatch

def _dispatch_impl(x, topk_idx, topk_weights, cfg: Cfg):
    return backends.get(cfg.backend).dispatch(x, topk_idx, topk_weights, cfg)


def _dispatch_fwd(x, topk_idx, topk_weights, cfg):
    out = _dispatch_impl(x, topk_idx, topk_weights, cfg)
    return out, (out[1], out[3])


def dispatch_transpose(combine_fn, recv_idx, cts):
    """Cotangents (x, topk_idx, topk_weights) of dispatch from those of its outputs, for
    a `combine_fn(rows) -> tokens` bound to the dispatch's handle (per shard or global)."""
    d_recv_x, _, d_recv_w, _ = cts
    d_x = combine_fn(d_recv_x)
    # Each slot's weight lives on exactly one rank: masking the others and summing over
    # ranks returns the owner's cotangent exactly (zero where dropped). The two combines
    # are independent: chain them so they never run at once (they share transport state).
    d_w = combine_fn(after(d_x, jnp.where(recv_idx >= 0, d_recv_w, 0.0)))
    return d_x, None, d_w


def _dispatch_bwd(cfg, res, cts):
    recv_idx, handle = res
    return dispatch_transpose(
        lambda v: _combine_impl(v, handle, cfg.backend, cfg.group_axes), recv_idx, cts)


_dispatch = jax.custom_vjp(_dispatch_impl, nondiff_argnums=(3,))
_dispatch.defvjp(_dispatch_fwd, _dispatch_bwd)


def dispatch(x, topk_idx, topk_weights, *, num_experts: int, axis_name, capacity=None,
             backend=None):
    """Sends each token to the ranks that hold its top-k experts (inside shard_map).

    Args:
      x: [T, H] float32, bfloat16 or float16.
      topk_idx: [T, K] int32 expert ids in [-1, E); -1 is an unused slot.
      topk_weights: [T, K] float32.
      num_experts: E, a multiple of the EP axis size R.
      axis_name: the EP mesh axis (or tuple of axes).
      capacity: C, rows received per rank (default R * T, which never overflows).
      backend: 'reference', 'ffi', 'internode' or None/'auto'. On GPUs with NVSHMEM
        started in this process (jax_ep.nvshmem_bootstrap) and several processes, 'auto'
        and 'ffi' resolve to 'internode'.

    Returns:
      recv_x [C, H] (x's dtype), recv_topk_idx [C, K] int32 (local expert ids, -1 where
      the expert is elsewhere or the row is empty), recv_topk_weights [C, K] float32, and a
      DispatchHandle. Rows are ordered by source rank, then source token; rows past
      capacity are dropped (counted in handle.num_dropped).
    """
    x = jnp.asarray(x)
    topk_idx = jnp.asarray(topk_idx)
    topk_weights = jnp.asarray(topk_weights)
    _check_tokens("x", x)
    num_experts = _static_int("num_experts", num_experts, 1)
    R = ep_size(axis_name)
    _check_routing(topk_idx, topk_weights, x.shape[0], num_experts, R)
    C = R * x.shape[0] if capacity is None else _static_int("capacity", capacity, 1)
    cfg = Cfg(num_experts, R, C, axis_name, resolve_backend(backend))
    return _dispatch(x, topk_idx, topk_weights, cfg)


# ----------------------------------------------------------------------------- combine

def _combine_impl(y, handle, backend, group_axes=None):
    return backends.get(backend).combine(y, handle, Cfg.for_handle(handle, backend, group_axes))


def _gather_impl(g, handle, backend, group_axes=None):
    return backends.get(backend).gather(g, handle, Cfg.for_handle(handle, backend, group_axes))


def _combine_fwd(y, handle, backend):
    return _combine_impl(y, handle, backend), handle


def _combine_bwd(backend, handle, d_out):
    dy = _gather_impl(d_out, handle, backend)
    zeros = jax.tree.map(lambda a: np.zeros(a.shape, jax.dtypes.float0), handle)
    return dy, zeros


def _combine_primal(y, handle, backend):
    # Exactly the fwd's arguments: custom_vjp fills in defaulted parameters of the primal
    # (like _combine_impl's group_axes) and would pass them on to _combine_fwd.
    return _combine_impl(y, handle, backend)


_combine = jax.custom_vjp(_combine_primal, nondiff_argnums=(2,))
_combine.defvjp(_combine_fwd, _combine_bwd)


def combine(y, handle: DispatchHandle, *, backend=None):
    """Sums expert outputs back onto the ranks their tokens came from (inside shard_map).

    Args:
      y: [C, H] float32, bfloat16 or float16; row i belongs to the handle's row i. Rows
        past handle.num_recv are ignored.
      handle: the DispatchHandle from `dispatch`.
    Returns:
      out [T, H] in y's dtype: for each token, the float32 sum in ascending rank order of
      the rows that ranks kept for it; zero for tokens sent nowhere.
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
    return _combine(y, handle, resolve_backend(backend))
