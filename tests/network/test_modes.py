"""The direct vs hierarchical MODEL (jax_ep.network.modes, `python -m jax_ep.plan modes`)
and the hierarchical layout (kernels/internode/hierarchical_layout.h through its bindings)
against hand-computed values."""
import json
import math
import pathlib
import shutil
import subprocess

import numpy as np
import pytest

from jax_ep.network import modes, plan
from jax_ep.network.topology import Topology

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_layout_hand_checked():
    # the header's ring sizes; rows of H = 7 in a 16-bit type keep their metadata aligned
    assert (modes.RDMA_CHUNK_ROWS, modes.RDMA_RING_CHUNKS, modes.NVL_RING_ROWS,
            modes.MAX_GPUS_PER_NODE, modes.META_WORDS) == (16, 8, 64, 32, 4)
    assert modes.hier_meta_offset(14) == 16 and modes.hier_meta_offset(32) == 32
    # R = 4 in 2 nodes of 2, 1 QP, H = 7 x 2 bytes, top-1: dispatch row 16 + 8 + 16 -> 48,
    # combine row 16 + 16 = 32; every signal and count region rounds up to 256 bytes
    assert modes.hier_dispatch_row_stride(14, 1) == 48
    assert modes.hier_combine_row_stride(14) == 32
    L = modes.hier_layout(4, 2, 1, 7, 1, 2, 2)
    ring = 16 * 8 * 48  # one RDMA ring: 128 rows of the wider stride (a multiple of 256)
    nvl = 64 * 48       # one NVLink ring
    assert (L.sig_data, L.sig_credit, L.sig_counts, L.nvl_head, L.nvl_tail, L.counts) == (
        0, 256, 512, 768, 1024, 1280)
    assert L.row_stride == 48
    assert (L.rdma_send, L.rdma_recv, L.nvl_recv) == (1536, 1536 + 2 * ring, 1536 + 4 * ring)
    assert (L.rdma_bytes, L.nvl_bytes) == (4 * ring, 4 * nvl)
    assert L.total == 1536 + 4 * ring + 4 * nvl
    assert modes.hier_state_bytes(4, 2, 1, 7, 1, 2, 2) == 2 * L.total
    # data signal words grow with the QPs: one per (node, QP)
    assert modes.hier_layout(4, 2, 40, 7, 1, 2, 2).sig_credit == 768  # 2 x 40 x 8 -> 768


@pytest.mark.parametrize("ranks", [16, 32, 64])
def test_state_bytes_at_deepseek_sizes_fit_one_gib(ranks):
    # T=4096, H=7168 bf16, K=8, 8 GPUs per node, 8 QPs per peer: state does not depend
    # on T or C, and stays under DeepEP's normal-mode buffer (~1 GiB RDMA + NVLink)
    b = modes.hier_state_bytes(ranks, 8, 8, 7168, 8, 2, 2)
    L = modes.hier_layout(ranks, 8, 8, 7168, 8, 2, 2)
    assert b == 2 * L.total
    assert L.rdma_bytes + L.nvl_bytes <= L.total
    assert b <= 2 ** 30
    # the direct mode's heap at the default capacity R*T grows with R*T
    assert modes.direct_state_bytes(ranks, 4096, ranks * 4096, 7168, 8, 2, 2) > 4 * b


def test_traffic_hand_checked():
    topo = Topology(8, 4)  # 2 nodes of 4; experts 0..7, 1 per rank
    idx = np.array([[4, 5, 6],     # node 1 only: 3 GPUs, 1 node
                    [0, 4, -1],    # own rank 0 and rank 4
                    [1, 2, 3],     # own node only
                    [-1, -1, -1]], np.int32)
    tr = modes.traffic(idx, 0, topo, 8)
    assert tr["remote_gpu_rows"] == 4       # 3 + 1
    assert tr["remote_node_rows"] == 2      # tokens 0 and 1 cross once each
    assert tr["local_gpu_rows"] == 3        # ranks 1, 2, 3 for token 2
    assert tr["forwarded_rows"] == 2        # token 0: rail peer 4 keeps one, forwards 5, 6
    assert tr["per_node_rows"].tolist() == [2, 2]


def test_routing_samplers():
    rng = np.random.default_rng(0)
    idx = modes.sample_routing(rng, 500, 256, 8, 16, "node-limited", 4)
    nodes = idx // 16
    assert all(len(set(row)) <= 4 for row in nodes.tolist())
    assert all(len(set(row)) == 8 for row in idx.tolist())  # distinct experts
    uni = modes.sample_routing(rng, 500, 256, 8, 16, "uniform")
    assert max(len(set(row)) for row in (uni // 16).tolist()) > 4
    with pytest.raises(ValueError, match="routing"):
        modes.sample_routing(rng, 1, 16, 2, 2, "zipf")
    with pytest.raises(ValueError, match="multiple"):
        modes.sample_routing(rng, 1, 10, 2, 4)


def test_hierarchical_moves_at_least_1_9x_fewer_bytes_at_4x8_node_limited():
    m = modes.model(modes.ModeInputs(nodes=4, gpus_per_node=8, routing="node-limited"))
    direct, hier = m["modes"]
    assert direct["dispatch_internode_bytes"] >= 1.9 * hier["dispatch_internode_bytes"]
    assert m["dispatch_bytes_ratio_direct_over_hier"] >= 1.9
    assert hier["rdma_peers_per_gpu"] == 3 and direct["rdma_peers_per_gpu"] == 24
    # combine is reduced in the node: the same rows cross back as went out
    assert hier["combine_internode_bytes"] < direct["combine_internode_bytes"]
    assert hier["combine_internode_bytes"] == (
        hier["dispatch_internode_bytes"]
        // modes.hier_dispatch_row_stride(7168 * 2, 8)
        * modes.hier_combine_row_stride(7168 * 2))
    assert "MODEL" in m["label"]


def test_two_nodes_uniform_ratio_matches_the_closed_form():
    # 16 ranks of 16 experts: E[remote GPUs hit] / P(remote node hit) per token
    m = modes.model(modes.ModeInputs(nodes=2, gpus_per_node=8, routing="uniform",
                                     tokens=8192))
    c = math.comb
    gpus = 8 * (1 - c(240, 8) / c(256, 8))
    node = 1 - c(128, 8) / c(256, 8)
    # the direct row: 14336 payload bytes, 8 ids, 8 weights, the token index -> 14416
    want = gpus / node * 14416 / modes.hier_dispatch_row_stride(7168 * 2, 8)
    assert m["dispatch_bytes_ratio_direct_over_hier"] == pytest.approx(want, rel=0.03)


def test_ports_and_bonds():
    aff = modes.model(modes.ModeInputs(nodes=4, ports=2, lag="affinity", tokens=1024))
    one = modes.model(modes.ModeInputs(nodes=4, ports=1, tokens=1024))
    bond = modes.model(modes.ModeInputs(nodes=4, ports=2, lag="hash", tokens=1024))
    for mode in (0, 1):
        a, o, b = aff["modes"][mode], one["modes"][mode], bond["modes"][mode]
        # striping: two ports within a chunk per stream, half the single-port time
        chunks = a["rdma_peers_per_gpu"] * 65536
        assert a["dispatch_port_bytes"][0] - a["dispatch_port_bytes"][1] <= chunks
        assert sum(a["dispatch_port_bytes"]) == a["dispatch_internode_bytes"]
        assert a["dispatch_time_us"] == pytest.approx(o["dispatch_time_us"] / 2, rel=0.02)
        # a hashing bond is never better than pinned QPs
        assert b["dispatch_port_bytes"][0] >= a["dispatch_port_bytes"][0] - chunks
    # fewer RDMA peers means fewer QPs for a bond to hash: hierarchical loses more to it
    eff = lambda m, i: (sum(m["modes"][i]["dispatch_port_bytes"]) / 2  # noqa: E731
                        / m["modes"][i]["dispatch_port_bytes"][0])
    assert eff(bond, 1) < eff(bond, 0)


def test_bad_inputs_name_the_field():
    with pytest.raises(ValueError, match="nodes"):
        modes.model(modes.ModeInputs(nodes=0))
    with pytest.raises(ValueError, match="lag"):
        modes.model(modes.ModeInputs(lag="bonded"))


def test_cli_through_plan_says_model_and_json(capsys):
    assert plan.main(["modes", "--nodes", "2", "--ports", "2", "--lag", "affinity",
                      "--routing", "node-limited", "--tokens", "256"]) == 0
    text = capsys.readouterr().out
    assert text.count("MODEL, not a measurement") >= 2
    assert "hierarchical" in text and "direct" in text
    assert plan.main(["modes", "--nodes", "2", "4", "--ports", "1", "2", "--tokens", "128",
                      "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert "MODEL" in doc["label"]
    # 2 node counts x 2 routings x (1 port, 2 ports affinity, 2 ports hash)
    assert len(doc["results"]) == 2 * 2 * 3
    assert plan.main(["modes", "--nodes", "3", "--tokens", "8"]) == 2  # 256 % 3 != 0


def test_header_compiles_as_device_code_with_warnings_as_errors(tmp_path):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("no nvcc")
    src = tmp_path / "hier.cu"
    src.write_text('#include "kernels/internode/hierarchical_layout.h"\n'
                   "__global__ void k(long long* o) {\n"
                   "  o[0] = jax_ep::hier::layout(64, 8, 8, 7168, 8, 2, 2).total +\n"
                   "         jax_ep::hier::credit_needed(9) + jax_ep::hier::nvl_slot(40);\n}\n")
    subprocess.run([nvcc, "-std=c++17", "-arch=sm_90", "-Werror", "all-warnings",
                    "-Xcompiler", "-Wall,-Wextra,-Werror", f"-I{ROOT}", "-c", str(src), "-o",
                    str(tmp_path / "hier.o")], check=True)
