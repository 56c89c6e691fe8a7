"""NVSHMEM's IBGDA device and port selection as modelled (kernels/internode/nvshmem_select.h,
bound as nvshmem_select / nvshmem_pci_distance), checked against values worked out by hand
from NVSHMEM's host source (3.5.1, commit 2d7d25f; docs/internode.md, "How NVSHMEM picks
devices (modelled)" has the rules with their lines), then the fabric CLI on the 8-GPU
fixture nodes, the user's environment checked by nvshmem_plan, and the checked-in fixture
trees against a fresh write.

Every expected value below is written out by hand with the rule it comes from; none is
taken from the model itself.
"""
from __future__ import annotations

import importlib.util
import json
import mmap
import os

import pytest

from jax_ep.network import fabric as fb
from jax_ep.network import fixtures
from jax_ep.network.transport import TransportConfig

ext = pytest.importorskip("jax_ep._jax_ep_ext")
if not hasattr(ext, "nvshmem_select"):
    pytest.skip("extension built without the nvshmem_select binding", allow_module_level=True)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SYSFS = os.path.join(ROOT, "tests", "data", "sysfs")

PIX, PXB, PHB, NODE, SYS = 0, 1, 2, 3, 4
UP = (True, True)  # a port that is ACTIVE with an InfiniBand/Ethernet link layer


# --- PCI distance (topo.cpp get_pci_distance) ------------------------------------------------
#
# The rule: walk the GPU's path; depth = its '/' count, score = the '/' seen before the
# first character where the two paths differ. score <= 3 -> NODE if both numa_node files
# agree else SYS; score == 4 -> PHB; score == depth - 1 -> PIX; anything else -> PXB.
#
# GPU path: one PCIe switch (upstream port 0000:01:00.0, downstream port 0000:02:00.0)
# below root port 0000:00:01.0. Its '/'s come before sys, devices, pci0000:00,
# 0000:00:01.0, 0000:01:00.0, 0000:02:00.0, 0000:03:00.0: depth 7.
GPU = "/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:00.0/0000:03:00.0"


@pytest.mark.parametrize("dev,gpu_numa,dev_numa,want", [
    # below the same switch: the two downstream ports share their parent bridge (the
    # switch's upstream port); the paths part inside "0000:02:0?.0", after 6 '/':
    # score 6 == depth - 1 -> PIX
    ("/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:01.0/0000:04:00.0",
     0, 0, PIX),
    # the GPU's own parent directory (another function of its device): every '/' of the
    # GPU path matches, score 7 == depth, which is neither PHB nor PIX -> PXB
    ("/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:00.0/0000:03:00.1",
     0, 0, PXB),
    # same root complex, another root port: the paths part inside "0000:00:0?.0", after
    # 4 '/': score 4 -> PHB
    ("/sys/devices/pci0000:00/0000:00:02.0/0000:07:00.0", 0, 0, PHB),
    # another root complex: they part inside "pci0000:??", after 3 '/': score 3 ->
    # NODE when the numa ids agree, SYS when they differ
    ("/sys/devices/pci0000:40/0000:40:01.0/0000:41:00.0", 0, 0, NODE),
    ("/sys/devices/pci0000:80/0000:80:01.0/0000:81:00.0", 0, 1, SYS),
    # get_numa_id gives -1 for both when neither has a numa_node: equal -> NODE
    ("/sys/devices/pci0000:80/0000:80:01.0/0000:81:00.0", -1, -1, NODE),
])
def test_pci_distance_by_hand(dev, gpu_numa, dev_numa, want):
    assert ext.nvshmem_pci_distance(GPU, dev, gpu_numa, dev_numa) == want


def test_pci_distance_same_switch_with_the_gpu_one_level_deeper_is_pxb():
    # the GPU behind a second switch (upstream 0000:03:00.0, downstream 0000:04:00.0) in a
    # downstream port of the first; the NIC in another downstream port of the first switch.
    # GPU depth 9 ('/' before sys .. 0000:05:00.0); they part inside "0000:02:0?.0",
    # after 6 '/': 4 < 6 < depth - 1 = 8 -> PXB
    gpu = ("/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:00.0/0000:03:00.0/"
           "0000:04:00.0/0000:05:00.0")
    nic = "/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:01.0/0000:06:00.0"
    assert ext.nvshmem_pci_distance(gpu, nic, 0, 0) == PXB
    # and a NIC below the GPU's own second switch: part inside "0000:04:0?.0", after 8
    # '/': score 8 == depth - 1 -> PIX
    near = gpu.rsplit("/", 2)[0] + "/0000:04:01.0/0000:06:00.0"
    assert ext.nvshmem_pci_distance(gpu, near, 0, 0) == PIX


# --- hand-built nodes ------------------------------------------------------------------------

def below(switch: int, port: int, fn: int = 0, rc: str = "00") -> str:
    """The sysfs path of function `fn` in downstream port `port` of switch `switch` (in root
    port `switch` of root complex `rc`). From a GPU in port 0 of a switch: another port of
    that switch is PIX, another switch of the same root complex PHB (see above)."""
    return (f"/sys/devices/pci0000:{rc}/0000:{rc}:0{switch}.0/0000:{switch}0:00.0/"
            f"0000:{switch}1:0{port}.0/0000:{switch}{port + 2}:00.{fn}")


def dev(name, path, ports=(1,), numa=0):
    """A device tuple for the binding; `ports` are port numbers (ACTIVE, RDMA link layer)
    or (num, active, rdma_link) tuples."""
    return (name, path, numa, [p if isinstance(p, tuple) else (p, *UP) for p in ports])


def select(devices, gpus, env=None, pe=0, num_qps=0, qp_api=True, numa=None):
    return ext.nvshmem_select(devices, gpus, numa or [0] * len(gpus), env or {}, pe,
                              num_qps, qp_api)


# one GPU in switch 1; mlx5_0 (two ports) beside it, mlx5_1 and mlx5_2 below switches 2, 3
THREE = [dev("mlx5_0", below(1, 1), (1, 2)), dev("mlx5_1", below(2, 1)),
         dev("mlx5_2", below(3, 1))]
ONE_GPU = [below(1, 0)]


@pytest.mark.parametrize("hca_list,want", [
    # ibgda.cpp enumeration: devices in ibv_get_device_list order, ports 1..n; the HCA
    # list only filters, so its own order does not matter
    ("mlx5_2,mlx5_0:2", ["mlx5_0:2", "mlx5_2:1"]),
    # a name without a port takes every port of it
    ("mlx5_0", ["mlx5_0:1", "mlx5_0:2"]),
    # port-qualified
    ("mlx5_0:2", ["mlx5_0:2"]),
    # '^' excludes the named entries and keeps the rest
    ("^mlx5_0:1", ["mlx5_0:2", "mlx5_1:1", "mlx5_2:1"]),
    ("^mlx5_0", ["mlx5_1:1", "mlx5_2:1"]),
    # unset: everything
    (None, ["mlx5_0:1", "mlx5_0:2", "mlx5_1:1", "mlx5_2:1"]),
])
def test_hca_list_filters_in_enumeration_order(hca_list, want):
    env = {} if hca_list is None else {"NVSHMEM_HCA_LIST": hca_list}
    assert select(THREE, ONE_GPU, env)["list"] == want


def test_hca_list_names_match_whole():
    # strcmp on the whole name: "mlx5_1" is not a prefix match for "mlx5_10"
    devs = [dev("mlx5_1", below(1, 1)), dev("mlx5_10", below(2, 1))]
    assert select(devs, ONE_GPU, {"NVSHMEM_HCA_LIST": "mlx5_1"})["list"] == ["mlx5_1:1"]


def test_hca_pe_mapping_replicates_and_hca_list_wins():
    # ibgda.cpp: a mapped port is entered `count` times (replicate_count); a device the
    # mapping does not name is dropped (allowed_device = 0)
    env = {"NVSHMEM_HCA_PE_MAPPING": "mlx5_0:1:2,mlx5_1:1:3"}
    r = select(THREE, [below(1, 0), below(2, 0)], env)
    assert r["list"] == ["mlx5_0:1"] * 2 + ["mlx5_1:1"] * 3
    # transport.cpp: 5 entries for 2 PEs -> 5 // 2 = 2 per PE
    assert r["max_devices_per_pe"] == 2
    # an entry without a count counts once
    assert select(THREE, ONE_GPU, {"NVSHMEM_HCA_PE_MAPPING": "mlx5_2:1"})["list"] == \
        ["mlx5_2:1"]
    # with NVSHMEM_HCA_LIST too, the mapping is ignored ("Found conflicting parameters")
    both = {**env, "NVSHMEM_HCA_LIST": "mlx5_2"}
    assert select(THREE, ONE_GPU, both)["list"] == ["mlx5_2:1"]
    # ...but only when the list parses to at least one entry (hca_list_count): "," has none
    assert select(THREE, ONE_GPU, {**env, "NVSHMEM_HCA_LIST": ","})["list"] == \
        ["mlx5_0:1"] * 2 + ["mlx5_1:1"] * 3


def test_inactive_ports_and_other_link_layers_are_skipped():
    # ibgda.cpp: a port not IBV_PORT_ACTIVE, or neither InfiniBand nor Ethernet, is skipped
    # after the list filter, so naming it leaves nothing
    devs = [dev("mlx5_0", below(1, 1), [(1, False, True), (2, True, True)]),
            dev("mlx5_1", below(2, 1), [(1, True, False)]),
            dev("mlx5_2", below(3, 1))]
    assert select(devs, ONE_GPU)["list"] == ["mlx5_0:2", "mlx5_2:1"]
    for only in ("mlx5_0:1", "mlx5_1"):
        r = select(devs, ONE_GPU, {"NVSHMEM_HCA_LIST": only})
        assert r["list"] == [] and r["devices"] == [] and r["error"], only


def test_no_device_is_an_error():
    # ibgda.cpp: "no active IB device that supports GPU-initiated communication"
    assert select([], ONE_GPU)["error"]
    r = select(THREE, ONE_GPU, {"NVSHMEM_HCA_LIST": "^mlx5_0,mlx5_1,mlx5_2"})
    assert r["error"] and r["devices"] == [] and r["qp_ports"] == []
    assert not select(THREE, ONE_GPU)["error"]


# GPUs 0..3 in switches 1..4; mlx5_k in switch 3 - k (beside GPU 2 - k); GPU 3 has none
MAPPED = [dev(f"mlx5_{k}", below(3 - k, 1)) for k in range(3)]
FOUR_GPUS = [below(s, 0) for s in (1, 2, 3, 4)]


@pytest.mark.parametrize("pe,want_mapped,want_distance", [
    # NIC_PE_MAPPING: transport.cpp selected_devices[0] = mype_node % n_devices (n = 3)
    # by distance: PE 0's PIX device is mlx5_2 (switch 1), PE 1's mlx5_1, PE 2's mlx5_0;
    # PE 3 has only PHB ones and takes its first pair, mlx5_0 (loop two cannot move it:
    # mlx5_0 is used by 2, mlx5_1 and mlx5_2 by 1, and 2 - 1 < 2)
    (0, "mlx5_0:1", "mlx5_2:1"),
    (1, "mlx5_1:1", "mlx5_1:1"),
    (2, "mlx5_2:1", "mlx5_0:1"),
    (3, "mlx5_0:1", "mlx5_0:1"),
])
def test_nic_pe_mapping_is_pe_mod_n(pe, want_mapped, want_distance):
    on = select(MAPPED, FOUR_GPUS, {"NVSHMEM_ENABLE_NIC_PE_MAPPING": "1"}, pe)
    off = select(MAPPED, FOUR_GPUS, {"NVSHMEM_ENABLE_NIC_PE_MAPPING": "0"}, pe)
    assert on["devices"] == [want_mapped]
    assert off["devices"] == [want_distance]


def test_nic_pe_mapping_takes_one_device_even_with_multi_port():
    # transport.cpp: the mapping branch sets selected_devices[0] only (found_devices = 1)
    devs = [dev("mlx5_0", below(1, 1), (1, 2))]
    env = {"NVSHMEM_ENABLE_NIC_PE_MAPPING": "1", "NVSHMEM_ENABLE_MULTI_PORT": "1"}
    assert select(devs, ONE_GPU, env)["devices"] == ["mlx5_0:1"]
    assert select(devs, ONE_GPU, {"NVSHMEM_ENABLE_MULTI_PORT": "1"})["devices"] == \
        ["mlx5_0:1", "mlx5_0:2"]


# GPU behind two switch levels; mlx5_0 is PXB from it, mlx5_1 PIX (both perf 4 in
# topo.cpp's pci_distance_perf, so loop one takes both; the pair list is sorted by the
# distance itself, PIX first)
DEEP_GPU = ("/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:00.0/0000:03:00.0/"
            "0000:04:00.0/0000:05:00.0")
DEEP = [dev("mlx5_0", "/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:01.0/"
                      "0000:07:00.0", (1, 2)),
        dev("mlx5_1", "/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:00.0/"
                      "0000:03:00.0/0000:04:01.0/0000:06:00.0")]


def test_multi_port_off_keeps_the_first_by_distance():
    # 3 entries for 1 PE -> 3 per PE; by distance: mlx5_1:1 (PIX), then mlx5_0:1, mlx5_0:2
    # (PXB, list order)
    on = select(DEEP, [DEEP_GPU], {"NVSHMEM_ENABLE_MULTI_PORT": "1"})
    assert on["devices"] == ["mlx5_1:1", "mlx5_0:1", "mlx5_0:2"]
    assert on["distance"] == [PIX, PXB, PXB]
    # ibgda.cpp connect_endpoints: multi-port off -> num_selected_devs = 1, the first of
    # the selected array: the closest, not the list's first
    off = select(DEEP, [DEEP_GPU], {"NVSHMEM_ENABLE_MULTI_PORT": "0"})
    assert off["devices"] == ["mlx5_1:1"] and "multi-port" in off["note"]
    # default (env_defs.h IBGDA_ENABLE_MULTI_PORT false): off
    assert select(DEEP, [DEEP_GPU])["devices"] == ["mlx5_1:1"]


def test_loop_one_never_takes_a_less_optimal_device():
    # mlx5_0 PIX, mlx5_1 PHB: 2 entries for 1 PE -> 2 slots; PHB's perf 3 < PIX's 4, so
    # slot 1 becomes PE_DEVICE_NO_OPTIMAL_ASSIGNMENT and only mlx5_0 is opened
    devs = [dev("mlx5_0", below(1, 1)), dev("mlx5_1", below(2, 1))]
    r = select(devs, ONE_GPU, {"NVSHMEM_ENABLE_MULTI_PORT": "1"})
    assert r["max_devices_per_pe"] == 2
    assert r["devices"] == ["mlx5_0:1"] and r["distance"] == [PIX]


@pytest.mark.parametrize("n,npes,want", [
    # transport.cpp: max_devices_per_pe = n_devices / npes_node, 0 -> 1
    (5, 2, 2), (3, 4, 1), (1, 8, 1), (8, 8, 1), (16, 8, 2), (2, 1, 2),
])
def test_max_devices_per_pe(n, npes, want):
    devs = [dev(f"mlx5_{k}", below(1, 1 + k % 8, fn=k // 8)) for k in range(n)]
    gpus = [below(2, k % 8, fn=k // 8) for k in range(npes)]
    assert select(devs, gpus)["max_devices_per_pe"] == want


def test_loop_two_moves_a_shared_port():
    # GPUs in ports 0 and 2 of switch 1, a 2-port device in port 1: all four pairs PIX.
    # 2 entries / 2 PEs -> 1 each. Pairs in order (pe0,p1) (pe0,p2) (pe1,p1) (pe1,p2).
    # Loop one: PE 0 -> port 1, PE 1 -> port 1 (used 2, 0). Loop two, PE 0: port 1 has
    # density 2, port 2 has 0, 2 - 0 >= 2 -> PE 0 moves to port 2. PE 1: density 1, stays.
    devs = [dev("mlx5_0", below(1, 1), (1, 2))]
    gpus = [below(1, 0), below(1, 2)]
    assert select(devs, gpus, pe=0)["devices"] == ["mlx5_0:2"]
    assert select(devs, gpus, pe=1)["devices"] == ["mlx5_0:1"]


def test_qp_handles_round_robin_over_opened_devices():
    # ibgda_connect_rc_only: handle i on selected device last_device_index % n, the index
    # starting at 0 and counting every handle; the selected order is by distance
    env = {"NVSHMEM_ENABLE_MULTI_PORT": "1"}
    r = select(DEEP, [DEEP_GPU], env, num_qps=7)
    a, b, c = "mlx5_1:1", "mlx5_0:1", "mlx5_0:2"
    assert r["qp_ports"] == [a, b, c, a, b, c, a]
    assert r["default_handles"] is False
    # one device: every handle on it
    assert select(DEEP, [DEEP_GPU], num_qps=3)["qp_ports"] == [a] * 3


def test_without_custom_qps_every_handle_is_default():
    # init.cu nvshmemx_qp_create fills NVSHMEMX_QP_DEFAULT and only a transport with
    # connect_endpoints (IBGDA) replaces them
    assert select(THREE, ONE_GPU, num_qps=2, qp_api=False)["default_handles"] is True
    assert select(THREE, ONE_GPU, num_qps=2, qp_api=True)["default_handles"] is False


# --- booleans (env_defs_internal.h nvshmemi_getenv_bool) ------------------------------------
#
# set and starting with '0', 'N', 'n', 'F' or 'f' -> false; set to anything else (the empty
# string included) -> true; unset -> the default (false for multi-port and PE mapping).

@pytest.mark.parametrize("value,want", [
    ("0", False), ("no", False), ("NO", False), ("n", False), ("false", False),
    ("False", False), ("f", False), ("0x1", False), ("nope", False),
    ("1", True), ("yes", True), ("true", True), ("", True), ("on", True),
    ("off", True), ("2", True), (" 0", True), ("Y", True),
])
def test_bool_env_rule(value, want):
    r = select(THREE, ONE_GPU, {"NVSHMEM_ENABLE_MULTI_PORT": value})
    assert r["multi_port"] is want
    # the same rule for NVSHMEM_ENABLE_NIC_PE_MAPPING: two GPUs in switch 1, two devices,
    # one per PE; mapping on puts PE 1 on mlx5_1 (1 % 2)
    devs = [dev("mlx5_0", below(1, 1)), dev("mlx5_1", below(2, 1))]
    gpus = [below(1, 0), below(1, 2)]
    got = select(devs, gpus, {"NVSHMEM_ENABLE_NIC_PE_MAPPING": value}, pe=1)["devices"]
    # mapping off: both GPUs are PIX to mlx5_0, PHB to mlx5_1; loop one puts both on
    # mlx5_0, loop two cannot move PE 1 (mlx5_1 is less optimal) -> mlx5_0:1
    assert got == (["mlx5_1:1"] if want else ["mlx5_0:1"])


def test_unset_booleans_are_false():
    r = select(THREE, ONE_GPU, {})
    assert r["multi_port"] is False


@pytest.mark.parametrize("new,old,want", [
    # 3.8: NVSHMEM_ENABLE_MULTI_PORT wins, NVSHMEM_IBGDA_ENABLE_MULTI_PORT its older alias
    ("0", "1", False), ("1", "0", True), (None, "1", True), (None, "0", False),
    ("1", None, True), ("no", "yes", False),
])
def test_multi_port_name_precedence(new, old, want):
    env = {}
    if new is not None:
        env["NVSHMEM_ENABLE_MULTI_PORT"] = new
    if old is not None:
        env["NVSHMEM_IBGDA_ENABLE_MULTI_PORT"] = old
    assert select(THREE, ONE_GPU, env)["multi_port"] is want


def _nvshmem_lib(name):
    spec = importlib.util.find_spec("nvidia")
    for base in (spec.submodule_search_locations or []) if spec else []:
        p = os.path.join(base, "nvshmem", "lib", name)
        if os.path.exists(p):
            return p
    return None


@pytest.mark.parametrize("lib,strings", [
    # the installed host library: both multi-port names, and which one wins when they
    # disagree (the rule test_multi_port_name_precedence checks in the model)
    ("libnvshmem_host.so.3", [b"NVSHMEM_ENABLE_MULTI_PORT and NVSHMEM_IBGDA_ENABLE_MULTI_PORT "
                              b"disagree; using NVSHMEM_ENABLE_MULTI_PORT",
                              b"NVSHMEM_ENABLE_NIC_PE_MAPPING = 1, setting dev_id"]),
    # its IBGDA transport: the list wins over the mapping
    ("nvshmem_transport_ibgda.so.7", [b"Found conflicting parameters NVSHMEM_HCA_LIST and "
                                      b"NVSHMEM_HCA_PE_MAPPING, ignoring"]),
])
def test_installed_nvshmem_knows_the_rules(lib, strings):
    path = _nvshmem_lib(lib)
    if path is None:
        pytest.skip(f"no NVSHMEM wheel with {lib} installed")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        for s in strings:
            assert m.find(s) >= 0, s


# --- the fixture nodes through the CLI -------------------------------------------------------

# GPU g's PCI address (jax_ep/network/fixtures.py's layout): one switch per GPU, switch k
# with upstream bus 0x08 * (k + 1) (+ 0x80 on socket 1) and the GPU on bus upstream + 2;
# node8_shared_nic: GPUs 2k and 2k + 1 in ports 0 and 1 of switch k of 4.
GPUS8 = ["0000:0a:00.0", "0000:12:00.0", "0000:1a:00.0", "0000:22:00.0",
         "0000:aa:00.0", "0000:b2:00.0", "0000:ba:00.0", "0000:c2:00.0"]
GPUS_SHARED = ["0000:0a:00.0", "0000:0b:00.0", "0000:12:00.0", "0000:13:00.0",
               "0000:9a:00.0", "0000:9b:00.0", "0000:a2:00.0", "0000:a3:00.0"]


def _bond(g):
    return [f"mlx5_bond_{g}:1@ens{g}f0np0", f"mlx5_bond_{g}:1@ens{g}f1np1"]


# (kind, GPUs to check, g -> devices opened, g -> qp_ports, num_ports, a message expected)
# By hand, with every PE on the node's whole list (8 PEs):
#  (a) 16 entries / 8 PEs = 2 per PE; GPU g's two ports are PIX and taken first, nobody
#      shares -> both; 2 QPs round-robin over them.
#  (b) the same with mlx5_2g and mlx5_2g+1 (list in name order: mlx5_12 before mlx5_13).
#  (c) 8 bonds / 8 PEs = 1; one device, the two QPs pinned to its members alternately.
#  (d) 8 entries / 8 PEs = 1; loop one puts both GPUs of switch k on mlx5_k:1, loop two
#      moves the first (GPU 2k) to mlx5_k:2; the plan runs on 1 port, said.
#  (e) 16 planes / 8 PEs = 2; both planes of GPU g's function are PIX -> both.
#  (f) one port per GPU; the plan runs on 1, said.
FIXTURES = [
    ("node8_ib_dualport", (1, 6), lambda g: [f"mlx5_{g}:1", f"mlx5_{g}:2"],
     lambda g: [f"mlx5_{g}:1", f"mlx5_{g}:2"], 2, False),
    ("node8_roce_pairs", (1, 6), lambda g: [f"mlx5_{2 * g}:1", f"mlx5_{2 * g + 1}:1"],
     lambda g: [f"mlx5_{2 * g}:1", f"mlx5_{2 * g + 1}:1"], 2, False),
    ("node8_roce_bond", (1, 6), lambda g: [f"mlx5_bond_{g}:1"], _bond, 2, False),
    ("node8_shared_nic", (4, 5), lambda g: [f"mlx5_{g // 2}:{2 - g % 2}"],
     lambda g: [f"mlx5_{g // 2}:{2 - g % 2}"], 1, True),
    ("node8_multi_plane", (1, 6), lambda g: [f"mlx5_{2 * g}:1", f"mlx5_{2 * g + 1}:1"],
     lambda g: [f"mlx5_{2 * g}:1", f"mlx5_{2 * g + 1}:1"], 2, False),
    ("node8_single_port", (1, 6), lambda g: [f"mlx5_{g}:1"], lambda g: [f"mlx5_{g}:1"],
     1, True),
]


def cli(capsys, *argv):
    assert fb.main(list(argv)) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("kind,gpus,devices,qp_ports,num_ports,said", FIXTURES,
                         ids=[f[0] for f in FIXTURES])
def test_cli_on_fixture_nodes(capsys, kind, gpus, devices, qp_ports, num_ports, said):
    addrs = GPUS_SHARED if kind == "node8_shared_nic" else GPUS8
    for g in gpus:
        out = cli(capsys, "--sysfs", os.path.join(SYSFS, kind), "--gpu", addrs[g],
                  "--pes-per-node", "8", "--json")["nvshmem"]
        assert out["devices"] == devices(g), (kind, g, out)
        assert out["qp_ports"] == qp_ports(g), (kind, g, out)
        assert out["num_ports"] == num_ports, (kind, g, out)
        assert bool(out["messages"]) is said, (kind, g, out["messages"])
        # what the bootstrap sets: PE mapping off, a node-wide list naming this GPU's ports
        assert out["env"]["NVSHMEM_ENABLE_NIC_PE_MAPPING"] == "0"
        named = out["env"]["NVSHMEM_HCA_LIST"].split(",")
        assert {d.split("@")[0] for d in devices(g)} <= set(named)


def test_cli_ib_dualport_env_is_the_whole_node():
    # every PE gets the node's 16 ports, in name order, with multi-port on (both names)
    f = fb.discover(os.path.join(SYSFS, "node8_ib_dualport"), GPUS8[3])
    env = fb.nvshmem_env_for(f, TransportConfig(num_ports=2, qps_per_port=1))
    assert env == {
        "NVSHMEM_HCA_LIST": ",".join(f"mlx5_{g}:{p}" for g in range(8) for p in (1, 2)),
        "NVSHMEM_ENABLE_MULTI_PORT": "1", "NVSHMEM_IBGDA_ENABLE_MULTI_PORT": "1",
        "NVSHMEM_ENABLE_NIC_PE_MAPPING": "0"}


def test_per_pe_hca_list_gives_one_device_with_8_pes():
    # each PE's own two ports in NVSHMEM_HCA_LIST: n_devices = 2, 2 // 8 -> 1 per PE.
    # GPU 1: its ports are PIX, GPUs 0, 2, 3 PHB, GPUs 4-7 SYS to them; loop one puts all
    # 8 PEs on mlx5_1:1 (each PE's first pair). Loop two: PE 0 moves to mlx5_1:2 (8 - 0),
    # then PE 1 (7 - 1 = 6 >= 2) -> GPU 1 opens mlx5_1:2 alone and both QPs sit on it.
    root = os.path.join(SYSFS, "node8_ib_dualport")
    env = {"NVSHMEM_HCA_LIST": "mlx5_1:1,mlx5_1:2", "NVSHMEM_ENABLE_MULTI_PORT": "1",
           "NVSHMEM_ENABLE_NIC_PE_MAPPING": "0"}
    r = fb.nvshmem_selection(env, sysfs=root, gpu=GPUS8[1], pes_per_node=8, num_qps=2)
    assert r["max_devices_per_pe"] == 1
    assert r["devices"] == ["mlx5_1:2"] and r["qp_ports"] == ["mlx5_1:2"] * 2
    # one PE on the node: 2 // 1 = 2 per PE, both ports
    r1 = fb.nvshmem_selection(env, sysfs=root, gpu=GPUS8[1], pes_per_node=1, num_qps=2)
    assert r1["max_devices_per_pe"] == 2
    assert r1["devices"] == ["mlx5_1:1", "mlx5_1:2"]
    assert r1["qp_ports"] == ["mlx5_1:1", "mlx5_1:2"]


def test_nvshmem_plan_refuses_another_gpus_nic():
    root = os.path.join(SYSFS, "node8_ib_dualport")
    f = fb.discover(root, GPUS8[1])
    cfg = TransportConfig(num_ports=2, qps_per_port=1)
    # the user's list names GPU 5's NIC: NVSHMEM would open one of its ports for GPU 1
    with pytest.raises(RuntimeError) as e:
        fb.nvshmem_plan(f, cfg, 8, environ={"NVSHMEM_HCA_LIST": "mlx5_5:1,mlx5_5:2"})
    msg = str(e.value)
    assert "ib-multiport" in msg and "mlx5_5" in msg and "mlx5_1:1, mlx5_1:2" in msg
    assert "Fix: unset NVSHMEM_HCA_LIST" in msg
    # GPU 1's own ports in the user's list: no error, but 1 device (see above), said,
    # and the plan shrinks to it
    cfg1, _, sel, msgs = fb.nvshmem_plan(f, cfg, 8,
                                         environ={"NVSHMEM_HCA_LIST": "mlx5_1:1,mlx5_1:2"})
    assert cfg1.num_ports == 1 and sel["devices"] == ["mlx5_1:2"] and msgs
    # without the user's list: both ports, nothing said
    cfg2, _, sel2, msgs2 = fb.nvshmem_plan(f, cfg, 8, environ={})
    assert cfg2.num_ports == 2 and sel2["devices"] == ["mlx5_1:1", "mlx5_1:2"]
    assert msgs2 == []


# --- the checked-in trees ----------------------------------------------------------------

def _tree(root):
    """{relative path: ("dir",) | ("link", target) | ("file", bytes)} without following
    links."""
    out = {}
    for d, dirs, files in os.walk(root):
        for name in dirs + files:
            p = os.path.join(d, name)
            rel = os.path.relpath(p, root)
            if os.path.islink(p):
                out[rel] = ("link", os.readlink(p))
            elif os.path.isdir(p):
                out[rel] = ("dir",)
            else:
                with open(p, "rb") as f:
                    out[rel] = ("file", f.read())
    return out


def test_checked_in_fixture_trees_equal_a_fresh_write(tmp_path):
    fixtures.main(str(tmp_path))
    checked_in = sorted(n for n in os.listdir(SYSFS) if n.startswith("node8_"))
    assert checked_in == sorted(fixtures.KINDS)
    for kind in fixtures.KINDS:
        fresh, kept = _tree(str(tmp_path / kind)), _tree(os.path.join(SYSFS, kind))
        assert sorted(fresh) == sorted(kept), kind
        diff = [p for p in fresh if fresh[p] != kept[p]]
        assert diff == [], (kind, diff[:5])
        assert any(v[0] == "link" for v in kept.values()), kind  # symlinks were compared


@pytest.mark.parametrize("env,want", [
    # ibgda.cpp nvshmemt_init: a device whose name lacks NVSHMEM_HCA_PREFIX (default
    # "mlx5") is skipped before any list filter
    ({}, ["mlx5_0:1", "mlx5_0:2"]),
    ({"NVSHMEM_HCA_LIST": "irdma0,mlx5_0:1"}, ["mlx5_0:1"]),
    ({"NVSHMEM_HCA_PREFIX": "irdma"}, ["irdma0:1"]),
])
def test_devices_without_the_hca_prefix_are_skipped(env, want):
    devices = [dev("irdma0", below(2, 1)), dev("mlx5_0", below(1, 1), (1, 2))]
    assert select(devices, ONE_GPU, env)["list"] == want


def test_a_gpu_the_tree_lacks_is_said_not_blamed_on_the_environment(capsys):
    root = os.path.join(SYSFS, "node8_roce_bond")
    assert fb.main(["--sysfs", root, "--gpu", "0000:99:00.0", "--pes-per-node", "8",
                    "--json"]) == 0
    n = json.loads(capsys.readouterr().out)["nvshmem"]
    assert n["devices"] == [] and "not modelled" in " ".join(n["messages"])
