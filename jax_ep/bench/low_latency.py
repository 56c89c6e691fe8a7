"""Benchmark of the low-latency mode: `python -m jax_ep.bench --mode low_latency`.

Times, per backend, jitted `shard_map` programs over `--ranks` devices at the decode
shape (default: 128 tokens per rank, H 7168, top-8 of 256 experts, bfloat16):

  dispatch       x, topk_idx -> recv_x [E_local, R * M, H], recv_count, handle
  dispatch_fp8   the same with fp8=True (cast in the send half, one message of H + H / 32
                 bytes a row, split into values and scales)
  combine        y = recv_x, topk_idx, topk_weights, handle -> out [T, H]
  roundtrip      dispatch then combine of recv_x (identity experts)

Each op reports the median, min and max of `--repeats` calls (after `--warmup` calls,
cycling through pre-generated input sets, waiting for every output).

Floors, from the memcpy bandwidth measured in the same run (`jax_ep.bench.measure_memcpy`,
bytes copied per second, the faster of one thread and one per core):
  rows floor    rows moved (one per valid (token, slot): R * T * K) times row bytes, the
                DeepEP accounting; combine and dispatch each move every row once.
  output floor  the bytes the contract makes each op write or move: dispatch writes every
                row of its fixed [E_local, R * M, H] blocks (the rows, then zeros past the
                counts), combine moves the rows; roundtrip adds both.
The CPU target is the roundtrip within 3x its output floor.

On a GPU machine with fewer GPUs than `--ranks` (or with `--virtual-ranks`), the ranks run
on one GPU through the CUDA low-latency harness (`jax_ep.low_latency.harness_dispatch` /
`harness_combine`: every rank's buffer on that GPU, each phase launched for every rank),
backend `ffi` only; the floors then use that GPU's device-to-device copy bandwidth.
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time

OPS = ("dispatch", "dispatch_fp8", "combine", "roundtrip")
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m jax_ep.bench --mode low_latency",
        description="Times jax_ep.low_latency dispatch/combine at the decode shape against "
                    "the memcpy floor.")
    p.add_argument("--backends", default="ffi", help="comma list (default ffi)")
    p.add_argument("--ranks", type=int, default=8, help="EP ranks = devices (default 8)")
    p.add_argument("--tokens", type=int, default=128, help="tokens per rank = M (128)")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPE_BYTES))
    p.add_argument("--ops", default=",".join(OPS))
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--input-sets", type=int, default=2)
    p.add_argument("--memcpy-mib", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--virtual-ranks", action="store_true",
                   help="GPU only: run the R ranks on one GPU through the CUDA harness")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    args = p.parse_args(argv)
    if args.experts % args.ranks:
        p.error(f"--experts {args.experts} must be a multiple of --ranks {args.ranks}")
    if not 1 <= args.topk <= args.experts:
        p.error("--topk must be in [1, experts]")
    args.ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    bad = [o for o in args.ops if o not in OPS]
    if bad or not args.ops:
        p.error(f"--ops must name some of {', '.join(OPS)}, got {bad or 'nothing'}")
    return args


def _programs(mesh, backend, *, E, M):
    import jax
    from jax.sharding import PartitionSpec as P

    from jax_ep import low_latency as ll

    kw = dict(num_experts=E, axis_name="ep", max_tokens_per_rank=M, backend=backend)
    spec = P("ep")

    def sm(f):
        return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=spec, out_specs=spec))

    def f_dispatch(x, idx):
        recv, cnt, h = ll.dispatch(x, idx, **kw)
        return recv, cnt, h.src_rank, h.src_index, h.first_row, h.row_count

    def f_dispatch_fp8(x, idx):
        (q, s), cnt, _ = ll.dispatch(x, idx, fp8=True, **kw)
        return q, s, cnt

    def f_combine(y, idx, w, src_rank, src_index, first, count):
        h = ll.LowLatencyHandle(src_rank, src_index, first, count, E,
                                jax.lax.axis_size("ep"), M, "ep", idx.shape[0], idx.shape[1])
        return ll.combine(y, idx, w, h, backend=backend)

    def f_roundtrip(x, idx, w):
        recv, _, h = ll.dispatch(x, idx, **kw)
        return ll.combine(recv, idx, w, h, backend=backend)

    return {"dispatch": sm(f_dispatch), "dispatch_fp8": sm(f_dispatch_fp8),
            "combine": sm(f_combine), "roundtrip": sm(f_roundtrip)}


def _harness_programs(*, E, M):
    """The same ops through the CUDA virtual-rank harness, on inputs stacked per rank
    ([R, T, ...]); combine takes the dispatch outputs in the order `_programs` uses."""
    import jax

    from jax_ep import fp8
    from jax_ep import low_latency as ll

    kw = dict(num_experts=E, max_tokens_per_rank=M)

    def f_dispatch(x, idx):
        return ll.harness_dispatch(x, idx, **kw)

    def f_dispatch_fp8(x, idx):
        # Rows move as bytes: the FP8 values and their scales as two dispatches.
        q, s = fp8.quantize(x, block=ll.FP8_BLOCK)
        rq, cnt = ll.harness_dispatch(q, idx, **kw)[:2]
        return rq, ll.harness_dispatch(s, idx, **kw)[0], cnt

    def f_combine(y, idx, w, src_rank, src_index, first, count):
        del src_rank, src_index  # the harness keeps them in its buffers
        return ll.harness_combine(y, idx, w, first, count, **kw)

    def f_roundtrip(x, idx, w):
        recv, _, _, _, first, count = ll.harness_dispatch(x, idx, **kw)
        return ll.harness_combine(recv, idx, w, first, count, **kw)

    return {"dispatch": jax.jit(f_dispatch), "dispatch_fp8": jax.jit(f_dispatch_fp8),
            "combine": jax.jit(f_combine), "roundtrip": jax.jit(f_roundtrip)}


def _inputs(R, T, H, K, E, dtype, n_sets, seed):
    import numpy as np

    rng = np.random.default_rng(seed)
    sets = []
    for _ in range(n_sets):
        x = rng.standard_normal((R * T, H), np.float32).astype(dtype)
        idx = np.argsort(rng.random((R * T, E)), axis=1)[:, :K].astype(np.int32)
        w = rng.random((R * T, K)).astype(np.float32)
        sets.append((x, idx, w))
    return sets


def _time(fn, arg_sets, warmup, repeats):
    import jax

    for i in range(warmup):
        jax.block_until_ready(fn(*arg_sets[i % len(arg_sets)]))
    times = []
    gc.disable()
    try:
        for i in range(repeats):
            args = arg_sets[i % len(arg_sets)]
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times.append(time.perf_counter() - t0)
    finally:
        gc.enable()
    return times


def main(argv=None) -> dict:
    args = parse_args(argv)
    from jax_ep.bench._util import (measure_device_copy, measure_memcpy,
                                    set_host_device_count)

    set_host_device_count(args.ranks)
    import jax
    import jax.numpy as jnp

    import jax_ep

    R, T, H, K, E = args.ranks, args.tokens, args.hidden, args.topk, args.experts
    M, el = T, E // R
    platform = jax.default_backend()
    virtual = args.virtual_ranks
    if virtual and platform != "gpu":
        raise SystemExit(
            "jax_ep.bench --mode low_latency: --virtual-ranks runs the ranks on one GPU "
            f"through the CUDA harness, but JAX's default backend is {platform!r}; on CPU, "
            f"--ranks {R} already gives {R} virtual devices: drop --virtual-ranks")
    if not virtual and len(jax.devices()) < R:
        if platform != "gpu":
            raise SystemExit(f"jax_ep.bench --mode low_latency: {len(jax.devices())} "
                             f"devices for --ranks {R}")
        virtual = True
        print(f"jax_ep.bench --mode low_latency: {len(jax.devices())} GPU(s) for --ranks "
              f"{R}: running virtual ranks on GPU 0 (--virtual-ranks)", file=sys.stderr)
    if virtual and not jax_ep.cuda.available():
        raise SystemExit("jax_ep.bench --mode low_latency: --virtual-ranks needs a build "
                         f"with the CUDA backend (built: {jax_ep.build_info()})")
    mesh = None if virtual else jax.make_mesh(
        (R,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:R])
    dtype = jnp.dtype(args.dtype)
    itemsize = DTYPE_BYTES[args.dtype]
    row = H * itemsize
    fp8_row = H + 4 * (H // 128)
    sets = _inputs(R, T, H, K, E, dtype, max(1, args.input_sets), args.seed)
    rows = R * T * K  # every slot valid: top-k without -1
    recv_bytes = R * el * R * M * row
    nbytes = {
        "dispatch": (rows * row, recv_bytes),
        "dispatch_fp8": (rows * fp8_row, R * el * R * M * fp8_row),
        "combine": (rows * row, rows * row),
        "roundtrip": (2 * rows * row, recv_bytes + rows * row),
    }
    # Host memcpy on CPU; on a GPU the device's own copy bandwidth.
    memcpy = (measure_memcpy if platform == "cpu" else measure_device_copy)(
        args.memcpy_mib << 20)
    results = []
    skipped = {}
    for b in [b.strip() for b in args.backends.split(",") if b.strip()]:
        try:
            backend = jax_ep.resolve_backend(b)
            if backend == "intranode":
                backend = "ffi"  # the benchmark's name for the intranode kernels
        except (NotImplementedError, ValueError) as e:
            skipped[b] = str(e)
            continue
        if virtual and backend != "ffi":
            skipped[backend] = "the CUDA harness runs the ffi (CUDA intranode) kernels only"
            continue
        if virtual:
            progs = _harness_programs(E=E, M=M)
            put = [tuple(jnp.asarray(a.reshape((R, T) + a.shape[1:])) for a in s)
                   for s in sets]
        else:
            if backend == "ffi" and platform == "gpu":
                # The low-latency area of the intranode kernels (once per GPU).
                jax_ep.cuda.setup(mesh, "ep", num_tokens=None, hidden=H, topk=K, dtype=dtype,
                                  max_tokens_per_rank=M, num_experts=E)
            progs = _programs(mesh, backend, E=E, M=M)
            sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("ep"))
            put = [tuple(jax.device_put(a, sharding) for a in s) for s in sets]
        for op in args.ops:
            if op == "combine":
                comb = []
                for x, idx, w in put:
                    recv, _, *parts = progs["dispatch"](x, idx)
                    comb.append((recv, idx, w, *parts))
                jax.block_until_ready(comb)
                arg_sets = comb
            elif op == "roundtrip":
                arg_sets = put
            else:
                arg_sets = [(x, idx) for x, idx, _ in put]
            times = _time(progs[op], arg_sets, args.warmup, args.repeats)
            if op == "combine":
                del comb, arg_sets
            med = statistics.median(times)
            rows_b, out_b = nbytes[op]
            bw = memcpy["GBps"] * 1e9
            results.append({"backend": backend, "op": op, "median_s": med,
                            "min_s": min(times), "max_s": max(times),
                            "rows_floor_s": rows_b / bw, "output_floor_s": out_b / bw,
                            "rows_bytes": rows_b, "output_bytes": out_b})
            print(f"{backend:>9} {op:>13}: median {med * 1e3:9.2f} ms  "
                  f"rows floor {rows_b / bw * 1e3:8.2f} ms ({med * bw / rows_b:6.1f}x)  "
                  f"output floor {out_b / bw * 1e3:8.2f} ms ({med * bw / out_b:5.2f}x)",
                  flush=True)
    report = {"config": {"ranks": R, "tokens_per_rank": T, "max_tokens_per_rank": M,
                         "hidden": H, "topk": K, "experts": E, "dtype": args.dtype,
                         "repeats": args.repeats, "warmup": args.warmup,
                         "platform": platform, "virtual_ranks": bool(virtual)},
              "memcpy": memcpy, "results": results}
    if skipped:
        report["skipped_backends"] = skipped
    print(f"memcpy {memcpy['GBps']:.2f} GB/s ({memcpy['method']})")
    rt = [r for r in results if r["op"] == "roundtrip" and r["backend"] == "ffi"]
    if rt:
        report["ffi_roundtrip_over_output_floor"] = rt[0]["median_s"] / rt[0]["output_floor_s"]
        print("ffi roundtrip / output floor: "
              f"{report['ffi_roundtrip_over_output_floor']:.2f}x (target <= 3x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {args.json}")
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
