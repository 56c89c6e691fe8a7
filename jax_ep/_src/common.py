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

from jax_ep._src import ext as _ext
from jax_ep._src import ordering as _order

from jax_ep._src import stream as _stream

FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))

# Call-site ids. Every rank must give the same EP call the same id (the kernels compare
# them to catch ranks in different calls), and the EP calls of one traced function get
# distinct ids (the CPU rendezvous meets on them). A process-wide counter breaks the first
# rule as soon as one process traces an extra EP function (an evaluation on rank 0 only),
# so the id is derived from what every process shares for the same program point:
#  - the scope: the innermost user function JAX itself called to trace it (a jit,
#    shard_map, checkpoint or scan body). JAX caches a traced body by function and
#    types, so a body reused from an earlier trace keeps ids that depend on the body
#    alone. Module methods Flax calls inside it are sub-scopes, numbered in order of
#    appearance, so the layers of one model differ;
#  - the op's position among the EP calls of that scope;
#  - the op's kind and operand types (the body JAX traces it in) and `static`.
_SITE_SPACE = (1 << 31) - 1  # ids in [1, 2^31): the internode header carries 32 bits
_SITE_INFO_MAX = 4096
_site_info: dict[int, str] = {}
_scopes: dict[int, dict] = {}  # id(frame) -> {"frame", "calls", "children", "path", "used"}
_trace_scopes: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # trace -> scope
_HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the jax_ep package
_JAX_DIRS = (f"{os.sep}jax{os.sep}", f"{os.sep}jaxlib{os.sep}")
_LIB_DIRS = _JAX_DIRS + (f"{os.sep}flax{os.sep}",)


def _where(frame) -> str:
    return os.path.abspath(frame.f_code.co_filename)


def _is_lib(path: str) -> bool:
    return path.startswith(_HERE) or any(d in path for d in _LIB_DIRS)


def _code_key(frame) -> str:
    c = frame.f_code
    return f"{getattr(c, 'co_qualname', c.co_name)}@{os.path.basename(c.co_filename)}:" \
           f"{c.co_firstlineno}"


def _scope_of_caller():
    """The scope state of the EP call being traced (see above), or None outside one."""
    frames = []
    f = sys._getframe(2)
    while f is not None:
        frames.append(f)
        f = f.f_back
    frames.reverse()  # outermost first
    live = {id(f) for f in frames}
    for k in [k for k in _scopes if k not in live]:  # scopes whose trace has finished
        del _scopes[k]
    scope = None
    for caller, fr in zip(frames, frames[1:]):
        path, cpath = _where(fr), _where(caller)
        if _is_lib(path) or not _is_lib(cpath):
            continue
        st = _scopes.get(id(fr))
        if st is None or st["frame"] is not fr:
            if any(d in cpath for d in _JAX_DIRS) or scope is None:
                spath = (_code_key(fr),)  # a body JAX traced (and may cache): a root
            else:
                spath = scope["path"] + ((_code_key(fr), scope["children"]),)
                scope["children"] += 1
            st = {"frame": fr, "calls": 0, "children": 0, "path": spath, "used": set()}
            _scopes[id(fr)] = st
        scope = st
    return scope


def _innermost_trace():
    """The innermost function JAX is tracing (its trace object), None outside tracing."""
    from jax._src import core
    try:
        stack = core.unsafe_get_trace_stack(core.trace_ctx.trace)
    except Exception:  # noqa: BLE001 - a JAX without these internals
        return None
    traces = [t for t in stack if hasattr(t, "frame")]
    return traces[-1] if traces else None


def _op_key(trace, types: bool = True) -> str:
    """The function JAX is tracing the op in (jax_ep's own custom_vjp body: the op kind,
    or the body a backward pass is traced into) and, with `types`, its operand types."""
    if trace is None:
        return "<eager>"
    frame = trace.frame
    src = str(getattr(getattr(frame, "debug_info", None), "func_src_info", None) or "?")
    name, _, where = src.rpartition(" at ")  # the directory may differ between hosts
    src = f"{name} at {os.path.basename(where)}" if name else os.path.basename(src)
    if not types:
        return f"{src}(...)"
    avals = ",".join(str(getattr(v, "aval", "?")) for v in getattr(frame, "invars", ()))
    return f"{src}({avals})"


def next_call_site(*static, types: bool = True) -> int:
    """The call-site id of the EP call being traced: the same on every process for the
    same program point, distinct for the EP calls of one traced function (see above).
    `static`: more of the call's static configuration to hash in; its repr must not
    depend on the process. `types=False` leaves the operand types out, so a process
    that calls the same program point with other shapes gets the same id (the
    multi-process arrival barrier, jax_ep/_src/arrival.py, then names the difference)."""
    scope = _scope_of_caller()
    trace = _innermost_trace()
    op = _op_key(trace, types)
    if scope is None and trace is not None:
        # No user function on the stack (a backward pass JAX traces after the forward
        # function returned): the body JAX is tracing the calls into is the scope.
        scope = _trace_scopes.get(trace)
        if scope is None:
            scope = {"calls": 0, "path": (op,), "used": set()}
            _trace_scopes[trace] = scope
    if scope is None:  # an eager call: a program of its own
        spath, pos, used = ("<eager>",), 0, set()
    else:
        spath, pos, used = scope["path"], scope["calls"], scope["used"]
        scope["calls"] += 1
    salt = 0
    while True:
        text = repr((spath, pos, op, tuple(repr(s) for s in static), salt)).encode()
        site = 1 + int.from_bytes(hashlib.sha256(text).digest()[:8], "little") % (
            _SITE_SPACE - 1)
        if site not in used:  # never one id for two calls of one scope
            break
        salt += 1
    used.add(site)
    if len(_site_info) >= _SITE_INFO_MAX:
        _site_info.pop(next(iter(_site_info)))
    where = " > ".join(p.split("(")[0] if isinstance(p, str) else f"{p[0]}[{p[1]}]"
                       for p in spath)
    _site_info[site] = f"EP call #{pos} of {where} ({op.split('(')[0]})"
    return site


def call_site_info(site: int) -> str | None:
    """Where this process traced the EP call with this call-site id, or None."""
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
    that jax-ep itself emits are chained with `after`; every call is also chained after
    the EP call traced before it (`jax_ep._src.ordering`: values through optimization
    barriers; a nested body's first call after the enclosing trace's last one). The
    calls are deliberately not marked side-effecting: JAX
    refuses side-effecting calls under `jax.checkpoint` (remat), which MoE training needs.
    Stream: on GPU each call runs in a region on XLA's collective stream
    (`jax_ep._src.stream`, setting `jax_ep.config.collective_stream`).

    Operands and attributes are given by name and put in the handler's order from its
    C++ signature table (`jax_ep._src.ext.ffi_call`): a name the target does not have, or
    one it needs left out, is a TypeError naming the target.
    """
    call = _order.ordered(_stream.on_collective_stream(
        _ext.ffi_call(target, results, vmap_method=vmap_method, bind=False)))

    def named_call(**named):
        operands, attrs = _ext.ffi_arguments(target, named)
        return call(*operands, **attrs)
    return named_call


def after(first, value):
    """`value`, made to depend on `first` (an array or pytree), so an EP call taking it
    cannot start before `first` exists: orders two otherwise independent EP calls."""
    _, value = jax.lax.optimization_barrier((first, value))
    return value


def like(a, shape, dtype):
    """The abstract value of an FFI result: `a`'s type (varying axes included) with
    another shape and dtype."""
    return jax.typeof(a).update(shape=tuple(shape), dtype=jnp.dtype(dtype), weak_type=False)


def concrete_mesh():
    """The concrete mesh in context (`jax.set_mesh(mesh)` or `with mesh:`), also inside
    jit; ValueError where there is none."""
    from jax._src import mesh as mesh_lib  # no public accessor works inside jit
    getter = getattr(mesh_lib, "get_concrete_mesh", None)
    mesh = getter() if getter is not None else None
    if mesh is None or mesh.empty:  # `with mesh:` (pre-set_mesh style)
        mesh = mesh_lib.thread_resources.env.physical_mesh
    if mesh is None or mesh.empty:
        raise ValueError("jax_ep.sharded needs a concrete mesh in context: use "
                         "`with jax.set_mesh(mesh):` or `with mesh:` around the call")
    return mesh
