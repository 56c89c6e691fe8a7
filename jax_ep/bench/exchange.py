"""Benchmark of jax-ep's dispatch and combine: `python -m jax_ep.bench`.

Times, for each backend in one process, four programs (each one jitted `shard_map` over
an EP mesh of `--ranks` devices of the default JAX backend):

  dispatch   x, topk_idx, topk_weights -> recv_x, recv_topk_idx, recv_topk_weights, handle
  combine    recv_x, handle -> out
  roundtrip  dispatch then combine of recv_x (identity experts), forward only
  roundtrip_fwd_bwd  the round trip and its vjp with respect to x

Every timed call is preceded by warm-up calls of the same compiled program, cycles
through several pre-generated input sets (different tokens and routings), and waits for
its outputs; each op reports the median, min and max of `--repeats` calls. Python's
garbage collector is paused during the timed calls (as `timeit` does).

Byte accounting (the "bytes" of each result, the same for every backend): like DeepEP,
rows actually sent times row bytes, where a row is one token's hidden vector
(H * itemsize bytes). A token goes to a rank at most once, whatever number of its top-k
experts live there; rows a rank sends to itself count; rows dropped by the capacity do
not. Routing metadata (topk ids and weights, K * 8 bytes per row) is not counted.
  dispatch          = rows * row_bytes
  combine           = rows * row_bytes  (each kept row goes back once)
  roundtrip         = 2 * rows * row_bytes
  roundtrip_fwd_bwd = 4 * rows * row_bytes  (backward: combine's transpose gathers the
                      cotangent rows, dispatch's transpose combines them)
rows is averaged over the input sets (it differs slightly from routing to routing).

On CPU, the memcpy bandwidth is measured in the same run with `numpy.copyto` between large
uint8 buffers (bytes copied per second, counting each copied byte once), once with one
thread and once with one thread per CPU core, each thread copying its own share; the
faster of the two counts. It is measured before and again after the timings, and
`memcpy_GBps` is the higher of the two (on a shared machine it drifts). On other
platforms (GPU) it is the device's own copy bandwidth instead (a jitted reversal of a
large array on device 0). An op's floor is its bytes over that bandwidth: the
time a plain memcpy of the rows it must move takes on this machine.

On a GPU machine with fewer GPUs than `--ranks` (or with `--virtual-ranks`), the ranks
run as virtual ranks on GPU 0 through the CUDA harness (jax_ep.cuda.harness_dispatch,
harness_combine, harness_gather: the "ffi" backend's intranode kernels with every rank's
buffers on one GPU), on the same inputs stacked per rank [R, T, ...], with the same byte
accounting, floor and results; the reference backend is a shard_map over R devices and
is skipped there, with the reason in the table and in the JSON's "skipped_backends".
The harness runs each rank on a stream of its own and needs a hardware queue per rank:
above 8 ranks, set CUDA_DEVICE_MAX_CONNECTIONS (up to 32) before starting the bench.
On CPU, `--ranks` already gives R virtual devices and `--virtual-ranks` is an error.

Peak memory is read from XLA's compiled `memory_analysis()` of each program, per device:
argument + output + temp - alias bytes, next to argument + output bytes.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

from jax_ep.bench._util import measure_device_copy, measure_memcpy, set_host_device_count

OPS = ("dispatch", "combine", "roundtrip", "roundtrip_fwd_bwd")
# Multiples of rows * row_bytes that each op must move.
OP_ROW_FACTOR = {"dispatch": 1, "combine": 1, "roundtrip": 2, "roundtrip_fwd_bwd": 4}
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
AXIS = "ep"

QUICK = dict(tokens=128, hidden=256, repeats=3, warmup=1, input_sets=2,
             memcpy_mib=32)
FULL = dict(tokens=4096, hidden=2048, repeats=5, warmup=2, input_sets=3, memcpy_mib=256)
VIRTUAL_NOTE = ("{R} virtual ranks on device 0 through the CUDA harness (jax_ep.cuda."
                "harness_*), standing for backend 'ffi': the same intranode kernels, each "
                "phase launched for every rank in turn on one GPU; memory is of that GPU, "
                "all ranks together")
# The internode modes run one process per GPU (NVSHMEM PEs): jax_ep/bench/launch.py.
INTERNODE_MODES = ("internode", "hierarchical", "internode_low_latency")
VIRTUAL_SKIP = ("cannot run R ranks on one device: it is a shard_map program over a mesh "
                "of R devices; only the CUDA harness (ffi) has virtual ranks")


# ----------------------------------------------------------------------------- bytes

def routing_rows(topk_idx, *, num_ranks: int, num_experts: int, capacity: int) -> dict:
    """Rows that dispatch moves for a global routing `topk_idx[R * T, K]` (rank s owns
    rows s*T .. s*T+T-1). Pure numpy, no JAX.

    Returns {"counts": [R_src][R_dst] tokens sent, "received": [R] before the capacity
    cut, "kept": [R] rows kept, "rows": total rows kept (the rows actually sent)}.
    """
    import numpy as np

    idx = np.asarray(topk_idx)
    R, E = num_ranks, num_experts
    if idx.ndim != 2 or idx.shape[0] % R:
        raise ValueError(f"topk_idx must be [R * T, K] with R={R}, got {idx.shape}")
    T = idx.shape[0] // R
    el = E // R
    owner = np.where(idx >= 0, idx // el, -1)                      # [R*T, K]
    in_rank = (owner[:, :, None] == np.arange(R)).any(axis=1)      # [R*T, R]
    counts = in_rank.reshape(R, T, R).sum(axis=1)                  # [src, dst]
    received = counts.sum(axis=0)
    kept = np.minimum(received, capacity)
    return {"counts": counts.tolist(), "received": received.tolist(),
            "kept": kept.tolist(), "rows": int(kept.sum())}


def op_bytes(rows: int, hidden: int, itemsize: int) -> dict:
    """Bytes each op must move for `rows` kept rows of `hidden` elements."""
    row_bytes = hidden * itemsize
    return {op: OP_ROW_FACTOR[op] * rows * row_bytes for op in OPS}


# ----------------------------------------------------------------------------- programs

def _programs(mesh, backend, *, num_experts, capacity):
    """Jitted per-op programs over `mesh` (axis AXIS) for one backend."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    import jax_ep

    spec = P(AXIS)

    def disp(x, idx, w):
        return jax_ep.dispatch(x, idx, w, num_experts=num_experts, axis_name=AXIS,
                               capacity=capacity, backend=backend)

    # The handle crosses from the dispatch program to the combine program as its array
    # leaves (the backend's `extra` too: the internode kernels' counts and send slots),
    # scalars with a leading axis for the shard_map outputs; its structure is kept here
    # when dispatch is traced (before combine is).
    handle_tree = {}

    def pack(h):
        leaves, handle_tree["def"] = jax.tree.flatten(h)
        handle_tree["scalar"] = [jnp.ndim(v) == 0 for v in leaves]
        return tuple(v[None] if sc else v for v, sc in zip(leaves, handle_tree["scalar"]))

    def unpack(p, C):
        if "def" not in handle_tree:
            raise RuntimeError("jax_ep.bench: the combine program is traced before dispatch")
        h = jax.tree.unflatten(handle_tree["def"], [v[0] if sc else v for v, sc in
                                                    zip(p, handle_tree["scalar"])])
        if h.capacity != C:
            raise ValueError(f"jax_ep.bench: combine's y has {C} rows, the handle's "
                             f"capacity is {h.capacity}")
        return h

    def f_dispatch(x, idx, w):
        rx, ri, rw, h = disp(x, idx, w)
        return rx, ri, rw, pack(h)

    def f_combine(y, packed):
        return jax_ep.combine(y, unpack(packed, y.shape[0]), backend=backend)

    def f_roundtrip(x, idx, w):
        rx, _, _, h = disp(x, idx, w)
        return jax_ep.combine(rx, h, backend=backend)

    def f_fwd_bwd(x, idx, w, ct):
        out, vjp = jax.vjp(lambda v: f_roundtrip(v, idx, w), x)
        (dx,) = vjp(ct)
        return out, dx

    def sm(f, n_in):
        return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(spec,) * n_in, out_specs=spec))

    return {"dispatch": sm(f_dispatch, 3), "combine": sm(f_combine, 2),
            "roundtrip": sm(f_roundtrip, 3), "roundtrip_fwd_bwd": sm(f_fwd_bwd, 4)}


def _harness_programs(*, num_experts, capacity):
    """The same four programs for R virtual ranks on one GPU, through the CUDA harness
    (jax_ep.cuda.harness_*: the intranode kernels of the "ffi" backend, every rank's
    buffers on device 0). Inputs and outputs are _programs's with a leading rank axis
    [R, ...] instead of the sharded one; dispatch's handle is packed in the same order."""
    import jax

    from jax_ep import cuda

    def f_dispatch(x, idx, w):
        d = cuda.harness_dispatch(x, idx, w, num_experts=num_experts, capacity=capacity)
        return d.recv_x, d.recv_topk_idx, d.recv_topk_weights, (
            d.num_recv, d.num_dropped, d.num_recv_tokens_per_expert, d.src_rank,
            d.src_index, d.send_row)

    def f_combine(y, packed):
        return cuda.harness_combine(y, packed[5])

    def f_roundtrip(x, idx, w):
        rx, _, _, packed = f_dispatch(x, idx, w)
        return f_combine(rx, packed)

    def f_fwd_bwd(x, idx, w, ct):
        # The vjp with respect to x as ops.py defines it: combine's transpose gathers the
        # cotangent rows back to the receivers, dispatch's transpose combines them.
        rx, _, _, packed = f_dispatch(x, idx, w)
        d_rx = cuda.harness_gather(ct, packed[3], packed[4])
        return f_combine(rx, packed), f_combine(d_rx, packed)

    return {"dispatch": jax.jit(f_dispatch), "combine": jax.jit(f_combine),
            "roundtrip": jax.jit(f_roundtrip), "roundtrip_fwd_bwd": jax.jit(f_fwd_bwd)}


def _make_inputs(sharding, lead, *, n_sets, hidden, topk, experts, dtype, seed):
    """`n_sets` input sets (x, topk_idx, topk_weights, cotangent) of shapes lead + (H,) or
    lead + (K,) placed by `sharding`, plus the host copies of their routings, each
    [R * T, K] (rank s owns rows s*T .. s*T+T-1). `lead` is (R * T,) for a global array
    sharded over the EP axis, (R, T) for the harness's stacked per-rank inputs; the same
    seed gives the same values either way. Routing: each token picks `topk` distinct
    experts uniformly at random (the top-k of random scores)."""
    import math

    import jax
    import jax.numpy as jnp
    import numpy as np

    lead = tuple(lead)
    N = math.prod(lead)
    gen = jax.jit(lambda k: jax.random.normal(k, (N, hidden), jnp.float32)
                  .astype(dtype).reshape(lead + (hidden,)), out_shardings=sharding)
    rng = np.random.default_rng(seed)
    key = jax.random.key(seed)
    xs, idxs, ws, host_idx = [], [], [], []
    for _ in range(n_sets):
        key, k1 = jax.random.split(key)
        xs.append(gen(k1))
        idx = np.argsort(rng.random((N, experts)), axis=1)[:, :topk].astype(np.int32)
        w = rng.random((N, topk), dtype=np.float32)
        host_idx.append(idx)
        idxs.append(jax.device_put(idx.reshape(lead + (topk,)), sharding))
        ws.append(jax.device_put(w.reshape(lead + (topk,)), sharding))
    sets = [(xs[i], idxs[i], ws[i], xs[(i + 1) % n_sets]) for i in range(n_sets)]
    return sets, host_idx


def _global_sum(a) -> int:
    """The sum of a global array's elements, also where this process holds only some of
    its shards (several processes)."""
    import numpy as np

    if not a.is_fully_addressable:
        from jax.experimental import multihost_utils
        a = multihost_utils.process_allgather(a, tiled=True)
    return int(np.asarray(a).sum())


def _memory(compiled) -> dict:
    ma = compiled.memory_analysis()
    if ma is None:
        return {}
    arg, out = int(ma.argument_size_in_bytes), int(ma.output_size_in_bytes)
    temp, alias = int(ma.temp_size_in_bytes), int(ma.alias_size_in_bytes)
    peak = arg + out + temp - alias
    return {"argument_bytes": arg, "output_bytes": out, "temp_bytes": temp,
            "alias_bytes": alias, "peak_bytes": peak, "in_out_bytes": arg + out,
            "peak_over_in_out": peak / max(arg + out, 1)}


# ----------------------------------------------------------------------------- bench

def run_bench(*, backends, ops=OPS, ranks, tokens, hidden, topk, experts, dtype, capacity,
              repeats, warmup, input_sets, memcpy_GBps, seed=0, progress=None,
              with_memory=True, virtual=False):
    """One benchmark at one token count. Returns (config, results, memory, rows).

    virtual=True runs the `ranks` EP ranks as virtual ranks on device 0 through the CUDA
    harness (`_harness_programs`), which stands for the "ffi" backend; inputs, routing,
    byte accounting, timing and results are the same as over a mesh of `ranks` devices."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P, SingleDeviceSharding

    import jax_ep

    devices = jax.devices()
    C = ranks * tokens if capacity is None else int(capacity)
    if virtual:
        if list(backends) != ["ffi"]:
            raise ValueError(f"virtual ranks run the CUDA harness, i.e. backend 'ffi' only; "
                             f"got {list(backends)}")
        mesh, sharding, lead = None, SingleDeviceSharding(devices[0]), (ranks, tokens)
    else:
        if len(devices) < ranks:
            raise SystemExit(
                f"jax_ep.bench: --ranks {ranks} needs {ranks} devices but the default "
                f"backend ({jax.default_backend()}) has {len(devices)}. On CPU, run as "
                "`python -m jax_ep.bench` (it sets XLA_FLAGS itself) or set "
                f"XLA_FLAGS=--xla_force_host_platform_device_count={ranks} before JAX "
                "starts; on GPU, add --virtual-ranks.")
        mesh = jax.sharding.Mesh(np.array(devices[:ranks]), (AXIS,),
                                 axis_types=(jax.sharding.AxisType.Auto,))
        sharding, lead = NamedSharding(mesh, P(AXIS)), (ranks * tokens,)
    sets, host_idx = _make_inputs(sharding, lead, n_sets=input_sets, hidden=hidden,
                                  topk=topk, experts=experts, dtype=dtype, seed=seed)
    rows_per_set = [routing_rows(i, num_ranks=ranks, num_experts=experts,
                                 capacity=C)["rows"] for i in host_idx]
    rows = int(round(statistics.mean(rows_per_set)))
    nbytes = op_bytes(rows, hidden, DTYPE_BYTES[dtype])
    results, memory, errors, kept_rows = [], {}, [], {}
    for backend in backends:
        progs = (_harness_programs(num_experts=experts, capacity=C) if virtual
                 else _programs(mesh, backend, num_experts=experts, capacity=C))
        # combine's inputs: this backend's dispatch of every set.
        comp_d = progs["dispatch"].lower(*sets[0][:3]).compile()
        comb_sets = []
        for s in sets:
            rx, _, _, packed = comp_d(*s[:3])
            comb_sets.append((rx, packed))
        jax.block_until_ready(comb_sets)
        # The rows the op kept (sum of num_recv), next to rows_per_set from the routing.
        kept_rows[backend] = [_global_sum(p[0]) for _, p in comb_sets]
        memory[backend] = {}
        for op in ops:
            args = {"dispatch": [s[:3] for s in sets], "combine": comb_sets,
                    "roundtrip": [s[:3] for s in sets],
                    "roundtrip_fwd_bwd": list(sets)}[op]
            if progress is not None:
                progress.set_postfix_str(f"T={tokens} {backend} {op} (compile)")
            try:
                compiled = (comp_d if op == "dispatch"
                            else progs[op].lower(*args[0]).compile())
            except Exception as e:  # noqa: BLE001  (one broken op must not hide the rest)
                errors.append({"backend": backend, "op": op,
                               "error": f"{type(e).__name__}: {e}"[:2000]})
                print(f"jax_ep.bench: {backend} {op} failed to compile: "
                      f"{type(e).__name__}: {str(e)[:300]}", file=sys.stderr)
                if progress is not None:
                    progress.update(warmup + repeats)
                continue
            if with_memory:
                memory[backend][op] = _memory(compiled)
            if progress is not None:
                progress.set_postfix_str(f"T={tokens} {backend} {op}")
            for i in range(warmup):
                jax.block_until_ready(compiled(*args[i % len(args)]))
                if progress is not None:
                    progress.update(1)
            times = []
            # Like timeit: no Python garbage collection inside the timed calls.
            gc.collect()
            gc_was_enabled = gc.isenabled()
            gc.disable()
            try:
                for i in range(repeats):
                    a = args[(warmup + i) % len(args)]
                    t0 = time.perf_counter()
                    out = compiled(*a)
                    jax.block_until_ready(out)
                    times.append(time.perf_counter() - t0)
                    del out
                    if progress is not None:
                        progress.update(1)
            finally:
                if gc_was_enabled:
                    gc.enable()
            med = statistics.median(times)
            results.append({
                "backend": backend, "op": op, "median_s": med, "min_s": min(times),
                "max_s": max(times), "bytes": int(nbytes[op]),
                "GBps": nbytes[op] / med / 1e9,
                "floor_s": nbytes[op] / (memcpy_GBps * 1e9),
                "tokens": tokens, "times_s": times})
        del comb_sets, progs
    config = {"ranks": ranks, "tokens": tokens, "hidden": hidden, "topk": topk,
              "experts": experts, "dtype": dtype, "capacity": C, "repeats": repeats,
              "warmup": warmup, "input_sets": input_sets, "backends": list(backends),
              "platform": jax.default_backend(), "device_kind": devices[0].device_kind,
              "num_devices": len(devices), "cpu_count": os.cpu_count(),
              "jax": jax.__version__, "build": jax_ep.build_info(),
              "rows_per_set": rows_per_set, "rows": rows, "kept_rows_per_set": kept_rows,
              "row_bytes": hidden * DTYPE_BYTES[dtype], "virtual_ranks": bool(virtual)}
    if virtual:
        config["virtual_ranks_note"] = VIRTUAL_NOTE.format(R=ranks)
    if errors:
        config["errors"] = errors
    return config, results, memory, rows


def _targets(results, memory):
    """The issue's three targets, from one run (None where a backend is missing)."""
    by = {(r["backend"], r["op"]): r for r in results}
    out = {}
    f, ref = by.get(("ffi", "roundtrip")), by.get(("reference", "roundtrip"))
    if f and ref:
        out["roundtrip_speedup_ffi_vs_reference"] = ref["median_s"] / f["median_s"]
    if f:
        out["ffi_roundtrip_over_floor"] = f["median_s"] / f["floor_s"]
    mem = memory.get("ffi", {})
    if mem:
        out["ffi_peak_over_in_out"] = {op: m.get("peak_over_in_out") for op, m in mem.items()}
    return out


def format_table(results, memcpy_GBps, memory=None, skipped=None, note=None) -> str:
    head = (f"{'backend':<10} {'op':<18} {'median ms':>10} {'min ms':>9} {'max ms':>9} "
            f"{'MB moved':>9} {'GB/s':>7} {'floor ms':>9} {'x floor':>8}")
    lines = [f"memcpy bandwidth: {memcpy_GBps:.2f} GB/s", head, "-" * len(head)]
    if note:
        lines.insert(0, note)
    for r in results:
        lines.append(
            f"{r['backend']:<10} {r['op']:<18} {r['median_s'] * 1e3:>10.2f} "
            f"{r['min_s'] * 1e3:>9.2f} {r['max_s'] * 1e3:>9.2f} {r['bytes'] / 1e6:>9.1f} "
            f"{r['GBps']:>7.2f} {r['floor_s'] * 1e3:>9.2f} "
            f"{r['median_s'] / r['floor_s']:>8.2f}")
    by = {(r["backend"], r["op"]): r for r in results}
    ratios = [f"{op} {by[('reference', op)]['median_s'] / by[('ffi', op)]['median_s']:.1f}x"
              for op in OPS if ("ffi", op) in by and ("reference", op) in by]
    if ratios:
        lines.append("ffi speedup over reference: " + ", ".join(ratios))
    for backend, ops in (memory or {}).items():
        for op, m in ops.items():
            if m:
                lines.append(
                    f"memory {backend:<9} {op:<18} peak {m['peak_bytes'] / 2**20:9.1f} MiB "
                    f"(in+out {m['in_out_bytes'] / 2**20:9.1f} MiB, temp "
                    f"{m['temp_bytes'] / 2**20:8.1f} MiB) = {m['peak_over_in_out']:.2f}x "
                    "per device")
    for backend, why in (skipped or {}).items():
        lines.append(f"{backend:<10} skipped: {why}")
    return "\n".join(lines)


def plot(sweep, memcpy_GBps, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(OPS), figsize=(4.2 * len(OPS), 3.6), sharey=True)
    for ax, op in zip(axes, OPS):
        backends = sorted({r["backend"] for s in sweep for r in s["results"]})
        for b in backends:
            pts = sorted((s["tokens"], r["GBps"]) for s in sweep for r in s["results"]
                         if r["backend"] == b and r["op"] == op)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=b)
        ax.axhline(memcpy_GBps, color="gray", ls="--", lw=1, label="memcpy")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(op)
        ax.set_xlabel("tokens per rank")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("GB/s (rows moved / median time)")
    axes[-1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------- CLI

def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m jax_ep.bench",
        description="Times jax-ep dispatch/combine per backend against the memcpy floor.")
    p.add_argument("--backends", default="ffi,reference",
                   help="comma-separated: ffi, reference, auto (default: ffi,reference)")
    p.add_argument("--ranks", type=int, default=8, help="EP ranks = devices (default 8)")
    p.add_argument("--tokens", type=int, default=None, help="tokens per rank (default 4096)")
    p.add_argument("--hidden", type=int, default=None, help="hidden size (default 2048)")
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPE_BYTES))
    p.add_argument("--capacity", type=int, default=None,
                   help="rows received per rank (default ranks * tokens: never drops)")
    p.add_argument("--repeats", type=int, default=None, help="timed calls per op (default 5)")
    p.add_argument("--warmup", type=int, default=None, help="untimed calls first (default 2)")
    p.add_argument("--input-sets", type=int, default=None,
                   help="pre-generated input sets cycled through (default 3)")
    p.add_argument("--memcpy-mib", type=int, default=None,
                   help="buffer size of the memcpy measurement (default 256)")
    p.add_argument("--quick", action="store_true",
                   help="small sizes and few repeats (smoke test, tens of seconds)")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    p.add_argument("--plot", metavar="PATH",
                   help="also sweep token counts and plot GB/s per backend and op")
    p.add_argument("--sweep-tokens", default=None,
                   help="token counts of the --plot sweep (default tokens/8,/4,/2,1)")
    p.add_argument("--ops", default=",".join(OPS),
                   help=f"comma-separated subset of {','.join(OPS)} (default: all)")
    p.add_argument("--virtual-ranks", action="store_true",
                   help="GPU only: run the --ranks ranks as virtual ranks on GPU 0 through "
                        "the CUDA harness (the default when there are fewer GPUs than "
                        "--ranks); the reference backend is then skipped")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--layer", action="store_true",
                   help="benchmark the Flax MoE layer against a dense SwiGLU instead "
                        "(`--layer -h` lists its flags; see jax_ep/bench/layer.py)")
    p.add_argument("--dispatch-overhead", action="store_true",
                   help="host cost per step of a jitted step with EP calls against one "
                        "without (see jax_ep/bench/overhead.py)")
    p.add_argument("--train-step", action="store_true",
                   help="steps/s of the demo's training step (examples/train_moe.py) "
                        "against its dense twin, with --baseline to flag a regression "
                        "(`--train-step -h` lists its flags)")
    p.add_argument("--mode", choices=("normal", "low_latency") + INTERNODE_MODES,
                   default="normal",
                   help="'low_latency': time the low-latency (decode) mode instead, "
                        "fused and split send/receive (`--mode low_latency -h` lists its "
                        "flags; see jax_ep/bench/low_latency.py); default: normal. The "
                        "internode modes ('internode': direct, 'hierarchical', "
                        "'internode_low_latency') run one process per rank on GPUs, as "
                        "--processes does (jax_ep/bench/launch.py)")
    p.add_argument("--processes", type=int, default=None,
                   help="run the ranks as this many processes of this machine (= --ranks), "
                        "one device each, joined by jax.distributed; on CPU one CPU device "
                        "each with gloo. The JSON is the same; each median is the slowest "
                        "process's (jax_ep/bench/launch.py)")
    p.add_argument("--gpus-per-node", type=int, default=None,
                   help="with --processes: JAX_EP_GPUS_PER_NODE of the workers (virtual "
                        "nodes, e.g. for --mode hierarchical on one machine)")
    p.add_argument("--platform", choices=("auto", "cpu", "gpu"), default="auto",
                   help="with --processes: the workers' platform (default: gpu if this "
                        "machine shows one)")
    p.add_argument("--launch-timeout", type=float, default=None,
                   help="with --processes: seconds before every process still running is "
                        "killed (default 1800)")
    p.add_argument("--log-dir", default=None,
                   help="with --processes: keep every process's log and JSON in this (empty "
                        "or new) folder; by default a temporary one, removed after a "
                        "successful run and kept, its path printed, after a failure")
    p.add_argument("--emulated", action="store_true",
                   help="instead of timing: COUNT what the CUDA kernels do on the emulated "
                        "GPU, per mode (`--emulated -h` lists its flags; see "
                        "jax_ep/bench/emulated.py); --model adds the modelled H200 estimate")
    p.add_argument("--fp8", action="store_true",
                   help="time dispatch of bf16 rows against FP8 pairs (values + one "
                        "float32 scale per 128) instead (`--fp8 -h` lists its flags)")
    args = p.parse_args(argv)
    # The launcher (jax_ep/bench/launch.py) takes these before this parser sees the rest.
    given = [f for f, v in (("--processes", args.processes),
                            ("--gpus-per-node", args.gpus_per_node),
                            ("--launch-timeout", args.launch_timeout),
                            ("--log-dir", args.log_dir)) if v is not None]
    if args.platform != "auto":
        given.append("--platform")
    if given:
        p.error(f"{', '.join(given)} only go with --processes or an internode --mode")
    base = QUICK if args.quick else FULL
    for k in ("tokens", "hidden", "repeats", "warmup", "input_sets", "memcpy_mib"):
        if getattr(args, k) is None:
            setattr(args, k, base[k])
    if args.ranks < 1 or args.tokens < 1 or args.hidden < 1 or args.repeats < 1:
        p.error("--ranks, --tokens, --hidden and --repeats must be >= 1")
    if args.experts % args.ranks:
        p.error(f"--experts {args.experts} must be a multiple of --ranks {args.ranks}")
    if not 1 <= args.topk <= args.experts:
        p.error("--topk must be in [1, experts]")
    args.input_sets = max(1, args.input_sets)
    args.ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    bad = [o for o in args.ops if o not in OPS]
    if bad or not args.ops:
        p.error(f"--ops must name some of {', '.join(OPS)}, got {bad or 'nothing'}")
    return args


def _launch_check(kind: str, argv: list[str]) -> None:
    """The bench's own argument errors, raised by the launcher before any process starts."""
    if kind == "normal":
        parse_args(list(argv))
    else:
        from jax_ep.bench import low_latency as bench_low_latency
        bench_low_latency.parse_args(list(argv))


def _launch_table(report: dict) -> str:
    return format_table(report["results"], report["memcpy_GBps"], report.get("memory"),
                        report.get("skipped_backends"))


def main(argv=None) -> dict:
    # `--layer`: the Flax MoE layer against a dense SwiGLU (jax_ep/bench/layer.py).
    argv = sys.argv[1:] if argv is None else list(argv)
    # `--mode low_latency`: the low-latency mode at the decode shape
    # (jax_ep/bench/low_latency.py).
    argv = [a for x in argv for a in (x.split("=", 1) if x.startswith("--mode=") else [x])]
    # `--emulated` / `--model`: counts on the emulated GPU and the modelled H200 estimate
    # (jax_ep/bench/emulated.py); nothing is timed.
    if any(a in argv for a in ("--emulated", "--model", "--model-only", "--model-from")):
        from jax_ep.bench import emulated as bench_emulated
        return bench_emulated.main([x for x in argv if x != "--emulated"])
    # `--processes N`, and the internode modes: one process per rank (jax_ep/bench/launch.py).
    mode = argv[argv.index("--mode") + 1] if "--mode" in argv[:-1] else None
    if any(a == "--processes" or a.startswith("--processes=") for a in argv) or (
            mode in INTERNODE_MODES):
        if "--virtual-ranks" in argv:
            raise SystemExit("jax_ep.bench: --virtual-ranks runs every rank in this process; "
                             "it does not go with --processes or an internode --mode")
        from jax_ep.bench import launch as bench_launch
        return bench_launch.launch_main(argv, validate=_launch_check, table=_launch_table)
    if "--mode" in argv:
        i = argv.index("--mode")
        mode = argv[i + 1] if i + 1 < len(argv) else ""
        if mode not in ("normal", "low_latency"):
            raise SystemExit(f"jax_ep.bench: --mode must be 'normal' or 'low_latency', "
                             f"got {mode!r}")
        argv = argv[:i] + argv[i + 2:]
        if mode == "low_latency":
            from jax_ep.bench import low_latency as bench_low_latency
            return bench_low_latency.main(argv)
    if "--layer" in argv:
        from jax_ep.bench import layer as bench_layer
        return bench_layer.main([x for x in argv if x != "--layer"])
    if "--dispatch-overhead" in argv:  # host cost per step (jax_ep/bench/overhead.py)
        from jax_ep.bench import overhead as bench_overhead
        return bench_overhead.main([x for x in argv if x != "--dispatch-overhead"])
    if "--train-step" in argv:  # the demo's training step (jax_ep/bench/layer.py)
        from jax_ep.bench import layer as bench_layer
        return bench_layer.train_step_main([x for x in argv if x != "--train-step"])
    if "--fp8" in argv:  # FP8 pairs against bf16 rows (fp8_main below)
        return fp8_main([x for x in argv if x != "--fp8"])
    args = parse_args(argv)
    # One virtual CPU device per rank, if JAX's backends have not started yet (as under
    # `python -m jax_ep.bench`).
    set_host_device_count(args.ranks)
    import jax

    import jax_ep

    platform = jax.default_backend()
    virtual = args.virtual_ranks
    if virtual and platform != "gpu":
        raise SystemExit(
            f"jax_ep.bench: --virtual-ranks runs the ranks on one GPU through the CUDA "
            f"harness, but JAX's default backend is {platform!r}, not a GPU. On CPU, "
            f"--ranks {args.ranks} already gives {args.ranks} virtual devices: drop "
            "--virtual-ranks.")
    if not virtual and platform == "gpu" and len(jax.devices()) < args.ranks:
        virtual = True
        print(f"jax_ep.bench: {len(jax.devices())} GPU(s) for --ranks {args.ranks}: running "
              "virtual ranks on GPU 0 (--virtual-ranks)", file=sys.stderr)
    if virtual and not jax_ep.cuda.available():
        raise SystemExit("jax_ep.bench: --virtual-ranks needs a build with the CUDA backend "
                         f"(built: {jax_ep.build_info()})")

    backends = []
    skipped = {}
    for b in [b.strip() for b in args.backends.split(",") if b.strip()]:
        try:
            resolved = jax_ep.resolve_backend(b)
            if resolved == "intranode":
                resolved = "ffi"  # the benchmark's name for the intranode kernels
        except (NotImplementedError, ValueError) as e:
            skipped[b] = str(e)
            print(f"jax_ep.bench: skipping backend {b!r}: {e}", file=sys.stderr)
            continue
        if virtual and resolved != "ffi":
            skipped[resolved] = (VIRTUAL_SKIP if resolved == "reference" else
                                 "the CUDA harness runs the intranode (ffi) kernels only")
            print(f"jax_ep.bench: skipping backend {resolved!r} with virtual ranks: "
                  f"{skipped[resolved]}", file=sys.stderr)
            continue
        if resolved not in backends:
            backends.append(resolved)
    if not backends:
        raise SystemExit("jax_ep.bench: no backend left to run")

    token_list = [args.tokens]
    if args.plot:
        if args.sweep_tokens:
            token_list = sorted({int(t) for t in args.sweep_tokens.split(",")} | {args.tokens})
        else:
            token_list = sorted({max(1, args.tokens // d) for d in (8, 4, 2, 1)})

    if platform == "gpu" and not virtual and "ffi" in backends:
        # The intranode kernels' buffers (once per GPU), for the largest shape of the run.
        import numpy as np
        t_max = max(token_list)
        jax_ep.cuda.setup(
            jax.sharding.Mesh(np.array(jax.devices()[:args.ranks]), (AXIS,),
                              axis_types=(jax.sharding.AxisType.Auto,)), AXIS,
            num_tokens=t_max, hidden=args.hidden, topk=args.topk, dtype=args.dtype,
            capacity=args.capacity if args.capacity is not None else args.ranks * t_max)

    steps = len(token_list) * len(backends) * len(args.ops) * (args.warmup + args.repeats)
    try:
        from tqdm import tqdm
        bar = tqdm(total=steps + 1, desc="jax_ep.bench", unit="call", file=sys.stderr,
                   disable=args.no_progress, dynamic_ncols=True)
    except ImportError:  # progress is optional
        bar = None
    if bar is not None:
        bar.set_postfix_str("memcpy")
    # Host memcpy on CPU; on accelerators the device's own copy bandwidth.
    measure = (measure_memcpy if platform == "cpu" else measure_device_copy)
    memcpy = measure(args.memcpy_mib << 20)
    if bar is not None:
        bar.update(1)

    sweep, main_run = [], None
    for t in token_list:
        config, results, memory, rows = run_bench(
            backends=backends, ops=args.ops, ranks=args.ranks, tokens=t, hidden=args.hidden,
            topk=args.topk, experts=args.experts, dtype=args.dtype,
            capacity=args.capacity, repeats=args.repeats, warmup=args.warmup,
            input_sets=args.input_sets, memcpy_GBps=memcpy["GBps"], seed=args.seed,
            progress=bar, with_memory=(t == args.tokens), virtual=virtual)
        sweep.append({"tokens": t, "rows": rows, "results": results})
        if t == args.tokens:
            main_run = (config, results, memory)
    # Measured again at the end: on a shared machine the bandwidth drifts; the floor uses
    # the best of the two (the stricter floor).
    memcpy_end = measure(args.memcpy_mib << 20)
    memcpy["start_GBps"], memcpy["end_GBps"] = memcpy["GBps"], memcpy_end["GBps"]
    if memcpy_end["GBps"] > memcpy["GBps"]:
        memcpy["GBps"] = memcpy_end["GBps"]
        scale = memcpy["start_GBps"] / memcpy["GBps"]
        for s in sweep:
            for r in s["results"]:
                r["floor_s"] *= scale
    if bar is not None:
        bar.close()

    config, results, memory = main_run
    config["quick"] = bool(args.quick)
    report = {"config": config, "memcpy_GBps": memcpy["GBps"], "results": results,
              "memcpy": memcpy, "memory": memory,
              "memory_method": "XLA compiled memory_analysis() per device: peak = "
                               "argument + output + temp - alias bytes",
              "targets": _targets(results, memory)}
    if skipped:
        report["skipped_backends"] = skipped
    if len(sweep) > 1:
        report["sweep"] = sweep
    print(format_table(results, memcpy["GBps"], memory, skipped,
                       note=config.get("virtual_ranks_note")))
    tg = report["targets"]
    if tg:
        print("targets: " + json.dumps(tg))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {args.json}")
    if args.plot:
        plot(sweep, memcpy["GBps"], args.plot)
        print(f"wrote {args.plot}")
    return report


# ----------------------------------------------------------------------------- --fp8

def fp8_payload_bytes(hidden: int) -> dict:
    """Bytes one dispatched row carries: bf16 (2 H) against an FP8 pair (H values + H/128
    float32 scales = H + H/32)."""
    from jax_ep import fp8
    return {"bfloat16": 2 * hidden, "fp8": fp8.payload_bytes(hidden)}


def fp8_main(argv=None) -> dict:
    """`--fp8`: per-shard dispatch of bf16 rows against FP8 pairs (jax_ep.fp8.quantize;
    quantization not timed), same routing. Reports bytes per row and time per call."""
    p = argparse.ArgumentParser(
        prog="python -m jax_ep.bench --fp8",
        description="Times dispatch of bf16 rows against FP8 pairs (H + H/32 bytes a row).")
    p.add_argument("--backends", default="ffi,reference")
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--tokens", type=int, default=None, help="tokens per rank (default 4096)")
    p.add_argument("--hidden", type=int, default=None,
                   help="hidden size, a multiple of 128 (default 2048)")
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--quick", action="store_true", help="small sizes, few repeats")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    base = QUICK if a.quick else FULL
    for k in ("tokens", "hidden", "repeats", "warmup"):
        if getattr(a, k) is None:
            setattr(a, k, base[k])
    if a.hidden % 128:
        p.error(f"--hidden {a.hidden} must be a multiple of 128 (one scale per 128 values)")
    if a.experts % a.ranks:
        p.error(f"--experts {a.experts} must be a multiple of --ranks {a.ranks}")
    set_host_device_count(a.ranks)
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    import jax_ep
    from jax_ep import fp8

    R, T, H = a.ranks, a.tokens, a.hidden
    if len(jax.devices()) < R:
        raise SystemExit(f"jax_ep.bench --fp8: {len(jax.devices())} devices for --ranks {R}")
    mesh = jax.make_mesh((R,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:R])
    put = lambda v: jax.device_put(v, NamedSharding(mesh, P("ep")))  # noqa: E731
    rng = np.random.default_rng(a.seed)
    x = put(jnp.asarray(rng.standard_normal((R * T, H)), jnp.bfloat16))
    idx = put(jnp.asarray(np.argsort(rng.random((R * T, a.experts)), 1)[:, :a.topk],
                          jnp.int32))
    w = put(jnp.full((R * T, a.topk), 1.0 / a.topk, jnp.float32))
    q, sc = jax.jit(fp8.quantize)(x)
    per_row = fp8_payload_bytes(H)
    results = []
    for backend in [b.strip() for b in a.backends.split(",") if b.strip()]:
        backend = jax_ep.resolve_backend(backend)
        backend = "ffi" if backend == "intranode" else backend  # the benchmark's name
        for fmt, args in (("bfloat16", (x,)), ("fp8", (q, sc))):
            def f(*xs, idx, w, backend=backend):
                xs = xs[0] if len(xs) == 1 else xs
                rx, _, _, h = jax_ep.dispatch(xs, idx, w, num_experts=a.experts,
                                              axis_name="ep", backend=backend)
                return rx, h.num_recv[None]
            n_in = len(args)
            prog = jax.jit(jax.shard_map(
                lambda *v: f(*v[:n_in], idx=v[n_in], w=v[n_in + 1]), mesh=mesh,
                in_specs=P("ep"), out_specs=P("ep")))
            for _ in range(a.warmup):
                jax.block_until_ready(prog(*args, idx, w))
            times = []
            for _ in range(a.repeats):
                t0 = time.perf_counter()
                _, n = jax.block_until_ready(prog(*args, idx, w))
                times.append(time.perf_counter() - t0)
            rows = int(np.sum(np.asarray(n)))
            med = float(np.median(times))
            results.append({"backend": backend, "format": fmt, "bytes_per_row": per_row[fmt],
                            "rows": rows, "bytes": rows * per_row[fmt], "median_s": med,
                            "GBps": rows * per_row[fmt] / med / 1e9})
    print(f"dispatch, {R} ranks x {T} tokens, H={H}, top-{a.topk} of {a.experts}: payload "
          f"bytes per row bf16 {per_row['bfloat16']} (2H), fp8 {per_row['fp8']} (H + H/32; "
          f"{per_row['fp8'] / per_row['bfloat16']:.3f}x)")
    print(f"{'backend':<10} {'format':<9} {'B/row':>6} {'rows':>8} {'MB':>9} {'ms':>9} "
          f"{'GB/s':>7}")
    for r in results:
        print(f"{r['backend']:<10} {r['format']:<9} {r['bytes_per_row']:>6} {r['rows']:>8} "
              f"{r['bytes'] / 1e6:>9.2f} {r['median_s'] * 1e3:>9.3f} {r['GBps']:>7.2f}")
    report = {"config": {"ranks": R, "tokens": T, "hidden": H, "topk": a.topk,
                         "experts": a.experts, "repeats": a.repeats, "warmup": a.warmup,
                         "platform": jax.default_backend()},
              "payload_bytes_per_row": per_row, "results": results}
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(report, fh, indent=1)
        print(f"wrote {a.json}")
    return report

