"""NCCL GIN's placement of contexts on devices, ports and LAG members as modelled
(kernels/internode/nccl_select.h, bound as nccl_select; jax_ep.network.fabric's
nccl_selection / nccl_env_for), on the sysfs fixture nodes (jax_ep/network/fixtures.py).

Expected values are worked out by hand from NCCL's source (github.com/NVIDIA/nccl master
5067397c, v2.30.7-1; docs/internode.md, "How NCCL picks ports for GIN contexts
(modelled)"), each with the rule it comes from; none is taken from the model itself.
"""
from __future__ import annotations

import importlib.util
import mmap
import os

import pytest

from jax_ep.network import fabric as fb
from jax_ep.network.transport import TransportConfig

ext = pytest.importorskip("jax_ep._jax_ep_ext")
if not hasattr(ext, "nccl_select"):
    pytest.skip("extension built without the nccl_select binding", allow_module_level=True)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SYSFS = os.path.join(ROOT, "tests", "data", "sysfs")

# GPU g's PCI address in the fixtures (one switch per GPU; shared: two GPUs per switch)
GPUS8 = ["0000:0a:00.0", "0000:12:00.0", "0000:1a:00.0", "0000:22:00.0",
         "0000:aa:00.0", "0000:b2:00.0", "0000:ba:00.0", "0000:c2:00.0"]
GPUS_SHARED = ["0000:0a:00.0", "0000:0b:00.0", "0000:12:00.0", "0000:13:00.0",
               "0000:9a:00.0", "0000:9b:00.0", "0000:a2:00.0", "0000:a3:00.0"]


def sel(kind, g, env=None, contexts=4, ranks=8, gpus=GPUS8, **kw):
    return fb.nccl_selection(env or {}, sysfs=os.path.join(SYSFS, kind), gpu=gpus[g],
                             ranks_per_node=ranks, num_contexts=contexts, **kw)


def cfg2():
    return TransportConfig(num_ports=2, qps_per_port=2)  # 4 QPs = 4 GIN contexts


def boot_env(kind, g, gpus=GPUS8, environ=None):
    """What the bootstrap sets for GPU g (fabric.nccl_env_for over the fabric)."""
    f = fb.discover(os.path.join(SYSFS, kind), gpus[g])
    return fb.nccl_env_for(f, cfg2(), ranks_per_node=8, environ=environ)


# --- two single-port RoCE functions per GPU (b): both ports carry GIN ---------------------
#
# NCCL's device list (init.cc:357-456, sorted by PCI function init.cc:484): mlx5_0:1 ...
# mlx5_15:1, fn 0 before fn 1 of each NIC. GPU g's closest (topo.cc:2046) are mlx5_2g:1
# and mlx5_2g+1:1 (below its switch); the GPUs closest to mlx5_2g are {g}, so netsPerGpu
# = DIVUP(2, 1) = 2 (topo.cc:2058), start g % 1 = 0: localGinDevs = [mlx5_2g, mlx5_2g+1]
# (topo.cc:2084-2093) -> 2 GIN connections (gin_host.cc:121), one per port (:159); context
# c on connection c % 2 (gin__funcs.h:83-92) -> ports alternate.

@pytest.mark.parametrize("g", [1, 6])
def test_roce_pairs_with_the_bootstrap_env_use_both_ports(g):
    env = boot_env("node8_roce_pairs", g)
    assert env == {}  # NCCL's defaults already do it
    r = sel("node8_roce_pairs", g, env)
    a, b = f"mlx5_{2 * g}:1", f"mlx5_{2 * g + 1}:1"
    assert r["error"] == "" and r["backend"] == "gdaki"
    assert r["ib_devs"] == [f"mlx5_{i}:1" for i in range(16)]
    assert r["local_ib_devs"] == [a, b] and r["nets_per_gpu"] == 2
    assert r["connections"] == [a, b]
    assert r["context_ports"] == [a, b, a, b]
    assert r["context_connection"] == [0, 1, 0, 1] and r["context_id"] == [0, 0, 1, 1]
    assert r["context_lag_member"] == [0, 0, 0, 0]
    assert fb.nccl_wire_ports(r) == [a, b]


def test_contexts_round_up_to_whole_connections():
    # 3 contexts over 2 connections: ROUNDUP(3, 2) = 4 created, 2 each (gin_host.cc:221)
    r = sel("node8_roce_pairs", 1, contexts=3)
    assert r["contexts_created"] == 4
    assert r["context_ports"] == ["mlx5_2:1", "mlx5_3:1", "mlx5_2:1"]


# --- planted wrong environments: one port, so the check can fail -----------------------------

@pytest.mark.parametrize("env,why", [
    # NCCL_IB_HCA names one function of the pair (prefix "mlx5_2" matches mlx5_2 only here)
    ({"NCCL_IB_HCA": "mlx5_2"}, "IB_HCA keeps one"),
    ({"NCCL_IB_HCA": "=mlx5_2:1"}, "exact with port"),
    ({"NCCL_IB_HCA": "^mlx5_3"}, "excluded"),
    ({"NCCL_IB_HCA": "^=mlx5_3:1"}, "excluded exactly"),
    # one net per GPU (topo.cc:2061-2062 min(1, 2))
    ({"NCCL_NETDEVS_POLICY": "MAX:1"}, "MAX:1"),
    # one connection: every context on localGinDevs[0] (gin_host.cc:127)
    ({"NCCL_GIN_NCONNECTIONS": "1"}, "one connection"),
])
def test_a_wrong_env_gives_one_port(env, why):
    r = sel("node8_roce_pairs", 1, env)
    assert r["error"] == ""
    assert fb.nccl_wire_ports(r) == ["mlx5_2:1"], (why, r)


def test_ib_hca_is_a_prefix_match_without_equals():
    # "mlx5_1" matches mlx5_1 and mlx5_10..mlx5_15 (utils.cc:218-222): GPU 0 keeps only
    # mlx5_1:1 of its pair; "=mlx5_1" keeps mlx5_1 alone
    r = sel("node8_roce_pairs", 0, {"NCCL_IB_HCA": "mlx5_1"})
    assert r["ib_devs"] == ["mlx5_1:1"] + [f"mlx5_{i}:1" for i in range(10, 16)]
    assert fb.nccl_wire_ports(r) == ["mlx5_1:1"]
    r = sel("node8_roce_pairs", 0, {"NCCL_IB_HCA": "=mlx5_1"})
    assert r["ib_devs"] == ["mlx5_1:1"]


def test_merge_nics_does_not_apply_to_gin():
    # vNICs are only made where makeVDevice is set; the GIN import passes NULL
    # (topo.cc:1827): NCCL_IB_MERGE_NICS=0 changes nothing for GIN, said in a note
    r = sel("node8_roce_pairs", 1, {"NCCL_IB_MERGE_NICS": "0"})
    assert fb.nccl_wire_ports(r) == ["mlx5_2:1", "mlx5_3:1"]
    assert any("MERGE_NICS" in n for n in r["notes"])


def test_no_port_left_is_an_error():
    r = sel("node8_roce_pairs", 1, {"NCCL_IB_HCA": "=nosuch"})
    assert "No GIN-capable devices" in r["error"]
    assert sel("node8_roce_pairs", 1, {"NCCL_GIN_ENABLE": "0"})["error"]
    assert sel("node8_roce_pairs", 1, {"NCCL_IB_DISABLE": "1"})["error"]


# --- one dual-port device per GPU (a): GDAKI's port-1 assumption -----------------------------
#
# NCCL lists mlx5_g:1 and mlx5_g:2 as two devices and opens one GIN connection on each,
# but GDAKI creates every QP with port_num 1 (gin_host_gdaki.cc:567), so both
# connections' QPs leave through port 1. The proxy backend honours the port.

def test_ib_dualport_connections_on_both_ports_but_gdaki_wires_port_one():
    r = sel("node8_ib_dualport", 3, boot_env("node8_ib_dualport", 3))
    assert r["local_ib_devs"] == ["mlx5_3:1", "mlx5_3:2"]
    assert r["connections"] == ["mlx5_3:1", "mlx5_3:2"]
    assert r["context_ib_dev"] == ["mlx5_3:1", "mlx5_3:2"] * 2
    assert fb.nccl_wire_ports(r) == ["mlx5_3:1"]
    assert any("gin_host_gdaki.cc:567" in n for n in r["notes"])
    # a library that honoured the port, or the proxy backend: both
    r = sel("node8_ib_dualport", 3, gdaki_port_one=False)
    assert fb.nccl_wire_ports(r) == ["mlx5_3:1", "mlx5_3:2"]
    r = sel("node8_ib_dualport", 3, {"NCCL_GIN_TYPE": "2"})
    assert r["backend"] == "proxy"
    assert fb.nccl_wire_ports(r) == ["mlx5_3:1", "mlx5_3:2"]
    # and there NCCL_IB_HCA restricting to port 1 leaves one
    r = sel("node8_ib_dualport", 3, {"NCCL_GIN_TYPE": "2", "NCCL_IB_HCA": "mlx5_3:1"})
    assert fb.nccl_wire_ports(r) == ["mlx5_3:1"]


# --- a NIC shared by two GPUs (d): NCCL_NETDEVS_POLICY ---------------------------------------
#
# GPUs 4 and 5 share mlx5_2 (ports 1, 2): localNetCount 2, localGpuCount 2 -> AUTO gives
# DIVUP(2, 2) = 1 net; start = dev % 2, mirrored over 2 nets (topo.cc:2070-2072): GPU 4
# -> mlx5_2:1, GPU 5 -> mlx5_2:2. ALL gives both, from the start net.

def test_shared_nic_auto_splits_ports_and_the_bootstrap_sets_all():
    r4 = sel("node8_shared_nic", 4, gpus=GPUS_SHARED, gdaki_port_one=False)
    r5 = sel("node8_shared_nic", 5, gpus=GPUS_SHARED, gdaki_port_one=False)
    assert r4["nets_per_gpu"] == 1 and r4["local_ib_devs"] == ["mlx5_2:1"]
    assert r5["local_ib_devs"] == ["mlx5_2:2"]
    env = boot_env("node8_shared_nic", 4, gpus=GPUS_SHARED)
    assert env == {"NCCL_NETDEVS_POLICY": "ALL"}
    r4 = sel("node8_shared_nic", 4, env, gpus=GPUS_SHARED, gdaki_port_one=False)
    r5 = sel("node8_shared_nic", 5, env, gpus=GPUS_SHARED, gdaki_port_one=False)
    assert r4["local_ib_devs"] == ["mlx5_2:1", "mlx5_2:2"]
    assert r5["local_ib_devs"] == ["mlx5_2:2", "mlx5_2:1"]
    # the user's own policy wins, so the bootstrap adds nothing over it
    assert boot_env("node8_shared_nic", 4, gpus=GPUS_SHARED,
                    environ={"NCCL_NETDEVS_POLICY": "ALL"}) == {}


# --- a RoCE bond (c): LAG TX affinity per context ---------------------------------------------
#
# mlx5_bond_g is one device with one port: one connection, all contexts on it. NCCL 2.32
# pins each main QP to a member (modelled: context index % 2 + 1); before 2.32, or with
# NCCL_GIN_GDAKI_LAG_AWARE_DISABLE=1, nothing is pinned (-1).

def test_roce_bond_contexts_alternate_members_on_2_32():
    env = boot_env("node8_roce_bond", 2)
    assert env == {"NCCL_GIN_GDAKI_LAG_AWARE_DISABLE": "0"}
    r = sel("node8_roce_bond", 2, env)
    assert r["connections"] == ["mlx5_bond_2:1"]
    assert r["context_ports"] == ["mlx5_bond_2:1"] * 4
    assert r["context_lag_member"] == [1, 2, 1, 2]
    assert fb.nccl_wire_ports(r) == ["mlx5_bond_2:1/1", "mlx5_bond_2:1/2"]


@pytest.mark.parametrize("env,version", [
    ({"NCCL_GIN_GDAKI_LAG_AWARE_DISABLE": "1"}, 23206),
    ({}, 23007),  # 2.30.7: no affinity in the source
])
def test_roce_bond_unpinned(env, version):
    r = sel("node8_roce_bond", 2, env, version=version)
    assert r["context_lag_member"] == [-1] * 4
    assert fb.nccl_wire_ports(r) == ["mlx5_bond_2:1"]
    assert any("not pinned" in n for n in r["notes"])


# --- one definition: the Python side asks the C++ rule -----------------------------------------

def test_python_uses_the_cpp_rule(monkeypatch):
    calls = []

    class Fake:
        def nccl_select(self, devices, gpu_paths, gpu_numa, env, local_rank, num_contexts,
                        lag, version, port_one):
            calls.append(dict(env))
            n = 2 if env.get("NCCL_NETDEVS_POLICY") == "ALL" else 1
            return {"local_ib_devs": ["x:1"] * n, "error": "", "sentinel": True}

    monkeypatch.setattr(fb, "_ext", lambda: Fake())
    r = sel("node8_roce_pairs", 1)
    assert r["sentinel"] and calls[-1] == {}
    # nccl_env_for decides from what the rule answers, not from a copy of its own: the
    # fake says AUTO gives 1 net and ALL 2 on a node where NCCL gives 2 either way
    assert boot_env("node8_roce_pairs", 1) == {"NCCL_NETDEVS_POLICY": "ALL"}
    assert {"NCCL_NETDEVS_POLICY": "ALL"} in calls


def test_no_python_copy_of_the_rule():
    # the topology's start-net rule and connection modulo live in nccl_select.cc only
    with open(os.path.join(ROOT, "jax_ep", "network", "fabric.py")) as f:
        src = f.read()
    for frag in ("mirror", "DIVUP", "% nl", "local_gpus"):
        assert frag not in src, frag


# --- the installed library knows the variables modelled ----------------------------------------

def _nccl_lib():
    spec = importlib.util.find_spec("nvidia")
    for base in (spec.submodule_search_locations or []) if spec else []:
        p = os.path.join(base, "nccl", "lib", "libnccl.so.2")
        if os.path.exists(p):
            return p
    return None


def test_installed_nccl_knows_the_variables():
    path = _nccl_lib()
    if path is None:
        pytest.skip("no nvidia-nccl wheel installed")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        for s in (b"NCCL_IB_HCA", b"NCCL_NETDEVS_POLICY", b"NCCL_GIN_NCONNECTIONS",
                  b"NCCL_GIN_TYPE", b"NCCL_IB_MERGE_NICS"):
            assert m.find(s) >= 0, s
        if m.find(b"NCCL_GIN_GDAKI_LAG_AWARE_DISABLE") < 0:
            pytest.skip("this NCCL predates the GDAKI LAG affinity (2.32)")
