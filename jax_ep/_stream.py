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
"""
from __future__ import annotations

import functools
import inspect
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
        if "compute_type" in params and "out_memory_spaces" in params:
            return fn
    return None


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


def on_collective_stream(call):
    """`call(*arrays, **static_attrs)` (an ffi_call), run inside a collective-stream
    region when `active()` at trace time; otherwise `call` itself."""

    @functools.wraps(call)
    def wrapped(*args, **attrs):
        if not active():
            return call(*args, **attrs)
        region = region_compute_on()(
            lambda *a: call(*a, **attrs), compute_type=COMPUTE_TYPE,
            out_memory_spaces=_device_space())
        return region(*args)

    return wrapped
