"""The planning model's arithmetic (jax_ep.network.plan) on hand-checked cases."""

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jax_ep.network import plan


def test_hit_probability_hand_checked():
    assert plan.hit_probability(16, 16, 1) == pytest.approx(1 / 16)
    # 8 experts on 2 ranks, top-2: miss = C(4,2)/C(8,2) = 6/28
    assert plan.hit_probability(8, 2, 2) == pytest.approx(22 / 28)
    assert plan.hit_probability(4, 2, 3) == 1.0  # 3 of 4 experts cannot avoid a rank
    with pytest.raises(ValueError, match="multiple"):
        plan.hit_probability(10, 4, 2)


def test_row_bytes_hand_checked():
    # 7168 bf16 = 14336, 8 ids + 8 weights = 64, source index 4 -> 14404 -> 14416
    assert plan.dispatch_row_bytes(7168, 2, 8) == 14416
    assert plan.dispatch_row_bytes(8, 2, 1) == 32


def test_expected_max_and_efficiency_hand_checked():
    assert plan.expected_max_count(1, 2) == pytest.approx(1.0)
    assert plan.expected_max_count(2, 2) == pytest.approx(1.5)
    # X ~ Bin(8, 1/2): E[max(X, 8-X)] = (4*70 + 5*112 + 6*56 + 7*16 + 8*2) / 256
    assert plan.expected_max_count(8, 2) == pytest.approx(1304 / 256)
    assert plan.hash_efficiency(1, 2) == pytest.approx(0.5)
    assert plan.hash_efficiency(2, 2) == pytest.approx(2 / 3)
    assert plan.hash_efficiency(8, 2) == pytest.approx(4 / (1304 / 256))
    assert plan.expected_max_count(5, 1) == 5.0
    # 3 ports, Monte Carlo: 1 QP always lands alone; 3 QPs: E[max] = 1*6/27 + 2*18/27 + 3*3/27
    assert plan.expected_max_count(1, 3) == pytest.approx(1.0)
    assert plan.expected_max_count(3, 3) == pytest.approx(51 / 27, rel=0.03)


def test_qps_for_95_percent():
    assert plan.qps_for_efficiency(1) == 1
    q = plan.qps_for_efficiency(2, 0.95, 1)
    assert plan.hash_efficiency(q, 2) >= 0.95
    assert all(plan.hash_efficiency(k, 2) < 0.95 for k in range(1, q))
    # many peers share the ports, so fewer QPs per peer are needed
    assert plan.qps_for_efficiency(2, 0.95, 24) < q
    assert plan.qps_for_efficiency(2, 0.999, 1, limit=8) is None


def _tiny(**kw):
    base = dict(nodes=2, gpus_per_node=1, ports=2, port_gbps=200.0, lag="affinity",
                qps_per_peer=2, tokens=10, hidden=8, topk=1, experts=2, elem_bytes=2,
                chunk_bytes=64, nvlink_gbs=450.0)
    base.update(kw)
    return plan.PlanInputs(**base)


def test_model_hand_checked_affinity():
    m = plan.model(_tiny())
    assert "not a measurement" in m["label"]
    assert m["hit_probability"] == pytest.approx(0.5)
    assert m["row_bytes"] == 32
    assert m["bytes_per_peer"] == pytest.approx(160.0)  # 10 tokens * 0.5 * 32 B
    assert m["remote_peers"] == 1 and m["nvlink_bytes_per_gpu"] == 0
    striped, rotated, single = m["scenarios"]
    # peer 1 starts on port 1: chunks 64 (p1), 64 (p0), 32 (p1) -> 96 / 64
    assert striped["port_bytes"] == [96.0, 64.0]
    assert striped["time_us"] == pytest.approx(96 / 25e9 * 1e6)  # 200 Gb/s = 25 GB/s
    assert rotated["port_bytes"] == [160.0, 0.0]
    assert single["port_bytes"] == [160.0, 0.0]
    assert single["gpu_gbs"] == pytest.approx(25.0)
    assert m["ideal_rdma_time_us"] == pytest.approx(160 / 50e9 * 1e6)


def test_model_hand_checked_hash():
    m = plan.model(_tiny(lag="hash", qps_per_peer=2, hit_prob=1.0))
    assert m["bytes_per_peer"] == pytest.approx(320.0)
    striped, single = m["scenarios"]
    # 2 QPs of 160 B each, hashed: E[busiest] = 1.5 QPs = 240 B
    assert striped["busiest_port_bytes"] == pytest.approx(240.0)
    assert sum(striped["port_bytes"]) == pytest.approx(320.0)
    assert single["busiest_port_bytes"] == pytest.approx(320.0)
    assert m["striped_efficiency"] == pytest.approx(2 / 3)


def test_model_rejects_bad_inputs():
    with pytest.raises(ValueError, match="lag"):
        plan.model(_tiny(lag="roundrobin"))
    with pytest.raises(ValueError, match="nodes"):
        plan.model(_tiny(nodes=0))
    with pytest.raises(ValueError, match="hit_prob"):
        plan.model(_tiny(hit_prob=1.5))


@settings(max_examples=40, deadline=None)
@given(nodes=st.integers(2, 6), gpus=st.sampled_from([1, 2, 4, 8]), ports=st.integers(1, 3),
       qpp=st.integers(1, 4), tokens=st.integers(1, 4096))
def test_model_properties(nodes, gpus, ports, qpp, tokens):
    m = plan.model(_tiny(nodes=nodes, gpus_per_node=gpus, ports=ports, qps_per_peer=ports * qpp,
                         tokens=tokens, experts=nodes * gpus * 2, topk=2, hidden=256))
    striped, _, single = m["scenarios"]
    total = m["rdma_bytes_per_gpu"]
    # striping never loses to one port, and is within one chunk per peer of ideal
    assert striped["time_us"] <= single["time_us"] + 1e-9
    assert striped["busiest_port_bytes"] <= total / ports + 64 * m["remote_peers"] + 1
    assert sum(striped["port_bytes"]) == pytest.approx(m["bytes_per_peer"] *
                                                       m["remote_peers"])


def test_cli_text_and_json(capsys):
    assert plan.main(["--nodes", "2", "--gpus-per-node", "8", "--ports", "2", "--port-gbps",
                      "200", "--lag", "hash", "--qps-per-peer", "8"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# MODEL, not a measurement")
    assert "QPs per peer for 95% of 2 ports" in out
    assert plan.main(["--nodes", "2", "--json", "--lag", "affinity"]) == 0
    m = json.loads(capsys.readouterr().out)
    assert "not a measurement" in m["label"] and len(m["scenarios"]) == 3
    assert plan.main(["--nodes", "3", "--experts", "100"]) == 2
    assert "multiple" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        plan.main(["--lag", "random"])
    assert math.isfinite(m["ideal_rdma_time_us"])


# --- --check-wire ---------------------------------------------------------------------

def test_check_wire_agrees_by_construction():
    from jax_ep.network.plan import check_wire
    from jax_ep.network.transport import TransportConfig

    for P, Q in [(1, 1), (2, 1), (2, 4), (3, 2)]:
        cfg = TransportConfig(num_ports=P, qps_per_port=Q, chunk_bytes=100)
        r = check_wire(cfg, 9, 100 * (3 * P * Q + 1) + 5)
        assert r["ok"], r["disagreements"]
        assert r["checked"] == 9 * 8 * r["chunks_per_stream"] and r["losses"] == []


def test_check_wire_catches_a_wrong_qp_choice_and_a_wrong_wait():
    from jax_ep.network.plan import check_wire
    from jax_ep._src.ext import require_ext
    from jax_ep.network.transport import TransportConfig

    ext = require_ext()
    cfg = TransportConfig(num_ports=2, qps_per_port=2, chunk_bytes=64)
    # a sender that ignores the peer's starting port (peer % ports would be the same bug)
    wrong_channel = lambda peer, q, P, Q: q  # noqa: E731
    r = check_wire(cfg, 4, 64 * 9, channel_of_qp=wrong_channel,
                   expected_signal=ext.internode_expected_signal)
    assert not r["ok"] and any("plan says QP" in d for d in r["disagreements"])
    # a receiver that forgets the closing signal
    short = lambda n, recv, q, P, Q: ext.internode_expected_signal(n, recv, q, P, Q) - 1  # noqa
    r = check_wire(cfg, 4, 64 * 9, expected_signal=short)
    assert not r["ok"] and any("waits for" in d for d in r["disagreements"])


def test_check_wire_command(capsys):
    from jax_ep.network.plan import main

    assert main(["--check-schedule", "--ranks", "6", "--ports", "2", "--qps-per-port", "2",
                 "--chunk-bytes", "4096", "--path", "qp_api"]) == 0
    assert "agrees with the plan" in capsys.readouterr().out
    assert main(["--check-schedule", "--ranks", "6", "--ports", "2", "--qps-per-port", "2",
                 "--path", "fallback"]) == 0
    out = capsys.readouterr().out
    assert "fallback loses: no striping across ports" in out


# --- --check-wire: a transport log against the plan ------------------------------------

def _log_from_plan(cfg, streams, call=0):
    """The records a correct transport would log: chunk j of the stream to dst on
    the plan's QP (cfg.qp_for), at that QP's port."""
    recs = []
    for src, dst, nbytes in streams:
        j = 0
        while j * cfg.chunk_bytes < nbytes:
            qp, port = cfg.qp_for(dst, j % cfg.num_channels, j)
            size = min(cfg.chunk_bytes, nbytes - j * cfg.chunk_bytes)
            recs.append({"src": src, "dst": dst, "qp": qp, "port": port, "bytes": size,
                         "call": call})
            j += 1
    return recs


def test_check_wire_log_passes_on_the_plan_and_fails_on_any_mismatch():
    from jax_ep.network.plan import check_wire_log
    from jax_ep.network.transport import TransportConfig

    cfg = TransportConfig(num_ports=2, qps_per_port=2, chunk_bytes=64)
    streams = [(0, 1, 64 * 9 + 5), (0, 3, 64 * 4), (2, 1, 17), (1, 0, 0)]
    good = _log_from_plan(cfg, streams)
    assert check_wire_log(cfg, good)["ok"]
    # one chunk on another QP of the same port: per-QP bytes differ
    bad = [dict(r) for r in good]
    bad[0]["qp"] = (bad[0]["qp"] + 2) % 4
    r = check_wire_log(cfg, bad)
    assert not r["ok"] and any("QP" in d and "carried" in d for d in r["disagreements"])
    # one chunk counted on the wrong port (its handle sits on the other port)
    bad = [dict(r) for r in good]
    bad[1]["port"] = 1 - bad[1]["port"]
    r = check_wire_log(cfg, bad)
    assert not r["ok"] and any("went out on port" in d for d in r["disagreements"])
    # one chunk missing, and one chunk more
    assert not check_wire_log(cfg, good[1:])["ok"]
    extra = good + [dict(good[0])]
    assert not check_wire_log(cfg, extra)["ok"]
    # a QP the plan does not have
    assert not check_wire_log(cfg, good + [{"src": 0, "dst": 1, "qp": 9, "port": 1,
                                            "bytes": 0}])["ok"]
    # every handle on port 0 (NVSHMEM selected one device): caught
    one_port = [dict(r, port=0) for r in good]
    assert not check_wire_log(cfg, one_port)["ok"]
    # an empty log proves nothing
    assert not check_wire_log(cfg, [])["ok"]
    # two calls to the same pair are separate streams
    two = _log_from_plan(cfg, streams, 0) + _log_from_plan(cfg, streams, 1)
    assert check_wire_log(cfg, two)["ok"]
    with pytest.raises(ValueError, match="lacks"):
        check_wire_log(cfg, [{"src": 0}])


def test_check_wire_log_command(tmp_path, capsys):
    from jax_ep.network.plan import main
    from jax_ep.network.transport import TransportConfig

    cfg = TransportConfig(num_ports=2, qps_per_port=2, chunk_bytes=64)
    good = _log_from_plan(cfg, [(0, 1, 1000), (1, 0, 700)])
    f = tmp_path / "log.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in good))
    args = ["--check-wire", "--ports", "2", "--qps-per-port", "2", "--chunk-bytes", "64"]
    assert main(args + ["--log", str(f)]) == 0
    assert "agrees" in capsys.readouterr().out
    good[2]["bytes"] += 64  # one chunk more on one QP
    f.write_text(json.dumps(good))
    assert main(args + ["--log", str(f)]) == 1
    assert "DISAGREEMENTS" in capsys.readouterr().out
    assert main(args) == 2 and "--log" in capsys.readouterr().err


def test_fabric_model_lag_one_member_vs_alternate():
    base = _tiny(nodes=2, gpus_per_node=2, ports=2, qps_per_peer=4, tokens=200,
                 hidden=64, topk=2, experts=4)
    none = plan.model(plan.PlanInputs(**{**base.__dict__, "fabric": "roce-lag",
                                         "lag_affinity": "none"}))
    alt = plan.model(plan.PlanInputs(**{**base.__dict__, "fabric": "roce-lag",
                                        "lag_affinity": "alternate"}))
    assert none["fabric"]["ports_used"] == 1 and alt["fabric"]["ports_used"] == 2
    total = none["rdma_bytes_per_gpu"]
    one = [s for s in none["scenarios"] if "no affinity" in s["name"]][0]
    assert one["port_bytes"] == [float(total), 0.0]
    assert none["fabric"]["time_us"] == pytest.approx(2 * alt["fabric"]["time_us"], rel=0.02)
    single = plan.model(plan.PlanInputs(**{**base.__dict__, "fabric": "single-port"}))
    assert single["fabric"]["ports_used"] == 1
    with pytest.raises(ValueError, match="fabric"):
        plan.model(plan.PlanInputs(**{**base.__dict__, "fabric": "token-ring"}))


def test_plan_from_sysfs(capsys):
    import os

    root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data",
                        "sysfs")
    assert plan.main(["--from-sysfs", os.path.join(root, "roce_bond"), "--gpu",
                      "0000:13:00.0", "--lag-affinity", "none", "--json"]) == 0
    m = json.loads(capsys.readouterr().out)
    assert m["fabric"]["class"] == "roce-lag" and m["fabric"]["ports_used"] == 1
    assert m["inputs"]["ports"] == 2 and m["inputs"]["port_gbps"] == 200.0
    assert plan.main(["--from-sysfs", os.path.join(root, "single_port"), "--json"]) == 0
    m = json.loads(capsys.readouterr().out)
    assert m["fabric"]["class"] == "single-port" and m["inputs"]["ports"] == 1
    assert m["inputs"]["port_gbps"] == 400.0
    assert plan.main(["--from-sysfs", os.path.join(root, "partial")]) == 2
    assert "unknown" in capsys.readouterr().err


def test_check_wire_log_skips_control_puts():
    from jax_ep.network.plan import check_wire_log
    from jax_ep.network.transport import TransportConfig

    cfg = TransportConfig(num_ports=2, qps_per_port=2, chunk_bytes=64)
    data = [dict(r, sig_op=5) for r in _log_from_plan(cfg, [(0, 1, 64 * 5 + 3)])]
    header = {"src": 0, "dst": 1, "qp": 0, "port": 0, "bytes": 64, "sig_op": 0}
    r = check_wire_log(cfg, data + [header])
    assert r["ok"] and r["control_records"] == 1 and r["records"] == len(data)
    # the same header counted as data would break QP 0's bytes: the check sees it
    assert not check_wire_log(cfg, data + [dict(header, sig_op=5)])["ok"]


def test_plan_from_sysfs_with_the_node_pe_count(capsys):
    """--pes-per-node: the plan's ports are those NVSHMEM opens for the GPU's PE (the
    modelled selection): two on the standard node, one where two GPUs share an HCA,
    although discovery alone sees two ports near each GPU of both nodes."""
    import os

    root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data",
                        "sysfs")
    for node, gpu, ports in (("node8_ib_dualport", "0000:12:00.0", 2),
                             ("node8_shared_nic", "0000:0b:00.0", 1)):
        argv = ["--from-sysfs", os.path.join(root, node), "--gpu", gpu, "--json"]
        assert plan.main(argv) == 0
        assert json.loads(capsys.readouterr().out)["inputs"]["ports"] == 2
        assert plan.main(argv + ["--pes-per-node", "8"]) == 0
        m = json.loads(capsys.readouterr().out)
        assert m["inputs"]["ports"] == ports, (node, m["inputs"])
    assert plan.main(["--from-sysfs", os.path.join(root, "node8_ib_dualport"),
                      "--pes-per-node", "8"]) == 2
    assert "--gpu" in capsys.readouterr().err
