"""MODEL of the two internode modes on the same routing (not a measurement).

    python -m jax_ep.plan modes --nodes 2 4 8 16 --routing node-limited --ports 1 2 --json

For routing drawn from a seeded sampler (uniform top-k, or DeepSeek-V3-like node-limited
routing: the experts of one node form a group, each token picks at most
`max_nodes` groups uniformly at random and its top-k experts uniformly among them), it
counts what one GPU sends in one dispatch and one combine:

- direct: one row per (token, remote GPU holding one of its experts), every GPU an RDMA
  peer;
- hierarchical: one row per (token, remote node), to the rail peer there, which forwards
  it over NVLink to each GPU of its node that holds one of the token's experts.
  Combine sums a token's rows inside the node first (the order of
  kernels/common/combine_order.h, which every backend follows), so one row per
  (token, remote node) crosses the network back: the same rows as dispatch.

Bytes per port use the striping plan per stream (one stream per peer: per remote GPU in
direct mode, per remote node in hierarchical mode); `lag=hash` (a bond hashing each QP
onto a port) uses the expected busiest port over random hashes of the QPs, as
`jax_ep.plan`. Time is the busiest port's bytes at the nominal port rate. Everything is
arithmetic on these assumptions: no congestion, no protocol overhead, no overlap.

`HierLayout` / `hier_state_bytes` are kernels/internode/hierarchical_layout.h's, through its
bindings (`jax_ep.network.hier_layout`, re-exported here); the direct mode's rows are
kernels/internode/internode_layout.h's.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import numpy as np

from jax_ep._src.ext import require_ext
from jax_ep.network.hier_layout import (  # noqa: F401 (re-exported)
    MAX_GPUS_PER_NODE, META_WORDS, NVL_RING_ROWS, RDMA_CHUNK_ROWS, RDMA_RING_CHUNKS,
    HierLayout, hier_combine_row_stride, hier_dispatch_row_stride, hier_layout,
    hier_meta_offset, hier_state_bytes)
from jax_ep.network.topology import Topology

MODEL_LABEL = ("MODEL, not a measurement: sampled routing, nominal link rates, no "
               "congestion or protocol overhead")

__all__ = ["MODEL_LABEL", "RDMA_CHUNK_ROWS", "RDMA_RING_CHUNKS", "NVL_RING_ROWS",
           "META_WORDS", "HierLayout", "hier_layout", "hier_state_bytes",
           "direct_state_bytes", "sample_routing", "traffic", "ModeInputs", "model",
           "format_report", "main"]


def direct_state_bytes(num_ranks, tokens, capacity, hidden, topk, x_bytes, y_bytes) -> int:
    """The direct mode's NVSHMEM heap for comparison (`heap_bytes_for`,
    kernels/internode/internode_layout.h): it grows with the tokens and the capacity."""
    from jax_ep.nvshmem_bootstrap import heap_bytes_for

    return heap_bytes_for(num_ranks=num_ranks, max_tokens=tokens, capacity=capacity,
                          hidden=hidden, topk=topk, x_dtype=int(x_bytes), y_dtype=int(y_bytes))


# --- routing ---------------------------------------------------------------------------

def sample_routing(rng: np.random.Generator, tokens: int, experts: int, topk: int,
                   num_nodes: int, routing: str = "uniform", max_nodes: int = 4) -> np.ndarray:
    """topk_idx[tokens, topk] int32. "uniform": top-k of all experts without replacement.
    "node-limited": pick min(max_nodes, num_nodes) nodes uniformly (a node's experts are
    one group), then top-k uniformly among their experts."""
    if experts % num_nodes:
        raise ValueError(f"experts ({experts}) must be a multiple of num_nodes ({num_nodes})")
    if routing not in ("uniform", "node-limited"):
        raise ValueError(f"routing must be 'uniform' or 'node-limited', got {routing!r}")
    scores = rng.random((tokens, experts))
    if routing == "node-limited" and max_nodes < num_nodes:
        per = experts // num_nodes
        picked = np.argsort(rng.random((tokens, num_nodes)), axis=1)[:, :max_nodes]
        allowed = np.zeros((tokens, num_nodes), bool)
        np.put_along_axis(allowed, picked, True, axis=1)
        scores = np.where(np.repeat(allowed, per, axis=1), scores, -1.0)
    if topk > experts:
        raise ValueError("topk must be <= experts")
    return np.argsort(-scores, axis=1)[:, :topk].astype(np.int32)


def traffic(topk_idx: np.ndarray, src_rank: int, topo: Topology, experts: int) -> dict:
    """Per-token counts for one source rank's routing topk_idx[T, K] (-1 = unused):
    remote GPUs hit, remote nodes hit, local GPUs hit (other than the source itself)
    and the rows each forwarder delivers over NVLink, summed over tokens."""
    R, G = topo.num_ranks, topo.gpus_per_node
    el = experts // R
    idx = np.asarray(topk_idx)
    owner = np.where(idx >= 0, idx // el, -1)
    hit = (owner[:, :, None] == np.arange(R)).any(axis=1)  # [T, R]
    node_hit = hit.reshape(len(idx), topo.num_nodes, G).any(axis=2)  # [T, N]
    my_node = topo.node_of(src_rank)
    remote = np.ones(R, bool)
    remote[my_node * G:(my_node + 1) * G] = False
    remote_nodes = np.ones(topo.num_nodes, bool)
    remote_nodes[my_node] = False
    local_others = ~remote
    local_others[src_rank] = False
    return dict(
        remote_gpu_rows=int(hit[:, remote].sum()),
        remote_node_rows=int(node_hit[:, remote_nodes].sum()),
        local_gpu_rows=int(hit[:, local_others].sum()),
        # rows the rail peers hand to a GPU other than themselves over NVLink
        forwarded_rows=int(sum(hit[:, n * G:(n + 1) * G].sum() - hit[:, topo.rail_peer(
            src_rank, n)].sum() for n in range(topo.num_nodes) if n != my_node)),
        per_node_rows=node_hit.sum(axis=0).astype(np.int64),
        per_gpu_rows=hit.sum(axis=0).astype(np.int64),
    )


# --- the model ---------------------------------------------------------------------------

@dataclasses.dataclass
class ModeInputs:
    nodes: int = 4
    gpus_per_node: int = 8
    ports: int = 2
    port_gbps: float = 200.0
    lag: str = "affinity"  # "affinity" (QPs pinned round-robin) or "hash" (bond)
    qps_per_peer: int = 8
    tokens: int = 4096
    hidden: int = 7168
    topk: int = 8
    experts: int = 256
    x_bytes: int = 2
    y_bytes: int = 2
    routing: str = "node-limited"
    max_nodes: int = 4
    chunk_bytes: int = 65536
    nvlink_gbs: float = 450.0
    seed: int = 0
    # the node's fabric class (jax_ep.network.fabric); on "roce-lag" without per-QP
    # affinity (lag_affinity="none") every QP is modelled on one member
    fabric: str | None = None
    lag_affinity: str = "alternate"


def _port_bytes(stream_bytes: np.ndarray, peers: list[int], P: int, qps_per_peer: int,
                lag: str, chunk_bytes: int) -> np.ndarray:
    """Busiest-first bytes on each port for streams `stream_bytes[i]` to peer `peers[i]`."""
    from jax_ep.network.hashing import expected_max_count
    from jax_ep.network.transport import TransportConfig

    total = float(np.sum(stream_bytes))
    if lag == "one-member":  # a LAG whose QPs all sit on one member
        return np.array([total] + [0.0] * (P - 1))
    if lag == "affinity":
        cfg = TransportConfig(num_ports=P, qps_per_port=max(1, qps_per_peer // P),
                              chunk_bytes=chunk_bytes)
        sizes = np.zeros(max(peers) + 1 if peers else 1, np.int64)
        sizes[peers] = stream_bytes
        ports = cfg.stripe(sizes).port_bytes.sum(axis=0).astype(float)
    else:
        m = qps_per_peer * len(peers)
        busiest = expected_max_count(m, P) * (total / m) if m else 0.0
        rest = (total - busiest) / (P - 1) if P > 1 else 0.0
        ports = np.array([busiest] + [rest] * (P - 1))
    return -np.sort(-ports)


def model(inp: ModeInputs) -> dict:
    """Both modes on the same sampled routing of one source GPU (rank 0; routing is
    symmetric over ranks). Byte counts are per GPU per call."""
    for f in ("nodes", "gpus_per_node", "ports", "qps_per_peer", "tokens", "hidden", "topk",
              "experts", "x_bytes", "y_bytes", "max_nodes", "chunk_bytes"):
        if getattr(inp, f) < 1:
            raise ValueError(f"{f} must be >= 1")
    if inp.lag not in ("hash", "affinity"):
        raise ValueError("lag must be 'hash' or 'affinity'")
    if inp.lag_affinity not in ("none", "alternate"):
        raise ValueError("lag_affinity must be 'none' or 'alternate'")
    # GPU-initiated QPs on a RoCE LAG are pinned by affinity, never hashed by the bond
    lag = inp.lag if inp.fabric != "roce-lag" else (
        "affinity" if inp.lag_affinity == "alternate" else "one-member")
    topo = Topology(inp.nodes * inp.gpus_per_node, inp.gpus_per_node)
    rng = np.random.default_rng(inp.seed)
    idx = sample_routing(rng, inp.tokens, inp.experts, inp.topk, inp.nodes, inp.routing,
                         inp.max_nodes)
    tr = traffic(idx, 0, topo, inp.experts)
    G, N, P = inp.gpus_per_node, inp.nodes, inp.ports
    # the direct kernels' rows (internode_layout.h): payload to 16 B, ids, weights, index
    ext = require_ext()
    d_row = ext.internode_dispatch_row_stride(inp.hidden * inp.x_bytes, inp.topk)
    c_row = ext.internode_combine_row_stride(inp.hidden * inp.y_bytes)
    hd_row = hier_dispatch_row_stride(inp.hidden * inp.x_bytes, inp.topk)
    hc_row = hier_combine_row_stride(inp.hidden * inp.y_bytes)
    rate = inp.port_gbps * 1e9 / 8

    remote_gpus = [r for r in range(topo.num_ranks) if topo.node_of(r) != 0]
    rails = [topo.rail_peer(0, n) for n in range(1, N)]
    per_gpu = tr["per_gpu_rows"]
    per_node = tr["per_node_rows"]

    def mode_entry(name, disp_streams, comb_streams, peers, nvlink_rows, note):
        disp_b = np.asarray(disp_streams, dtype=np.int64)
        comb_b = np.asarray(comb_streams, dtype=np.int64)
        ports = _port_bytes(disp_b, peers, P, inp.qps_per_peer, lag, inp.chunk_bytes)
        cports = _port_bytes(comb_b, peers, P, inp.qps_per_peer, lag, inp.chunk_bytes)
        t_d = ports[0] / rate if len(peers) else 0.0
        t_c = cports[0] / rate if len(peers) else 0.0
        return {
            "mode": name,
            "rdma_peers_per_gpu": len(peers),
            "qps_per_gpu": len(peers) * inp.qps_per_peer,
            "dispatch_internode_bytes": int(disp_b.sum()),
            "combine_internode_bytes": int(comb_b.sum()),
            "dispatch_port_bytes": [float(v) for v in ports],
            "combine_port_bytes": [float(v) for v in cports],
            "dispatch_time_us": t_d * 1e6,
            "combine_time_us": t_c * 1e6,
            "nvlink_rows": int(nvlink_rows),
            "note": note,
        }

    direct = mode_entry(
        "direct", [per_gpu[r] * d_row for r in remote_gpus],
        [per_gpu[r] * c_row for r in remote_gpus], remote_gpus, tr["local_gpu_rows"],
        "every GPU an RDMA peer; a token crosses once per remote GPU")
    hier = mode_entry(
        "hierarchical", [per_node[n] * hd_row for n in range(1, N)],
        [per_node[n] * hc_row for n in range(1, N)], rails,
        tr["local_gpu_rows"] + tr["forwarded_rows"],
        "RDMA once per (token, remote node) to the rail peer, NVLink inside the node; "
        "combine reduced in the node: one row per (token, node) back")
    d, h = direct["dispatch_internode_bytes"], hier["dispatch_internode_bytes"]
    return {
        "label": MODEL_LABEL,
        "inputs": dataclasses.asdict(inp),
        "ranks": topo.num_ranks,
        "modes": [direct, hier],
        "dispatch_bytes_ratio_direct_over_hier": (d / h) if h else float("inf"),
        "remote_nodes_per_token": tr["remote_node_rows"] / inp.tokens,
        "remote_gpus_per_token": tr["remote_gpu_rows"] / inp.tokens,
        "hier_state_bytes_per_gpu": hier_state_bytes(
            topo.num_ranks, G, inp.qps_per_peer, inp.hidden, inp.topk, inp.x_bytes,
            inp.y_bytes),
    }


def format_report(results: list[dict]) -> str:
    lines = [f"# {MODEL_LABEL}"]
    for m in results:
        i = m["inputs"]
        lines.append(
            f"## {i['nodes']} nodes x {i['gpus_per_node']} GPUs, routing={i['routing']}"
            f" (<= {i['max_nodes']} nodes), {i['ports']} x {i['port_gbps']:g} Gb/s, "
            f"lag={i['lag']}"
            + (f", fabric={i['fabric']} (lag affinity {i['lag_affinity']})"
               if i.get("fabric") else "")
            + f", {i['qps_per_peer']} QPs/peer, {i['tokens']} tokens, "
            f"H={i['hidden']}, top-{i['topk']} of {i['experts']}")
        lines.append(f"{'mode':44s} {'peers':>5s} {'disp MB':>9s} {'comb MB':>9s} "
                     f"{'disp port MB (busiest first)':30s} {'disp us':>8s} {'comb us':>8s}")
        for e in m["modes"]:
            ports = " ".join(f"{b / 1e6:.2f}" for b in e["dispatch_port_bytes"])
            lines.append(
                f"{e['mode']:44s} {e['rdma_peers_per_gpu']:5d} "
                f"{e['dispatch_internode_bytes'] / 1e6:9.2f} "
                f"{e['combine_internode_bytes'] / 1e6:9.2f} {ports:30s} "
                f"{e['dispatch_time_us']:8.1f} {e['combine_time_us']:8.1f}")
        lines.append(f"dispatch inter-node bytes, direct / hierarchical: "
                     f"{m['dispatch_bytes_ratio_direct_over_hier']:.2f}x; hierarchical "
                     f"state {m['hier_state_bytes_per_gpu'] / 2**20:.1f} MiB per GPU")
    lines.append(f"# {MODEL_LABEL}")
    return "\n".join(lines)


def parser(prog: str = "python -m jax_ep.plan modes") -> argparse.ArgumentParser:
    d = ModeInputs()
    ap = argparse.ArgumentParser(prog=prog, description=MODEL_LABEL)
    ap.add_argument("--nodes", type=int, nargs="+", default=[2, 4, 8, 16])
    ap.add_argument("--gpus-per-node", type=int, default=d.gpus_per_node)
    ap.add_argument("--ports", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--lag", choices=["affinity", "hash"], nargs="+",
                    default=["affinity", "hash"])
    ap.add_argument("--routing", choices=["uniform", "node-limited"], nargs="+",
                    default=["uniform", "node-limited"])
    ap.add_argument("--max-nodes", type=int, default=d.max_nodes)
    ap.add_argument("--port-gbps", type=float, default=d.port_gbps,
                    help="rate of one port (a 400G NIC as 2 ports: 200)")
    ap.add_argument("--qps-per-peer", type=int, default=d.qps_per_peer)
    ap.add_argument("--tokens", type=int, default=d.tokens)
    ap.add_argument("--hidden", type=int, default=d.hidden)
    ap.add_argument("--topk", type=int, default=d.topk)
    ap.add_argument("--experts", type=int, default=d.experts)
    ap.add_argument("--chunk-bytes", type=int, default=d.chunk_bytes)
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--fabric", default=None,
                    choices=["ib-multiport", "roce-multiport", "roce-lag", "multi-plane",
                             "single-port"], help="the node's fabric class")
    ap.add_argument("--lag-affinity", choices=["none", "alternate"], default="alternate",
                    help="roce-lag: per-QP member affinity, or none (one member)")
    ap.add_argument("--json", action="store_true", help="print the model as JSON")
    return ap


def main(argv=None, prog: str = "python -m jax_ep.plan modes") -> int:
    a = parser(prog).parse_args(argv)
    results = []
    try:
        for routing in a.routing:
            for nodes in a.nodes:
                for ports in a.ports:
                    for lag in a.lag:
                        if ports == 1 and lag == "hash":
                            continue  # one port: nothing to hash
                        results.append(model(ModeInputs(
                            nodes=nodes, gpus_per_node=a.gpus_per_node, ports=ports,
                            port_gbps=a.port_gbps, lag=lag, qps_per_peer=a.qps_per_peer,
                            tokens=a.tokens, hidden=a.hidden, topk=a.topk,
                            experts=a.experts, routing=routing, max_nodes=a.max_nodes,
                            chunk_bytes=a.chunk_bytes, seed=a.seed, fabric=a.fabric,
                            lag_affinity=a.lag_affinity)))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if a.json:
        print(json.dumps({"label": MODEL_LABEL, "results": results}, indent=1))
    else:
        print(format_report(results))
    return 0


if __name__ == "__main__":
    sys.exit(main(prog="python -m jax_ep.network.modes"))
