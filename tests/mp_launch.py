"""The multi-process tests' launcher (jax_ep._launch: one shared deadline, hung processes
killed and reported, log tails) and their workers' environment."""
from __future__ import annotations

import os

from jax_ep._launch import free_port, run_workers  # noqa: F401  (re-exported)


def worker_env(timeout_s: str = "30", **extra) -> dict:
    """This process's environment without the CPU device count or a platform pin, with
    the kernels' timeout, no GPU memory preallocation and unbuffered output."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env.update(JAX_EP_TIMEOUT_S=timeout_s, XLA_PYTHON_CLIENT_PREALLOCATE="false",
               PYTHONUNBUFFERED="1", **extra)
    return env
