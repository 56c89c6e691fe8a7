"""Helpers shared by the contract (`jax_ep.ops`) and the backends: mesh-axis names and
coordinates, varying-axes bookkeeping for FFI results, abstract shapes, and the static
configuration every backend function takes.
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import jax
import jax.numpy as jnp

FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))

# Every traced communicating call gets its own id, so two call sites (or two programs)
# running at once never meet in the CPU rendezvous.
_call_sites = itertools.count(1)


def next_call_site() -> int:
    return next(_call_sites)


@dataclasses.dataclass(frozen=True)
class Cfg:
    """Static configuration of one op call, the same object for every backend.

    num_experts: E; num_ranks: R (size of the EP axis); capacity: C rows received per
    rank (None for layout); axis_name: the EP mesh axis (None for layout); backend: the
    resolved backend name; group_axes: ((name, size), ...) of the other manual mesh axes,
    None for "those in context"; check_ids: whether the reference backend checks ids on
    the host inside the op (the global view checks them before partitioning instead).
    """

    num_experts: int
    num_ranks: int
    capacity: Any = None
    axis_name: Any = None
    backend: str = "reference"
    group_axes: Any = None
    check_ids: bool = True

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.num_ranks

    @classmethod
    def for_handle(cls, handle, backend: str, group_axes=None) -> "Cfg":
        """The configuration of the dispatch that made `handle` (for combine/gather)."""
        return cls(handle.num_experts, handle.num_ranks, handle.capacity, handle.axis_name,
                   backend, group_axes)


def axis_names(axis_name) -> tuple:
    if isinstance(axis_name, (tuple, list)):
        return tuple(axis_name)
    return (axis_name,)


def ep_size(axis_name) -> int:
    try:
        return int(jax.lax.axis_size(axis_names(axis_name)))
    except NameError as e:
        raise NameError(f"axis_name {axis_name!r} is not a bound mesh axis: call the op "
                        "inside shard_map over that axis, or use jax_ep.sharded") from e


def group_axes(axis_name) -> tuple:
    """((name, size), ...) of the manual mesh axes other than the EP axis."""
    names = axis_names(axis_name)
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty:
        return ()
    manual = getattr(mesh, "manual_axes", ())
    return tuple((a, int(mesh.shape[a])) for a in mesh.axis_names
                 if a not in names and a in manual)


def ep_coords(axis_name, groups=None):
    """(rank on the EP axis, EP group id) as int32 scalars. The group numbers the other
    mesh axes, so each data-parallel replica meets only its own peers."""
    names = axis_names(axis_name)
    rank = jax.lax.axis_index(names).astype(jnp.int32)
    if groups is None:
        groups = group_axes(axis_name)
    group = jnp.zeros((), jnp.int32)
    for a, size in groups:
        group = group * size + jax.lax.axis_index(a).astype(jnp.int32)
    return rank, group


def varying_axes(a) -> frozenset:
    t = jax.typeof(a)
    mat = getattr(t, "manual_axis_type", None)
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(t, "vma", frozenset()) or ())


def unify_varying(*arrays):
    """Marks every array varying over the union of their manual axes, so FFI results
    typed after the first one carry the right varying-axis set."""
    union = frozenset().union(*(varying_axes(a) for a in arrays))
    out = []
    for a in arrays:
        missing = tuple(sorted(union - varying_axes(a)))
        out.append(jax.lax.pcast(a, missing, to="varying") if missing else a)
    return out


def ep_call(target: str, results, *, vmap_method: str = "sequential"):
    """`jax.ffi.ffi_call` for every communicating EP custom call.

    Ordering: every call carries a unique `call_site` attribute, so XLA cannot merge
    (CSE) two of them; calls with a data dependency run in order, and independent calls
    that jax-ep itself emits are chained with `after`. The calls are deliberately not
    marked side-effecting: JAX refuses side-effecting calls under `jax.checkpoint`
    (remat), which MoE training needs. XLA compiles one program for every rank, so an
    unused call is dropped on all ranks alike and ranks never disagree on the order.
    """
    return jax.ffi.ffi_call(target, results, vmap_method=vmap_method)


def after(first, value):
    """`value`, made to depend on `first` (an array or pytree), so an EP call taking it
    cannot start before `first` exists: orders two otherwise independent EP calls."""
    _, value = jax.lax.optimization_barrier((first, value))
    return value


def like(a, shape, dtype):
    """The abstract value of an FFI result: `a`'s type (varying axes included) with
    another shape and dtype."""
    return jax.typeof(a).update(shape=tuple(shape), dtype=jnp.dtype(dtype), weak_type=False)
