"""Fabric discovery on sysfs fixture trees (tests/data/sysfs/*), the classification, the
NVSHMEM settings and QP table derived from it, and the agreement across processes."""

import jax_ep
import json
import os
import shutil
import subprocess
import sys

import pytest

from jax_ep.network import fabric as fb
from jax_ep.network.transport import TransportConfig

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DATA = os.path.join(ROOT, "tests", "data", "sysfs")
GPU = "0000:13:00.0"


def tree(name):
    return os.path.join(DATA, name)


def test_parsers_real_formats():
    assert fb.parse_state("4: ACTIVE") == (4, "ACTIVE")
    assert fb.parse_state("1: DOWN\n") == (1, "DOWN")
    assert fb.parse_state(None) == (None, None)
    assert fb.parse_state("weird") == (None, "weird")
    assert fb.parse_rate("400 Gb/sec (4X NDR)") == 400.0
    assert fb.parse_rate("2.5 Gb/sec (1X SDR)") == 2.5
    assert fb.parse_rate("garbage") is None
    assert fb.parse_bond_field("802.3ad 4") == ("802.3ad", 4)
    assert fb.parse_bond_field("layer3+4 1") == ("layer3+4", 1)
    assert fb.parse_bond_field("") == (None, None)


@pytest.mark.parametrize("name,cls,ports,selected", [
    ("ib_dualport", "ib-multiport", 2, [("mlx5_0", 1), ("mlx5_1", 1)]),
    ("roce_two_devices", "roce-multiport", 2, [("mlx5_0", 1), ("mlx5_1", 1)]),
    ("roce_bond", "roce-lag", 2, [("mlx5_bond_0", 1)]),
    ("multi_plane", "multi-plane", 2, [("mlx5_0", 1), ("mlx5_1", 1)]),
    ("single_port", "single-port", 1, [("mlx5_0", 1)]),
    ("partial", "unknown", 0, []),
])
def test_classify_fixtures(name, cls, ports, selected):
    f = fb.discover(tree(name), GPU)
    assert f.fabric_class == cls, f.reason
    assert f.usable_ports == ports
    assert f.selected == selected


def test_gpu_picks_the_closest_devices():
    # without a GPU every device counts (4 IB ports); the far HCA is on another root
    assert fb.discover(tree("ib_dualport")).usable_ports == 4
    f = fb.discover(tree("ib_dualport"), "13:00.0")  # short bus id form
    assert [n for n, _ in f.selected] == ["mlx5_0", "mlx5_1"]
    far = fb.discover(tree("ib_dualport"), "0000:99:00.0")  # not in the tree
    assert far.usable_ports == 4 and any("not found" in w for w in far.warnings)
    with pytest.raises(ValueError, match="gpu"):
        fb.discover(tree("ib_dualport"), "nonsense")


def test_device_details():
    f = fb.discover(tree("roce_bond"), GPU)
    d = f.devices[0]
    assert d.pci == "0000:14:00.0" and d.numa_node == 0 and d.netdevs == ["ens1f0np0"]
    assert d.ports[0].rate_gbps == 200.0 and d.ports[0].netdev == "bond0"
    assert f.bond.mode == "802.3ad" and f.bond.mode_code == 4
    assert f.bond.hash_policy == "layer3+4" and f.bond.slaves == ["ens1f0np0", "ens1f1np1"]
    assert "802.3ad" in f.reason and "layer3+4" in f.reason


def test_multi_port_off_uses_one_port():
    f = fb.discover(tree("ib_dualport"), GPU, multi_port=False)
    assert f.fabric_class == "single-port" and f.selected == [("mlx5_0", 1)]


def test_partial_and_empty_trees_do_not_crash(tmp_path):
    f = fb.discover(tree("partial"))
    assert f.fabric_class == "unknown" and "link_layer" in f.reason
    assert any("not ACTIVE" in w for w in f.warnings)
    e = fb.discover(str(tmp_path))
    assert e.fabric_class == "unknown" and "no RDMA devices" in e.reason
    # a port directory with junk files, a device with a dangling PCI link
    junk = tmp_path / "class" / "infiniband" / "mlx5_9"
    (junk / "ports" / "1").mkdir(parents=True)
    (junk / "ports" / "1" / "state").write_bytes(b"\xff\xfe")
    (junk / "ports" / "1" / "link_layer").write_text("Ethernet\n")
    os.symlink("../../../devices/nowhere", junk / "device")
    j = fb.discover(str(tmp_path), GPU)
    assert j.fabric_class == "unknown"


def test_mixed_layers_are_unknown(tmp_path):
    shutil.copytree(tree("ib_dualport"), tmp_path / "t", symlinks=True)
    (tmp_path / "t/class/infiniband/mlx5_1/ports/1/link_layer").write_text("Ethernet\n")
    f = fb.discover(str(tmp_path / "t"), GPU)
    assert f.fabric_class == "unknown" and "mixed" in f.reason


def test_down_port_leaves_single_port(tmp_path):
    shutil.copytree(tree("roce_two_devices"), tmp_path / "t", symlinks=True)
    (tmp_path / "t/class/infiniband/mlx5_1/ports/1/state").write_text("1: DOWN\n")
    f = fb.discover(str(tmp_path / "t"), GPU)
    assert f.fabric_class == "single-port" and f.usable_ports == 1


def test_cli_json_and_this_machine():
    env = dict(os.environ, PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, "-m", "jax_ep.network.fabric", "--sysfs",
                          tree("roce_bond"), "--gpu", GPU, "--json"], env=env,
                         capture_output=True, text=True, check=True)
    d = json.loads(out.stdout)
    assert d["class"] == "roce-lag" and d["usable_ports"] == 2
    assert d["selected"] == ["mlx5_bond_0:1"] and d["bond"]["mode"] == "802.3ad"
    # the real /sys of a machine without RDMA: a clean "unknown", exit 0
    out = subprocess.run([sys.executable, "-m", "jax_ep.network.fabric", "--sysfs",
                          "/nonexistent-sysfs"], env=env, capture_output=True, text=True)
    assert out.returncode == 0 and "unknown" in out.stdout
    out = subprocess.run([sys.executable, "-m", "jax_ep.network.fabric", "--gpu", "zz"],
                         env=env, capture_output=True, text=True)
    assert out.returncode == 2 and "gpu" in out.stderr


# --- what the bootstrap derives -----------------------------------------------------------

def test_nvshmem_env_per_class():
    cfg = TransportConfig(num_ports=2, qps_per_port=4)
    ib = fb.nvshmem_env_for(fb.discover(tree("ib_dualport"), GPU), cfg)
    assert ib["NVSHMEM_HCA_LIST"] == "mlx5_0:1,mlx5_1:1"
    assert ib["NVSHMEM_ENABLE_MULTI_PORT"] == "1" and ib["NVSHMEM_ENABLE_NIC_PE_MAPPING"] == "0"
    lag = fb.nvshmem_env_for(fb.discover(tree("roce_bond"), GPU), cfg)
    assert lag["NVSHMEM_HCA_LIST"] == "mlx5_bond_0:1"
    assert lag["NVSHMEM_ENABLE_MULTI_PORT"] == "0"
    one = fb.nvshmem_env_for(fb.discover(tree("single_port"), GPU), cfg)
    assert one["NVSHMEM_HCA_LIST"] == "mlx5_0:1" and one["NVSHMEM_ENABLE_MULTI_PORT"] == "0"
    assert fb.nvshmem_env_for(fb.discover(tree("partial")), cfg) == {}


def test_plan_config_for_classes():
    cfg = TransportConfig(num_ports=2, qps_per_port=4)
    c, msgs = fb.plan_config_for(fb.discover(tree("roce_bond"), GPU), cfg, "alternate")
    assert c.lag == "bond" and c.num_ports == 2 and msgs == []
    c, msgs = fb.plan_config_for(fb.discover(tree("roce_bond"), GPU), cfg, "none")
    assert len(msgs) == 1 and "ONE member" in msgs[0] and "lag_tx_port_affinity" in msgs[0]
    c, msgs = fb.plan_config_for(fb.discover(tree("single_port"), GPU), cfg)
    assert c.num_ports == 1 and "one usable port" in msgs[0]
    c, msgs = fb.plan_config_for(fb.discover(tree("ib_dualport")), cfg)  # 4 ports, plan 2
    assert "JAX_EP_NUM_PORTS=4" in msgs[0]
    c, msgs = fb.plan_config_for(fb.discover(tree("ib_dualport"), GPU), cfg)
    assert c == cfg and msgs == []
    with pytest.raises(ValueError, match="lag_affinity"):
        fb.plan_config_for(fb.discover(tree("ib_dualport"), GPU), cfg, "maybe")


def test_qp_table_and_handle_order():
    cfg = TransportConfig(num_ports=2, qps_per_port=2)
    t = fb.qp_table(fb.discover(tree("ib_dualport"), GPU), cfg, [10, 11, 12, 13])
    assert [(r["handle"], r["device"], r["wire_port"]) for r in t] == [
        (10, "mlx5_0", 0), (11, "mlx5_1", 1), (12, "mlx5_0", 0), (13, "mlx5_1", 1)]
    assert all(r["on_plan"] for r in t)
    lag = fb.qp_table(fb.discover(tree("roce_bond"), GPU), cfg, [1, 2, 3, 4])
    assert [r["member"] for r in lag] == ["ens1f0np0", "ens1f1np1"] * 2
    none = fb.qp_table(fb.discover(tree("roce_bond"), GPU), cfg, [1, 2, 3, 4], "none")
    assert all(r["port"] == "firmware" and not r["on_plan"] for r in none)
    # a [NIC 0 QPs | NIC 1 QPs] layout: the permutation puts logical QP q on port q % 2
    laid = [{"wire_port": p} for p in (0, 0, 1, 1)]
    order = fb.handle_order_for_plan(laid, 2)
    assert order == [0, 2, 1, 3]
    assert [laid[i]["wire_port"] for i in order] == [0, 1, 0, 1]
    assert fb.handle_order_for_plan([{"wire_port": 0}] * 4, 2) is None
    assert fb.handle_order_for_plan([{"wire_port": None}] * 2, 2) is None


class _KV:
    def __init__(self, preset=None):
        self.d = dict(preset or {})

    def key_value_set(self, k, v):
        self.d[k] = v

    def blocking_key_value_get(self, k, timeout_ms):
        return self.d[k]


def test_agree_across_processes():
    s = fb.discover(tree("roce_bond"), GPU).summary()
    other = dict(s, **{"class": "single-port", "usable_ports": 1})
    kv = _KV({"p/fabric/0": json.dumps(s, sort_keys=True),
              "p/fabric/2": json.dumps(s, sort_keys=True)})
    assert fb.agree(s, kv, 1, 3, key_prefix="p", timeout_ms=10) == []
    kv = _KV({"p/fabric/0": json.dumps(s, sort_keys=True),
              "p/fabric/2": json.dumps(other, sort_keys=True)})
    diffs = fb.agree(s, kv, 1, 3, key_prefix="p", timeout_ms=10)
    assert len(diffs) == 1 and diffs[0].startswith("process 2") and "single-port" in diffs[0]


def test_modes_model_on_a_lag():
    from jax_ep.network import modes

    base = dict(nodes=2, gpus_per_node=2, ports=2, qps_per_peer=4, tokens=64, hidden=64,
                topk=2, experts=8, routing="uniform", lag="hash", chunk_bytes=256)
    none = modes.model(modes.ModeInputs(**base, fabric="roce-lag", lag_affinity="none"))
    alt = modes.model(modes.ModeInputs(**base, fabric="roce-lag", lag_affinity="alternate"))
    for a, b in zip(none["modes"], alt["modes"]):
        assert a["dispatch_port_bytes"][1] == 0.0  # one member carries everything
        assert b["dispatch_port_bytes"][1] > 0.0
        assert a["dispatch_port_bytes"][0] == pytest.approx(sum(b["dispatch_port_bytes"]))
    # no fabric: the old "hash" model is unchanged
    plain = modes.model(modes.ModeInputs(**base))
    assert plain["modes"][0]["dispatch_port_bytes"] != none["modes"][0]["dispatch_port_bytes"]
    with pytest.raises(ValueError, match="lag_affinity"):
        modes.model(modes.ModeInputs(**base, fabric="roce-lag", lag_affinity="x"))


# --- at NVSHMEM start ----------------------------------------------------------------------

class _BytesKV:
    def __init__(self, preset=None):
        self.d = dict(preset or {})

    def key_value_set_bytes(self, k, v):
        self.d[k] = v

    def blocking_key_value_get_bytes(self, k, timeout_ms):
        return self.d[k]


def test_setup_for_bootstrap_lag_without_shim_says_so(monkeypatch):
    from jax_ep.network import lag_affinity as la

    monkeypatch.setattr(la, "_shim", None)
    monkeypatch.setattr(la, "shim_path", lambda: None)
    monkeypatch.setattr(fb, "_said", set())
    cfg = TransportConfig(num_ports=2, qps_per_port=2)
    with pytest.warns(UserWarning, match="cannot set the LAG TX affinity"):
        s = fb.setup_for_bootstrap(cfg, {"JAX_EP_SYSFS": tree("roce_bond")}, 0, 1, None,
                                   key_prefix="k", timeout_ms=10, gpu=GPU)
    assert s.config.lag == "bond" and not s.shim_armed
    assert s.env["NVSHMEM_HCA_LIST"] == "mlx5_bond_0:1"
    # no shim table: the recorded table says the firmware picks the member
    t = fb.recorded_qp_table(s.config, [0, 1, 2, 3])
    assert all(r["port"] == "firmware" and not r["on_plan"] for r in t)


def test_setup_for_bootstrap_arms_the_shim_and_reads_members(monkeypatch):
    from jax_ep.network import lag_affinity as la

    class FakeShim:
        def __init__(self):
            self.cfg = None

        def configure(self, **kw):
            self.cfg = kw

        def disable(self):
            pass

        def table(self):  # 2 default slots + 4 handles, world 3: 2 QPs per slot
            aff = [1, 1, 2, 2] + [1, 1, 2, 2, 1, 1, 2, 2]
            return [{"qpn": 0x10 + i, "affinity": a, "udp_sport": 0xC000 + i, "patched": 7,
                     "rts2rts_status": 0} for i, a in enumerate(aff)]

    shim = FakeShim()
    monkeypatch.setattr(la, "load_shim", lambda path=None: shim)
    cfg = TransportConfig(num_ports=2, qps_per_port=2)
    s = fb.setup_for_bootstrap(cfg, {"JAX_EP_SYSFS": tree("roce_bond")}, 0, 1, None,
                               key_prefix="k", timeout_ms=10, gpu=GPU)
    assert s.shim_armed and shim.cfg["members"] == 2 and shim.cfg["sport_base"] == 0xC000
    s.world = 3
    fb.after_nvshmem_start()
    t = fb.recorded_qp_table(s.config, [100, 101, 102, 103])
    assert [r["member"] for r in t] == ["ens1f0np0", "ens1f1np1"] * 2
    assert all(r["on_plan"] for r in t)
    assert t[1]["qpns"] == [0x16, 0x17] and t[1]["udp_sports"] == [0xC006, 0xC007]
    # a handle whose QPs got different members is reported, not hidden
    s.shim_table = s.shim_table[:-1] + [dict(s.shim_table[-1], affinity=1)]
    t = fb.recorded_qp_table(s.config, [100, 101, 102, 103])
    assert t[3]["port"] == "mixed" and not t[3]["on_plan"]


def test_setup_for_bootstrap_disagreement_is_an_error(monkeypatch):
    monkeypatch.setattr(fb, "_said", set())
    cfg = TransportConfig(num_ports=2, qps_per_port=2)
    other = fb.discover(tree("single_port"), GPU).summary()
    kv = _BytesKV({"k/fabric/1": json.dumps(other, sort_keys=True).encode()})
    with pytest.raises(RuntimeError, match="different fabrics.*process 1"):
        fb.setup_for_bootstrap(cfg, {"JAX_EP_SYSFS": tree("ib_dualport")}, 0, 2, kv,
                               key_prefix="k", timeout_ms=10, gpu=GPU)
    same = fb.discover(tree("ib_dualport"), GPU).summary()
    kv = _BytesKV({"k/fabric/1": json.dumps(same, sort_keys=True).encode()})
    s = fb.setup_for_bootstrap(cfg, {"JAX_EP_SYSFS": tree("ib_dualport")}, 0, 2, kv,
                               key_prefix="k", timeout_ms=10, gpu=GPU)
    assert s.env["NVSHMEM_HCA_LIST"] == "mlx5_0:1,mlx5_1:1"
    off = fb.setup_for_bootstrap(cfg, {"JAX_EP_SYSFS": tree("ib_dualport"),
                                       "JAX_EP_FABRIC": "off"}, 0, 2, kv, key_prefix="k",
                                 timeout_ms=10)
    assert off.env == {} and off.config == cfg
    with pytest.raises(ValueError, match="JAX_EP_LAG_AFFINITY"):
        fb.setup_for_bootstrap(cfg, {"JAX_EP_LAG_AFFINITY": "x"}, 0, 1, None,
                               key_prefix="k", timeout_ms=10)


class StandInRuntime:
    """What `nvshmem.initialize` calls of NVSHMEM, doing nothing (init's arguments kept)."""

    def unique_id(self):
        return b"\0" * 128

    def init(self, *a):
        self.args = a

    def finalize(self):
        pass


class StandInClient:
    """The jax.distributed client calls of a one-process start-up, doing nothing."""

    def key_value_set_bytes(self, k, v):
        pass

    def wait_at_barrier(self, k, t):
        pass


def test_bootstrap_sets_device_selection_and_report_has_the_table(monkeypatch):
    from jax_ep._src.backends import internode
    from jax_ep import nvshmem_bootstrap as nb

    Rt, Client = StandInRuntime, StandInClient
    monkeypatch.setattr(nb, "_state", None)
    monkeypatch.setattr(nb, "_check_one_process_per_gpu", lambda: None)
    env = {"JAX_EP_SYSFS": tree("ib_dualport"), "JAX_EP_GPU_PCI_BUS_ID": GPU}
    jax_ep.config.update("gpu_pci_bus_id", GPU)
    st = nb.initialize(heap_bytes=64 << 20, num_ranks=1, runtime=Rt(), client=Client(),
                       environ=env, config=TransportConfig(num_ports=2, qps_per_port=2))
    assert env["NVSHMEM_HCA_LIST"] == "mlx5_0:1,mlx5_1:1"
    assert env["NVSHMEM_ENABLE_NIC_PE_MAPPING"] == "0"
    assert st.env["NVSHMEM_ENABLE_MULTI_PORT"] == "1"
    rep = internode.transport_report()
    assert rep["fabric"]["class"] == "ib-multiport"
    assert [m["nic_port"] for m in rep["qp_map"]] == [1, 1, 1, 1]
    assert [m["device"] for m in rep["qp_map"]] == ["mlx5_0", "mlx5_1"] * 2
    assert all(m["on_plan"] for m in rep["qp_map"])
    monkeypatch.setattr(nb, "_state", None)


def test_recorded_devices_decide_the_table_and_missing_devices_are_said(monkeypatch):
    from jax_ep.network import lag_affinity as la

    class RecordingShim:
        def __init__(self, devices):
            self.devices = devices
            self.cfg = None

        def configure(self, **kw):
            self.cfg = kw

        def disable(self):
            pass

        def table(self):
            return [{"qpn": i, "affinity": 0, "udp_sport": 0, "patched": 0,
                     "rts2rts_status": -1, "device": d} for i, d in enumerate(self.devices)]

    cfg = TransportConfig(num_ports=2, qps_per_port=2)
    # world 3: 2 QPs per handle; 2 default slots, then 4 handles laid out
    # [NIC 0 | NIC 0 | NIC 1 | NIC 1] instead of round-robin
    devs = ["mlx5_0"] * 2 + ["mlx5_1"] * 2 + ["mlx5_0"] * 4 + ["mlx5_1"] * 4
    shim = RecordingShim(devs)
    monkeypatch.setattr(la, "load_shim", lambda path=None: shim)
    monkeypatch.setattr(fb, "_said", set())
    s = fb.setup_for_bootstrap(cfg, {"JAX_EP_SYSFS": tree("ib_dualport")}, 0, 1, None,
                               key_prefix="k", timeout_ms=10, gpu=GPU)
    assert s.shim_armed and shim.cfg["members"] == 0 and shim.cfg["sport_base"] == 0
    s.world = 3
    fb.after_nvshmem_start()
    t = fb.recorded_qp_table(s.config, [0, 3, 6, 9])
    assert [r["device"] for r in t] == ["mlx5_0", "mlx5_0", "mlx5_1", "mlx5_1"]
    assert [r["on_plan"] for r in t] == [True, False, False, True]
    order = fb.handle_order_for_plan(t, 2)
    assert [t[i]["wire_port"] for i in order] == [0, 1, 0, 1]
    # NVSHMEM used one device only: said loudly
    shim.devices = ["mlx5_0"] * 12
    monkeypatch.setattr(fb, "_said", set())
    fb.setup_for_bootstrap(cfg, {"JAX_EP_SYSFS": tree("ib_dualport")}, 0, 1, None,
                           key_prefix="k", timeout_ms=10, gpu=GPU).world = 3
    with pytest.warns(UserWarning, match="1 device.*JAX_EP_NUM_PORTS=1"):
        fb.after_nvshmem_start()


def test_active_backup_bond_is_one_port(tmp_path):
    shutil.copytree(tree("roce_bond"), tmp_path / "t", symlinks=True)
    (tmp_path / "t/class/net/bond0/bonding/mode").write_text("active-backup 1\n")
    f = fb.discover(str(tmp_path / "t"), GPU)
    assert f.fabric_class == "single-port" and f.usable_ports == 1
    assert "802.3ad" in f.reason  # the fix names the bond setting


def test_plan_with_more_ports_than_the_node(tmp_path):
    cfg = TransportConfig(num_ports=4, qps_per_port=1)
    c, msgs = fb.plan_config_for(fb.discover(tree("ib_dualport"), GPU), cfg)
    assert c == cfg and "this node has 2" in msgs[0] and "JAX_EP_NUM_PORTS=2" in msgs[0]
    # a plan of 2: the HCA list names the ports closest to some GPU of the node (the one
    # GPU here: mlx5_0 and mlx5_1), multi-port on; NVSHMEM's selection decides the rest
    env = fb.nvshmem_env_for(fb.discover(tree("ib_dualport")), TransportConfig(num_ports=2))
    assert env["NVSHMEM_HCA_LIST"] == "mlx5_0:1,mlx5_1:1"
    assert env["NVSHMEM_ENABLE_MULTI_PORT"] == "1"


def test_lag_shim_that_saw_nothing_is_said(monkeypatch):
    from jax_ep.network import lag_affinity as la

    class EmptyShim:
        def configure(self, **kw):
            pass

        def disable(self):
            pass

        def table(self):
            return []

    monkeypatch.setattr(la, "load_shim", lambda path=None: EmptyShim())
    monkeypatch.setattr(fb, "_said", set())
    cfg = TransportConfig(num_ports=2, qps_per_port=2)
    s = fb.setup_for_bootstrap(cfg, {"JAX_EP_SYSFS": tree("roce_bond")}, 0, 1, None,
                               key_prefix="k", timeout_ms=10, gpu=GPU)
    s.world = 2
    with pytest.warns(UserWarning, match="saw no RC QP.*ONE member"):
        fb.after_nvshmem_start()
    t = fb.recorded_qp_table(s.config, [0, 1, 2, 3])
    assert all(r["port"] == "firmware" for r in t)


def test_bootstrap_on_8_gpu_nodes_uses_the_node_list_and_the_model(monkeypatch):
    """On the standard node every PE gets the node's whole port list with multi-port on,
    and the modelled selection (both of its own NIC's ports) is kept; where two GPUs share
    an HCA the plan shrinks to the one port NVSHMEM gives each, said loudly."""
    from jax_ep.network import lag_affinity as la
    monkeypatch.setattr(la, "_shim", None)
    monkeypatch.setattr(la, "shim_path", lambda: None)
    monkeypatch.setattr(fb, "_said", set())
    environ = {"JAX_EP_SYSFS": tree("node8_ib_dualport"), "JAX_EP_GPUS_PER_NODE": "8"}
    cfg = TransportConfig(num_ports=2, qps_per_port=1)
    s = fb.setup_for_bootstrap(cfg, environ, 0, 16, None, key_prefix="k", timeout_ms=10,
                               gpu="0000:12:00.0", coordinator="")
    assert s.env["NVSHMEM_HCA_LIST"] == ",".join(f"mlx5_{g}:{p}" for g in range(8)
                                                  for p in (1, 2))
    assert s.env["NVSHMEM_ENABLE_MULTI_PORT"] == "1"
    assert s.nvshmem["devices"] == ["mlx5_1:1", "mlx5_1:2"] and s.config.num_ports == 2
    environ["JAX_EP_SYSFS"] = tree("node8_shared_nic")
    with pytest.warns(UserWarning, match="running on 1"):
        s = fb.setup_for_bootstrap(cfg, environ, 0, 16, None, key_prefix="k",
                                   timeout_ms=10, gpu="0000:0b:00.0", coordinator="")
    assert s.config.num_ports == 1 and s.nvshmem["devices"] == ["mlx5_0:1"]
    assert s.env["NVSHMEM_ENABLE_MULTI_PORT"] == "0"
    # a user's list naming another GPU's NIC fails at start, naming the fix
    environ.update(JAX_EP_SYSFS=tree("node8_ib_dualport"), NVSHMEM_HCA_LIST="mlx5_7:1")
    with pytest.raises(RuntimeError, match="not its closest ports.*Fix"):
        fb.setup_for_bootstrap(cfg, environ, 0, 16, None, key_prefix="k", timeout_ms=10,
                               gpu="0000:12:00.0", coordinator="")
