"""Starting local processes and collecting them: every process is waited for up to one
shared deadline, the ones still running are killed (reported as hung, never waited on
forever), and the tail of each log is returned. Used by the multi-process benchmark
(jax_ep.bench.launch) and the multi-process tests."""
from __future__ import annotations

import os
import socket
import subprocess
import time


def free_port() -> int:
    """A TCP port on localhost that was free a moment ago (for jax.distributed)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def run_workers(log_dir, argvs, env, deadline_s: float, tail: int = 3000):
    """Runs one process per argv (logs in log_dir/proc<i>.log); returns (procs, indices of
    the hung ones, the last `tail` characters of each log)."""
    log_dir = os.fspath(log_dir)
    procs, logs = [], []
    try:
        for pid, argv in enumerate(argvs):
            log = open(os.path.join(log_dir, f"proc{pid}.log"), "w+")
            logs.append(log)
            procs.append(subprocess.Popen(argv, env=env, stdout=log,
                                          stderr=subprocess.STDOUT))
        deadline = time.monotonic() + deadline_s
        for p in procs:
            try:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
    finally:  # also on KeyboardInterrupt: never leave a worker behind
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


def process_env(environ=None, **extra) -> dict:
    """The environment of a worker process: `environ` (default this one's) without the CPU
    device count or a platform pin (each worker sets its own), with unbuffered output and
    no GPU memory preallocation (processes may share a GPU), plus `extra`."""
    env = {k: v for k, v in (os.environ if environ is None else environ).items()
           if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env.update(PYTHONUNBUFFERED="1", XLA_PYTHON_CLIENT_PREALLOCATE="false", **extra)
    return env


def mps_share(env: dict, processes_per_gpu: int) -> dict:
    """`env` for processes sharing one GPU: CUDA_MPS_ACTIVE_THREAD_PERCENTAGE =
    100 // processes_per_gpu (unless set), so under MPS the shares add up to at most 100:
    kernels that wait for each other all stay resident, and NVSHMEM gives several PEs on
    one GPU full support only then. Without MPS the variable has no effect."""
    if processes_per_gpu < 1:
        raise ValueError(f"processes per GPU must be >= 1, got {processes_per_gpu}")
    env.setdefault("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", str(100 // processes_per_gpu))
    return env
