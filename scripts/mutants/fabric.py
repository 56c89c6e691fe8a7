"""Planted mistakes on the way to both NIC ports: the NVSHMEM environment the bootstrap sets
(jax_ep/network/fabric.py), the refusal of default QP handles (nvshmem_host.cu) and
the LAG shim (xla_ffi/internode/lag_shim.cc). See scripts/mutants/__init__.py."""
from __future__ import annotations

from . import Mutant
from ._paths import *  # noqa: F401,F403

FAB = "jax_ep/network/fabric.py"
SHIM = "xla_ffi/internode/lag_shim.cc"
T_FAB = "tests/emu/test_internode_fabric_emu.py"
T_DEF = "tests/emu/test_internode_default_qp_emu.py"
T_SHIM = "tests/network/test_lag_affinity.py"

MUTANTS = [
    Mutant("fab_per_pe_hca_list", FAB,
           "        node_list = node_ports(fabric.sysfs, gpus) if gpus else []",
           "        node_list = []",
           (T_FAB, "-k", "follow and ib_dualport"),
           "per-PE HCA list: each PE names only its own ports, NVSHMEM gives it 2/8 -> 1"),
    Mutant("fab_pe_mapping_on", FAB,
           '    env = {"NVSHMEM_ENABLE_NIC_PE_MAPPING": "0", "NVSHMEM_HCA_LIST": ",".join(node_list)}',
           '    env = {"NVSHMEM_ENABLE_NIC_PE_MAPPING": "1", "NVSHMEM_HCA_LIST": ",".join(node_list)}',
           (T_FAB, "-k", "follow and ib_dualport"),
           "PE mapping on: NVSHMEM gives each PE one device, mype_node % n"),
    Mutant("fab_multi_port_off", FAB,
           '    multi = "1" if n > 1 else "0"\n    env["NVSHMEM_ENABLE_MULTI_PORT"] = multi',
           '    multi = "0"\n    env["NVSHMEM_ENABLE_MULTI_PORT"] = multi',
           (T_FAB, "-k", "follow and ib_dualport"),
           "multi-port off: IBGDA keeps the first selected device only"),
    Mutant("in_default_handles_counted_as_explicit", NVH,
           "      bool shared = arr[i] == kQpDefault;",
           "      bool shared = false;",
           (T_DEF,),
           "NVSHMEMX_QP_DEFAULT taken for a QP of its own: its puts go per CTA, counts may "
           "overtake rows"),
    Mutant("shim_affinity_at_init2rtr", SHIM,
           "    SetBits(cmd, kQpcBit + kUdpSportBit, 16, static_cast<uint64_t>(sport));\n"
           "    return kSportInit2Rtr;",
           "    SetBits(cmd, kQpcBit + kUdpSportBit, 16, static_cast<uint64_t>(sport));\n"
           "    if (affinity > 0) SetBits(cmd, kQpcBit + kLagAffBit, 4,"
           " static_cast<uint64_t>(affinity));\n"
           "    return kSportInit2Rtr;",
           (T_SHIM,),
           "LAG affinity written at INIT2RTR, which firmware without the capability refuses"),
]
