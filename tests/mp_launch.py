"""The multi-process tests' launcher (jax_ep._src.launch: one shared deadline, hung processes
killed and reported, log tails) and their workers' environment."""
from __future__ import annotations

from jax_ep._src.launch import free_port, process_env, run_workers  # noqa: F401  (re-exported)


def worker_env(timeout_s: str = "30", **extra) -> dict:
    """This process's environment for a worker (jax_ep._src.launch.process_env) with the
    kernels' timeout."""
    return process_env(JAX_EP_TIMEOUT_S=timeout_s, **extra)
