"""Running the communicating EP custom calls on XLA's collective stream.

`on_collective_stream(call)` wraps one custom call (a `jax.ffi.ffi_call` result) in JAX's
region form of `compute_on("gpu_stream:collective")`: the call is traced into its own
non-inlinable computation whose call site carries `_xla_stream_annotation = "collective"`.
XLA:GPU then wraps that computation in an async start/done pair on the collective
stream and schedules it as it schedules its own collectives, so compute that does not
depend on it can run meanwhile. Only the custom call is inside the region: the operand
preparation and everything the caller computes (expert matmuls) stay on the compute
stream.

The region form is `jax.experimental.compute_on.compute_on2` in JAX 0.10 and
`compute_on(f, *, compute_type, out_memory_spaces)` in later JAX; with neither (older
JAX), the call is returned unwrapped. See `jax_ep.config` for the setting.

The default setting, "auto", decides by the platform the program is lowered for, not by
the host: the call is traced once into a small primitive (`gpu_region_p`) whose lowering
rule for cuda and rocm emits the region and whose rule for every other platform emits the
call inline, as if there were no region. So `jax.export(..., platforms=["cuda"])` on a
CPU host carries the annotation, and a program lowered for CPU has none (and no wrapper).

The global view (`jax_ep.sharded`) puts the region around its `custom_partitioning` op
instead: the region's call survives SPMD partitioning with its annotation and holds the
partitioned body (the EP call and its few per-shard index computations). Inside the
body, traced by the partitioner, the calls are left plain: a region there would mark
its results with `annotate_device_placement` custom calls, which XLA converts only
before partitioning, and the compile would fail.
"""
from __future__ import annotations

import functools
import inspect
import threading
import warnings

import jax
from jax.extend import core as jex_core
from jax.interpreters import mlir

from jax_ep import config

COMPUTE_TYPE = "gpu_stream:collective"
# What XLA reads from the region's call site (the part after "gpu_stream:").
ANNOTATION = "collective"


@functools.cache
def region_compute_on():
    """JAX's region form of compute_on (a transform taking a function, `compute_type`
    and `out_memory_spaces`), or None where the installed JAX lacks it."""
    try:
        from jax.experimental import compute_on as mod
    except ImportError:
        return None
    for name in ("compute_on2", "compute_on"):
        fn = getattr(mod, name, None)
        if fn is None:
            continue
        try:
            params = inspect.signature(fn).parameters
        except (TypeError, ValueError):
            continue
        # The region form takes keyword-only arguments; the older context manager of the
        # same name takes compute_type positionally.
        ct = params.get("compute_type")
        if ct is not None and ct.kind is inspect.Parameter.KEYWORD_ONLY:
            return fn
    return None


def _region_kwargs(fn) -> dict:
    kw = {"compute_type": COMPUTE_TYPE}
    if "out_memory_spaces" in inspect.signature(fn).parameters:
        kw["out_memory_spaces"] = _device_space()
    return kw


def _device_space():
    space = getattr(getattr(jax, "memory", None), "Space", None)
    return None if space is None else space.Device


@functools.cache
def _warn_unavailable():
    warnings.warn(
        "jax_ep.config.collective_stream is True but this JAX "
        f"({jax.__version__}) has no region form of compute_on: the EP custom calls run "
        "on XLA's compute stream", RuntimeWarning, stacklevel=3)


# The GPU platforms (as lowering names them) whose programs get the region under "auto".
GPU_PLATFORMS = ("cuda", "rocm")


def mode() -> str | None:
    """How the calls traced now are wrapped (see jax_ep.config.collective_stream): None
    (plain), "always" (in a region, whatever the platform) or "gpu" (in a region where
    the program is lowered for a GPU platform, plain elsewhere)."""
    setting = config.collective_stream
    if setting is False:
        return None
    if region_compute_on() is None or _device_space() is None:
        if setting is True:
            _warn_unavailable()
        return None
    return "always" if setting is True else "gpu"


def active() -> bool:
    """Whether the calls traced now may go on the collective stream (for "auto": where
    lowered for a GPU)."""
    return mode() is not None


_partition_body = threading.local()


def partitioned_body(body):
    """Marks `body` (a global-view op's per-shard function, traced by the partitioner
    inside the region `region` put around the op): EP calls traced in it stay plain."""

    @functools.wraps(body)
    def wrapped(*args):
        before = getattr(_partition_body, "on", False)
        _partition_body.on = True
        try:
            return body(*args)
        finally:
            _partition_body.on = before

    return wrapped


def region(fn):
    """`fn` (arrays -> array or tuple of arrays), run inside a collective-stream region
    when `active()` at trace time; otherwise `fn` itself."""

    @functools.wraps(fn)
    def wrapped(*args):
        how = mode()
        if how is None:
            return fn(*args)
        if how == "always":
            form = region_compute_on()
            return form(fn, **_region_kwargs(form))(*args)
        return _gpu_region(fn, args)  # "auto": the lowering platform decides

    return wrapped


# ----------------------------------------------------------------------------- "auto"
# gpu_region_p(*args, jaxpr): `jaxpr` (fn traced on args) in a collective-stream region
# where lowered for a GPU platform, inline elsewhere.

gpu_region_p = jex_core.Primitive("jax_ep_gpu_collective_region")
gpu_region_p.multiple_results = True


def _gpu_region(fn, args):
    from jax._src import api_util, core as jcore, linear_util as lu
    from jax._src.interpreters import partial_eval as pe
    leaves, in_tree = jax.tree.flatten(args)
    out_tree = []

    def flat(*xs):
        out = fn(*jax.tree.unflatten(in_tree, xs))
        outs, tree = jax.tree.flatten(out)
        out_tree.append(tree)
        return outs

    avals = [jcore.typeof(x) for x in leaves]
    jaxpr, _, consts = pe.trace_to_jaxpr_dynamic(
        lu.wrap_init(flat, debug_info=api_util.debug_info("jax_ep region", fn, args, {})),
        avals)
    closed = jex_core.ClosedJaxpr(jaxpr, consts)
    outs = gpu_region_p.bind(*leaves, jaxpr=closed)
    return jax.tree.unflatten(out_tree[0], outs)


def _gpu_region_abstract_eval(*avals, jaxpr):
    return jaxpr.out_avals, jaxpr.effects


def _gpu_region_impl(*args, jaxpr):
    return jex_core.jaxpr_as_fun(jaxpr)(*args)


def _plain_lowering(ctx, *args, jaxpr):
    return mlir.lower_fun(jex_core.jaxpr_as_fun(jaxpr), multiple_results=True)(ctx, *args)


def _region_lowering(ctx, *args, jaxpr):
    form = region_compute_on()
    body = jex_core.jaxpr_as_fun(jaxpr)

    def in_region(*xs):
        out = form(lambda *a: tuple(body(*a)), **_region_kwargs(form))(*xs)
        return list(out)

    return mlir.lower_fun(in_region, multiple_results=True)(ctx, *args)


gpu_region_p.def_effectful_abstract_eval(_gpu_region_abstract_eval)
gpu_region_p.def_impl(_gpu_region_impl)
mlir.register_lowering(gpu_region_p, _plain_lowering)
for _p in GPU_PLATFORMS:
    mlir.register_lowering(gpu_region_p, _region_lowering, platform=_p)


def on_collective_stream(call):
    """`call(*arrays, **static_attrs)` (an ffi_call), run inside a collective-stream
    region when `active()` at trace time (and not in a partitioned body); otherwise
    `call` itself."""

    @functools.wraps(call)
    def wrapped(*args, **attrs):
        if getattr(_partition_body, "on", False):
            return call(*args, **attrs)
        return region(lambda *a: call(*a, **attrs))(*args)

    return wrapped
