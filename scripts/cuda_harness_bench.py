"""Times the CUDA kernels through the virtual-rank harness on one GPU and prints a
table: layout time, dispatch/combine bytes moved against a device-to-device copy timed in
the same run, and DeepEP-style logical bandwidth (received bytes / time).

    python scripts/cuda_harness_bench.py [--ranks 8 --tokens 4096 --hidden 7168 --topk 8
                                          --experts 256 --iters 20]

All R ranks run on one GPU, one after another, so a harness call moves every rank's
bytes through this GPU's memory; "bytes moved" counts every byte the kernels read and
write (rows pushed, staged rows read, outputs written, empty output rows zeroed).
"""
from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from jax_ep import cuda as jcuda
from jax_ep import ops


def _time(fn, *args, iters):
    out = fn(*args)
    jax.block_until_ready(out)
    for _ in range(2):
        jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    for _ in range(iters):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / iters, out


def _routing(R, T, K, E, seed=0):
    rng = np.random.default_rng(seed)
    # Distinct experts per token, uniform over E, like DeepEP's benchmark.
    keys = rng.random((R, T, E), dtype=np.float32)
    return np.argsort(keys, axis=-1)[..., :K].astype(np.int32)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--concurrent", action="store_true",
                   help="also time the concurrent mode (each rank on its own stream, small "
                        "grids: real waits, not a throughput setting)")
    p.add_argument("--json", default="", help="also write the results to this file")
    a = p.parse_args(argv)
    if not jcuda.available():
        raise SystemExit("no GPU (or a CPU-only build): nothing to time")
    R, T, H, K, E = a.ranks, a.tokens, a.hidden, a.topk, a.experts
    dt = jnp.bfloat16
    row = H * jnp.dtype(dt).itemsize
    C = R * T
    idx_np = _routing(R, T, K, E)
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((R, T, H), dtype=np.float32)).astype(dt)
    idx = jnp.asarray(idx_np)
    w = jnp.asarray(rng.random((R, T, K), dtype=np.float32))

    # Layout of one rank, 200 times in one program (the where keeps it in the loop).
    n_lay = 200

    @jax.jit
    def layout_loop(i):
        def body(_, c):
            ii = jnp.where(c < 0, -1, i)
            lay = ops.get_dispatch_layout(ii, num_experts=E, num_ranks=R, backend="ffi")
            return c + lay.num_tokens_per_rank[0]
        return jax.lax.fori_loop(0, n_lay, body, jnp.int32(0))

    t_layout, _ = _time(layout_loop, idx[0], iters=3)
    t_layout /= n_lay

    # Device-to-device copy reference: read and write `nbytes`.
    nbytes = 2 << 30
    buf = jnp.zeros((nbytes // 4,), jnp.uint32)
    copy = jax.jit(lambda b, s: b ^ s)
    t_copy, _ = _time(copy, buf, jnp.uint32(1), iters=a.iters)
    copy_bw = 2 * nbytes / t_copy
    del buf

    disp = jax.jit(lambda x, i, w: jcuda.harness_dispatch(x, i, w, num_experts=E, capacity=C))
    t_disp, d = _time(disp, x, idx, w, iters=a.iters)
    num_recv = np.asarray(d.num_recv).astype(np.int64)
    send_row = np.asarray(d.send_row)
    pairs = int((send_row >= 0).sum())          # (token, receiver) rows kept
    meta = K * 8 + 4                            # ids, weights, source token per row
    recv_rows = int(num_recv.sum())
    disp_bytes = (pairs * (2 * row + meta)       # push: read x row, write staged row
                  + recv_rows * (2 * row + 2 * meta)  # finish: read staged, write outputs
                  + (R * C - recv_rows) * (row + K * 8 + 8)  # zero / -1 fill of empty rows
                  + 2 * R * T * R * 4)           # send_row written and rewritten

    y = d.recv_x
    comb = jax.jit(jcuda.harness_combine)
    t_comb, _ = _time(comb, y, d.send_row, iters=a.iters)
    comb_bytes = (pairs * 2 * row                # push: read y row, write staged row
                  + pairs * row + R * T * row    # finish: read staged rows, write out
                  + 2 * R * T * R * 4)           # send_row read by plan and finish
    logical = recv_rows * row                    # DeepEP: received token bytes / time
    t_disp_c = t_comb_c = None
    if a.concurrent:
        disp_c = jax.jit(lambda x, i, w: jcuda.harness_dispatch(
            x, i, w, num_experts=E, capacity=C, concurrent=True))
        t_disp_c, dc = _time(disp_c, x, idx, w, iters=a.iters)
        same = all(np.array_equal(np.asarray(getattr(dc, f)), np.asarray(getattr(d, f)))
                   for f in ("recv_x", "src_rank", "src_index", "send_row"))
        comb_c = jax.jit(lambda y, s: jcuda.harness_combine(y, s, concurrent=True))
        t_comb_c, _ = _time(comb_c, y, d.send_row, iters=a.iters)
        jcuda.check_errors()

    res = dict(
        ranks=R, tokens=T, hidden=H, topk=K, experts=E, dtype="bfloat16", capacity=C,
        layout_us=t_layout * 1e6, copy_GBps=copy_bw / 1e9,
        dispatch_ms=t_disp * 1e3, dispatch_bytes_GBps=disp_bytes / t_disp / 1e9,
        combine_ms=t_comb * 1e3, combine_bytes_GBps=comb_bytes / t_comb / 1e9,
        dispatch_logical_GBps=logical / t_disp / 1e9,
        combine_logical_GBps=logical / t_comb / 1e9,
        received_rows=recv_rows, device=jax.devices("gpu")[0].device_kind)
    if a.concurrent:
        res.update(concurrent_dispatch_ms=t_disp_c * 1e3, concurrent_combine_ms=t_comb_c * 1e3,
                   concurrent_matches_sequential=bool(same))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    pct = lambda v: f"{100 * v / res['copy_GBps']:.0f}% of copy"  # noqa: E731
    rows = [
        ("layout (1 rank, T=%d, K=%d, E=%d)" % (T, K, E), f"{res['layout_us']:.1f} us", "< 20 us"),
        ("device-to-device copy", f"{res['copy_GBps']:.0f} GB/s", "reference"),
        ("dispatch, bytes moved", f"{res['dispatch_bytes_GBps']:.0f} GB/s ({pct(res['dispatch_bytes_GBps'])})", ">= 60% of copy"),
        ("combine, bytes moved", f"{res['combine_bytes_GBps']:.0f} GB/s ({pct(res['combine_bytes_GBps'])})", ">= 60% of copy"),
        ("dispatch, logical (DeepEP-style)", f"{res['dispatch_logical_GBps']:.0f} GB/s", "DeepEP EP8: 153"),
        ("combine, logical (DeepEP-style)", f"{res['combine_logical_GBps']:.0f} GB/s", "DeepEP EP8: 158"),
        ("dispatch / combine time (all %d ranks)" % R, f"{res['dispatch_ms']:.2f} / {res['combine_ms']:.2f} ms", ""),
    ]
    if a.concurrent:
        rows.append(("concurrent mode: dispatch / combine time",
                     f"{res['concurrent_dispatch_ms']:.2f} / {res['concurrent_combine_ms']:.2f} ms",
                     "bit-identical to phase by phase: "
                     + ("yes" if res["concurrent_matches_sequential"] else "NO")))
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    print(f"\nvirtual-rank harness on {res['device']}: {R} ranks x {T} tokens, hidden {H} bf16, "
          f"top-{K} of {E}")
    print(f"{'metric':<{w0}} | {'measured':<{w1}} | target")
    print(f"{'-' * w0}-+-{'-' * w1}-+-------")
    for r in rows:
        print(f"{r[0]:<{w0}} | {r[1]:<{w1}} | {r[2]}")


if __name__ == "__main__":
    main()
