"""Planning MODEL for inter-node dispatch over multi-port NICs (not a measurement).

    python -m jax_ep.plan --nodes 4 --gpus-per-node 8 --ports 2 --port-gbps 200 \
        --lag hash --qps-per-peer 8

From routing statistics (uniform top-k over the experts by default, or a measured
probability that a token goes to a given rank), it predicts the bytes each NIC port of
one GPU carries in one dispatch and the time the busiest port needs, with the striping
of `kernels/common/striping_plan.h` and with one QP per peer. Under a hashing bond (`--lag
hash`) every QP lands on a port chosen at random, so the busiest port is, on average,
busier than its share; the model gives that expected imbalance and how many QPs per peer
bring two ports to 95% of their combined rate. `--lag affinity` means QPs are pinned to
ports round-robin (NVSHMEM multi-port), so the imbalance is at most one chunk per peer.

Everything it prints is arithmetic on the stated assumptions: link rates are nominal,
there is no congestion, no protocol overhead and no overlap with compute.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import sys

import numpy as np

from jax_ep.network.hashing import expected_max_count
from jax_ep.network.transport import TransportConfig

MODEL_LABEL = "MODEL, not a measurement: nominal link rates, no congestion or protocol overhead"

__all__ = ["hit_probability", "dispatch_row_bytes", "expected_max_count", "hash_efficiency",
           "qps_for_efficiency", "PlanInputs", "model", "format_report", "check_wire", "main"]


def hit_probability(num_experts: int, num_ranks: int, topk: int) -> float:
    """P(a token has at least one of its top-k experts on a given rank), uniform routing.

    Experts are chosen uniformly without replacement; a rank holds E/R of them.
    """
    if num_experts % num_ranks:
        raise ValueError(f"num_experts ({num_experts}) must be a multiple of ranks ({num_ranks})")
    el = num_experts // num_ranks
    k = min(topk, num_experts)
    if num_experts - el < k:
        return 1.0
    # 1 - C(E - el, k) / C(E, k)
    miss = math.exp(math.lgamma(num_experts - el + 1) - math.lgamma(num_experts - el - k + 1)
                    - math.lgamma(num_experts + 1) + math.lgamma(num_experts - k + 1))
    return 1.0 - miss


def dispatch_row_bytes(hidden: int, elem_bytes: float, topk: int) -> int:
    """Bytes of one dispatched row on the wire: the token, its k ids and weights
    (int32 + float32 each) and its source index, padded to 16 bytes: the kernels' row
    (kernels/internode/internode_layout.h `dispatch_row_stride`, through the bindings)."""
    from jax_ep._src.ext import require_ext
    return int(require_ext().internode_dispatch_row_stride(int(math.ceil(hidden * elem_bytes)),
                                                           topk))


def hash_efficiency(num_qps: int, num_ports: int) -> float:
    """Expected fraction of the ports' combined rate that equal-sized QPs reach when a
    bond hashes them at random: (share of a port) / E[busiest port]."""
    if num_qps <= 0:
        return 1.0
    return (num_qps / num_ports) / expected_max_count(num_qps, num_ports)


@functools.lru_cache(maxsize=256)
def qps_for_efficiency(num_ports: int, target: float = 0.95, peers: int = 1,
                       limit: int = 4096) -> int | None:
    """Fewest QPs per peer for which `peers` peers' QPs, hashed at random, reach `target`
    of the ports' combined rate; None if not reached by `limit`."""
    if num_ports == 1:
        return 1
    for q in range(1, limit + 1):  # efficiency is not monotone step to step: scan
        if hash_efficiency(q * peers, num_ports) >= target:
            return q
    return None


@dataclasses.dataclass
class PlanInputs:
    nodes: int = 2
    gpus_per_node: int = 8
    ports: int = 2
    port_gbps: float = 200.0
    lag: str = "affinity"  # "hash" or "affinity"
    qps_per_peer: int = 8
    tokens: int = 4096
    hidden: int = 7168
    topk: int = 8
    experts: int = 256
    elem_bytes: float = 2.0
    chunk_bytes: int = 65536
    nvlink_gbs: float = 450.0
    hit_prob: float | None = None  # measured P(token -> a given rank), overrides uniform
    # the node's fabric class (jax_ep.network.fabric), None: not modelled
    fabric: str | None = None
    lag_affinity: str = "alternate"  # roce-lag: "alternate" (per-QP member) or "none"


def _scenario(name, port_bytes, port_rate_bytes_s, total_bytes, note):
    port_bytes = -np.sort(-np.asarray(port_bytes, dtype=float))  # busiest first
    busiest = float(port_bytes.max()) if port_bytes.size else 0.0
    t = busiest / port_rate_bytes_s if port_rate_bytes_s > 0 else 0.0
    return {
        "name": name,
        "port_bytes": [float(v) for v in port_bytes],
        "busiest_port_bytes": busiest,
        "time_us": t * 1e6,
        "gpu_gbs": (total_bytes / t / 1e9) if t > 0 else 0.0,
        "note": note,
    }


FABRICS = ("ib-multiport", "roce-multiport", "roce-lag", "multi-plane", "single-port")


def _fabric_scenarios(inp, cfg, striped_ports, rate, rdma_total):
    """What the wire does on this fabric class: (summary, scenarios first in the list).

    On a RoCE LAG the GPU's QPs bypass the bond's hash: without per-QP LAG affinity
    every QP is modelled on ONE member; with it (alternate), QP q is on member q % P and
    the striping holds. Separate ports (IB or RoCE, multi-plane) pin QPs round-robin."""
    if inp.fabric not in FABRICS:
        raise ValueError(f"fabric must be one of {FABRICS}, got {inp.fabric!r}")
    if inp.lag_affinity not in ("none", "alternate"):
        raise ValueError(f"lag_affinity must be 'none' or 'alternate', got "
                         f"{inp.lag_affinity!r}")
    P = inp.ports
    one = [float(rdma_total)] + [0.0] * (P - 1)
    scen = []
    if inp.fabric == "roce-lag":
        scen.append(_scenario(
            f"roce-lag, affinity alternate: {cfg.num_qps} QPs/peer on {P} members",
            striped_ports, rate, rdma_total, "QP q pinned to member q % P by "
            "lag_tx_port_affinity; members differ by at most one chunk per peer"))
        scen.append(_scenario(
            "roce-lag, no affinity: every QP on one member", one, rate, rdma_total,
            "GPU-initiated QPs bypass the bond's hash; NVSHMEM sets no affinity and one "
            "UDP source port"))
        chosen = scen[0] if inp.lag_affinity == "alternate" else scen[1]
        used = P if inp.lag_affinity == "alternate" else 1
    elif inp.fabric == "single-port":
        scen.append(_scenario("single-port: one port carries everything", [float(
            rdma_total)], rate, rdma_total, "nothing to stripe over"))
        chosen, used = scen[0], 1
    else:
        scen.append(_scenario(f"{inp.fabric}: {cfg.num_qps} QPs/peer pinned round-robin",
                              striped_ports, rate, rdma_total,
                              "one device per port (or plane); NVSHMEM multi-port on, "
                              "the device list fixed by jax-ep"))
        chosen, used = scen[0], P
    summary = {"class": inp.fabric, "lag_affinity": inp.lag_affinity,
               "ports_used": used, "scenario": chosen["name"], "time_us": chosen["time_us"]}
    return summary, scen


def model(inp: PlanInputs) -> dict:
    """The model's numbers for one GPU's NIC in one dispatch (see module docstring)."""
    if inp.lag not in ("hash", "affinity"):
        raise ValueError("lag must be 'hash' or 'affinity'")
    for f in ("nodes", "gpus_per_node", "ports", "qps_per_peer", "tokens", "hidden", "topk",
              "experts", "chunk_bytes"):
        if getattr(inp, f) < 1:
            raise ValueError(f"{f} must be >= 1")
    ranks = inp.nodes * inp.gpus_per_node
    p_hit = inp.hit_prob if inp.hit_prob is not None else hit_probability(
        inp.experts, ranks, inp.topk)
    if not 0.0 <= p_hit <= 1.0:
        raise ValueError("hit_prob must be in [0, 1]")
    row = dispatch_row_bytes(inp.hidden, inp.elem_bytes, inp.topk)
    per_peer = int(round(inp.tokens * p_hit * row))  # expected bytes to one peer
    remote_peers = (inp.nodes - 1) * inp.gpus_per_node
    local_peers = inp.gpus_per_node - 1
    rdma_total = per_peer * remote_peers
    nvlink_total = per_peer * local_peers
    rate = inp.port_gbps * 1e9 / 8  # bytes/s per port
    P, Q = inp.ports, inp.qps_per_peer
    qpp = max(1, Q // P)

    # Striping with the library's plan: per-peer chunks over ports, summed over peers.
    cfg = TransportConfig(num_ports=P, qps_per_port=qpp, chunk_bytes=inp.chunk_bytes)
    peer_ids = [n * inp.gpus_per_node + g for n in range(1, inp.nodes)
                for g in range(inp.gpus_per_node)]
    sizes = np.zeros(max(peer_ids) + 1 if peer_ids else 0, np.int64)
    sizes[peer_ids] = per_peer
    striped_ports = cfg.stripe(sizes).port_bytes.sum(axis=0) if peer_ids else np.zeros(P)

    scenarios = []
    fabric = None
    if inp.fabric is not None:
        fabric, fab_scen = _fabric_scenarios(inp, cfg, striped_ports, rate, rdma_total)
        scenarios.extend(fab_scen)
    if inp.lag == "affinity":
        scenarios.append(_scenario(
            f"striped, {cfg.num_qps} QPs/peer pinned round-robin", striped_ports, rate,
            rdma_total, "ports differ by at most one chunk per peer"))
        one_qp = np.zeros(P, dtype=np.int64)
        for peer in peer_ids:  # one QP per peer, on the peer's start port
            one_qp[cfg.start_port(peer)] += per_peer
        scenarios.append(_scenario("1 QP/peer, multi-port (rotated)", one_qp, rate, rdma_total,
                                   "a single pair uses one port: 1/P of the NIC"))
        scenarios.append(_scenario("1 QP/peer, multi-port off", [rdma_total] + [0.0] * (P - 1),
                                   rate, rdma_total, "every QP on the first port"))
        eff_striped = 1.0
    else:
        for q, label in ((Q, f"striped, {Q} QPs/peer hashed by the bond"),
                         (1, "1 QP/peer hashed by the bond")):
            m = q * remote_peers
            emax = expected_max_count(m, P)
            share = rdma_total / m if m else 0.0
            busiest = emax * share
            rest = (rdma_total - busiest) / (P - 1) if P > 1 else 0.0
            scenarios.append(_scenario(
                label, [busiest] + [rest] * (P - 1), rate, rdma_total,
                f"expected busiest port over random hashes of {m} QPs "
                f"(efficiency {hash_efficiency(m, P):.3f})"))
        eff_striped = hash_efficiency(Q * remote_peers, P)

    nvlink_time_us = nvlink_total / (inp.nvlink_gbs * 1e9) * 1e6 if inp.nvlink_gbs > 0 else 0.0
    return {
        "label": MODEL_LABEL,
        "inputs": dataclasses.asdict(inp),
        "ranks": ranks,
        "hit_probability": p_hit,
        "row_bytes": row,
        "bytes_per_peer": per_peer,
        "remote_peers": remote_peers,
        "rdma_bytes_per_gpu": rdma_total,
        "nvlink_bytes_per_gpu": nvlink_total,
        "nvlink_time_us": nvlink_time_us,
        "ideal_rdma_time_us": rdma_total / (rate * P) * 1e6 if P else 0.0,
        "scenarios": scenarios,
        "fabric": fabric,
        "striped_efficiency": eff_striped,
        "hash_efficiency_one_pair": {str(q): hash_efficiency(q, P) for q in (1, 2, 4, 8, 16, 32)},
        "qps_per_peer_for_95pct_one_pair": qps_for_efficiency(P, 0.95, 1),
        "qps_per_peer_for_95pct_all_peers": qps_for_efficiency(P, 0.95, max(remote_peers, 1)),
    }


def format_report(m: dict) -> str:
    i = m["inputs"]
    lines = [
        f"# {m['label']}",
        f"# {i['nodes']} nodes x {i['gpus_per_node']} GPUs = {m['ranks']} ranks; NIC per GPU: "
        f"{i['ports']} x {i['port_gbps']:g} Gb/s, lag={i['lag']}",
        f"# {i['tokens']} tokens/rank, hidden {i['hidden']}, top-{i['topk']} of "
        f"{i['experts']} experts, {i['elem_bytes']:g} B/elem -> {m['row_bytes']} B/row",
        f"P(token -> given rank)         {m['hit_probability']:.4f}",
        f"bytes to each peer             {m['bytes_per_peer'] / 1e6:.3f} MB",
        f"RDMA bytes per GPU             {m['rdma_bytes_per_gpu'] / 1e6:.3f} MB "
        f"to {m['remote_peers']} remote peers",
        f"NVLink bytes per GPU           {m['nvlink_bytes_per_gpu'] / 1e6:.3f} MB "
        f"({m['nvlink_time_us']:.1f} us at {i['nvlink_gbs']:g} GB/s)",
        f"ideal RDMA time (all ports)    {m['ideal_rdma_time_us']:.1f} us",
    ]
    if m.get("fabric"):
        f = m["fabric"]
        lines.append(f"fabric {f['class']} (lag affinity {f['lag_affinity']}): "
                     f"{f['ports_used']} port(s) used, {f['time_us']:.1f} us")
    lines += [
        "",
        f"{'scenario':48s} {'port MB (busiest first)':28s} {'time us':>9s} {'GB/s/GPU':>9s}",
    ]
    for s in m["scenarios"]:
        ports = " ".join(f"{b / 1e6:.2f}" for b in s["port_bytes"])
        lines.append(f"{s['name']:48s} {ports:28s} {s['time_us']:9.1f} {s['gpu_gbs']:9.2f}")
        lines.append(f"    {s['note']}")
    lines.append("")
    lines.append("random bond hashing, one pair: expected share of the ports' combined rate")
    lines.append("  " + "  ".join(f"{q} QPs: {e:.3f}" for q, e in
                                  m["hash_efficiency_one_pair"].items()))
    q1 = m["qps_per_peer_for_95pct_one_pair"]
    qa = m["qps_per_peer_for_95pct_all_peers"]
    lines.append(f"QPs per peer for 95% of {i['ports']} ports: one pair alone {q1}; "
                 f"all {m['remote_peers']} peers at once {qa}")
    lines.append(f"# {m['label']}")
    return "\n".join(lines)


# --- --check-wire: the compiled path's QP choice against the plan --------------------

def _compiled_wire(ext):
    """The kernels' send and wait schedule through the bindings of
    kernels/internode/wire_protocol.h: (channel_of_qp, expected_signal)."""
    return ext.internode_channel_of_qp, ext.internode_expected_signal


def check_wire(cfg: TransportConfig, ranks: int, stream_bytes: int, *, qp_api: bool = True,
               channel_of_qp=None, expected_signal=None) -> dict:
    """Replays the QP choice of the compiled path for every (sender, peer, channel, chunk)
    of a `stream_bytes` stream and compares it with the plan (`cfg.qp_for`).

    Compiled path: CTA q (logical QP q) sends, to each peer, the chunks j of the channel
    channel_of_qp(peer, q) (j = channel mod num_qps), with data and signal on QP q's
    handle (QP API), signalling word (kind, sender, q); the receiver waits for
    expected_signal(chunks, receiver, q) on each word. Returns {"ok", "checked",
    "disagreements": [...], "losses": [...], ...}.
    qp_api=False replays the fallback: one port (cfg.single_port()); the QP of each put
    is then NVSHMEM's choice, which is reported as a loss, not checked.
    """
    if channel_of_qp is None or expected_signal is None:
        from jax_ep._src import ext as _ext
        ext = _ext.ext
        if ext is None or not hasattr(ext, "internode_channel_of_qp"):
            raise RuntimeError("--check-wire needs the compiled extension (pip install -e .)")
        c, e = _compiled_wire(ext)
        channel_of_qp = channel_of_qp or c
        expected_signal = expected_signal or e
    wire_cfg = cfg if qp_api else cfg.single_port()
    P, Q, NQ, cb = wire_cfg.num_ports, wire_cfg.qps_per_port, wire_cfg.num_qps, cfg.chunk_bytes
    from jax_ep._src.ext import require_ext
    chunk = int(require_ext().internode_wire_chunk_bytes(cb))  # the kernels' chunk on the wire
    n = 0 if stream_bytes <= 0 else (stream_bytes + chunk - 1) // chunk
    bad, checked = [], 0
    for sender in range(ranks):
        for peer in range(ranks):
            if peer == sender:
                continue
            sent_by = {}
            for q in range(NQ):
                ch = int(channel_of_qp(peer, q, P, Q))
                for j in range(ch, n, NQ) if ch >= 0 else ():
                    if j in sent_by:
                        bad.append(f"peer {peer} chunk {j} sent on QPs {sent_by[j]} and {q}")
                    sent_by[j] = q
                # the receiver's wait must count exactly this QP's chunks plus its closing
                want = sum(1 for j in range(n) if j % NQ == ch) + 1 if ch >= 0 else 1
                got = int(expected_signal(n, peer, q, P, Q))
                if got != want:
                    bad.append(f"peer {peer} QP {q}: receiver waits for {got} signals, the "
                               f"sender sends {want}")
            for j in range(n):
                checked += 1
                plan_qp, plan_port = wire_cfg.qp_for(peer, j % NQ, j)
                q = sent_by.get(j)
                if q is None:
                    bad.append(f"sender {sender} peer {peer} chunk {j}: never sent")
                elif q != plan_qp or q % P != plan_port:
                    bad.append(f"sender {sender} peer {peer} chunk {j}: plan says QP "
                               f"{plan_qp} (port {plan_port}), the wire uses QP {q} "
                               f"(port {q % P})")
    losses = []
    if not qp_api:
        if cfg.num_ports > 1:
            losses.append(f"no striping across ports: all {n} chunks per peer on one port, "
                          f"not {cfg.num_ports}")
        losses.append("no explicit QP handles: the QP of each put is NVSHMEM's choice "
                      "(CTA q -> RC QP q mod NVSHMEM_IBGDA_NUM_RC_PER_PE with RC_MAP_BY=cta), "
                      "so the plan's QP is not guaranteed on the wire")
    return {"ok": not bad, "checked": checked, "chunks_per_stream": n, "ranks": ranks,
            "path": "qp_api" if qp_api else "fallback", "ports": P, "qps_per_port": Q,
            "chunk_bytes": chunk, "disagreements": bad[:50], "num_disagreements": len(bad),
            "losses": losses}


LOG_KEYS = ("src", "dst", "qp", "port", "bytes")
SIGNAL_ADD = 5  # NVSHMEM_SIGNAL_ADD: the data chunks' put-with-signal


def check_wire_log(cfg: TransportConfig, records) -> dict:
    """Compares a transport log with the plan; cannot pass on a mismatch.

    records: iterable of {"src", "dst", "qp", "port", "bytes"} (and optionally "call",
    to keep the streams of several calls apart): the bytes a put carried, the logical QP
    handle it went through and the port that handle is on (from an emulated run's
    transport log, or the recorded QP handle -> (device, port) table on hardware). For
    each (call, src, dst) stream the bytes per QP and per port must equal
    `cfg.stripe` of the stream's total (chunks rounded to 16 bytes, as the kernels do),
    and every record's port must be its QP's planned port (q % num_ports).
    Records with a "sig_op" other than SIGNAL_ADD (5) are the control puts (headers and
    count rows: put-with-signal SET on the control QP, as the emulated NVSHMEM's put log
    writes them) and are counted apart, not checked against the stripe.
    """
    import dataclasses as dc

    from jax_ep._src.ext import require_ext
    wire_cfg = dc.replace(cfg, num_channels=None, chunk_bytes=int(
        require_ext().internode_wire_chunk_bytes(cfg.chunk_bytes)))
    streams: dict = {}
    bad = []
    n = control = 0
    for i, r in enumerate(records):
        if not isinstance(r, dict):
            raise ValueError(f"log record {i} must be an object with keys {LOG_KEYS}, "
                             f"got {r!r}")
        if "sig_op" in r and r["sig_op"] != SIGNAL_ADD:
            control += 1
            continue
        n += 1
        missing = [k for k in LOG_KEYS if k not in r]
        if missing:
            raise ValueError(f"log record {i} lacks {missing}: {r}")
        try:
            src, dst, qp, nbytes = (int(r[k]) for k in ("src", "dst", "qp", "bytes"))
        except (TypeError, ValueError):
            raise ValueError(f"log record {i}: src, dst, qp and bytes must be integers: "
                             f"{r}") from None
        if nbytes < 0 or dst < 0 or src < 0:
            raise ValueError(f"log record {i}: negative src, dst or bytes: {r}")
        port = r["port"]
        if not 0 <= qp < wire_cfg.num_qps:
            bad.append(f"record {i}: QP {qp} is not one of the plan's {wire_cfg.num_qps}")
            continue
        if port != qp % wire_cfg.num_ports:
            bad.append(f"record {i}: src {src} dst {dst} QP {qp} went out on port {port}, "
                       f"the plan binds QP {qp} to port {qp % wire_cfg.num_ports}")
        s = streams.setdefault((r.get("call", 0), src, dst), {"qp": {}, "port": {}})
        s["qp"][qp] = s["qp"].get(qp, 0) + nbytes
        s["port"][port] = s["port"].get(port, 0) + nbytes
    for (call, src, dst), s in sorted(streams.items(), key=lambda kv: str(kv[0])):
        total = sum(s["qp"].values())
        sizes = np.zeros(dst + 1, np.int64)
        sizes[dst] = total
        plan = wire_cfg.stripe(sizes)
        want_qp = plan.qp_bytes[dst]
        want_port = plan.port_bytes[dst]
        for q in range(wire_cfg.num_qps):
            got = s["qp"].get(q, 0)
            if got != int(want_qp[q]):
                bad.append(f"call {call} src {src} dst {dst}: QP {q} carried {got} bytes, "
                           f"the plan {int(want_qp[q])} (stream of {total} bytes)")
        for p in range(wire_cfg.num_ports):
            got = s["port"].get(p, 0)
            if got != int(want_port[p]):
                bad.append(f"call {call} src {src} dst {dst}: port {p} carried {got} bytes, "
                           f"the plan {int(want_port[p])}")
    return {"ok": not bad and n > 0, "records": n, "control_records": control,
            "streams": len(streams),
            "ports": wire_cfg.num_ports, "qps_per_port": wire_cfg.qps_per_port,
            "chunk_bytes": wire_cfg.chunk_bytes, "disagreements": bad[:50],
            "num_disagreements": len(bad) + (0 if n else 1),
            **({} if n else {"empty": "the log has no records"})}


def _load_log(path: str) -> list:
    """A JSON list of records, or JSON lines (one record per line)."""
    with open(path) as f:
        text = f.read()
    t = text.strip()
    if t.startswith("["):
        return json.loads(t)
    if t.startswith("{") and '"records"' in t.split("\n", 1)[0]:
        return json.loads(t)["records"]
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _check_log_main(args: dict) -> int:
    qps = args["qps_per_port"] or max(1, args["qps_per_peer"] // max(args["ports"], 1))
    try:
        cfg = TransportConfig(num_ports=args["ports"], qps_per_port=qps,
                              chunk_bytes=args["chunk_bytes"])
        r = check_wire_log(cfg, _load_log(args["log"]))
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args["json"]:
        print(json.dumps(r, indent=1))
    else:
        print(f"check-wire (log {args['log']}): {r['records']} records, {r['streams']} "
              f"streams, {r['ports']} ports x {r['qps_per_port']} QPs, chunks of "
              f"{r['chunk_bytes']} B: " + ("the wire agrees with the plan" if r["ok"] else
                                            f"{r['num_disagreements']} DISAGREEMENTS"))
        for line in r["disagreements"]:
            print("  " + line)
        if r.get("empty"):
            print("  " + r["empty"])
    return 0 if r["ok"] else 1


def _check_wire_main(args: dict) -> int:
    path = args["path"]
    if path == "auto":
        from jax_ep._src import ext as _ext_mod
        nv = _ext_mod.nvshmem_ext()  # the NVSHMEM module, where built and loadable
        avail = bool(nv is not None and getattr(nv, "nvshmem_qp_api_available", None)
                     and nv.nvshmem_qp_api_available())
        path = "qp_api" if avail else "fallback"
    qps = args["qps_per_port"] or max(1, args["qps_per_peer"] // max(args["ports"], 1))
    cfg = TransportConfig(num_ports=args["ports"], qps_per_port=qps,
                          chunk_bytes=args["chunk_bytes"])
    ranks = args["ranks"] or args["nodes"] * args["gpus_per_node"]
    stream = args["stream_bytes"] or 2 * cfg.num_qps * cfg.chunk_bytes + 17
    try:
        r = check_wire(cfg, ranks, stream, qp_api=(path == "qp_api"))
    except (RuntimeError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args["json"]:
        print(json.dumps(r, indent=1))
    else:
        print(f"check-wire ({r['path']}): {ranks} ranks, {r['ports']} ports x "
              f"{r['qps_per_port']} QPs, {r['chunks_per_stream']} chunks of "
              f"{r['chunk_bytes']} B per stream, {r['checked']} chunks checked: "
              + ("agrees with the plan" if r["ok"] else
                 f"{r['num_disagreements']} DISAGREEMENTS"))
        for line in r["disagreements"]:
            print("  " + line)
        for line in r["losses"]:
            print("  fallback loses: " + line)
    return 0 if r["ok"] else 1


SUBCOMMANDS = """subcommands:
  modes       the direct vs hierarchical internode model over node counts and ports
              (python -m jax_ep.plan modes --help)

Without a subcommand: the striping plan and time model of one configuration (the
options above); --check-wire / --check-schedule compare the plan with a transport log
or with the compiled kernels' QP choice."""


def _parser() -> argparse.ArgumentParser:
    d = PlanInputs()
    ap = argparse.ArgumentParser(prog="python -m jax_ep.plan", description=MODEL_LABEL,
                                 usage="%(prog)s [modes ...] [options]",
                                 epilog=SUBCOMMANDS,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=d.nodes)
    ap.add_argument("--gpus-per-node", type=int, default=d.gpus_per_node)
    ap.add_argument("--ports", type=int, default=d.ports)
    ap.add_argument("--port-gbps", type=float, default=d.port_gbps)
    ap.add_argument("--lag", choices=["hash", "affinity"], default=d.lag)
    ap.add_argument("--qps-per-peer", type=int, default=d.qps_per_peer)
    ap.add_argument("--tokens", type=int, default=d.tokens)
    ap.add_argument("--hidden", type=int, default=d.hidden)
    ap.add_argument("--topk", type=int, default=d.topk)
    ap.add_argument("--experts", type=int, default=d.experts)
    ap.add_argument("--elem-bytes", type=float, default=d.elem_bytes,
                    help="bytes per hidden element on the wire (2 = bf16, ~1.03 = fp8+scales)")
    ap.add_argument("--chunk-bytes", type=int, default=d.chunk_bytes)
    ap.add_argument("--nvlink-gbs", type=float, default=d.nvlink_gbs)
    ap.add_argument("--hit-prob", type=float, default=None,
                    help="measured P(token -> a given rank); default: uniform top-k routing")
    ap.add_argument("--json", action="store_true", help="print the model as JSON")
    f = ap.add_argument_group("the node's fabric (jax_ep.network.fabric)")
    f.add_argument("--fabric", choices=list(FABRICS), default=None,
                   help="model what the wire does on this fabric class")
    f.add_argument("--lag-affinity", choices=["none", "alternate"], default="alternate",
                   help="roce-lag: per-QP member affinity (alternate) or none (one member)")
    f.add_argument("--from-sysfs", default=None, metavar="ROOT",
                   help="discover the fabric class, ports and port rate from sysfs")
    f.add_argument("--gpu", default=None, help="with --from-sysfs: the GPU's PCI bus id")
    f.add_argument("--pes-per-node", type=int, default=None, metavar="N",
                   help="with --from-sysfs and --gpu: the ports are those NVSHMEM opens for "
                        "that GPU's PE when the node runs N PEs (its selection, modelled: "
                        "jax_ep.network.fabric.nvshmem_report)")
    w = ap.add_argument_group("--check-wire: the wire (a transport log) against the plan")
    w.add_argument("--check-wire", action="store_true",
                   help="compare the bytes per QP handle and per port of a transport log "
                        "(--log) with the plan; exit 1 on any disagreement")
    w.add_argument("--log", default=None,
                   help="transport log: JSON list or JSON lines of {src, dst, qp, port, "
                        "bytes[, call]} records")
    w.add_argument("--check-schedule", action="store_true",
                   help="replay the compiled kernels' QP choice and waits for every (peer, "
                        "channel, chunk) against the plan (the schedule, not the wire)")
    w.add_argument("--ranks", type=int, default=None, help="default: nodes * gpus-per-node")
    w.add_argument("--qps-per-port", type=int, default=None,
                   help="default: qps-per-peer // ports")
    w.add_argument("--stream-bytes", type=int, default=None,
                   help="bytes per peer stream (default: 2 chunks per QP + 17)")
    w.add_argument("--path", choices=["auto", "qp_api", "fallback"], default="auto",
                   help="auto: what this install's NVSHMEM supports")
    return ap


_CHECK_WIRE_ONLY = ("check_wire", "ranks", "qps_per_port", "stream_bytes", "path", "log",
                    "check_schedule", "from_sysfs", "gpu")


def _apply_sysfs(args: dict) -> str | None:
    """--from-sysfs: the fabric class, ports and port rate from discovery; an error
    message if the fabric is unknown."""
    from jax_ep.network import fabric as fb

    f = fb.discover(args["from_sysfs"], args["gpu"])
    if f.fabric_class == "unknown":
        return f"--from-sysfs {args['from_sysfs']}: fabric unknown ({f.reason})"
    args["fabric"] = f.fabric_class
    args["ports"] = max(f.usable_ports, 1)
    ppn = args.pop("pes_per_node", None)
    if ppn is not None:
        if args["gpu"] is None:
            return "--pes-per-node needs --gpu"
        rep = fb.nvshmem_report(f, ppn, num_ports=args["ports"])
        if f.fabric_class != "roce-lag":  # a bond's members are the plan's ports
            args["ports"] = max(rep.get("num_ports", 1), 1)
    rates = [p.rate_gbps for d in f.devices for p in d.ports
             if (d.name, p.num) in f.selected and p.rate_gbps]
    if rates:
        args["port_gbps"] = min(rates)
    return None


def main(argv=None) -> int:
    # `python -m jax_ep.plan modes ...`: the direct vs hierarchical model (network/modes.py)
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["modes"]:
        from jax_ep.network import modes
        return modes.main(argv[1:], prog="python -m jax_ep.plan modes")
    args = vars(_parser().parse_args(argv))
    if args["check_wire"]:
        if not args["log"]:
            print("error: --check-wire compares a transport log with the plan: give --log "
                  "FILE (records {src, dst, qp, port, bytes}); --check-schedule replays the "
                  "compiled QP choice instead", file=sys.stderr)
            return 2
        return _check_log_main(args)
    if args["check_schedule"]:
        return _check_wire_main(args)
    if args["from_sysfs"]:
        try:
            why = _apply_sysfs(args)
        except ValueError as e:
            why = str(e)
        if why:
            print(f"error: {why}", file=sys.stderr)
            return 2
    args.pop("pes_per_node", None)
    for k in _CHECK_WIRE_ONLY:
        args.pop(k)
    as_json = args.pop("json")
    try:
        m = model(PlanInputs(**args))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(m, indent=1) if as_json else format_report(m))
    return 0


if __name__ == "__main__":
    sys.exit(main())
