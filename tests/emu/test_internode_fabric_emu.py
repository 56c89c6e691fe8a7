"""Both NIC ports on 8-GPU nodes: the internode kernels on the emulated GPU over 2 nodes of
8 PEs, where the emulated NVSHMEM places every QP handle by NVSHMEM's own selection rules
(kernels/internode/nvshmem_select.h) from a fixture node's sysfs tree
(tests/data/sysfs/node8_*) and the NVSHMEM environment the bootstrap sets for each PE.

Each RDMA stream (source, destination, call) must split its data bytes over the source
GPU's own NIC ports as the plan splits them over its ports, within 10% of the stream;
the ports each GPU should use are written out here by hand from the fixtures' layout, not
taken from the model. The same run with the per-PE HCA list the bootstrap used to set
(each PE's own ports only) puts every stream on one port, and fails.
"""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

from jax_ep.network import fabric as fb
from jax_ep.network.transport import TransportConfig

sys.path.insert(0, os.path.dirname(__file__))
from internode_emu_util import SIGNAL_ADD, InternodeEmu  # noqa: E402
from test_internode_emu import Case, inputs  # noqa: E402
from test_internode_ll_emu import inputs as ll_inputs  # noqa: E402

pytestmark = pytest.mark.emu
full = pytest.mark.emu_full
SYSFS = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "sysfs")
G, NODES = 8, 2
R = G * NODES

# GPU g's wire ports in the plan's port order (the fixtures' layout, by hand).
EXPECT = {
    "node8_ib_dualport": lambda g: [f"mlx5_{g}:1", f"mlx5_{g}:2"],
    "node8_roce_pairs": lambda g: [f"mlx5_{2 * g}:1", f"mlx5_{2 * g + 1}:1"],
    "node8_roce_bond": lambda g: [f"ens{g}f0np0", f"ens{g}f1np1"],
    # two GPUs share each HCA: one port each (NVSHMEM moves the pair's first GPU off the
    # shared port 1, topo.cpp's second loop)
    "node8_shared_nic": lambda g: [f"mlx5_{g // 2}:{2 - g % 2}"],
    "node8_multi_plane": lambda g: [f"mlx5_{2 * g}:1", f"mlx5_{2 * g + 1}:1"],
    "node8_single_port": lambda g: [f"mlx5_{g}:1"],
}


# Over NCCL GIN (nccl_select.h, by hand from the fixtures): GDAKI makes every QP of a
# one-device dual-port NIC on port 1 (gin_host_gdaki.cc:567), so those nodes run on one
# port; devices of their own (pairs, planes) carry a context each; a bond's contexts
# alternate members (NCCL 2.32's LAG affinity).
EXPECT_NCCL = {
    "node8_ib_dualport": lambda g: [f"mlx5_{g}:1"],
    "node8_roce_pairs": lambda g: [f"mlx5_{2 * g}:1", f"mlx5_{2 * g + 1}:1"],
    "node8_roce_bond": lambda g: [f"ens{g}f0np0", f"ens{g}f1np1"],
    "node8_shared_nic": lambda g: [f"mlx5_{g // 2}:1"],
    "node8_multi_plane": lambda g: [f"mlx5_{2 * g}:1", f"mlx5_{2 * g + 1}:1"],
    "node8_single_port": lambda g: [f"mlx5_{g}:1"],
}


def bootstrap_plan(kind):
    """(cfg, env_for, messages) as the bootstrap decides them on this node."""
    root = os.path.join(SYSFS, kind)
    gpus = fb.node_gpus(root)
    f0 = fb.discover(root, gpus[0])
    cfg, msgs = fb.plan_config_for(f0, TransportConfig(num_ports=2, qps_per_port=1,
                                                       chunk_bytes=64))
    cfg, _, _, more = fb.nvshmem_plan(f0, cfg, G)

    def env_for(f, c):
        return fb.nvshmem_plan(f, c, G)[1]
    return cfg, env_for, msgs + more


def per_pe_env(f, cfg):
    """The environment the bootstrap set before: each PE's own closest ports only."""
    n = cfg.num_ports
    own = ",".join(f"{d}:{p}" for d, p in sorted(f.selected)[:max(n, 1)])
    multi = "1" if n > 1 else "0"
    return {"NVSHMEM_ENABLE_NIC_PE_MAPPING": "0", "NVSHMEM_HCA_LIST": own,
            "NVSHMEM_ENABLE_MULTI_PORT": multi, "NVSHMEM_IBGDA_ENABLE_MULTI_PORT": multi}


def split_errors(kind, cfg, log, expect=EXPECT):
    """Streams whose data bytes per wire port differ from the plan's split by more than 10%
    of the stream, or that leave on a port of another GPU's NIC. The plan's split: the
    kernels put each chunk on a logical QP q, which the plan binds to port q % num_ports,
    the k-th of the GPU's own ports (EXPECT)."""
    streams = {}
    for r in log:
        # data: chunks (put-with-signal ADD) and low-latency rows (puts alone); headers
        # and counts (SET) are control, on QP 0
        if r["src"] // G == r["dst"] // G or r["sig_op"] not in (SIGNAL_ADD, -1):
            continue
        s = streams.setdefault((r["call"], r["src"], r["dst"]), ({}, {}))
        want_port = expect[kind](r["src"] % G)[r["qp"] % cfg.num_ports]
        s[0][want_port] = s[0].get(want_port, 0) + r["bytes"]
        s[1][r["wire"]] = s[1].get(r["wire"], 0) + r["bytes"]
    bad = []
    for (call, src, dst), (want, got) in sorted(streams.items()):
        total = sum(got.values())
        for name in set(want) | set(got):
            if abs(got.get(name, 0) - want.get(name, 0)) > 0.10 * total:
                bad.append(f"call {call} {src}->{dst}: {name} carried {got.get(name, 0)} "
                           f"of {total} bytes, the plan {want.get(name, 0)}")
    return bad, len(streams)


def run_low_latency(em, rng, S=4, H=64, K=2, E=32, M=8):
    """One low-latency dispatch and combine (send and receive halves)."""
    em.ll_init(max_tokens=M, row_bytes=H * 4, topk=K, num_experts=E)
    x, idx, w, y = ll_inputs(R, S, H, K, E, M, "f32", rng)
    tok, errs = em.ll_dispatch_send(x, idx)
    assert errs == [""] * R, errs
    d, errs = em.ll_dispatch_recv(tok, H=H, dtype=np.float32)
    assert errs == [""] * R, errs
    first = np.stack([o["first_row"] for o in d])
    count = np.stack([o["row_count"] for o in d])
    tok, errs = em.ll_combine_send(y, first, count, rows_per_dest=M)
    assert errs == [""] * R, errs
    _, errs = em.ll_combine_recv(tok, idx, w, H=H, dtype=np.float32)
    assert errs == [""] * R, errs


def run_modes(em, c, modes):
    x, idx, w, y, g = inputs(c)
    if "low_latency" in modes:
        run_low_latency(em, np.random.default_rng(c.seed))
    for mode in (m for m in modes if m != "low_latency"):
        outs, errs = em.dispatch(x, idx, w, num_experts=c.E, capacity=c.C, mode=mode)
        assert errs == [""] * c.R, errs
        counts = np.stack([o["counts"] for o in outs])
        slot = np.stack([o["send_slot"] for o in outs])
        src_index = np.stack([o["src_index"] for o in outs])
        out, errs = em.combine(y, counts, slot, topk=c.K, src_index=src_index, mode=mode)
        assert errs == [""] * c.R, errs


CASE = Case("fabric", R=R, T=4, H=64, K=2, E=16, C=16, chunk=64)


@pytest.mark.parametrize("kind", [
    "node8_ib_dualport", "node8_roce_bond", "node8_shared_nic",
    pytest.param("node8_roce_pairs", marks=full), pytest.param("node8_multi_plane", marks=full),
    "node8_single_port"])
def test_bytes_per_port_follow_the_plan(kind):
    cfg, env_for, msgs = bootstrap_plan(kind)
    ports = len(EXPECT[kind](0))
    assert cfg.num_ports == ports, (cfg, msgs)
    if ports == 1:  # said, with the reason
        assert msgs and ("one" in msgs[0] or "share" in msgs[0]), msgs
    em = InternodeEmu(R, gpus_per_node=G, num_ports=cfg.num_ports,
                      qps_per_port=cfg.qps_per_port, chunk_bytes=64, seed=3, resident_blocks=64,
                      sysfs=os.path.join(SYSFS, kind), env_for=env_for)
    run_modes(em, CASE, ("low_latency", "direct", "hierarchical"))
    log, pending = em.log()
    assert pending == 0
    bad, n = split_errors(kind, cfg, log)
    assert n >= NODES * G, f"{n} RDMA streams"
    assert not bad, bad[:5]
    calls = {r["call"] for r in log if r["src"] // G != r["dst"] // G}
    assert len(calls) >= 6, f"every mode's calls crossed nodes: {sorted(calls)}"


# The other fixtures take the same paths as these three (one device per port, one
# dual-port device, a bond); tests/network/test_nccl_select.py covers their placement.
@pytest.mark.parametrize("kind", ["node8_ib_dualport", "node8_roce_pairs", "node8_roce_bond"])
def test_nccl_bytes_per_port_follow_the_plan(kind):
    """The same run over NCCL GIN: the bootstrap's plan checked against NCCL's placement of
    the contexts (fabric.nccl_plan: a one-device dual-port NIC shrinks to one port, said),
    each context's port from the C++ rule, and every RDMA stream's bytes per wire port as
    the plan splits them over the ports written out by hand (EXPECT_NCCL)."""
    root = os.path.join(SYSFS, kind)
    f0 = fb.discover(root, fb.node_gpus(root)[0])
    cfg, _ = fb.plan_config_for(f0, TransportConfig(num_ports=2, qps_per_port=1,
                                                    chunk_bytes=64))
    cfg, _, _, msgs = fb.nccl_plan(f0, cfg, G)
    ports = len(EXPECT_NCCL[kind](0))
    assert cfg.num_ports == ports, (cfg, msgs)
    if kind == "node8_ib_dualport":  # said, with the reason
        assert msgs and "port 1" in msgs[0], msgs
    em = InternodeEmu(R, gpus_per_node=G, num_ports=cfg.num_ports,
                      qps_per_port=cfg.qps_per_port, chunk_bytes=64, seed=3, resident_blocks=64,
                      sysfs=root, transport="nccl")
    run_modes(em, CASE, ("low_latency", "direct", "hierarchical"))
    log, pending = em.log()
    assert pending == 0
    bad, n = split_errors(kind, cfg, log, EXPECT_NCCL)
    assert n >= NODES * G, f"{n} RDMA streams"
    assert not bad, bad[:5]


@pytest.mark.parametrize("kind", ["node8_ib_dualport", "node8_roce_pairs"])
def test_per_pe_hca_list_runs_on_one_port(kind):
    """Today's-before settings (each PE's own ports in NVSHMEM_HCA_LIST): NVSHMEM gives
    each PE 2 / 8 -> 1 device, so every stream sits on one port and the check fails."""
    cfg, _, _ = bootstrap_plan(kind)
    em = InternodeEmu(R, gpus_per_node=G, num_ports=cfg.num_ports,
                      qps_per_port=cfg.qps_per_port, chunk_bytes=64, seed=3, resident_blocks=64,
                      sysfs=os.path.join(SYSFS, kind), env_for=per_pe_env)
    run_modes(em, CASE, ("direct",))
    log, _ = em.log()
    bad, n = split_errors(kind, cfg, log)
    assert n and len(bad) >= n // 2, (len(bad), n)


def test_lag_without_affinity_sits_on_one_member():
    """A bond whose QPs carry no LAG TX affinity: the bond hashes each pair's QPs (one
    UDP source port) onto one member, so each stream uses half the NIC: caught."""
    kind = "node8_roce_bond"
    cfg, env_for, _ = bootstrap_plan(kind)
    em = InternodeEmu(R, gpus_per_node=G, num_ports=cfg.num_ports,
                      qps_per_port=cfg.qps_per_port, chunk_bytes=64, seed=3, resident_blocks=64,
                      sysfs=os.path.join(SYSFS, kind), env_for=env_for, lag_affinity=False)
    run_modes(em, CASE, ("direct",))
    log, _ = em.log()
    bad, n = split_errors(kind, cfg, log)
    assert n and len(bad) >= n // 2, (len(bad), n)
