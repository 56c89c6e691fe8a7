"""Striping plan (kernels/common/striping_plan.h via jax_ep.network.transport) and the NVSHMEM environment."""

import jax_ep
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jax_ep.network import transport
from jax_ep.network.transport import TransportConfig

configs = st.builds(
    TransportConfig,
    num_ports=st.integers(1, 4),
    qps_per_port=st.integers(1, 6),
    chunk_bytes=st.sampled_from([1, 7, 64, 4096, 65536]),
)


# --- properties of the plan -------------------------------------------------------

@settings(max_examples=150, deadline=None)
@given(cfg=configs, sizes=st.lists(st.integers(0, 300_000), min_size=1, max_size=12))
def test_ports_balanced_within_one_chunk_and_exactly_once(cfg, sizes):
    plan = cfg.stripe(sizes)
    b = np.array(sizes)
    # every byte is sent exactly once: per peer, ports, QPs and channels each add up
    np.testing.assert_array_equal(plan.port_bytes.sum(1), b)
    np.testing.assert_array_equal(plan.qp_bytes.sum(1), b)
    np.testing.assert_array_equal(plan.channel_bytes.sum(1), b)
    assert np.all(plan.port_imbalance_bytes <= cfg.chunk_bytes)
    np.testing.assert_array_equal(plan.chunks_per_peer, -(-b // cfg.chunk_bytes))


@settings(max_examples=100, deadline=None)
@given(cfg=configs, peer=st.integers(0, 5000), n=st.integers(1, 200))
def test_each_chunk_once_and_qp_agrees_with_stripe(cfg, peer, n):
    # chunk-by-chunk: every chunk goes to exactly one (qp, port), the qp sits on that
    # port, and accumulating qp_for over the chunks reproduces stripe()
    size = n * cfg.chunk_bytes - (cfg.chunk_bytes // 3)
    size = max(size, 1)
    chunks = -(-size // cfg.chunk_bytes)
    port_bytes = np.zeros(cfg.num_ports, np.int64)
    qp_bytes = np.zeros(cfg.num_qps, np.int64)
    for j in range(chunks):
        qp, port = cfg.qp_for(peer, cfg.channel_for(j), j)
        assert 0 <= qp < cfg.num_qps and 0 <= port < cfg.num_ports
        assert qp % cfg.num_ports == port
        nbytes = min(cfg.chunk_bytes, size - j * cfg.chunk_bytes)
        port_bytes[port] += nbytes
        qp_bytes[qp] += nbytes
    sizes = np.zeros(peer + 1, np.int64)
    sizes[peer] = size
    plan = cfg.stripe(sizes)
    np.testing.assert_array_equal(plan.port_bytes[peer], port_bytes)
    np.testing.assert_array_equal(plan.qp_bytes[peer], qp_bytes)


@settings(max_examples=100, deadline=None)
@given(ports=st.integers(2, 4), block=st.integers(0, 1000))
def test_start_port_rotates_across_peers(ports, block):
    cfg = TransportConfig(num_ports=ports, qps_per_port=1)
    # P consecutive peers from a multiple of P start on P distinct ports ...
    starts = {cfg.start_port(block * ports + i) for i in range(ports)}
    assert starts == set(range(ports))
    # ... and so do peers spaced by a power of P (one GPU index on successive nodes)
    stride = ports ** (1 + block % 3)
    starts = {cfg.start_port(block % ports + (block // ports * ports + i) * stride)
              for i in range(ports)}
    assert starts == set(range(ports))
    # the first chunk of a peer goes out on its start port
    for peer in range(4 * ports):
        assert cfg.qp_for(peer, 0, 0)[1] == cfg.start_port(peer)


def test_rotation_balances_first_chunks_over_all_peers():
    cfg = TransportConfig(num_ports=2, qps_per_port=2)
    for npeers in (2, 8, 16, 64):
        firsts = np.bincount([cfg.start_port(p) for p in range(npeers)], minlength=2)
        assert firsts.max() - firsts.min() == 0
    # same local GPU index on 16 nodes of 8 GPUs
    firsts = np.bincount([cfg.start_port(3 + 8 * n) for n in range(16)], minlength=2)
    assert firsts.max() - firsts.min() == 0


def test_one_qp_per_channel_when_channels_match_qps():
    cfg = TransportConfig(num_ports=2, qps_per_port=3)
    assert cfg.num_channels == 6
    for peer in range(12):
        used = {}
        for j in range(60):
            ch = cfg.channel_for(j)
            used.setdefault(ch, set()).add(cfg.qp_for(peer, ch, j)[0])
        assert all(len(v) == 1 for v in used.values())  # each channel: one QP
        assert sorted(q for v in used.values() for q in v) == list(range(6))  # all QPs


def test_hand_checked_plan():
    cfg = TransportConfig(num_ports=2, qps_per_port=1, chunk_bytes=100)
    plan = cfg.stripe([250, 250, 0])
    # peer 0 starts on port 0: chunks 100 (p0), 100 (p1), 50 (p0)
    np.testing.assert_array_equal(plan.port_bytes[0], [150, 100])
    # peer 1 starts on port 1
    np.testing.assert_array_equal(plan.port_bytes[1], [100, 150])
    np.testing.assert_array_equal(plan.port_bytes[2], [0, 0])
    np.testing.assert_array_equal(plan.qp_bytes, plan.port_bytes)
    assert cfg.qp_for(0, 0, 0) == (0, 0)
    assert cfg.qp_for(0, 1, 1) == (1, 1)
    assert cfg.qp_for(1, 0, 0) == (1, 1)


def test_hand_checked_qp_for_three_ports():
    # start port: the base-3 digit sum of the peer, mod 3 (4 = "11" -> 2, 5 = "12" -> 0)
    cfg = TransportConfig(num_ports=3, qps_per_port=2, chunk_bytes=100)
    assert [cfg.start_port(p) for p in (0, 1, 2, 3, 4, 5)] == [0, 1, 2, 1, 2, 0]
    # chunk j of peer 4 goes out on port (2 + j) % 3; channel c picks slot (c // 3) % 2
    assert cfg.qp_for(4, 4, 1) == (3, 0)
    assert cfg.qp_for(4, 5, 2) == (4, 1)
    assert cfg.qp_for(4, 7, 2) == (1, 1)
    assert [cfg.channel_for(j) for j in (0, 5, 6, 13)] == [0, 5, 0, 1]
    # peer 4's 250 bytes: chunks of 100, 100, 50 on ports 2, 0, 1 by channels 0, 1, 2
    plan = cfg.stripe([0, 0, 0, 0, 250])
    np.testing.assert_array_equal(plan.chunks_per_peer, [0, 0, 0, 0, 3])
    np.testing.assert_array_equal(plan.port_bytes[4], [100, 50, 100])
    np.testing.assert_array_equal(plan.qp_bytes[4], [100, 50, 100, 0, 0, 0])
    np.testing.assert_array_equal(plan.channel_bytes[4], [100, 100, 50, 0, 0, 0])
    assert not plan.port_bytes[:4].any()


def test_bad_config_is_a_clear_error():
    with pytest.raises(ValueError, match="num_ports"):
        TransportConfig(num_ports=0)
    with pytest.raises(ValueError, match="chunk_bytes"):
        TransportConfig(chunk_bytes="big")
    with pytest.raises(ValueError, match="bytes_per_peer"):
        TransportConfig().stripe([-1])


# --- NVSHMEM environment and JAX_EP_* overrides -----------------------------------

def test_nvshmem_env_both_versions():
    env = TransportConfig(num_ports=2, qps_per_port=4).nvshmem_env()
    assert env["NVSHMEM_IB_ENABLE_IBGDA"] == "1"
    # NVSHMEM counts RC QPs per device: with multi-port, 2 devices x 4 = the 8 planned
    assert env["NVSHMEM_IBGDA_NUM_RC_PER_PE"] == "4"
    assert env["NVSHMEM_ENABLE_MULTI_PORT"] == "1"  # 3.8
    assert env["NVSHMEM_IBGDA_ENABLE_MULTI_PORT"] == "1"  # 3.7
    assert env["NVSHMEM_IBGDA_RC_MAP_BY"] == "cta"
    assert "NVSHMEM_HCA_LIST" not in env and "NVSHMEM_HCA_PE_MAPPING" not in env
    assert all(isinstance(v, str) for v in env.values())


def test_nvshmem_env_per_version_and_single_port():
    cfg = TransportConfig(num_ports=1, qps_per_port=2)
    new = cfg.nvshmem_env("3.8")
    old = cfg.nvshmem_env("3.7")
    assert new["NVSHMEM_ENABLE_MULTI_PORT"] == "0" and "NVSHMEM_IBGDA_ENABLE_MULTI_PORT" not in new
    assert old["NVSHMEM_IBGDA_ENABLE_MULTI_PORT"] == "0" and "NVSHMEM_ENABLE_MULTI_PORT" not in old
    assert new["NVSHMEM_IBGDA_NUM_RC_PER_PE"] == "2"
    with pytest.raises(ValueError, match="version"):
        cfg.nvshmem_env("3.6")


def test_env_overrides_config():
    base = TransportConfig(num_ports=2, qps_per_port=4, chunk_bytes=65536)
    env = {"JAX_EP_NUM_PORTS": "4", "JAX_EP_QPS_PER_PORT": "3", "JAX_EP_CHUNK_BYTES": "8192"}
    cfg = base.resolve(env)
    assert (cfg.num_ports, cfg.qps_per_port, cfg.chunk_bytes) == (4, 3, 8192)
    assert cfg.num_channels == 12
    assert cfg.nvshmem_env()["NVSHMEM_IBGDA_NUM_RC_PER_PE"] == "3"  # per device (port)
    assert base.resolve({}) is base
    assert base.resolve({"JAX_EP_NUM_PORTS": " "}) is base
    # channels are one per QP in the kernels: the old variable is an error, not ignored
    with pytest.raises(ValueError, match="JAX_EP_NUM_CHANNELS"):
        base.resolve({"JAX_EP_NUM_CHANNELS": "5"})


def test_qp_count_for_multiport_and_bond():
    """NVSHMEM_IBGDA_NUM_RC_PER_PE is per RDMA device: multi-port has one device per port,
    a bond one device for all ports. Either way the peer gets ports x QPs per port."""
    for P, Q in [(1, 3), (2, 1), (2, 4), (4, 2)]:
        mp = TransportConfig(num_ports=P, qps_per_port=Q, lag="multiport")
        bond = TransportConfig(num_ports=P, qps_per_port=Q, lag="bond")
        devices_mp = P if mp.nvshmem_env()["NVSHMEM_ENABLE_MULTI_PORT"] == "1" else 1
        assert devices_mp * int(mp.nvshmem_env()["NVSHMEM_IBGDA_NUM_RC_PER_PE"]) == P * Q
        assert bond.nvshmem_env()["NVSHMEM_ENABLE_MULTI_PORT"] == "0"
        assert int(bond.nvshmem_env()["NVSHMEM_IBGDA_NUM_RC_PER_PE"]) == P * Q
    with pytest.raises(ValueError, match="lag"):
        TransportConfig(lag="lacp")
    with pytest.raises(ValueError, match="num_channels"):
        TransportConfig(num_ports=2, qps_per_port=2, num_channels=3)
    assert transport.MAX_QPS == 64  # kMaxQps: signal words reserved per source
    TransportConfig(num_ports=2, qps_per_port=32)
    with pytest.raises(ValueError, match="64"):
        TransportConfig(num_ports=2, qps_per_port=33)
    one = TransportConfig(num_ports=2, qps_per_port=3).single_port()
    assert (one.num_ports, one.qps_per_port, one.num_channels) == (1, 3, 3)


def test_env_override_bad_value_names_variable():
    with pytest.raises(ValueError, match="JAX_EP_QPS_PER_PORT"):
        TransportConfig().resolve({"JAX_EP_QPS_PER_PORT": "many"})
    with pytest.raises(ValueError, match="JAX_EP_QPS_PER_PORT"):
        TransportConfig().resolve({"JAX_EP_QPS_PER_PORT": "0"})
    with pytest.raises(ValueError, match="qps_per_port"):
        jax_ep.config.update("qps_per_port", "many")
    with jax_ep.config.override(qps_per_port=3):  # the process's settings
        assert TransportConfig(qps_per_port=4).resolve().qps_per_port == 3
