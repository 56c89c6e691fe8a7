"""Start-up shared by the multi-process test workers: this process's CPU devices, gloo
collectives and `jax.distributed` (before JAX creates its CPU client)."""
from __future__ import annotations

import os


def start(pid: int, nproc: int, port: int, devices: int):
    """Joins the job as process `pid` of `nproc` (coordinator localhost:`port`) with
    `devices` CPU devices; returns the jax module."""
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"localhost:{port}",
                               num_processes=nproc, process_id=pid,
                               initialization_timeout=60)
    return jax
