"""The internode mode (`TransportConfig.mode`, JAX_EP_INTERNODE_MODE) as the internode
backend resolves it: "direct" and "hierarchical" as asked; "auto" is direct until a GPU
run has verified the hierarchical kernels (topology.HIERARCHICAL_VERIFIED), then
hierarchical with several nodes of several GPUs. No kernel runs here (the lowered targets
are checked in test_internode_hier.py)."""
from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_ep
from jax_ep import nvshmem_bootstrap, ops
from jax_ep._src.backends import internode
from jax_ep.network.transport import TransportConfig

from conftest import ep_mesh

R = 8


def _fake_state(monkeypatch, mode):
    st = nvshmem_bootstrap.BootstrapState(
        rank=0, world=R, heap_bytes=1 << 30,
        config=TransportConfig(num_ports=2, qps_per_port=4, mode=mode), env={})
    monkeypatch.setattr(nvshmem_bootstrap, "_state", st)
    monkeypatch.setattr(ops, "resolve_backend", lambda backend: "internode")
    return st


def test_config_mode_validation_and_env_override():
    assert TransportConfig().mode == "auto"
    with pytest.raises(ValueError, match="mode"):
        TransportConfig(mode="tree")
    cfg = TransportConfig(mode="direct").resolve({"JAX_EP_INTERNODE_MODE": "hierarchical"})
    assert cfg.mode == "hierarchical"
    assert TransportConfig(mode="direct").resolve({}).mode == "direct"
    with pytest.raises(ValueError, match="JAX_EP_INTERNODE_MODE"):
        TransportConfig().resolve({"JAX_EP_INTERNODE_MODE": "ring"})


@pytest.mark.parametrize("mode,gpn,want", [
    ("direct", "4", "direct"), ("auto", "4", "direct"), ("auto", "2", "direct"),
    ("auto", "8", "direct"), ("auto", "1", "direct"),
    ("hierarchical", "4", "hierarchical"), ("hierarchical", "8", "hierarchical"),
])
def test_internode_mode(monkeypatch, mode, gpn, want):
    # "auto" stays direct until a GPU run has verified the hierarchical kernels
    _fake_state(monkeypatch, mode)
    jax_ep.config.update("gpus_per_node", gpn)
    assert internode.internode_mode(R) == want


@pytest.mark.parametrize("gpn,want", [("4", "hierarchical"), ("2", "hierarchical"),
                                      ("8", "direct"), ("1", "direct")])
def test_auto_mode_once_hierarchical_is_verified(monkeypatch, gpn, want):
    from jax_ep.network import topology
    monkeypatch.setattr(topology, "HIERARCHICAL_VERIFIED", True)
    _fake_state(monkeypatch, "auto")
    jax_ep.config.update("gpus_per_node", gpn)
    assert internode.internode_mode(R) == want


def test_bad_gpus_per_node_is_a_clear_error(monkeypatch):
    _fake_state(monkeypatch, "hierarchical")
    jax_ep.config.update("gpus_per_node", "3")
    with pytest.raises(ValueError, match="JAX_EP_GPUS_PER_NODE"):
        internode.internode_mode(R)


def test_hierarchical_request_traces_to_the_hierarchical_target(monkeypatch):
    _fake_state(monkeypatch, "hierarchical")
    jax_ep.config.update("gpus_per_node", "4")
    x = np.zeros((R * 2, 4), np.float32)
    idx = np.zeros((R * 2, 2), np.int32)
    w = np.zeros((R * 2, 2), np.float32)

    def f(x, i, w):
        return jax_ep.dispatch(x, i, w, num_experts=R, axis_name="ep")[0]

    g = jax.jit(jax.shard_map(f, mesh=ep_mesh(R), in_specs=P("ep"), out_specs=P("ep")))
    hlo = g.trace(x, idx, w).lower(lowering_platforms=("cuda",)).as_text()
    assert "@jax_ep_internode_hier_dispatch(" in hlo
    assert "@jax_ep_internode_dispatch(" not in hlo
