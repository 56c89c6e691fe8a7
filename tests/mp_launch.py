"""Starts the worker processes of a multi-process test on this machine and collects
them: every process is waited for up to one shared deadline, the ones still running are
killed (reported as hung, never waited on forever), and the tail of each log is returned."""
from __future__ import annotations

import os
import socket
import subprocess
import time


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def worker_env(timeout_s: str = "30", **extra) -> dict:
    """This process's environment without the CPU device count or a platform pin, with
    the kernels' timeout, no GPU memory preallocation and unbuffered output."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env.update(JAX_EP_TIMEOUT_S=timeout_s, XLA_PYTHON_CLIENT_PREALLOCATE="false",
               PYTHONUNBUFFERED="1", **extra)
    return env


def run_workers(tmp_path, argvs, env, deadline_s: float, tail: int = 3000):
    """Runs one process per argv; returns (procs, indices of the hung ones, the last
    `tail` characters of each log)."""
    procs, logs = [], []
    for pid, argv in enumerate(argvs):
        log = open(tmp_path / f"proc{pid}.log", "w+")
        logs.append(log)
        procs.append(subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + deadline_s
    for p in procs:
        try:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    hung = [i for i, p in enumerate(procs) if p.poll() is None]
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    text = []
    for pid, log in enumerate(logs):
        log.seek(0)
        text.append(f"--- process {pid} (rc {procs[pid].returncode}) ---\n{log.read()[-tail:]}")
        log.close()
    return procs, hung, "\n".join(text)
