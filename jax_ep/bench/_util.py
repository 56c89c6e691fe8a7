"""Pieces every benchmark (`jax_ep.bench`, `bench_layer`, `bench_low_latency`) uses: the
CPU device count, the host memcpy floor and a device copy floor."""
from __future__ import annotations

import os
import re
import statistics
import threading
import time


def set_host_device_count(n: int) -> None:
    """Asks XLA:CPU for at least `n` virtual devices (a count already in XLA_FLAGS that
    covers `n` is kept). Effective only before JAX's backends start (importing jax does
    not start them; the first device query does)."""
    flags = os.environ.get("XLA_FLAGS", "")
    pat = r"--xla_force_host_platform_device_count=(\d+)"
    m = re.search(pat, flags)
    flag = f"--xla_force_host_platform_device_count={n}"
    if m is None:
        os.environ["XLA_FLAGS"] = (flags + " " + flag).strip()
    elif int(m.group(1)) < n:
        os.environ["XLA_FLAGS"] = re.sub(pat, flag, flags)


def measure_memcpy(total_bytes: int, repeats: int = 5, threads=None) -> dict:
    """Copy bandwidth of this machine in GB/s (1e9 bytes copied per second) with
    numpy.copyto, for 1 thread and for `threads` threads (default: CPU count)."""
    import numpy as np

    ncpu = threads or os.cpu_count() or 1
    out = {}
    for nt in sorted({1, ncpu}):
        share = max(total_bytes // nt, 1 << 20)
        src = [np.ones(share, np.uint8) for _ in range(nt)]
        dst = [np.zeros(share, np.uint8) for _ in range(nt)]
        times = []
        for _ in range(repeats + 1):  # the first pass faults the pages in
            barrier = threading.Barrier(nt + 1)

            def work(i):
                barrier.wait()
                np.copyto(dst[i], src[i])
                barrier.wait()

            ts = [threading.Thread(target=work, args=(i,)) for i in range(nt)]
            for t in ts:
                t.start()
            barrier.wait()
            t0 = time.perf_counter()
            barrier.wait()
            times.append(time.perf_counter() - t0)
            for t in ts:
                t.join()
        out[nt] = share * nt / statistics.median(times[1:]) / 1e9
        del src, dst
    best = max(out.values())
    return {"GBps": best, "by_threads": {str(k): v for k, v in out.items()},
            "method": "numpy.copyto of uint8 buffers, 1 thread and one per CPU core; "
                      "bytes copied (counted once) per second; the faster is used",
            "bytes": int(total_bytes)}


def measure_device_copy(total_bytes: int, repeats: int = 5) -> dict:
    """Copy bandwidth of one device of JAX's default backend (for GPUs, where the host's
    memcpy is the wrong floor): a jitted reversal of a float32 array, which must read and
    write every byte; GB/s counts each copied byte once."""
    import jax
    import jax.numpy as jnp

    dev = jax.local_devices()[0]  # this process's (the first of several processes')
    n = max(total_bytes // 4, 1 << 18)
    x = jax.device_put(jnp.ones((n,), jnp.float32), dev)
    f = jax.jit(lambda a: a[::-1])
    jax.block_until_ready(f(x))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(f(x))
        times.append(time.perf_counter() - t0)
    gbps = 4 * n / statistics.median(times) / 1e9
    return {"GBps": gbps, "method": f"jitted reversal of a float32 array on {dev.platform} "
                                    f"device {dev.id}; bytes copied (counted once) per second",
            "bytes": int(4 * n)}
