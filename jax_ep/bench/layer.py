"""Benchmark of the Flax MoE layer against a dense SwiGLU of the same active FLOPs:
`python -m jax_ep.bench --layer` (or `python -m jax_ep.bench.layer`).

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
outputs; Python's GC is paused during the timed calls. Each call's wall time and the
process's CPU time (user + system seconds of all its threads, which other processes on
the cores disturb far less) are both reported, with the host's load average at the
start and the end. Memory is XLA's compiled `memory_analysis()` per device:
peak = argument + output + temp - alias bytes. For the MoE, the run also reports the
top-k slots dropped on its routing (`aux["dropped"]`, the layer's own router at its
initial weights on random normal tokens).

Targets: MoE fwd_bwd median <= 1.5x the dense one, peak memory <= 2x; the
JSON's "targets" holds both ratios per capacity factor.

User call (unless `--no-user-call`): the layer as a user's training step calls it,
`MoE(H, F, num_experts=E, top_k=K)` with every other argument at its default, and the
dense SwiGLU, each under `nnx.jit(nnx.grad(loss))` of a plain loss (mean of y^2) over its
parameters; `--repeats` rounds of `--user-calls` back-to-back calls of each program in
turn. Target: the default layer at most 1.3x dense ("user_call" in the JSON).

`--profile` (with the first capacity factor) times the pieces of the MoE's fwd_bwd as
programs of their own on the same mesh and tokens, round robin with the whole layer and
the dense one, and reports each as a share of the layer's time (shares of one run hold
under a steady load, where absolute times do not):

  router    x @ router, softmax, top-k, the balance and z losses; forward and backward
  exchange  dispatch, then combine of the received rows, forward and backward
  group     the sort of the received (row, slot) pairs by expert (`group_by_expert`)
  experts   `grouped_swiglu` forward and backward on the received rows (the grouping,
            the gathers of each tile's rows, the matmuls, the scatter-adds)
  matmuls   the same SwiGLU matmuls, forward and backward, as one batched einsum over
            `[E_local, pairs / E_local, H]` blocks (what the experts' work costs with no
            routing at all; a floor for `experts`)
"""
from __future__ import annotations

import argparse
import functools
import gc
import json
import statistics
import sys
import time

DEFAULTS = dict(tokens=8192, hidden=512, ffn=512, experts=16, topk=4, data=2, expert=4,
                capacity_factors="2.0", dtype="float32", repeats=5, warmup=2, input_sets=2,
                user_calls=3)
QUICK = dict(tokens=256, hidden=64, ffn=64, experts=8, topk=2, repeats=2, warmup=1,
             user_calls=2)


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
    p.add_argument("--profile", action="store_true",
                   help="time the MoE's pieces (router, exchange, grouping sort, expert "
                        "loop, bare matmuls) as shares of the layer (first capacity factor)")
    p.add_argument("--user-calls", type=int, default=None,
                   help="back-to-back calls per round of the user-call programs (default "
                        f"{DEFAULTS['user_calls']})")
    p.add_argument("--no-user-call", action="store_true",
                   help="skip the default-argument layer under nnx.jit(nnx.grad(loss))")
    p.add_argument("--expert-matmul", default=None, choices=("tiles", "ragged_dot"),
                   help="the MoE's expert_matmul (default: by platform)")
    a = p.parse_args(argv)
    base = dict(DEFAULTS, **(QUICK if a.quick else {}))
    for k in ("tokens", "hidden", "ffn", "experts", "topk", "repeats", "warmup",
              "user_calls"):
        if getattr(a, k) is None:
            setattr(a, k, base[k])
    for k in ("tokens", "hidden", "ffn", "experts", "topk", "data", "expert", "repeats",
              "input_sets", "user_calls"):
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
    cpu = {k: [] for k in progs}
    gc.collect()
    was = gc.isenabled()
    gc.disable()
    try:
        for i in range(repeats):
            for k, (compiled, arg_sets) in progs.items():
                a = arg_sets[(warmup + i) % len(arg_sets)]
                t0, c0 = time.perf_counter(), time.process_time()
                out = compiled(*a)
                jax_block(out)
                times[k].append(time.perf_counter() - t0)
                # CPU seconds of the whole process (every device's threads): other
                # processes on the cores disturb it far less than the wall time
                cpu[k].append(time.process_time() - c0)
                del out
    finally:
        if was:
            gc.enable()
    return {k: {"median_s": statistics.median(t), "min_s": min(t), "max_s": max(t),
                "times_s": t, "cpu_median_s": statistics.median(cpu[k]),
                "cpu_times_s": cpu[k]} for k, t in times.items()}


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


def _user_step(module, has_aux, x):
    """`nnx.jit(nnx.grad(loss))` of a plain loss over the module's parameters, as a
    user's training step calls the layer: loss = mean(y^2) (y the layer's output); the
    tokens x are an argument (closed over, a sharded array would become a constant of
    the program, replicated)."""
    import jax.numpy as jnp
    from flax import nnx

    def loss(m, x):
        y = m(x)
        y = y[0] if has_aux else y
        return jnp.mean(jnp.square(y.astype(jnp.float32)))

    @nnx.jit
    def step(m, x):
        return nnx.grad(loss)(m, x)

    return functools.partial(step, x=x)


def _time_user_calls(steps, warmup, repeats, calls):
    """steps: {key: (step, module)} -> {key: timing}: `warmup` calls each; then `repeats`
    rounds, each timing `calls` back-to-back calls of every step in turn (blocking on the
    last), as a training loop runs; per-call seconds."""
    for step, m in steps.values():
        for _ in range(max(warmup, 1)):
            jax_block(step(m))
    times = {k: [] for k in steps}
    cpu = {k: [] for k in steps}
    for _ in range(repeats):
        for k, (step, m) in steps.items():
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(calls):
                g = step(m)
            jax_block(g)
            times[k].append((time.perf_counter() - t0) / calls)
            cpu[k].append((time.process_time() - c0) / calls)
            del g
    return {k: {"median_s": statistics.median(t), "min_s": min(t), "max_s": max(t),
                "times_s": t, "cpu_median_s": statistics.median(cpu[k]),
                "cpu_times_s": cpu[k], "calls_per_round": calls}
            for k, t in times.items()}


def user_call(a, mesh, x) -> dict:
    """The layer as a user calls it: `MoE(H, F, num_experts=E, top_k=K)` with every other
    argument left at its default, and the dense SwiGLU, each under
    `nnx.jit(nnx.grad(loss))` of a plain loss over its parameters; timed as separate
    programs in a loop of back-to-back calls (`_time_user_calls`). Returns
    {"results": {name: timing}, "moe_over_dense": ratio of medians,
    "capacity_factor": the MoE's default}."""
    import jax
    from flax import nnx

    from jax_ep import experts
    from jax_ep.flax import MoE, SwiGLU

    with jax.set_mesh(mesh):
        moe = MoE(a.hidden, a.ffn, num_experts=a.experts, top_k=a.topk,
                  rngs=nnx.Rngs(a.seed))
        dense = SwiGLU(a.hidden, a.topk * a.ffn, rngs=nnx.Rngs(a.seed))
        steps = {"moe default": (_user_step(moe, True, x), moe),
                 "dense": (_user_step(dense, False, x), dense)}
        timing = _time_user_calls(steps, a.warmup, a.repeats, a.user_calls)
    return {"results": timing,
            "moe_over_dense": timing["moe default"]["median_s"]
            / timing["dense"]["median_s"],
            "cpu_moe_over_dense": timing["moe default"]["cpu_median_s"]
            / max(timing["dense"]["cpu_median_s"], 1e-9),
            "capacity_factor": moe.capacity_factor,
            "expert_matmul": experts.check_expert_matmul(None)}


def run(a) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec as P

    import jax_ep
    from jax_ep import experts
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
                        capacity_factor=cf, dtype=dtype, expert_matmul=a.expert_matmul,
                        rngs=nnx.Rngs(a.seed))
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
    user = None if a.no_user_call else user_call(a, mesh, xs[0])
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
        cpu = {p: by[(name, p)]["cpu_median_s"] / max(by[("dense", p)]["cpu_median_s"],
                                                       1e-9) for p in ("fwd", "fwd_bwd")}
        targets[name] = {"time_over_dense": t, "cpu_time_over_dense": cpu,
                         "peak_memory_over_dense": mem,
                         "fwd_bwd_time_target_1.5x_met": t["fwd_bwd"] <= 1.5,
                         "peak_memory_target_2x_met": mem["fwd_bwd"] <= 2.0}
    from jax_ep.ops import resolve_backend
    config = {"tokens": a.tokens, "hidden": a.hidden, "ffn": a.ffn, "experts": a.experts,
              "topk": a.topk, "mesh": {"data": a.data, "expert": a.expert},
              "capacity_factors": a.capacity_factors, "dtype": a.dtype,
              "backend": resolve_backend(a.backend), "repeats": a.repeats,
              "expert_matmul": experts.check_expert_matmul(a.expert_matmul),
              "warmup": a.warmup, "input_sets": a.input_sets,
              "platform": jax.default_backend(), "device_kind": devices[0].device_kind,
              "num_devices": len(devices), "jax": jax.__version__,
              "build": jax_ep.build_info(), "quick": bool(a.quick),
              "dense": f"SwiGLU({a.hidden}, {a.topk} * {a.ffn}), replicated weights"}
    return {"config": config, "results": results, "memory": memory, "dropped": dropped,
            "user_call": user,
            "memory_method": "XLA compiled memory_analysis() per device: peak = argument "
                             "+ output + temp - alias bytes",
            "targets": targets}


def profile(a) -> dict:
    """The pieces of the MoE's fwd_bwd (module docstring) timed round robin with the
    whole layer and the dense one; {"config", "pieces": {name: timing}, "shares"}."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec as P

    from jax_ep import experts, ops
    from jax_ep.flax import MoE, SwiGLU, _counts, _load_balance, route

    n = a.data * a.expert
    mesh = jax.make_mesh((a.data, a.expert), ("data", "expert"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 2,
                         devices=jax.devices()[:n])
    dtype = jnp.dtype(a.dtype)
    cf = a.capacity_factors[0]
    tok_axes = ("data", "expert")
    tok, wspec = P(tok_axes), P("expert")
    rng = np.random.default_rng(a.seed)
    put = lambda v, spec: jax.device_put(v, NamedSharding(mesh, spec))
    x = put(rng.standard_normal((a.tokens, a.hidden)).astype(dtype), tok)
    ct = put(rng.standard_normal((a.tokens, a.hidden)).astype(np.float32), tok)
    E, K, R = a.experts, a.topk, a.expert
    with jax.set_mesh(mesh):
        moe = MoE(a.hidden, a.ffn, E, K, backend=a.backend, capacity_factor=cf,
                  dtype=dtype, expert_matmul=a.expert_matmul, rngs=nnx.Rngs(a.seed))
        dense = SwiGLU(a.hidden, K * a.ffn, dtype=dtype, rngs=nnx.Rngs(a.seed))
    T = a.tokens // n
    C = moe._capacity(T, R)
    cap = experts.expert_capacity(T * K, E // R, cf, limit=C or R * T) if cf else (C or
                                                                                 R * T)
    matmul = experts.check_expert_matmul(a.expert_matmul)
    router = moe.router[...]
    wg, wu, wd = (put(np.asarray(v[...]).astype(dtype), wspec)
                  for v in (moe.w_gate, moe.w_up, moe.w_down))
    idx, w, _ = jax.jit(lambda x: route(x.astype(jnp.float32) @ router, K))(x)

    def grad_sum(f, argnums):
        return jax.jit(jax.grad(lambda *v: jnp.sum(f(*v)), argnums=argnums))

    def router_loss(r, x):
        logits = x.astype(jnp.float32) @ r
        i, ww, probs = route(logits, K)
        lb = _load_balance(probs, _counts(i, E), i.size)
        z = jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2)
        return jnp.sum(ww * ct[:, :K]) + lb + z

    def smap(f, in_specs, out_specs):
        return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs)

    def exchange(x, w):
        def per_shard(x, i, w):
            rx, _, rw, h = ops.dispatch(x, i, w, num_experts=E, axis_name="expert",
                                        capacity=C, backend=a.backend)
            return ops.combine((rx * jnp.sum(rw, 1, keepdims=True).astype(rx.dtype)), h,
                               backend=a.backend).astype(jnp.float32)
        return smap(per_shard, (tok, tok, tok), tok)(x, idx, w) * ct

    recv = jax.jit(smap(lambda x, i, w: ops.dispatch(
        x, i, w, num_experts=E, axis_name="expert", capacity=C, backend=a.backend)[:3],
        (tok, tok, tok), (tok, tok, tok)))(x, idx, w)
    rx, ridx, rw = recv
    ct_r = put(rng.standard_normal(rx.shape).astype(np.float32), tok)

    def group(i, w):
        g = smap(lambda i, w: experts.group_by_expert(i, w, E // R, cap)[:2],
                 (tok, tok), (tok, tok))(i, w)
        return g

    def expert_loop(rx, rw, wg, wu, wd):
        y = smap(lambda x, i, w, a_, b_, c_: experts.grouped_swiglu(
            x, i, w, a_, b_, c_, capacity=cap, matmul=matmul)[0],
            (tok, tok, tok, wspec, wspec, wspec), tok)(rx, ridx, rw, wg, wu, wd)
        return y * ct_r

    pairs = T * K // (E // R)  # pairs per local expert at balanced routing
    xb = put(rng.standard_normal((n * (E // R), pairs, a.hidden)).astype(dtype), tok)

    def matmuls(xb, wg, wu, wd):
        return smap(lambda xb, a_, b_, c_: experts.swiglu_blocks(xb, a_, b_, c_),
                    (tok, wspec, wspec, wspec), tok)(xb, wg, wu, wd).astype(jnp.float32)

    layer_state, _, layer_fb = _programs(moe, True)
    dense_state, _, dense_fb = _programs(dense, False)
    progs = {
        "layer": (layer_fb, [(layer_state, x, ct)]),
        "dense": (dense_fb, [(dense_state, x, ct)]),
        "router": (jax.jit(jax.grad(router_loss, argnums=(0, 1))), [(router, x)]),
        "exchange": (grad_sum(exchange, (0, 1)), [(x, w)]),
        "group": (jax.jit(group), [(ridx, rw)]),
        "experts": (grad_sum(expert_loop, (0, 1, 2, 3, 4)), [(rx, rw, wg, wu, wd)]),
        "matmuls": (grad_sum(matmuls, (0, 1, 2, 3)), [(xb, wg, wu, wd)]),
    }
    with jax.set_mesh(mesh):
        compiled = {}
        for k, (f, args) in progs.items():
            compiled[k] = (f.lower(*args[0]).compile(), args)
            print(f"  compiled {k}", file=sys.stderr, flush=True)
        timing = _time_round_robin(compiled, a.warmup, a.repeats)
    layer = timing["layer"]["median_s"]
    shares = {k: v["median_s"] / layer for k, v in timing.items()}
    return {"config": {"tokens": a.tokens, "hidden": a.hidden, "ffn": a.ffn,
                       "experts": E, "topk": K, "mesh": {"data": a.data, "expert": R},
                       "capacity_factor": cf, "receive_rows": C or R * T,
                       "expert_capacity": cap, "expert_matmul": matmul,
                       "dtype": a.dtype, "repeats": a.repeats, "warmup": a.warmup,
                       "backend": ops.resolve_backend(a.backend)},
            "pieces": timing, "shares_of_layer": shares}


def format_profile(report) -> str:
    lines = [f"{'piece':<10} {'median ms':>10} {'min ms':>9} {'share of layer':>15}"]
    for k, v in report["pieces"].items():
        lines.append(f"{k:<10} {v['median_s'] * 1e3:>10.1f} {v['min_s'] * 1e3:>9.1f} "
                     f"{report['shares_of_layer'][k]:>15.2f}")
    return "\n".join(lines)


def format_table(report) -> str:
    head = (f"{'layer':<14} {'program':<8} {'median ms':>10} {'min ms':>9} {'max ms':>9} "
            f"{'x dense':>8} {'cpu ms':>8} {'x dense':>8} {'peak MiB':>9} {'x dense':>8}")
    lines = [head, "-" * len(head)]
    by = {(r["layer"], r["program"]): r for r in report["results"]}
    mem = report["memory"]
    for r in report["results"]:
        d = by[("dense", r["program"])]
        pk = mem[r["layer"]][r["program"]].get("peak_bytes", 0)
        dpk = mem["dense"][r["program"]].get("peak_bytes", 0)
        lines.append(f"{r['layer']:<14} {r['program']:<8} {r['median_s'] * 1e3:>10.1f} "
                     f"{r['min_s'] * 1e3:>9.1f} {r['max_s'] * 1e3:>9.1f} "
                     f"{r['median_s'] / d['median_s']:>8.2f} "
                     f"{r['cpu_median_s'] * 1e3:>8.1f} "
                     f"{r['cpu_median_s'] / d['cpu_median_s']:>8.2f} {pk / 2**20:>9.1f} "
                     f"{pk / max(dpk, 1):>8.2f}")
    u = report.get("user_call")
    if u:
        for name, r in u["results"].items():
            lines.append(f"{'user: ' + name:<23} {r['median_s'] * 1e3:>10.1f} "
                         f"{r['min_s'] * 1e3:>9.1f} {r['max_s'] * 1e3:>9.1f} "
                         f"{r['median_s'] / u['results']['dense']['median_s']:>8.2f} "
                         f"{r['cpu_median_s'] * 1e3:>8.1f}")
        lines.append(f"user call: MoE(H, F, num_experts, top_k) with default arguments "
                     f"(capacity_factor={u['capacity_factor']}) under "
                     f"nnx.jit(nnx.grad(loss)): {u['moe_over_dense']:.2f}x dense")
    for name, d in report["dropped"].items():
        lines.append(f"{name}: dropped {d['dropped_slots']} of {d['slots']} top-k slots "
                     f"({d['dropped_rows']} rows at dispatch)")
    return "\n".join(lines)


def _loadavg():
    """[1, 5, 15 minute] load averages of the host, or None where unknown."""
    try:
        import os
        return [round(v, 2) for v in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def main(argv=None) -> dict:
    a = parse_args(argv)
    from jax_ep.bench._util import set_host_device_count

    set_host_device_count(a.data * a.expert)
    if a.profile:
        load0 = _loadavg()
        report = profile(a)
        report["load_average"] = {"start": load0, "end": _loadavg()}
        print(format_profile(report))
        print(f"load average (1, 5, 15 min): start {load0} end "
              f"{report['load_average']['end']}")
        if a.json:
            with open(a.json, "w") as f:
                json.dump(report, f, indent=1)
            print(f"wrote {a.json}")
        return report
    load0 = _loadavg()
    report = run(a)
    report["load_average"] = {"start": load0, "end": _loadavg()}
    print(format_table(report))
    print("load average (1, 5, 15 min): start {} end {} (ratios mean most under 1: other "
          "processes slow the layers unequally)".format(*(
              " ".join(f"{v:.2f}" for v in report["load_average"][k]) if
              report["load_average"][k] else "n/a" for k in ("start", "end"))))
    print("targets: " + json.dumps({k: {"fwd_bwd_x_dense": round(v["time_over_dense"]
                                                                  ["fwd_bwd"], 3),
                                        "fwd_bwd_cpu_x_dense": round(
                                            v["cpu_time_over_dense"]["fwd_bwd"], 3),
                                        "peak_x_dense": round(v["peak_memory_over_dense"]
                                                              ["fwd_bwd"], 3)}
                                    for k, v in report["targets"].items()}))
    u = report.get("user_call")
    if u:
        u["target_1.3x_met"] = u["moe_over_dense"] <= 1.3
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {a.json}")
    return report


if __name__ == "__main__":
    main()


# ----------------------------------------------------------------------------- train step

TRAIN_STEP_DEFAULTS = dict(steps=10, rounds=5, warmup=2)
# The demo's model made small for a smoke run (`--quick`).
TRAIN_STEP_QUICK = ["--batch", "8", "--seq", "32", "--layers", "1", "--hidden", "32",
                    "--heads", "2", "--ffn", "32", "--experts", "4", "--data", "1",
                    "--expert", "4"]
REGRESSION_TOLERANCE = 0.15


def _demo_script(path=None):
    """The demo's training script, `examples/train_moe.py` of the checkout this package
    runs from (or `path`), loaded as a module."""
    import importlib.util
    import os

    if path is None:
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        path = os.path.join(root, "examples", "train_moe.py")
    if not os.path.isfile(path):
        raise SystemExit(f"jax_ep.bench --train-step: no demo script at {path}; run it "
                         "from a checkout of the repository or pass --script PATH")
    spec = importlib.util.spec_from_file_location("_jax_ep_demo_train", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod, path


def parse_train_step_args(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m jax_ep.bench --train-step",
        description="Steps/s of the demo's training step (examples/train_moe.py at its "
                    "default arguments, as `make demo` runs it) against the same model "
                    "with a dense SwiGLU of the same active FLOPs in place of each MoE, "
                    "timed in turn in one process.")
    p.add_argument("--steps", type=int, default=TRAIN_STEP_DEFAULTS["steps"],
                   help="steps per timed round (default 10)")
    p.add_argument("--rounds", type=int, default=TRAIN_STEP_DEFAULTS["rounds"],
                   help="timed rounds of each configuration, in turn (default 5)")
    p.add_argument("--warmup", type=int, default=TRAIN_STEP_DEFAULTS["warmup"],
                   help="untimed steps first (default 2)")
    p.add_argument("--script", default=None, help="the demo script (default: the "
                   "checkout's examples/train_moe.py)")
    p.add_argument("--baseline", metavar="JSON", default=None,
                   help="a recorded run of this benchmark: exit 1 when this run's "
                        f"demo/dense time ratio exceeds it by more than "
                        f"{REGRESSION_TOLERANCE * 100:.0f}%%")
    p.add_argument("--quick", action="store_true", help="a small model, few steps")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    a = p.parse_args(argv)
    for k in ("steps", "rounds"):
        if getattr(a, k) < 1:
            p.error(f"--{k} must be >= 1, got {getattr(a, k)}")
    if a.warmup < 0:
        p.error("--warmup must be >= 0")
    return a


def train_step(a) -> dict:
    """{"config", "results": {"demo"|"dense": timing per step}, "demo_over_dense",
    "steps_per_s"}: both configurations built from the demo script's own `build` and
    `make_steps`, fed its own batches; round r runs `steps` steps of each in turn."""
    import jax

    mod, path = _demo_script(a.script)
    extra = TRAIN_STEP_QUICK if a.quick else []
    configs = {"demo": mod.parse_args(extra + ["--no-progress"]),
               "dense": mod.parse_args(extra + ["--no-progress", "--dense"])}
    d = configs["demo"]
    mesh = jax.make_mesh((d.data, d.expert), ("data", "expert"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 2,
                         devices=jax.devices()[:d.data * d.expert])
    data, _ = mod.load_corpus()
    runs = {}
    with jax.set_mesh(mesh):
        for name, args in configs.items():
            model, opt = mod.build(args, mesh)
            step, _, put = mod.make_steps(args, mesh)
            t0 = time.perf_counter()
            for s in range(max(a.warmup, 1)):
                m = step(model, opt, put(mod.batch_at(data, args.seed, s, args.batch,
                                                      args.seq)))
            jax_block(m)
            runs[name] = (step, model, opt, put, args, time.perf_counter() - t0)
            print(f"  compiled {name}", file=sys.stderr, flush=True)
        times = {k: [] for k in runs}
        cpu = {k: [] for k in runs}
        for r in range(a.rounds):
            for name, (step, model, opt, put, args, _) in runs.items():
                t0, c0 = time.perf_counter(), time.process_time()
                for s in range(a.steps):
                    # The demo's loop: a host batch put on the mesh, then the step.
                    m = step(model, opt, put(mod.batch_at(data, args.seed, 1000 + s,
                                                          args.batch, args.seq)))
                jax_block(m)
                times[name].append((time.perf_counter() - t0) / a.steps)
                cpu[name].append((time.process_time() - c0) / a.steps)
    results = {k: {"median_s": statistics.median(t), "min_s": min(t), "max_s": max(t),
                   "times_s": t, "cpu_median_s": statistics.median(cpu[k]),
                   "steps_per_s": 1.0 / statistics.median(t),
                   "first_steps_s": runs[k][5]} for k, t in times.items()}
    from jax_ep import experts
    return {"config": {"script": path, "demo_args": "default" if not a.quick else
                       " ".join(extra), "steps": a.steps, "rounds": a.rounds,
                       "warmup": a.warmup, "mesh": {"data": d.data, "expert": d.expert},
                       "hidden": d.hidden, "ffn": d.ffn, "experts": d.experts,
                       "top_k": d.top_k, "tokens_per_step": d.batch * d.seq,
                       "expert_matmul": experts.check_expert_matmul(
                           None if d.expert_matmul == "auto" else d.expert_matmul),
                       "platform": jax.default_backend(), "jax": jax.__version__},
            "results": results,
            "demo_over_dense": results["demo"]["median_s"] / results["dense"]["median_s"],
            "steps_per_s": results["demo"]["steps_per_s"]}


def compare_to_baseline(report, baseline) -> tuple[bool, str]:
    """(regressed, message): this run's demo/dense time ratio against a recorded one's;
    a regression is a ratio more than REGRESSION_TOLERANCE above it (steps/s themselves
    move with the machine, the ratio of two programs timed in turn much less)."""
    now, then = report["demo_over_dense"], baseline["demo_over_dense"]
    change = now / then - 1.0
    regressed = change > REGRESSION_TOLERANCE
    return regressed, (f"demo/dense step time {now:.3f} against the baseline's "
                       f"{then:.3f} ({change:+.1%}; the limit is "
                       f"+{REGRESSION_TOLERANCE:.0%}): "
                       + ("REGRESSION" if regressed else "ok"))


def format_train_step(report) -> str:
    lines = [f"{'config':<8} {'steps/s':>8} {'median ms':>10} {'min ms':>9} {'max ms':>9} "
             f"{'x dense':>8} {'cpu ms':>8}"]
    dense = report["results"]["dense"]["median_s"]
    for k, r in report["results"].items():
        lines.append(f"{k:<8} {r['steps_per_s']:>8.2f} {r['median_s'] * 1e3:>10.1f} "
                     f"{r['min_s'] * 1e3:>9.1f} {r['max_s'] * 1e3:>9.1f} "
                     f"{r['median_s'] / dense:>8.2f} {r['cpu_median_s'] * 1e3:>8.1f}")
    return "\n".join(lines)


def train_step_main(argv=None) -> dict:
    a = parse_train_step_args(argv)
    baseline = None
    if a.baseline:
        with open(a.baseline) as f:
            baseline = json.load(f)
    from jax_ep.bench._util import set_host_device_count

    set_host_device_count(8)
    load0 = _loadavg()
    report = train_step(a)
    report["load_average"] = {"start": load0, "end": _loadavg()}
    print(format_train_step(report))
    print(f"load average (1, 5, 15 min): start {load0} end {report['load_average']['end']}")
    regressed = False
    if baseline is not None:
        regressed, msg = compare_to_baseline(report, baseline)
        report["baseline"] = {"path": a.baseline, "regressed": regressed, "message": msg}
        print(msg)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {a.json}")
    if regressed:
        raise SystemExit(1)
    return report
