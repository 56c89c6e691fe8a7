"""Host cost per step of the EP calls: `python -m jax_ep.bench --dispatch-overhead`.

Three jitted programs over the same mesh and shapes, at sizes where the devices' work is
small: `plain` (two pieces of elementwise work on the tokens, no EP call), `plain+order`
(the same two pieces chained as EP calls are, jax_ep/_src/ordering.py: the cost of the
order alone) and `ep` (dispatch then combine, the default backend). Each run calls one program `--calls` times back to back
without waiting (the host's enqueue time per call) and then waits for the last result
(the time per step with the devices' work); runs of the two alternate, and the medians of
`--runs` runs are reported, with the EP program's extra host time per step and per EP
call, and the Python function calls one call of each makes (a handful where JAX takes its
C++ fast path, hundreds on its Python path: a count, not a time). On CPU the devices run
the program while it is enqueued, so there enqueue time includes the work. A measurement
of this machine's host, not of any GPU.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def _programs(mesh, T, H, K, E, backend):
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    import jax_ep
    from jax_ep._src import ordering as _order

    def work(x, idx, w):
        s = jnp.sum(w, axis=1, keepdims=True) + jnp.sum(idx, axis=1, keepdims=True)
        return x * s.astype(x.dtype) + 1.0

    def plain(x, idx, w):
        return work(x, idx, w) + work(x * 2, idx, w)

    def chained(x, idx, w):
        step = _order.ordered(work)
        return step(x, idx, w) + step(x * 2, idx, w)

    def ep(x, idx, w):
        rx, _, _, h = jax_ep.dispatch(x, idx, w, num_experts=E, axis_name="ep",
                                      capacity=T * K, backend=backend)
        return jax_ep.combine(rx, h, backend=backend)

    def wrap(f):
        return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))

    return {"plain": wrap(plain), "plain+order": wrap(chained), "ep": wrap(ep)}


def _time(f, args, calls):
    import jax
    t0 = time.perf_counter()
    out = None
    for _ in range(calls):
        out = f(*args)
    t1 = time.perf_counter()
    jax.block_until_ready(out)
    t2 = time.perf_counter()
    return (t1 - t0) / calls * 1e6, (t2 - t0) / calls * 1e6


def _python_calls(f, args) -> int:
    """Python function calls one call of `f` makes (0-few on JAX's C++ fast path, hundreds
    on its Python path): a count, independent of the machine's load."""
    import jax
    n = 0

    def prof(frame, event, arg):
        nonlocal n
        if event == "call":
            n += 1
    sys.setprofile(prof)
    try:
        out = f(*args)
    finally:
        sys.setprofile(None)
    jax.block_until_ready(out)
    return n


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m jax_ep.bench --dispatch-overhead",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=8, help="EP ranks = devices (default 8)")
    p.add_argument("--tokens", type=int, default=8, help="tokens per rank (default 8)")
    p.add_argument("--hidden", type=int, default=16)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--calls", type=int, default=200, help="calls per run (default 200)")
    p.add_argument("--runs", type=int, default=7, help="runs per program (default 7)")
    p.add_argument("--backend", default="auto")
    p.add_argument("--json", metavar="PATH")
    a = p.parse_args(argv)
    for name in ("ranks", "tokens", "hidden", "topk", "experts", "calls", "runs"):
        if getattr(a, name) < 1:
            p.error(f"--{name} must be >= 1")
    import jax
    import numpy as np

    import jax_ep
    if len(jax.devices()) < a.ranks:
        p.error(f"--ranks {a.ranks} needs as many devices, JAX has {len(jax.devices())} "
                f"(on CPU: XLA_FLAGS=--xla_force_host_platform_device_count={a.ranks})")
    if a.experts % a.ranks:
        p.error("--experts must be a multiple of --ranks")
    backend = jax_ep.resolve_backend(a.backend)
    mesh = jax.make_mesh((a.ranks,), ("ep",), devices=jax.devices()[:a.ranks],
                         axis_types=(jax.sharding.AxisType.Auto,))
    rng = np.random.default_rng(0)
    n = a.ranks * a.tokens
    x = rng.standard_normal((n, a.hidden)).astype(np.float32)
    idx = np.stack([rng.choice(a.experts, a.topk, replace=False) for _ in range(n)])
    w = rng.random((n, a.topk)).astype(np.float32)
    args = [jax.device_put(v, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(
        "ep"))) for v in (x, idx.astype(np.int32), w)]
    progs = _programs(mesh, a.tokens, a.hidden, a.topk, a.experts, backend)
    for f in progs.values():  # compile, then settle
        jax.block_until_ready(f(*args))
        _time(f, args, min(a.calls, 20))
    frames = {k: _python_calls(f, args) for k, f in progs.items()}
    runs = {k: [] for k in progs}
    for _ in range(a.runs):
        for k, f in progs.items():
            runs[k].append(_time(f, args, a.calls))
    med = {k: {"enqueue_us": statistics.median(r[0] for r in v),
               "step_us": statistics.median(r[1] for r in v)} for k, v in runs.items()}
    extra = med["ep"]["enqueue_us"] - med["plain"]["enqueue_us"]
    order = med["plain+order"]["enqueue_us"] - med["plain"]["enqueue_us"]
    res = {"backend": backend, "platform": jax.devices()[0].platform, "ranks": a.ranks,
           "tokens": a.tokens, "hidden": a.hidden, "calls": a.calls, "runs": a.runs,
           "jax": jax.__version__, "median": med, "ep_calls_per_step": 2,
           "python_calls_per_step": frames, "order_path_us_per_step": order,
           "extra_enqueue_us_per_step": extra, "extra_enqueue_us_per_call": extra / 2,
           "runs_us": {k: [list(r) for r in v] for k, v in runs.items()}}
    print(f"host cost per step, {a.ranks} {res['platform']} devices, backend {backend}, "
          f"T={a.tokens} H={a.hidden}; median of {a.runs} runs of {a.calls} calls")
    print(f"{'program':>11} | {'enqueue us/call':>15} | {'step us/call':>12} | "
          f"{'Python calls/call':>17}")
    for k, v in med.items():
        print(f"{k:>11} | {v['enqueue_us']:>15.1f} | {v['step_us']:>12.1f} | "
              f"{frames[k]:>17}")
    print(f"EP calls add {extra:.1f} us per step ({extra / 2:.1f} us per call, 2 calls "
          f"per step; their work included on CPU); the call order alone (plain+order, "
          f"same work) adds {order:.1f} us per step")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main(sys.argv[1:])
