"""A small run of the intranode kernels through the virtual-rank harness, for
compute-sanitizer (scripts/gpu_check.sh stage 5): dispatch, combine and gather for one
virtual rank by default, checked bit for bit against the NumPy model of the contract. Exit
code 0 only if every result matches and no device error was recorded.

One rank, because the tool serialises kernels: the harness's ranks each run on a stream of
their own and their channel kernels wait on each other, so under the tool a second rank's
kernels would wait for the first's to end, which waits for them (the kernels' timeout
ends it, with errors). No serial order can run them either (the harness refuses
concurrent=False). One rank still runs every kernel's code: its notify and channel
kernels, rings, credits and headers, with itself as the only peer.

    python scripts/gpu_sanitize_run.py [--ranks 1 --tokens 40 --hidden 72]
        [--dtypes float32,bfloat16] [--emulated]

--emulated runs the same calls and checks on the emulated GPU's harness (kernels/emu): the
code path of gpu_check.sh's stage 5 without the tool (`gpu_check.sh --emulated`).
"""
from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=1,
                   help="virtual ranks (more than 1 only without the sanitizer: see above)")
    p.add_argument("--tokens", type=int, default=40)
    p.add_argument("--hidden", type=int, default=72)
    p.add_argument("--dtypes", default="float32,bfloat16",
                   help="comma-separated: float32, bfloat16, float16")
    p.add_argument("--emulated", action="store_true",
                   help="the emulated GPU's harness instead of a GPU's")
    a = p.parse_args(argv)
    import jax.numpy as jnp
    import numpy as np

    from conftest import bits, np_gather, np_model  # NumPy model of the per-shard contract
    if a.ranks < 1:
        p.error(f"--ranks must be >= 1, got {a.ranks}")
    if a.emulated:
        from jax_ep._src.emu import Emulator

        emu = Emulator(1, seed=0)
        harness_dispatch, harness_combine, harness_gather = (
            emu.harness_dispatch, emu.harness_combine, emu.harness_gather)

        def check_errors():
            errs = emu.check_errors()
            if errs:
                raise RuntimeError("; ".join(errs))
    else:
        from jax_ep import cuda as jcuda

        if not jcuda.available():
            print("no GPU (or a CPU-only build): nothing to run")
            return 2
        harness_dispatch, harness_combine, harness_gather, check_errors = (
            jcuda.harness_dispatch, jcuda.harness_combine, jcuda.harness_gather,
            jcuda.check_errors)
    R, T, H, K, E = a.ranks, a.tokens, a.hidden, 3, 4 * a.ranks
    C = max(1, (R * T) // 2)  # below the worst case: some rows are dropped
    rng = np.random.default_rng(0)
    failures = []
    for dtype in [jnp.dtype(n) for n in a.dtypes.split(",")]:
        idx = rng.integers(-1, E, (R, T, K)).astype(np.int32)
        x = rng.standard_normal((R, T, H)).astype(np.float32).astype(dtype)
        w = rng.random((R, T, K)).astype(np.float32)
        y = rng.standard_normal((R, C, H)).astype(np.float32).astype(dtype)
        g = rng.standard_normal((R, T, H)).astype(np.float32).astype(dtype)
        want = np_model(x, idx, w, y, E, C)
        if a.emulated:
            d = harness_dispatch(x, idx, w, num_experts=E, capacity=C)
            send_row, src_rank, src_index = d["send_row"], d["src_rank"], d["src_index"]
            out = harness_combine(y, send_row)
            gat = harness_gather(g, src_rank, src_index)
            recv_x = d["recv_x"]
        else:
            d = harness_dispatch(jnp.asarray(x), jnp.asarray(idx), jnp.asarray(w),
                                 num_experts=E, capacity=C)
            send_row, src_rank, src_index, recv_x = d.send_row, d.src_rank, d.src_index, d.recv_x
            out = harness_combine(jnp.asarray(y), send_row)
            gat = harness_gather(jnp.asarray(g), src_rank, src_index)
        got = dict(recv_x=recv_x, src_rank=src_rank, src_index=src_index,
                   send_row=send_row, out=out)
        for k, v in got.items():
            if not np.array_equal(bits(np.asarray(v)), bits(want[k])):
                failures.append(f"{k} ({jnp.dtype(dtype).name})")
        gw = np_gather(g, np.asarray(src_rank), np.asarray(src_index))
        if not np.array_equal(bits(np.asarray(gat)), bits(gw)):
            failures.append(f"gather ({jnp.dtype(dtype).name})")
    try:
        check_errors()
    except RuntimeError as e:
        failures.append(f"device error: {e}")
    print("sanitizer harness run:", "OK" if not failures else "MISMATCH " + ", ".join(failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
