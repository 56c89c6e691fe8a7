"""Node topology and the internode mode choice (jax_ep.network.topology)."""
import pytest

from jax_ep.network import topology
from jax_ep.network.topology import Topology


def test_numbering_and_rail_peers():
    t = Topology(8, 4)
    assert t.num_nodes == 2
    assert [t.node_of(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [t.local_of(r) for r in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert t.rank_of(1, 2) == 6
    assert t.rail_peer(1, 1) == 5 and t.rail_peer(6, 0) == 2 and t.rail_peer(6, 1) == 6
    with pytest.raises(ValueError, match="rank"):
        t.node_of(8)
    with pytest.raises(ValueError, match="divide"):
        Topology(6, 4)
    with pytest.raises(ValueError, match="gpus_per_node"):
        Topology(4, 0)


def test_from_local_ranks():
    assert topology.from_local_ranks([0, 1, 0, 1, 0, 1]) == Topology(6, 2)
    assert topology.from_local_ranks([0, 1, 2, 3]) == Topology(4, 4)
    assert topology.from_local_ranks([0, 0, 0]) == Topology(3, 1)
    with pytest.raises(ValueError, match="local_ranks"):
        topology.from_local_ranks([0, 2, 1])
    with pytest.raises(ValueError, match="different sizes"):
        topology.from_local_ranks([0, 1, 0])
    with pytest.raises(ValueError, match="empty"):
        topology.from_local_ranks([])


def test_detect_override_and_default():
    env = {"JAX_EP_GPUS_PER_NODE": "2"}
    # 4 PEs on one GPU as 2 virtual nodes of 2
    assert topology.detect(4, local_ranks=[0, 1, 2, 3], environ=env) == Topology(4, 2)
    assert topology.detect(4, local_ranks=[0, 1, 0, 1], environ={}) == Topology(4, 2)
    assert topology.detect(4, environ={}) == Topology(4, 4)
    with pytest.raises(ValueError, match="JAX_EP_GPUS_PER_NODE"):
        topology.detect(4, environ={"JAX_EP_GPUS_PER_NODE": "3"})
    with pytest.raises(ValueError, match="JAX_EP_GPUS_PER_NODE"):
        topology.detect(4, environ={"JAX_EP_GPUS_PER_NODE": "two"})
    with pytest.raises(ValueError, match="entries"):
        topology.detect(6, local_ranks=[0, 1, 0, 1], environ={})


def test_choose_mode():
    # the hierarchical kernels have not run on a GPU yet: auto stays direct
    assert topology.HIERARCHICAL_VERIFIED is False
    assert topology.choose_mode("auto", Topology(16, 8)) == "direct"
    assert topology.choose_mode(None, Topology(16, 8)) == "direct"
    assert topology.choose_mode("auto", Topology(16, 8), hierarchical_verified=True) \
        == "hierarchical"
    assert topology.choose_mode("hierarchical", Topology(16, 8)) == "hierarchical"
    assert topology.choose_mode(None, Topology(8, 8)) == "direct"      # one node
    assert topology.choose_mode("auto", Topology(4, 1)) == "direct"    # one GPU per node
    assert topology.choose_mode("direct", Topology(16, 8)) == "direct"
    assert topology.choose_mode("Hierarchical", Topology(8, 8)) == "hierarchical"
    with pytest.raises(ValueError, match="mode"):
        topology.choose_mode("ring", Topology(8, 8))


def test_mode_from_env():
    assert topology.mode_from_env("direct", {}) == "direct"
    assert topology.mode_from_env(None, {}) == "auto"
    assert topology.mode_from_env("direct", {"JAX_EP_INTERNODE_MODE": "hierarchical"}) \
        == "hierarchical"
    with pytest.raises(ValueError, match="JAX_EP_INTERNODE_MODE"):
        topology.mode_from_env(None, {"JAX_EP_INTERNODE_MODE": "tree"})


def test_launcher_local_size_and_availability():
    assert topology.detect(16, environ={"LOCAL_WORLD_SIZE": "8"}) == Topology(16, 8)
    assert topology.detect(16, environ={"SLURM_NTASKS_PER_NODE": "8(x2)"}) == Topology(16, 16)
    # the override wins over the launcher
    assert topology.detect(16, environ={"LOCAL_WORLD_SIZE": "8",
                                        "JAX_EP_GPUS_PER_NODE": "4"}) == Topology(16, 4)
    # auto falls back to direct where the build has no hierarchical kernels
    assert topology.choose_mode("auto", Topology(16, 8), hierarchical_available=False,
                                hierarchical_verified=True) == "direct"
    assert topology.choose_mode("hierarchical", Topology(16, 8),
                                hierarchical_available=False) == "hierarchical"


def test_local_ranks_from_hosts():
    hosts = ["a", "a", "b", "b", "c", "c"]
    assert topology.local_ranks_from_hosts(hosts) == [0, 1, 0, 1, 0, 1]
    assert topology.from_local_ranks(topology.local_ranks_from_hosts(hosts)) == Topology(6, 2)
    # ranks of one host not contiguous: not node-major, refused
    with pytest.raises(ValueError, match="local_ranks"):
        topology.from_local_ranks(topology.local_ranks_from_hosts(["a", "b", "a", "b"]))
