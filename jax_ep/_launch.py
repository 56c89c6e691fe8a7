"""Starting local processes and collecting them: every process is waited for up to one
shared deadline, the ones still running are killed (reported as hung, never waited on
forever), and the tail of each log is returned. Used by the multi-process benchmark
(jax_ep.bench_launch) and the multi-process tests."""
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
