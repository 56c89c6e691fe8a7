"""Library-wide settings of jax-ep, read when an op is traced (so a change applies to the
programs traced after it, not to compiled ones).

  collective_stream: "auto" (default), True or False. Whether every communicating EP
    custom call (normal and low-latency, per shard and global view, forward and backward)
    is wrapped in a region on XLA's collective stream (JAX's region form of
    `compute_on("gpu_stream:collective")`), so XLA schedules it like its own collectives
    and can overlap it with compute. "auto": on when JAX's default backend is a GPU
    at trace time. True: on for every trace (to export a CUDA program from a CPU host,
    say). Where the installed JAX has no region form, the calls are left as they are
    (with a warning when the setting is True). Environment: JAX_EP_COLLECTIVE_STREAM
    (auto, 1/true/on, 0/false/off).

Use `jax_ep.config.update("collective_stream", False)`, or `with
jax_ep.config.override(collective_stream=True): ...` for a scope; read
`jax_ep.config.collective_stream`.
"""
from __future__ import annotations

import contextlib
import os

_TRUE = ("1", "true", "on", "yes")
_FALSE = ("0", "false", "off", "no")


def _collective_stream_value(value, source: str):
    if isinstance(value, str):
        v = value.strip().lower()
        if v == "auto":
            return "auto"
        if v in _TRUE:
            return True
        if v in _FALSE:
            return False
    elif isinstance(value, bool):
        return value
    raise ValueError(f"{source} must be 'auto', True or False, got {value!r}")


_CHECKS = {"collective_stream": _collective_stream_value}

collective_stream = _collective_stream_value(
    os.environ.get("JAX_EP_COLLECTIVE_STREAM", "auto"), "JAX_EP_COLLECTIVE_STREAM")


def _check(name: str, value):
    if name not in _CHECKS:
        raise AttributeError(f"jax_ep.config has no setting {name!r}; settings: "
                             f"{', '.join(sorted(_CHECKS))}")
    return _CHECKS[name](value, name)


def update(name: str, value) -> None:
    """Sets one setting for the traces that follow (process-wide)."""
    globals()[name] = _check(name, value)


@contextlib.contextmanager
def override(**settings):
    """Sets settings for the traces inside the block, then restores them."""
    checked = {k: _check(k, v) for k, v in settings.items()}
    before = {k: globals()[k] for k in checked}
    globals().update(checked)
    try:
        yield
    finally:
        globals().update(before)
