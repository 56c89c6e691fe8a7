"""Sizing of XLA's CPU thread pool for the CPU transport.

XLA's CPU client runs every virtual device's program on one pool of
max(NPROC or the core count, number of devices) threads. An executing program holds its
thread until its custom calls finish, and an EP call finishes only once all R ranks have
reached it, so one round needs R pool threads at once. When many asynchronous calls are
in flight (a loop that never waits), XLA also parks a pool thread per device whose queue
of in-flight programs is full (32 by default) until one of them finishes. With a pool of
exactly one thread per device, one parked thread leaves a round without the thread its
last rank needs: nothing moves until JAX_EP_TIMEOUT_S fails the round. Twice as many
threads as devices always leaves R threads for the oldest round.

`install()` (called when jax_ep is imported) wraps JAX's CPU client factory so that, when
the client is created and NPROC is unset, NPROC is raised to 2 x the device count (never
lowered). It does nothing once the CPU client exists or when NPROC is set by the user;
`check()` then warns once if the pool is too small.
"""
from __future__ import annotations

import dataclasses
import os
import re
import warnings

_state = {"installed": False, "pool": None, "warned": False}


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _requested_devices() -> int:
    """The CPU device count JAX will ask for: jax_num_cpu_devices, else XLA_FLAGS."""
    try:
        from jax._src import xla_bridge
        n = int(xla_bridge.num_cpu_devices.value)
        if n >= 0:
            return n
    except Exception:  # pragma: no cover - private API moved
        pass
    m = re.search(r"--xla_force_host_platform_device_count=(\d+)",
                  os.environ.get("XLA_FLAGS", ""))
    return int(m.group(1)) if m else 1


def pool_threads(num_devices: int) -> int:
    """Threads XLA's CPU client gets for `num_devices` devices under the current env."""
    nproc = os.environ.get("NPROC")
    base = int(nproc) if nproc and nproc.strip().isdigit() else _cores()
    return max(base, num_devices)


def _size_pool():
    devices = _requested_devices()
    if "NPROC" not in os.environ and _cores() < 2 * devices:
        os.environ["NPROC"] = str(2 * devices)
    _state["pool"] = pool_threads(devices)


def install():
    """Wraps the CPU backend factory once (before the CPU client exists)."""
    if _state["installed"]:
        return
    _state["installed"] = True
    try:
        from jax._src import xla_bridge
        if xla_bridge.backends_are_initialized():
            return
        reg = xla_bridge._backend_factories.get("cpu")
        if reg is None:
            return
        original = reg.factory

        def factory(*args, **kwargs):
            _size_pool()
            return original(*args, **kwargs)

        xla_bridge._backend_factories["cpu"] = dataclasses.replace(reg, factory=factory)
    except Exception:  # pragma: no cover - private API moved: check() still warns
        return


def check(num_devices: int):
    """Warns once if XLA's CPU pool has fewer than 2 threads per device (set NPROC
    before JAX starts, or wait on results every few calls)."""
    pool = _state["pool"] if _state["pool"] is not None else pool_threads(num_devices)
    if pool >= 2 * num_devices or _state["warned"]:
        return
    _state["warned"] = True
    warnings.warn(
        f"jax_ep: XLA's CPU thread pool has {pool} threads for {num_devices} devices. "
        "Many EP calls in flight at once (a loop that never waits on results) can then "
        "stall until JAX_EP_TIMEOUT_S fails them. Set NPROC to at least "
        f"{2 * num_devices} before JAX creates its CPU client (jax_ep does this when it "
        "is imported first), or wait on results every few calls.", RuntimeWarning,
        stacklevel=3)
