"""One process of `python -m jax_ep.bench --processes N` (jax_ep/bench/launch.py starts
N of these; on several machines, start one per process yourself):

    python -m jax_ep.bench.worker --process-id I --num-processes N --coordinator HOST:PORT \\
        --out DIR [--kind normal|low_latency] [--platform gpu|cpu] [--local-device D] \\
        -- <bench arguments>

It joins jax.distributed (one device of this process: GPU D, or one CPU device with
gloo), starts NVSHMEM for `--backends internode` (sized from the bench's shapes), runs
the single-process benchmark (jax_ep.bench or jax_ep.bench.low_latency) over the global
mesh and writes DIR/proc<I>.json: its report, or {"error": ...}.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

from jax_ep.bench.launch import arg_value


def sizes(kind: str, argv: list[str]) -> dict:
    """The shapes the bench arguments ask for (the buffers are sized from them)."""
    if kind == "normal":
        from jax_ep.bench import exchange as bench
        a = bench.parse_args(list(argv))
        tokens = a.tokens
        if a.plot and a.sweep_tokens:
            tokens = max([tokens] + [int(t) for t in a.sweep_tokens.split(",")])
        return dict(tokens=tokens, hidden=a.hidden, topk=a.topk, experts=a.experts,
                    dtype=a.dtype, ranks=a.ranks,
                    capacity=a.capacity if a.capacity is not None else a.ranks * tokens)
    from jax_ep.bench import low_latency as bench_low_latency
    a = bench_low_latency.parse_args(list(argv))
    return dict(tokens=a.tokens, hidden=a.hidden, topk=a.topk, experts=a.experts,
                dtype=a.dtype, ranks=a.ranks, capacity=None)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m jax_ep.bench.worker")
    p.add_argument("--process-id", type=int, required=True)
    p.add_argument("--num-processes", type=int, required=True)
    p.add_argument("--coordinator", required=True, help="HOST:PORT of process 0")
    p.add_argument("--out", required=True, help="directory for proc<i>.json")
    p.add_argument("--kind", choices=("normal", "low_latency"), default="normal")
    p.add_argument("--platform", choices=("cpu", "gpu"), default="gpu")
    p.add_argument("--local-device", type=int, default=None,
                   help="GPU of this machine for this process (default: local rank)")
    p.add_argument("bench_args", nargs=argparse.REMAINDER)
    a = p.parse_args(argv)
    bench_args = [x for x in a.bench_args if x != "--"]
    pid, n = a.process_id, a.num_processes
    out_json = os.path.join(a.out, f"proc{pid}.json")

    def fail(msg: str) -> int:
        with open(out_json, "w") as f:
            json.dump({"error": msg}, f)
        print(f"process {pid}: {msg}", file=sys.stderr, flush=True)
        return 1

    try:
        shape = sizes(a.kind, bench_args)
        if shape["ranks"] != n:
            return fail(f"--ranks {shape['ranks']} differs from the {n} processes")
        if a.platform == "cpu":
            os.environ["JAX_PLATFORMS"] = "cpu"
            os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
        import jax

        if a.platform == "cpu":
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=a.coordinator, num_processes=n, process_id=pid,
            local_device_ids=None if a.platform == "cpu" else [
                a.local_device if a.local_device is not None else pid],
            initialization_timeout=120)
        if len(jax.devices()) != n:
            return fail(f"{len(jax.devices())} devices over {n} processes: one each is "
                        "needed")
        import jax_ep

        backends = arg_value(bench_args, "--backends", "")
        if "internode" in backends.split(","):
            s = shape
            if a.kind == "normal":
                jax_ep.nvshmem_bootstrap.initialize(
                    max_tokens=s["tokens"], hidden=s["hidden"], topk=s["topk"],
                    capacity=s["capacity"], x_dtype=s["dtype"], y_dtype=s["dtype"])
            else:
                jax_ep.nvshmem_bootstrap.initialize(low_latency=dict(
                    max_tokens_per_rank=s["tokens"], hidden=s["hidden"], topk=s["topk"],
                    num_experts=s["experts"], dtype=s["dtype"]))
        if a.kind == "normal":
            from jax_ep.bench import exchange as bench
            bench.main(bench_args + ["--json", out_json, "--no-progress"])
        else:
            from jax_ep.bench import low_latency as bench_low_latency
            bench_low_latency.main(bench_args + ["--json", out_json])
    except SystemExit as e:
        return fail(f"exited: {e}")
    except Exception as e:  # noqa: BLE001  (reported to the launcher, which says it)
        traceback.print_exc()
        return fail(f"{type(e).__name__}: {e}")
    print(f"process {pid}: done", flush=True)
    return 0


if __name__ == "__main__":
    rc = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)  # no shutdown barrier: a failed peer must not hold this one
