"""`python -m jax_ep.bench --emulated`: what the CUDA kernels do, COUNTED by the emulated GPU
(kernels/emu, jax_ep._src.emu) for one configuration of each mode. These are counts of
launches, blocks, warps, bytes by access width and memory space, fences, release stores,
acquire loads, polls, puts, signals and work requests, taken while the unchanged kernel
sources run on the CPU. They are NOT measurements of a GPU, and the emulator's own
virtual time is not a GPU time.

`--model` adds jax_ep.bench.perf_model's roofline-style H200 estimate (a MODEL, every constant in
jax_ep/bench/perf_model.py) at the issue's target shapes: each mode is counted at small shapes and
every counter fitted linearly in tokens and tokens x hidden, then evaluated at the target.

Modes: intranode (normal dispatch/combine over NVLink peers), intranode_ll (intranode
low latency, send and receive halves), direct (internode, NVSHMEM), hierarchical
(internode, NVSHMEM + NVLink forwarding), internode_ll (internode low latency).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import numpy as np

MODES = ("intranode", "intranode_ll", "direct", "hierarchical", "internode_ll")
NOTE = ("COUNTED by the emulated GPU (the kernel sources run on the CPU): counts of what the "
        "kernels do, not measurements on a GPU")
LATENCY_NOTE = ("MODEL (latency-aware): bandwidth, issue, bytes in flight over latency and "
                "the longest chain of round trips, from the emulated GPU's counts (constants "
                "in jax_ep/bench/perf_model.py), not a measurement")
MODEL_NOTE = ("MODEL: a roofline-style estimate for H200 from the emulated GPU's counts "
              "(constants in jax_ep/bench/perf_model.py), not a measurement")

# Small default shapes (a minute or two on 2 CPU cores for all modes): ranks, nodes
# (internode), tokens per rank, hidden, top-k, experts; dtype bfloat16.
DEFAULTS = {
    "intranode": dict(ranks=8, tokens=8, hidden=256, topk=8, experts=256),
    "intranode_ll": dict(ranks=8, tokens=4, hidden=256, topk=8, experts=64),
    "direct": dict(ranks=4, nodes=2, tokens=8, hidden=256, topk=4, experts=32),
    "hierarchical": dict(ranks=8, nodes=2, tokens=8, hidden=256, topk=8, experts=64),
    "internode_ll": dict(ranks=4, nodes=2, tokens=4, hidden=256, topk=4, experts=32),
}
# The issue's target shapes for the model (issue 22 item 6).
TARGETS = {
    "intranode": dict(ranks=8, tokens=4096, hidden=7168, topk=8, experts=256),
    "hierarchical_2x8": dict(ranks=16, nodes=2, tokens=4096, hidden=7168, topk=8, experts=256),
    "hierarchical_4x8": dict(ranks=32, nodes=4, tokens=4096, hidden=7168, topk=8, experts=256),
    "direct_2x8": dict(ranks=16, nodes=2, tokens=4096, hidden=7168, topk=8, experts=256),
    # DeepEP's published low-latency times are of FP8 dispatch and BF16 combine
    "internode_ll": dict(ranks=16, nodes=2, tokens=128, hidden=7168, topk=8, experts=128,
                         fp8_dispatch=True),
}


def _routing(seed, R, T, K, E):
    """Each token picks K distinct experts uniformly (the top-k of random scores), from a
    stream per rank of its own: the routing does not depend on H, and the first T tokens
    at 2T are those at T. So the model's points (T, H), (2T, H) and (T, 2H) differ only in
    what they add (jax_ep.bench.perf_model.scale_counters), not in a fresh draw of the most loaded
    GPU, block or ring, whose noise a linear fit would carry to the target's T H."""
    out = np.empty((R, T, K), np.int32)
    for r in range(R):
        scores = np.random.default_rng([seed, 1, r]).random((T, E))
        out[r] = np.argsort(scores, axis=1)[:, :K]
    return out


def _rows(rng, shape):
    import ml_dtypes
    return rng.standard_normal(shape).astype(ml_dtypes.bfloat16)


def _merge(a: list[dict], b: list[dict]) -> list[dict]:
    out = []
    for x, y in zip(a, b):
        z = dict(x)
        for k, v in y.items():
            z[k] = z.get(k, 0) + v
        out.append(z)
    return out


_CACHE: dict = {}


def count_mode(mode: str, shape: dict, *, seed: int = 0,
               resident_blocks: int | None = None) -> dict[str, Any]:
    """Counts one dispatch and one combine of `mode` at `shape` (after one uncounted
    round, so buffers, credits and parities are in their steady state). Returns
    {"dispatch": [counters of each virtual GPU], "combine": [...], "seconds": wall}.
    resident_blocks: blocks one virtual GPU runs at once in the internode modes (None:
    each kernel's occupancy-table limit on 132 SMs). A (mode, shape, seed, resident_blocks)
    counted before in this process is not counted again."""
    key = (mode, json.dumps(shape, sort_keys=True), seed, resident_blocks)
    if key not in _CACHE:
        _CACHE[key] = _count_mode(mode, shape, seed=seed, resident_blocks=resident_blocks)
    return _CACHE[key]


def _count_mode(mode: str, shape: dict, *, seed: int = 0,
                resident_blocks: int | None = None) -> dict[str, Any]:
    from jax_ep._src import emu as em

    t0 = time.perf_counter()
    R, T, H, K, E = (shape[k] for k in ("ranks", "tokens", "hidden", "topk", "experts"))
    if E % R:
        raise ValueError(f"{mode}: experts {E} must be a multiple of ranks {R}")
    rng = np.random.default_rng(seed)
    x, idx = _rows(rng, (R, T, H)), _routing(seed, R, T, K, E)
    w = rng.random((R, T, K)).astype(np.float32)
    out: dict[str, Any] = {}

    def counted(name, f):
        em.reset_counters()
        r = f()
        out[name] = [em.counters(d) for d in range(R)]
        return r

    if mode == "intranode":
        C = R * T
        emu = em.Emulator(R, seed=seed + 1, resident_blocks=16)
        emu.setup(tokens=T, capacity=C, row_bytes=H * 2, topk=K)
        for counting in (False, True):
            if counting:
                d = counted("dispatch", lambda: emu.dispatch(x, idx, w, num_experts=E, capacity=C))
                counted("combine", lambda: emu.combine(d["recv_x"], d["send_row"]))
            else:
                d = emu.dispatch(x, idx, w, num_experts=E, capacity=C)
                emu.combine(d["recv_x"], d["send_row"])
    elif mode == "intranode_ll":
        M = T
        emu = em.Emulator(R, seed=seed + 1, resident_blocks=16)
        emu.setup(tokens=T, capacity=T, row_bytes=H * 2, topk=K, ll_shape=(M, K, E, H * 2))
        y = _rows(rng, (R, E // R, R * M, H))
        rpd = M * min(K, E // R)
        for counting in (False, True):
            ph = {}

            def step(name, f):
                if not counting:
                    return f()
                em.reset_counters()
                r = f()
                ph[name] = [em.counters(dd) for dd in range(R)]
                return r

            s = step("ds", lambda: emu.ll_dispatch_send(x, idx, num_experts=E, max_tokens=M))
            d = step("dr", lambda: emu.ll_dispatch_recv(s, num_experts=E, max_tokens=M, H=H,
                                                        dtype=x.dtype))
            c = step("cs", lambda: emu.ll_combine_send(y, d["first_row"], d["row_count"],
                                                       max_tokens=M, rows_per_dest=rpd))
            step("cr", lambda: emu.ll_combine_recv(c, idx, w, num_experts=E, max_tokens=M))
            if counting:
                out["dispatch"] = _merge(ph["ds"], ph["dr"])
                out["combine"] = _merge(ph["cs"], ph["cr"])
                out["halves"] = {"dispatch_send": ph["ds"], "dispatch_recv": ph["dr"],
                                 "combine_send": ph["cs"], "combine_recv": ph["cr"]}
    elif mode in ("direct", "hierarchical"):
        N = shape.get("nodes", 2)
        if R % N:
            raise ValueError(f"{mode}: ranks {R} must be a multiple of nodes {N}")
        C = R * T
        heap = max(4, (16 * R * T * (H * 2 + 64 * K)) >> 20)
        # resident_blocks None: the kernels' ptxas rows on 132 SMs (an H200), so the
        # cooperative grids of the default configuration are not cut to 16 blocks
        ie = em.InternodeEmulator(R, gpus_per_node=R // N, seed=seed + 1, heap_mib=heap,
                                  resident_blocks=resident_blocks)
        for counting in (False, True):
            if counting:
                d = counted("dispatch", lambda: ie.dispatch(x, idx, w, num_experts=E,
                                                            capacity=C, mode=mode))
                counted("combine", lambda: ie.combine(
                    np.stack([o["recv_x"] for o in d]), d, topk=K, mode=mode))
            else:
                d = ie.dispatch(x, idx, w, num_experts=E, capacity=C, mode=mode)
                ie.combine(np.stack([o["recv_x"] for o in d]), d, topk=K, mode=mode)
    elif mode == "internode_ll":
        N = shape.get("nodes", 2)
        M = T
        ie = em.InternodeEmulator(R, gpus_per_node=R // N, seed=seed + 1)
        ie.ll_init(max_tokens=M, row_bytes=H * 2, topk=K, num_experts=E)
        y = _rows(rng, (R, E // R, R * M, H))
        fp8 = bool(shape.get("fp8_dispatch", False))
        ie.ll_round(x, idx, w, y, topk=K, fp8=fp8)
        ph: dict = {}
        ie.ll_round(x, idx, w, y, topk=K, phases=ph, fp8=fp8)
        out["dispatch"] = _merge(ph["dispatch_send"], ph["dispatch_recv"])
        out["combine"] = _merge(ph["combine_send"], ph["combine_recv"])
        out["halves"] = ph
    else:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    out["seconds"] = time.perf_counter() - t0
    return out


def _total(per_device: list[dict]) -> dict[str, int]:
    t: dict[str, int] = {}
    for c in per_device:
        for k, v in c.items():
            t[k] = t.get(k, 0) + v
    return t


def row_of(mode: str, op: str, shape: dict, per_device: list[dict]) -> dict[str, Any]:
    """One table/JSON row: totals over the GPUs, grouped (jax_ep._src.emu.summarize)."""
    from jax_ep._src.emu import summarize

    tot = _total(per_device)
    s = summarize(tot)
    kernels = {n: {k: v for k, v in kv.items()} for n, kv in s["kernels"].items()}
    b = s["bytes"]
    puts = s["puts"]
    return {
        "mode": mode, "op": op, "shape": shape, "gpus": len(per_device),
        "kernels": kernels,
        "launches": sum(kv.get("launches", 0) for kv in kernels.values()),
        "max_blocks_per_launch": max([kv.get("blocks", 0) // max(kv.get("launches", 1), 1)
                                      for kv in kernels.values()] or [0]),
        "warps": sum(kv.get("warps", 0) for kv in kernels.values()),
        "bytes": b,
        "peer_bytes": sum(v for sp in ("peer",) for d in ("load", "store")
                          for v in b[d].get(sp, {}).values()),
        "local_bytes": sum(v for d in ("load", "store") for v in b[d].get("local", {}).values()),
        # bulk copies (TMA), apart from the threads' own loads and stores above
        "tma_bytes": sum(v for k, v in tot.items() if k.startswith("tma_bytes:")),
        "puts": puts, "qps": s["qps"],
        "fences": s["fences"],
        "release_stores": s.get("release_stores", 0),
        "acquire_loads": s.get("acquire_loads", 0),
        "polls": s.get("polls", 0), "sleeps": s.get("sleeps", 0),
        "atomics": s.get("atomics", 0),
        "counters": tot,
    }


def _w(b: dict, d: str, sp: str, w: int) -> int:
    by_width = b[d].get(sp, {})
    return by_width.get(w, by_width.get(str(w), 0))  # str: read back from JSON


def format_table(rows: list[dict]) -> str:
    head = (f"{'mode':<13} {'op':<9} {'GPUs':>4} {'launch':>6} {'blk/l':>5} {'warps':>6} "
            f"{'peer16 KB':>9} {'peer<16 KB':>10} {'local KB':>9} {'TMA KB':>8} {'RDMA KB':>8} "
            f"{'puts':>6} {'WRs':>6} {'sig':>5} {'f.sys':>6} {'f.gpu':>6} {'rel':>5} "
            f"{'acq':>6}")
    lines = [NOTE, "(totals over the GPUs of one call; KB = 1000 bytes)", head, "-" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['mode']:<13} {r['op']:<9} not counted: {r['error'][:150]}")
            continue
        b = r["bytes"]
        p16 = _w(b, "load", "peer", 16) + _w(b, "store", "peer", 16)
        plo = r["peer_bytes"] - p16
        rd = r["puts"].get("rdma", {})
        pp = r["puts"].get("peer", {})
        lines.append(
            f"{r['mode']:<13} {r['op']:<9} {r['gpus']:>4} {r['launches']:>6} "
            f"{r['max_blocks_per_launch']:>5} {r['warps']:>6} {p16 / 1e3:>9.1f} "
            f"{plo / 1e3:>10.1f} {r['local_bytes'] / 1e3:>9.1f} "
            f"{r.get('tma_bytes', 0) / 1e3:>8.1f} {rd.get('bytes', 0) / 1e3:>8.1f} {rd.get('puts', 0) + pp.get('puts', 0):>6} "
            f"{rd.get('wrs', 0) + pp.get('wrs', 0):>6} "
            f"{rd.get('signals', 0) + pp.get('signals', 0):>5} "
            f"{r['fences'].get('system', 0):>6} {r['fences'].get('gpu', 0):>6} "
            f"{r['release_stores']:>5} {r['acquire_loads']:>6}")
    return "\n".join(lines)


def format_markdown(rows: list[dict]) -> str:
    """The rows as a markdown table (docs/performance.md)."""
    out = ["| mode | op | GPUs | launches | blocks/launch (max) | warps | NVLink bytes at 16 B "
           "| NVLink bytes < 16 B | local bytes | bulk (TMA) bytes | RDMA bytes | puts | WRs "
           "| fences sys/gpu | release | acquire |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['mode']} | {r['op']} | not counted: {r['error'][:120]} "
                       "|  |  |  |  |  |  |  |  |  |  |  |  |  |")
            continue
        b = r["bytes"]
        p16 = _w(b, "load", "peer", 16) + _w(b, "store", "peer", 16)
        rd, pp = r["puts"].get("rdma", {}), r["puts"].get("peer", {})
        out.append(
            f"| {r['mode']} | {r['op']} | {r['gpus']} | {r['launches']} | "
            f"{r['max_blocks_per_launch']} | {r['warps']} | {p16} | {r['peer_bytes'] - p16 + pp.get('bytes', 0)} | "
            f"{r['local_bytes']} | {r.get('tma_bytes', 0)} | {rd.get('bytes', 0)} | {rd.get('puts', 0) + pp.get('puts', 0)} | "
            f"{rd.get('wrs', 0) + pp.get('wrs', 0)} | {r['fences'].get('system', 0)}/"
            f"{r['fences'].get('gpu', 0)} | {r['release_stores']} | {r['acquire_loads']} |")
    return "\n".join(out)


def count_all(modes, shapes, *, seed=0, progress=True, resident_blocks=None) -> list[dict]:
    rows = []
    for mode in modes:
        shape = shapes[mode]
        if progress:
            print(f"jax_ep.bench --emulated: counting {mode} at {shape} ...", file=sys.stderr)
        try:
            res = count_mode(mode, shape, seed=seed, resident_blocks=resident_blocks)
        except Exception as e:  # noqa: BLE001  (one mode's failure must not hide the rest)
            msg = f"{type(e).__name__}: {e}"
            for op in ("dispatch", "combine"):
                rows.append({"mode": mode, "op": op, "shape": shape, "error": msg[:2000]})
            continue
        for op in ("dispatch", "combine"):
            row = row_of(mode, op, shape, res[op])
            row["per_device"] = res[op]
            row["seconds"] = res["seconds"]
            rows.append(row)
    return rows


# ----------------------------------------------------------------------------- model

def model_points(mode: str, base: dict) -> list[dict]:
    """The small shapes a mode is counted at for the model: tokens T and 2T, hidden H and
    2H, at the target's ranks, top-k and experts."""
    T, H = base["tokens"], base["hidden"]
    return [dict(base, tokens=t, hidden=h) for t, h in ((T, H), (2 * T, H), (T, 2 * H))]


# Small shapes at the targets' ranks, experts and top-k. The tokens are enough for every
# dispatch channel of the intranode default (24, a block each: 8 tokens at 192) to get a
# few and for the random routing's load on
# the busiest GPU to be near the mean, whose excess a linear fit would carry to the target
# (at 2 tokens per rank one GPU can get twice the mean). The hierarchical targets count
# more tokens at a smaller H (still 16 vectors a row, so the source and forwarder parts
# are those of the target): a stream then holds several 16-row chunks, and the busiest
# (source, receiver) pair's share of a rank's tokens, which the busiest block carries, is
# nearer the target's (2x8: 0.56 T at 128 tokens, 0.61 at 64, 0.69 at 16, 0.43 at 4096).
# About an hour on 2 cores in all.
MODEL_COUNT = {
    "intranode": dict(TARGETS["intranode"], tokens=192, hidden=256),
    "hierarchical_2x8": dict(TARGETS["hierarchical_2x8"], tokens=128, hidden=128),
    "hierarchical_4x8": dict(TARGETS["hierarchical_4x8"], tokens=32, hidden=128),
    "direct_2x8": dict(TARGETS["direct_2x8"], tokens=32, hidden=128),
    "internode_ll": dict(TARGETS["internode_ll"], tokens=16, hidden=256),
}
MODEL_MODE = {"intranode": "intranode", "hierarchical_2x8": "hierarchical",
              "hierarchical_4x8": "hierarchical", "direct_2x8": "direct",
              "internode_ll": "internode_ll"}
# The --json summary's modes: each from one target of the model.
SUMMARY_TARGETS = {"intranode": "intranode", "hierarchical": "hierarchical_2x8",
                   "direct": "direct_2x8", "low_latency": "internode_ll"}


def run_model(names, *, seed=0, progress=True, bf16_dispatch=False,
              resident_blocks=None, tokens=None, constants=None) -> list[dict]:
    """Counts each target of `names` at its small shapes (MODEL_COUNT; `tokens` replaces
    their T) and models it with `constants` (jax_ep.bench.perf_model.H200 when None)."""
    out = []
    for name in names:
        mode = MODEL_MODE[name]
        base = dict(MODEL_COUNT[name])
        if tokens is not None:
            base["tokens"] = int(tokens)
        if bf16_dispatch:
            base.pop("fp8_dispatch", None)
        pts = model_points(mode, base)
        if progress:
            print(f"jax_ep.bench --model: counting {mode} at {len(pts)} small shapes "
                  f"({pts[0]}) ...", file=sys.stderr)
        try:
            counted = [(p, count_mode(mode, p, seed=seed, resident_blocks=resident_blocks))
                       for p in pts]
        except Exception as e:  # noqa: BLE001
            out.append({"target": name, "error": f"{type(e).__name__}: {e}"[:2000]})
            continue
        points = [{"shape": p, "dispatch": c["dispatch"], "combine": c["combine"]}
                  for p, c in counted]
        out.append(model_entry(name, points, constants))
    return out


def model_entry(name: str, points: list[dict], constants=None) -> dict:
    """The model at target `name` from its counted points [{"shape", "dispatch": [per
    GPU counters], "combine": [...]}] (kept in the JSON, so `--model-from` recomputes the
    model without counting again), with `constants` (jax_ep.bench.perf_model.H200 when None)."""
    from jax_ep.bench import perf_model as model

    k = model.H200 if constants is None else constants
    target = dict(TARGETS[name])
    if not points[0]["shape"].get("fp8_dispatch"):  # counted with a bf16 dispatch
        target.pop("fp8_dispatch", None)
    entry = {"target": name, "mode": MODEL_MODE[name], "shape": target,
             "counted_at": [p["shape"] for p in points], "ops": {}, "points": points}
    for op in ("dispatch", "combine"):
        per_dev = []
        joined = [model.op_chains(p[op]) for p in points]
        for d in range(target["ranks"]):
            src = d % points[0]["shape"]["ranks"]  # the counted GPU standing for this one
            per_dev.append(model.scale_counters(
                [(p["shape"], j[src]) for p, j in zip(points, joined)], target))
        entry["ops"][op] = model.op_time(per_dev, k)
        entry.setdefault("latency_ops", {})[op] = model.op_time_latency(per_dev, k)
    entry["verdict"] = _verdict(name, entry["ops"])
    entry["latency_verdict"] = _latency_verdict(name, entry["latency_ops"])
    return entry


# The issue-46 targets, read against the latency-aware model: intranode >= 0.75 of NVLink
# with <= 24 SMs; hierarchical >= 0.8 of DeepEP V2's 90 / 81 GB/s (EP 8x2, 12 SMs) with
# <= 12 SMs; low latency within 1.3 x DeepEP's 118 / 195 us at EP16
# (../shared/ANCHORS.md).
ISSUE46 = {"intranode": {"nvlink_fraction": 0.75, "sms": 24},
           "hierarchical": {"GBps": {"dispatch": 0.8 * 90, "combine": 0.8 * 81}, "sms": 12},
           "low_latency": {"us": {"dispatch": 1.3 * 118, "combine": 1.3 * 195}}}


def _latency_verdict(name: str, ops: dict) -> dict:
    mode = MODEL_MODE[name]
    if mode == "intranode":
        t = ISSUE46["intranode"]
        each = {op: o["nvlink_fraction"] >= t["nvlink_fraction"] and o["sms"] <= t["sms"]
                for op, o in ops.items()}
        target = "NVLink fraction >= 0.75 with <= 24 SMs"
    elif mode == "hierarchical":
        t = ISSUE46["hierarchical"]
        each = {op: o["rdma_GBps"] >= t["GBps"][op] and o["sms"] <= t["sms"]
                for op, o in ops.items()}
        target = "RDMA >= 72 / 64.8 GB/s (0.8 x DeepEP V2 90 / 81) with <= 12 SMs"
    elif mode == "internode_ll":
        t = ISSUE46["low_latency"]
        each = {op: ops[op]["time_s"] * 1e6 <= t["us"][op] for op in t["us"]}
        target = "dispatch <= 153.4 us, combine <= 253.5 us (1.3 x DeepEP EP16)"
    else:
        return {"target": "none (no published target for direct)", "met": None, "ops": {}}
    return {"target": target, "met": all(each.values()), "ops": each}


def model_summary(entries: list[dict]) -> dict:
    """The --json summary per mode: `dispatch_gbs` and `combine_gbs` (NVLink GB/s
    intranode, RDMA GB/s per GPU internode; low latency: `dispatch_us`, `combine_us`),
    `sms` (the widest launch of either op) and `latency_aware`, from the latency-aware
    model of each mode's target (SUMMARY_TARGETS)."""
    by_name = {e["target"]: e for e in entries if "latency_ops" in e}
    out = {}
    for mode, name in SUMMARY_TARGETS.items():
        e = by_name.get(name)
        if e is None:
            continue
        ops = e["latency_ops"]
        row: dict[str, Any] = {"target": name, "shape": e["shape"], "latency_aware": True,
                               "sms": max(int(o["sms"]) for o in ops.values())}
        for op, o in ops.items():
            if mode == "low_latency":
                row[f"{op}_us"] = o["time_s"] * 1e6
            elif mode == "intranode":
                row[f"{op}_gbs"] = o["nvlink_GBps"]
            else:
                row[f"{op}_gbs"] = o["rdma_GBps"]
            row[f"{op}_bound"] = o["bound"]
        row["gbs_basis"] = {"intranode": "NVLink bytes per GPU / modelled time",
                            "low_latency": None}.get(mode, "RDMA bytes per GPU / modelled time")
        row["met"] = e["latency_verdict"]["met"]
        out[mode] = row
    return out


def _verdict(name: str, ops: dict) -> dict:
    """The target of issue 22 for `name`: met when every op meets it ("ops": each op's)."""
    if name == "intranode":
        each = {op: o["nvlink_fraction"] >= 0.8 and o["sms"] <= 24 for op, o in ops.items()}
        target = "NVLink fraction >= 0.80 with <= 24 SMs"
    elif name.startswith("hierarchical"):
        each = {op: o["rdma_GBps"] >= 43 / 1.3 for op, o in ops.items()}
        target = "RDMA >= 33.1 GB/s per GPU (DeepEP 43-58 / 1.3)"
    else:
        lim = {"dispatch": 1.5 * 118e-6, "combine": 1.5 * 195e-6}
        each = {op: ops[op]["time_s"] <= lim[op] for op in lim}
        target = "dispatch <= 177 us, combine <= 292.5 us (1.5 x DeepEP EP16)"
    return {"target": target, "met": all(each.values()), "ops": each}


def verdict_words(verdict: dict, op: str) -> str:
    """'<target>: yes' / 'no' for one op, and the whole target's when that differs."""
    mine = verdict.get("ops", {}).get(op, verdict["met"])
    out = f"{verdict['target']}: {'yes' if mine else 'no'}"
    return out + ("" if mine == verdict["met"] else
                  f" (both ops: {'yes' if verdict['met'] else 'no'})")


def format_model(entries: list[dict], constants=None) -> str:
    from jax_ep.bench import perf_model as model

    k = model.H200 if constants is None else constants
    lines = [MODEL_NOTE,
             f"constants: NVLink {k.nvlink_Bps / 1e9:.0f} GB/s per direction, RDMA "
             f"{k.rdma_Bps / 1e9:.0f} GB/s (2 x 200 Gb/s), HBM {k.hbm_Bps / 1e12:.1f} TB/s, "
             f"per SM at 16 B: peer {k.sm_peer_Bps_16 / 1e9:.0f} GB/s, local "
             f"{k.sm_local_Bps_16 / 1e9:.0f} GB/s (w/16 of that at width w), bulk copies (TMA) "
             f"{k.sm_tma_Bps / 1e9:.0f} GB/s "
             f"{'beside the warps' if k.tma_overlaps else 'after the warps'}, launch "
             f"{k.launch_s * 1e6:.1f} us, fence sys {k.fence_sys_s * 1e6:.1f} us, gpu "
             f"{k.fence_gpu_s * 1e6:.1f} us, release {k.release_s * 1e6:.1f} us, WR "
             f"{k.wr_s * 1e6:.2f} us",
             "counts at small shapes scaled linearly in T and T*H to the target (see "
             "jax_ep.bench.perf_model.scale_counters)",
             f"{'target':<18} {'op':<9} {'model us':>9} {'bound':>6} {'SMs':>4} "
             f"{'NVLink frac':>11} {'RDMA GB/s':>9}  target met?"]
    for e in entries:
        if "error" in e:
            lines.append(f"{e['target']:<18} not counted: {e['error'][:150]}")
            continue
        for op, o in e["ops"].items():
            lines.append(f"{e['target']:<18} {op:<9} {o['time_s'] * 1e6:>9.1f} "
                         f"{o['bound']:>6} {o['sms']:>4} {o['nvlink_fraction']:>11.2f} "
                         f"{o['rdma_GBps']:>9.1f}  {verdict_words(e['verdict'], op)}")
    return "\n".join(lines)


def format_latency_model(entries: list[dict], constants=None) -> str:
    from jax_ep.bench import perf_model as model

    k = model.H200 if constants is None else constants
    lines = [LATENCY_NOTE,
             f"latencies: HBM {k.hbm_latency_s * 1e6:.2f} us, NVLink {k.nvlink_latency_s * 1e6:.2f}"
             f" us, RDMA {k.rdma_latency_s * 1e6:.2f} us; NIC {k.nic_wr_per_s / 1e6:.0f} M WR/s; "
             f"issue {k.sm_bytes_per_clk} B/clk/SM at {k.sm_clock_hz / 1e9:.2f} GHz",
             f"{'target':<18} {'op':<9} {'model us':>9} {'bound':>8} {'SMs':>4} "
             f"{'NVLink GB/s':>11} {'RDMA GB/s':>9} {'B/warp':>7} {'chain rnds':>10}  target met?"]
    for e in entries:
        if "latency_ops" not in e:
            continue
        v = e["latency_verdict"]
        for op, o in e["latency_ops"].items():
            fl = o["inflight_bytes_per_warp"]
            met = v["ops"].get(op)
            lines.append(
                f"{e['target']:<18} {op:<9} {o['time_s'] * 1e6:>9.1f} {o['bound']:>8} "
                f"{o['sms']:>4} {o['nvlink_GBps']:>11.1f} {o['rdma_GBps']:>9.1f} "
                f"{max(fl.values()):>7.0f} {sum(o['longest_rounds'].values()):>10.0f}  "
                f"{v['target']}: {'n/a' if met is None else ('yes' if met else 'no')}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- CLI

def model_constants(settings: list[str]):
    """jax_ep.bench.perf_model.H200 with each "name=value" of `settings` applied (--model-set): a
    float for the rates and costs, an int for num_sms, true/false (1/0) for tma_overlaps.
    ValueError names the setting that is not one."""
    import dataclasses

    from jax_ep.bench import perf_model as model

    fields = [f.name for f in dataclasses.fields(model.Constants)]
    changes: dict[str, Any] = {}
    for item in settings:
        name, eq, value = item.partition("=")
        name, value = name.strip(), value.strip()
        if not eq or name not in fields:
            raise ValueError(f"--model-set {item!r}: expected NAME=VALUE with NAME one of "
                             f"{', '.join(fields)}")
        kind = type(getattr(model.H200, name))
        try:
            if kind is bool:
                if value.lower() not in ("true", "false", "1", "0"):
                    raise ValueError(value)
                changes[name] = value.lower() in ("true", "1")
            elif kind is int:
                changes[name] = int(value)
            else:
                changes[name] = float(value)
        except ValueError:
            raise ValueError(f"--model-set {item!r}: {name} takes a {kind.__name__}, got "
                             f"{value!r}") from None
        if kind is not bool and changes[name] <= 0:
            raise ValueError(f"--model-set {item!r}: {name} must be positive")
    return dataclasses.replace(model.H200, **changes)


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m jax_ep.bench --emulated",
        description="Counts what the CUDA kernels do on the emulated GPU, per mode (counted, "
                    "not measured); --model adds a modelled H200 estimate.")
    p.add_argument("--modes", default=",".join(MODES),
                   help=f"comma-separated subset of {','.join(MODES)} (default: all)")
    p.add_argument("--ranks", type=int, help="override every mode's ranks")
    p.add_argument("--nodes", type=int, help="override the internode modes' nodes")
    p.add_argument("--tokens", type=int, help="override every mode's tokens per rank")
    p.add_argument("--hidden", type=int, help="override every mode's hidden size")
    p.add_argument("--topk", type=int, help="override every mode's top-k")
    p.add_argument("--experts", type=int, help="override every mode's experts")
    p.add_argument("--model", action="store_true",
                   help="also the modelled H200 estimate at the issue's target shapes")
    p.add_argument("--model-only", action="store_true", help="only the model")
    p.add_argument("--targets", default=",".join(TARGETS),
                   help=f"--model's targets, a subset of {','.join(TARGETS)}")
    p.add_argument("--model-tokens", type=int, metavar="T",
                   help="count the model's targets at T and 2T tokens per rank instead of "
                        "their defaults (intranode 48): a larger T brings the busiest "
                        "block's share nearer the target's, at a longer count")
    p.add_argument("--model-set", action="append", default=[], metavar="NAME=VALUE",
                   help="change one of the model's constants (jax_ep.bench.perf_model.Constants), e.g. "
                        "sm_tma_Bps=100e9 or tma_overlaps=false; repeatable")
    p.add_argument("--model-from", metavar="JSON",
                   help="recompute the model from the counted points of an earlier --json "
                        "(no counting)")
    p.add_argument("--resident-blocks", type=int, default=None,
                   help="blocks a virtual GPU runs at once in the internode modes (default: "
                        "each kernel's occupancy-table limit on 132 SMs)")
    p.add_argument("--bf16-dispatch", action="store_true",
                   help="count the low-latency model target's dispatch in bf16, not FP8 (for "
                        "kernels without the FP8 send, as the redesign's starting point)")
    p.add_argument("--json", metavar="PATH", help="write the counts (and model) as JSON")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    a.modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    bad = [m for m in a.modes if m not in MODES]
    if bad:
        p.error(f"--modes must name some of {', '.join(MODES)}, got {bad}")
    if a.model_tokens is not None and a.model_tokens < 1:
        p.error(f"--model-tokens must be a positive number of tokens per rank, got "
                f"{a.model_tokens}")
    try:
        a.constants = model_constants(a.model_set)
    except ValueError as e:
        p.error(str(e))
    a.targets = [t.strip() for t in a.targets.split(",") if t.strip()]
    bad = [t for t in a.targets if t not in TARGETS]
    if bad:
        p.error(f"--targets must name some of {', '.join(TARGETS)}, got {bad}")
    return a


def main(argv=None) -> dict:
    a = parse_args(argv)
    shapes = {m: dict(DEFAULTS[m]) for m in MODES}
    for m in MODES:
        for k in ("ranks", "tokens", "hidden", "topk", "experts"):
            if getattr(a, k) is not None:
                shapes[m][k] = getattr(a, k)
        if a.nodes is not None and "nodes" in shapes[m]:
            shapes[m]["nodes"] = a.nodes
    from jax_ep._src import emu as emulator
    report: dict[str, Any] = {"note": NOTE, "kind": "emulated_counts",
                              "module": getattr(emulator.module(), "__file__", "")}
    old = None
    if a.model_from:
        with open(a.model_from) as f:
            old = json.load(f)
    if old is not None:
        # regrouped from the saved per-GPU counters (the grouping may be newer than them)
        rows = [dict(row_of(r["mode"], r["op"], r["shape"], r["per_device"]),
                     per_device=r["per_device"], seconds=r.get("seconds"))
                if "per_device" in r else r for r in old.get("results", [])]
        report["results"] = rows
        print(format_table(rows))
    elif not a.model_only:
        rows = count_all(a.modes, shapes, seed=a.seed, resident_blocks=a.resident_blocks)
        report["results"] = rows
        print(format_table(rows))
    if old is not None or a.model or a.model_only:
        if old is not None:
            entries = [model_entry(e["target"], e["points"], a.constants) if "points" in e
                       else e for e in old.get("model", {}).get("entries", [])]
        else:
            entries = run_model(a.targets, seed=a.seed, bf16_dispatch=a.bf16_dispatch,
                                resident_blocks=a.resident_blocks, tokens=a.model_tokens,
                                constants=a.constants)
        report["model"] = {"note": MODEL_NOTE, "constants": a.constants.as_dict(),
                           "entries": entries}
        report["modes"] = model_summary(entries)
        print(format_model(entries, a.constants))
        print(format_latency_model(entries, a.constants))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
        print(f"wrote {a.json}")
    return report


if __name__ == "__main__":
    main()
