"""Helpers shared by the contract (`jax_ep.ops`) and the backends: mesh-axis names and
coordinates, varying-axes bookkeeping for FFI results, abstract shapes, and the static
configuration every backend function takes.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import sys
import weakref
from typing import Any

import jax
import jax.numpy as jnp

from jax_ep import _stream

FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))

# Call-site ids. Every rank must give the same EP call the same id (the kernels compare
# them to catch ranks in different calls), and one program must not reuse an id for two
# calls (the CPU rendezvous meets on it). A process-wide counter breaks the first rule as
# soon as one process traces an extra EP function (an evaluation on rank 0 only), so the
# id is derived from what every process shares for the same program point: the function
# being traced (its name, source line and input types; that is what JAX caches a traced
# function by), the op's position among the EP calls traced in it, and the op's static
# configuration.
_SITE_SPACE = (1 << 31) - 1  # ids in [1, 2^31): the internode header carries 32 bits
_site_positions: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_site_info: dict[int, str] = {}
_SITE_INFO_MAX = 4096


def _tracing_frame():
    """The innermost function being traced (jit, shard_map body, checkpoint, ...): its
    trace object, or None outside tracing."""
    from jax._src import core
    try:
        stack = core.unsafe_get_trace_stack(core.trace_ctx.trace)
    except Exception:  # noqa: BLE001 - a JAX without these internals: no shared frame
        return None
    frames = [t for t in stack if hasattr(t, "frame")]
    return frames[-1] if frames else None


def _function_key(trace) -> str:
    if trace is None:
        return "<eager>"
    frame = trace.frame
    info = getattr(frame, "debug_info", None)
    src = str(getattr(info, "func_src_info", None) or "?")
    # the directory may differ between hosts; the file's name and line do not
    name, _, where = src.rpartition(" at ")
    src = f"{name} at {os.path.basename(where)}" if name else os.path.basename(src)
    avals = ",".join(str(getattr(v, "aval", "?")) for v in getattr(frame, "invars", ()))
    return f"{src}({avals})"


def _user_location() -> str:
    """file:line of the nearest caller outside jax_ep and jax (for messages only)."""
    here = os.path.dirname(os.path.abspath(__file__))
    f = sys._getframe(2)
    while f is not None:
        fn = os.path.abspath(f.f_code.co_filename)
        if not fn.startswith(here) and f"{os.sep}jax{os.sep}" not in fn and \
                f"{os.sep}jaxlib{os.sep}" not in fn and "flax" not in fn:
            return f"{os.path.basename(fn)}:{f.f_lineno}"
        f = f.f_back
    return "?"


def next_call_site(*static) -> int:
    """The call-site id of the EP call being traced: the same on every process for the
    same program point, distinct for the EP calls of one traced function. `static`: the
    call's static configuration (target name, Cfg, shapes), hashed into the id; its repr
    must not depend on the process."""
    trace = _tracing_frame()
    fkey = _function_key(trace)
    if trace is None:
        pos, used = 0, set()  # an eager call is a program of its own
    else:
        state = _site_positions.setdefault(trace, {"n": 0, "used": set()})
        pos, used = state["n"], state["used"]
        state["n"] += 1
    salt = 0
    while True:
        text = repr((fkey, pos, tuple(repr(s) for s in static), salt)).encode()
        site = 1 + int.from_bytes(hashlib.sha256(text).digest()[:8], "little") % (
            _SITE_SPACE - 1)
        if site not in used:  # never two calls of one function with one id
            break
        salt += 1
    used.add(site)
    if len(_site_info) >= _SITE_INFO_MAX:
        _site_info.pop(next(iter(_site_info)))
    _site_info[site] = (f"EP call #{pos} of {fkey.split('(')[0]} "
                        f"(called from {_user_location()})")
    return site


def call_site_info(site: int) -> str | None:
    """Where the EP call with this call-site id was traced in this process, or None."""
    return _site_info.get(int(site))


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
    Stream: on GPU each call runs in a region on XLA's collective stream
    (`jax_ep._stream`, setting `jax_ep.config.collective_stream`).
    """
    return _stream.on_collective_stream(
        jax.ffi.ffi_call(target, results, vmap_method=vmap_method))


def after(first, value):
    """`value`, made to depend on `first` (an array or pytree), so an EP call taking it
    cannot start before `first` exists: orders two otherwise independent EP calls."""
    _, value = jax.lax.optimization_barrier((first, value))
    return value


def like(a, shape, dtype):
    """The abstract value of an FFI result: `a`'s type (varying axes included) with
    another shape and dtype."""
    return jax.typeof(a).update(shape=tuple(shape), dtype=jnp.dtype(dtype), weak_type=False)
