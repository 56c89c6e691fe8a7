"""Benchmark of the Flax MoE layer against a dense SwiGLU of the same active FLOPs:
`python -m jax_ep.bench --layer` (or `python -m jax_ep.bench_layer`).

In one process, on one `data x expert` mesh of devices of JAX's default backend (on CPU,
virtual devices of this host), with the same tokens `x[N, H]` sharded over both axes:

  moe    `jax_ep.flax.MoE(H, F, num_experts=E, top_k=K, capacity_factor=f)`, one entry
         per `--capacity-factors` value ("none" = never drop)
  dense  `jax_ep.flax.SwiGLU(H, K * F)` with replicated weights: the FLOPs of K experts
         of width F per token, without routing or exchange

and for each, two programs: `fwd` (y = layer(x)) and `fwd_bwd` (y and the gradients of
sum(y * ct) with respect to every parameter and to x; `ct` a fixed random cotangent).
Each program is compiled once and run `--warmup` times; then `--repeats` rounds each
time every program once, in turn (so a load that comes and goes on a shared machine hits
the layers alike), cycling through `--input-sets` token sets and waiting for all
outputs; Python's GC is paused during the timed calls. Memory is XLA's compiled `memory_analysis()` per device:
peak = argument + output + temp - alias bytes. For the MoE, the run also reports the
top-k slots dropped on its routing (`aux["dropped"]`, the layer's own router at its
initial weights on random normal tokens).

Targets: MoE fwd_bwd median <= 1.5x the dense one, peak memory <= 2x; the
JSON's "targets" holds both ratios per capacity factor.
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time

DEFAULTS = dict(tokens=8192, hidden=512, ffn=512, experts=16, topk=4, data=2, expert=4,
                capacity_factors="2.0", dtype="float32", repeats=5, warmup=2, input_sets=2)
QUICK = dict(tokens=256, hidden=64, ffn=64, experts=8, topk=2, repeats=2, warmup=1)


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m jax_ep.bench --layer",
        description="Times jax_ep.flax.MoE against a dense SwiGLU of the same active "
                    "FLOPs, forward and forward+backward, with peak memory.")
    p.add_argument("--tokens", type=int, default=None,
                   help=f"tokens in all (global batch * seq; default {DEFAULTS['tokens']})")
    p.add_argument("--hidden", type=int, default=None, help="H (default 512)")
    p.add_argument("--ffn", type=int, default=None, help="F, each expert's width (default 512)")
    p.add_argument("--experts", type=int, default=None, help="E (default 16)")
    p.add_argument("--topk", type=int, default=None, help="K (default 4)")
    p.add_argument("--data", type=int, default=DEFAULTS["data"], help="data mesh axis size")
    p.add_argument("--expert", type=int, default=DEFAULTS["expert"],
                   help="expert (EP) mesh axis size")
    p.add_argument("--capacity-factors", default=DEFAULTS["capacity_factors"],
                   help="comma-separated MoE capacity factors; 'none' = never drop "
                        "(default 2.0)")
    p.add_argument("--backend", default=None, help="jax-ep backend of the MoE (default auto)")
    p.add_argument("--dtype", default=DEFAULTS["dtype"],
                   choices=("float32", "bfloat16", "float16"))
    p.add_argument("--repeats", type=int, default=None, help="timed calls (default 5)")
    p.add_argument("--warmup", type=int, default=None, help="untimed calls first (default 2)")
    p.add_argument("--input-sets", type=int, default=DEFAULTS["input_sets"])
    p.add_argument("--quick", action="store_true", help="small shapes, few repeats")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true",
                   help="accepted for symmetry with the exchange benchmark (no bar here)")
    a = p.parse_args(argv)
    base = dict(DEFAULTS, **(QUICK if a.quick else {}))
    for k in ("tokens", "hidden", "ffn", "experts", "topk", "repeats", "warmup"):
        if getattr(a, k) is None:
            setattr(a, k, base[k])
    for k in ("tokens", "hidden", "ffn", "experts", "topk", "data", "expert", "repeats",
              "input_sets"):
        if getattr(a, k) < 1:
            p.error(f"--{k.replace('_', '-')} must be >= 1, got {getattr(a, k)}")
    if a.warmup < 0:
        p.error("--warmup must be >= 0")
    if a.experts % a.expert:
        p.error(f"--experts {a.experts} must be a multiple of --expert {a.expert}")
    if a.topk > a.experts:
        p.error(f"--topk {a.topk} must be <= --experts {a.experts}")
    if a.tokens % (a.data * a.expert):
        p.error(f"--tokens {a.tokens} must be a multiple of data * expert = "
                f"{a.data * a.expert}")
    cfs = []
    for c in a.capacity_factors.split(","):
        c = c.strip().lower()
        if not c:
            continue
        if c == "none":
            cfs.append(None)
            continue
        try:
            v = float(c)
        except ValueError:
            p.error(f"--capacity-factors: {c!r} is neither a number nor 'none'")
        if v <= 0:
            p.error(f"--capacity-factors: {v} must be positive")
        cfs.append(v)
    if not cfs:
        p.error("--capacity-factors names nothing")
    a.capacity_factors = cfs
    return a


def _memory(compiled) -> dict:
    ma = compiled.memory_analysis()
    if ma is None:
        return {}
    arg, out = int(ma.argument_size_in_bytes), int(ma.output_size_in_bytes)
    temp, alias = int(ma.temp_size_in_bytes), int(ma.alias_size_in_bytes)
    return {"argument_bytes": arg, "output_bytes": out, "temp_bytes": temp,
            "alias_bytes": alias, "peak_bytes": arg + out + temp - alias}


def _time_round_robin(progs, warmup, repeats):
    """progs: {key: (compiled, arg_sets)} -> {key: timing}; round r calls every program
    once with its arg set r (mod the number of sets)."""
    for compiled, arg_sets in progs.values():
        for i in range(warmup):
            jax_block(compiled(*arg_sets[i % len(arg_sets)]))
    times = {k: [] for k in progs}
    gc.collect()
    was = gc.isenabled()
    gc.disable()
    try:
        for i in range(repeats):
            for k, (compiled, arg_sets) in progs.items():
                a = arg_sets[(warmup + i) % len(arg_sets)]
                t0 = time.perf_counter()
                out = compiled(*a)
                jax_block(out)
                times[k].append(time.perf_counter() - t0)
                del out
    finally:
        if was:
            gc.enable()
    return {k: {"median_s": statistics.median(t), "min_s": min(t), "max_s": max(t),
                "times_s": t} for k, t in times.items()}


def jax_block(x):
    import jax
    return jax.block_until_ready(x)


def _programs(module, has_aux):
    """(fwd, fwd_bwd) jitted over (state, x[, ct]) for an nnx module."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    graphdef, state = nnx.split(module)

    def apply(st, x):
        out = nnx.merge(graphdef, st)(x)
        return out if has_aux else (out, {})

    def fwd(st, x):
        return apply(st, x)

    def fwd_bwd(st, x, ct):
        def loss(st, x):
            y, aux = apply(st, x)
            return jnp.sum(y.astype(jnp.float32) * ct), (y, aux)

        (_, (y, aux)), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(st, x)
        return y, aux, grads

    return state, jax.jit(fwd), jax.jit(fwd_bwd)


def run(a) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec as P

    import jax_ep
    from jax_ep.flax import MoE, SwiGLU

    n = a.data * a.expert
    devices = jax.devices()
    if len(devices) < n:
        raise SystemExit(f"jax_ep.bench --layer: a {a.data} x {a.expert} mesh needs {n} "
                         f"devices, the default backend has {len(devices)}; on CPU run as "
                         "`python -m jax_ep.bench --layer` (it sets XLA_FLAGS) or set "
                         f"XLA_FLAGS=--xla_force_host_platform_device_count={n}")
    mesh = jax.make_mesh((a.data, a.expert), ("data", "expert"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 2, devices=devices[:n])
    dtype = jnp.dtype(a.dtype)
    tok = NamedSharding(mesh, P(("data", "expert")))
    rng = np.random.default_rng(a.seed)
    xs = [jax.device_put(rng.standard_normal((a.tokens, a.hidden)).astype(dtype), tok)
          for _ in range(a.input_sets)]
    ct = jax.device_put(rng.standard_normal((a.tokens, a.hidden)).astype(np.float32), tok)

    layers = [("dense", None)] + [("moe", cf) for cf in a.capacity_factors]
    progs, compile_s, memory, dropped = {}, {}, {}, {}
    with jax.set_mesh(mesh):
        for kind, cf in layers:
            name = "dense" if kind == "dense" else f"moe cf={cf}"
            if kind == "dense":
                m = SwiGLU(a.hidden, a.topk * a.ffn, dtype=dtype, rngs=nnx.Rngs(a.seed))
            else:
                m = MoE(a.hidden, a.ffn, a.experts, a.topk, backend=a.backend,
                        capacity_factor=cf, dtype=dtype, rngs=nnx.Rngs(a.seed))
            state, fwd, fwd_bwd = _programs(m, has_aux=(kind == "moe"))
            memory[name] = {}
            for prog, args in (("fwd", [(state, x) for x in xs]),
                               ("fwd_bwd", [(state, x, ct) for x in xs])):
                f = fwd if prog == "fwd" else fwd_bwd
                t0 = time.perf_counter()
                compiled = f.lower(*args[0]).compile()
                compile_s[(name, prog)] = time.perf_counter() - t0
                memory[name][prog] = _memory(compiled)
                progs[(name, prog)] = (compiled, args)
                print(f"  compiled {name} {prog}", file=sys.stderr, flush=True)
            if kind == "moe":
                aux = jax.device_get(fwd(state, xs[0])[1])
                dropped[name] = {"dropped_slots": int(aux["dropped"]),
                                 "dropped_rows": int(aux["dropped_rows"]),
                                 "slots": int(np.sum(aux["tokens_per_expert"]))}
        timing = _time_round_robin(progs, a.warmup, a.repeats)
    del progs
    results = [{"layer": name, "capacity_factor": cf, "program": prog,
                "compile_s": compile_s[(name, prog)], **timing[(name, prog)]}
               for (kind, cf) in layers
               for name in ["dense" if kind == "dense" else f"moe cf={cf}"]
               for prog in ("fwd", "fwd_bwd")]

    by = {(r["layer"], r["program"]): r for r in results}
    targets = {}
    for kind, cf in layers[1:]:
        name = f"moe cf={cf}"
        t = {p: by[(name, p)]["median_s"] / by[("dense", p)]["median_s"]
             for p in ("fwd", "fwd_bwd")}
        mem = {p: memory[name][p].get("peak_bytes", 0) / max(
            memory["dense"][p].get("peak_bytes", 0), 1) for p in ("fwd", "fwd_bwd")}
        targets[name] = {"time_over_dense": t, "peak_memory_over_dense": mem,
                         "fwd_bwd_time_target_1.5x_met": t["fwd_bwd"] <= 1.5,
                         "peak_memory_target_2x_met": mem["fwd_bwd"] <= 2.0}
    from jax_ep.ops import resolve_backend
    config = {"tokens": a.tokens, "hidden": a.hidden, "ffn": a.ffn, "experts": a.experts,
              "topk": a.topk, "mesh": {"data": a.data, "expert": a.expert},
              "capacity_factors": a.capacity_factors, "dtype": a.dtype,
              "backend": resolve_backend(a.backend), "repeats": a.repeats,
              "warmup": a.warmup, "input_sets": a.input_sets,
              "platform": jax.default_backend(), "device_kind": devices[0].device_kind,
              "num_devices": len(devices), "jax": jax.__version__,
              "build": jax_ep.build_info(), "quick": bool(a.quick),
              "dense": f"SwiGLU({a.hidden}, {a.topk} * {a.ffn}), replicated weights"}
    return {"config": config, "results": results, "memory": memory, "dropped": dropped,
            "memory_method": "XLA compiled memory_analysis() per device: peak = argument "
                             "+ output + temp - alias bytes",
            "targets": targets}


def format_table(report) -> str:
    head = (f"{'layer':<14} {'program':<8} {'median ms':>10} {'min ms':>9} {'max ms':>9} "
            f"{'x dense':>8} {'peak MiB':>9} {'x dense':>8}")
    lines = [head, "-" * len(head)]
    by = {(r["layer"], r["program"]): r for r in report["results"]}
    mem = report["memory"]
    for r in report["results"]:
        d = by[("dense", r["program"])]
        pk = mem[r["layer"]][r["program"]].get("peak_bytes", 0)
        dpk = mem["dense"][r["program"]].get("peak_bytes", 0)
        lines.append(f"{r['layer']:<14} {r['program']:<8} {r['median_s'] * 1e3:>10.1f} "
                     f"{r['min_s'] * 1e3:>9.1f} {r['max_s'] * 1e3:>9.1f} "
                     f"{r['median_s'] / d['median_s']:>8.2f} {pk / 2**20:>9.1f} "
                     f"{pk / max(dpk, 1):>8.2f}")
    for name, d in report["dropped"].items():
        lines.append(f"{name}: dropped {d['dropped_slots']} of {d['slots']} top-k slots "
                     f"({d['dropped_rows']} rows at dispatch)")
    return "\n".join(lines)


def main(argv=None) -> dict:
    a = parse_args(argv)
    from jax_ep._bench_util import set_host_device_count

    set_host_device_count(a.data * a.expert)
    report = run(a)
    print(format_table(report))
    print("targets: " + json.dumps({k: {"fwd_bwd_x_dense": round(v["time_over_dense"]
                                                                  ["fwd_bwd"], 3),
                                        "peak_x_dense": round(v["peak_memory_over_dense"]
                                                              ["fwd_bwd"], 3)}
                                    for k, v in report["targets"].items()}))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {a.json}")
    return report


if __name__ == "__main__":
    main()
