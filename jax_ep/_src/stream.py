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


def active() -> bool:
    """Whether the calls traced now go on the collective stream (see jax_ep.config)."""
    setting = config.collective_stream
    if setting is False:
        return False
    if setting == "auto" and jax.default_backend() != "gpu":
        return False
    if region_compute_on() is None or _device_space() is None:
        if setting is True:
            _warn_unavailable()
        return False
    return True


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
        if not active():
            return fn(*args)
        form = region_compute_on()
        return form(fn, **_region_kwargs(form))(*args)

    return wrapped


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
