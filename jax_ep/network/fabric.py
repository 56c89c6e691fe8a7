"""Fabric discovery: which RDMA devices and ports this node has, how they are presented
(separate ports, a bond, planes), and how many ports the striping plan can really use.

    python -m jax_ep.network.fabric [--sysfs ROOT] [--gpu PCI_BUS_ID] [--json]

Reads Linux sysfs (default root `/sys`; tests point `--sysfs` at a copy):

- `class/infiniband/<dev>/ports/<n>/{link_layer,state,rate}` ("InfiniBand"/"Ethernet",
  "4: ACTIVE", "400 Gb/sec (4X NDR)"), `ports/<n>/gid_attrs/ndevs/0` (the netdev a RoCE
  port sends through: the bond for an mlx5 LAG), `sys_image_guid`;
- `class/infiniband/<dev>/device` (a symlink to the PCI function), its `numa_node` and
  `net/*` (the function's netdevs);
- `class/net/<if>/bonding/{mode,xmit_hash_policy,slaves}` ("802.3ad 4", "layer3+4 1");
- `bus/pci/devices/<gpu>` (the GPU's place in the PCI tree, for `--gpu`).

Missing files are tolerated (fields become None); a layout it cannot classify is reported
as `unknown` with the reason, never an exception.

Classes (`Fabric.fabric_class`), for the devices NVSHMEM would select for the GPU:
`ib-multiport` (two or more IB ports), `roce-multiport` (two or more RoCE ports, no
bond), `roce-lag` (one bonded RoCE device over two or more members), `multi-plane`
(several IB devices that are planes of one PCI function), `single-port`, `unknown`.

Selection model: the closest devices above only classify the fabric; what NVSHMEM opens
is its own selection, modelled in kernels/internode/nvshmem_select.h (`nvshmem_selection`).
Every PE gets the node's whole port list (`nvshmem_env_for`), checked by `nvshmem_plan`
before NVSHMEM starts: docs/internode.md, "How NVSHMEM picks devices (modelled)".
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys

__all__ = ["Port", "Bond", "RdmaDevice", "Fabric", "FABRIC_CLASSES", "discover",
           "parse_state", "parse_rate", "parse_bond_field", "nvshmem_env_for",
           "nccl_selection", "nccl_env_for", "nccl_wire_ports",
           "plan_config_for", "qp_table", "handle_order_for_plan", "apply_handle_order",
           "agree", "main"]

FABRIC_CLASSES = ("ib-multiport", "roce-multiport", "roce-lag", "multi-plane",
                  "single-port", "unknown")


# --- parsing of the kernel's formats ---------------------------------------------------

def parse_state(text: str | None) -> tuple[int | None, str | None]:
    """'4: ACTIVE' -> (4, 'ACTIVE'); None or junk -> (None, None or the text)."""
    if text is None:
        return None, None
    m = re.match(r"\s*(\d+)\s*:\s*(\S+)", text)
    if not m:
        t = text.strip()
        return None, (t or None)
    return int(m.group(1)), m.group(2)


def parse_rate(text: str | None) -> float | None:
    """'400 Gb/sec (4X NDR)' -> 400.0 (Gb/s); '2.5 Gb/sec (1X SDR)' -> 2.5; else None."""
    if text is None:
        return None
    m = re.match(r"\s*([0-9.]+)\s*Gb/sec", text)
    return float(m.group(1)) if m else None


def parse_bond_field(text: str | None) -> tuple[str | None, int | None]:
    """'802.3ad 4' -> ('802.3ad', 4); 'layer3+4 1' -> ('layer3+4', 1)."""
    if text is None:
        return None, None
    parts = text.split()
    if not parts:
        return None, None
    code = int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else None
    return parts[0], code


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except (OSError, UnicodeDecodeError):
        return None


def _listdir(path: str) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


# --- the model of a node -----------------------------------------------------------------

@dataclasses.dataclass
class Port:
    num: int
    link_layer: str | None  # "InfiniBand" | "Ethernet" | None (file missing)
    state: str | None       # "ACTIVE", "DOWN", ...
    state_code: int | None  # 4 = ACTIVE
    rate_gbps: float | None
    rate: str | None        # the kernel's text
    netdev: str | None      # gid_attrs/ndevs/0 (RoCE)

    @property
    def active(self) -> bool:
        return self.state_code == 4 or (self.state or "").upper() == "ACTIVE"


@dataclasses.dataclass
class Bond:
    name: str
    mode: str | None        # "802.3ad", "active-backup", ...
    mode_code: int | None
    hash_policy: str | None  # "layer3+4", ...
    hash_code: int | None
    slaves: list[str]


@dataclasses.dataclass
class RdmaDevice:
    name: str
    ports: list[Port]
    netdevs: list[str]       # the PCI function's netdevs (device/net/*)
    pci: str | None          # PCI address of the function ("0000:17:00.0")
    pci_path: list[str]      # the chain of PCI addresses from the root down
    numa_node: int | None
    sys_image_guid: str | None
    bond: Bond | None        # the bond a RoCE port sends through (mlx5 LAG)

    @property
    def link_layers(self) -> set:
        return {p.link_layer for p in self.ports if p.link_layer}


@dataclasses.dataclass
class Fabric:
    """What discovery says about this node (for one GPU, if given)."""

    sysfs: str
    gpu: str | None
    devices: list[RdmaDevice]
    selected: list[tuple[str, int]]  # (device, port) NVSHMEM would use, in a fixed order
    fabric_class: str
    usable_ports: int         # ports the plan can stripe over
    reason: str               # why this class (or why unknown)
    bond: Bond | None = None  # for roce-lag
    warnings: list[str] = dataclasses.field(default_factory=list)

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        head = {"class": d.pop("fabric_class"), "usable_ports": d.pop("usable_ports"),
                "selected": [f"{n}:{p}" for n, p in self.selected], "reason": d.pop("reason")}
        d.pop("selected")
        return {**head, **d}

    def summary(self) -> dict:
        """What every process must agree on (see `agree`)."""
        return {"class": self.fabric_class, "usable_ports": self.usable_ports,
                "ports_per_device": [p for _, p in self.selected],
                "num_selected": len(self.selected),
                "bond_mode": self.bond.mode if self.bond else None}


_PCI_RE = re.compile(r"^[0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]$")


def _pci_chain(sysfs: str, link: str) -> tuple[str | None, list[str]]:
    """(address, [root .. address]) of the PCI function a sysfs link points to."""
    try:
        real = os.path.realpath(link)
    except OSError:
        return None, []
    if not os.path.exists(real):
        return None, []
    chain = [c for c in real.split(os.sep) if _PCI_RE.match(c)]
    return (chain[-1] if chain else None), chain


def _read_bond(sysfs: str, ifname: str) -> Bond | None:
    base = os.path.join(sysfs, "class", "net", ifname, "bonding")
    if not os.path.isdir(base):
        return None
    mode, mcode = parse_bond_field(_read(os.path.join(base, "mode")))
    pol, pcode = parse_bond_field(_read(os.path.join(base, "xmit_hash_policy")))
    slaves = (_read(os.path.join(base, "slaves")) or "").split()
    return Bond(ifname, mode, mcode, pol, pcode, slaves)


def _read_device(sysfs: str, name: str) -> RdmaDevice:
    base = os.path.join(sysfs, "class", "infiniband", name)
    ports = []
    for pn in _listdir(os.path.join(base, "ports")):
        if not pn.isdigit():
            continue
        pb = os.path.join(base, "ports", pn)
        code, state = parse_state(_read(os.path.join(pb, "state")))
        rate = _read(os.path.join(pb, "rate"))
        ports.append(Port(int(pn), _read(os.path.join(pb, "link_layer")), state, code,
                          parse_rate(rate), rate,
                          _read(os.path.join(pb, "gid_attrs", "ndevs", "0"))))
    ports.sort(key=lambda p: p.num)
    dev_link = os.path.join(base, "device")
    pci, chain = _pci_chain(sysfs, dev_link)
    numa = _read(os.path.join(dev_link, "numa_node"))
    try:
        numa_i = int(numa) if numa is not None else None
    except ValueError:
        numa_i = None
    netdevs = _listdir(os.path.join(dev_link, "net"))
    bond = None
    for p in ports:
        if p.netdev:
            bond = _read_bond(sysfs, p.netdev)
            if bond:
                break
    return RdmaDevice(name, ports, netdevs, pci, chain, numa_i,
                      _read(os.path.join(base, "sys_image_guid")), bond)


def _distance(a: list[str], b: list[str]) -> int:
    """Hops between two PCI functions through their deepest common bridge."""
    common = 0
    for x, y in zip(a, b):
        if x != y:
            break
        common += 1
    if common == 0:
        # different root complexes: farther than any shared-root path
        return 1000 + len(a) + len(b)
    return (len(a) - common) + (len(b) - common)


def discover(sysfs: str = "/sys", gpu: str | None = None, multi_port: bool = True) -> Fabric:
    """Read sysfs under `sysfs` and classify the node (for `gpu`, a PCI bus id, if given).

    multi_port: NVSHMEM's multi-port setting the selection is modelled with (jax-ep turns
    it on wherever there are several ports). Never raises on a strange layout: the
    class is then "unknown" and `reason` says why.
    """
    ib_dir = os.path.join(sysfs, "class", "infiniband")
    names = _listdir(ib_dir)
    gpu_id = _normalize_pci(gpu) if gpu else None
    if not names:
        return Fabric(sysfs, gpu_id, [], [], "unknown", 0,
                      f"no RDMA devices: {ib_dir} is missing or empty")
    devices, problems = [], []
    for n in names:
        try:
            devices.append(_read_device(sysfs, n))
        except Exception as e:  # noqa: BLE001 - a strange tree is reported, not raised
            problems.append(f"{n}: {type(e).__name__}: {e}")
    fab = _classify(sysfs, gpu_id, devices, multi_port)
    fab.warnings.extend(problems)
    return fab


def _normalize_pci(bus_id: str) -> str:
    """'17:00.0', '0000:17:00.0' or '00000000:17:00.0' (nvidia-smi) -> '0000:17:00.0'."""
    s = bus_id.strip().lower()
    parts = s.split(":")
    if len(parts) == 2:
        s = "0000:" + s
    elif len(parts) == 3:
        s = parts[0][-4:].rjust(4, "0") + ":" + parts[1] + ":" + parts[2]
    if not _PCI_RE.match(s):
        raise ValueError(f"gpu must be a PCI bus id like 0000:18:00.0, got {bus_id!r}")
    return s


def _closest(sysfs: str, gpu: str | None, devices: list[RdmaDevice],
             notes: list[str]) -> list[RdmaDevice]:
    if gpu is None:
        return devices
    _, gchain = _pci_chain(sysfs, os.path.join(sysfs, "bus", "pci", "devices", gpu))
    if not gchain:
        notes.append(f"GPU {gpu} not found under {sysfs}/bus/pci/devices: every device "
                     f"counted")
        return devices
    with_path = [d for d in devices if d.pci_path]
    if not with_path:
        notes.append("no RDMA device has a PCI path: every device counted")
        return devices
    dist = {d.name: _distance(gchain, d.pci_path) for d in with_path}
    best = min(dist.values())
    return [d for d in with_path if dist[d.name] == best]


def _classify(sysfs, gpu, devices, multi_port) -> Fabric:
    notes: list[str] = []
    near = _closest(sysfs, gpu, devices, notes)
    # ports NVSHMEM can use: active, with a known link layer
    usable = [(d, p) for d in near for p in d.ports if p.active]
    down = [f"{d.name}:{p.num}" for d in near for p in d.ports if not p.active]
    if down:
        notes.append(f"ports not ACTIVE (not counted): {', '.join(down)}")

    def fab(cls, ports, why, bond=None):
        sel = [(d.name, p.num) for d, p in ports]
        return Fabric(sysfs, gpu, devices, sel, cls, len(sel) if cls != "roce-lag" else (
            len(bond.slaves) if bond else 0), why, bond, notes)

    if not usable:
        return fab("unknown", [], "no ACTIVE port on the devices closest to the GPU"
                   if near else "no device closest to the GPU")
    layers = {p.link_layer for _, p in usable}
    if None in layers:
        return fab("unknown", [], "a selected port has no link_layer file (partial tree)")
    if len(layers) > 1:
        return fab("unknown", [], f"mixed link layers on the selected ports: "
                                  f"{sorted(layers)}")
    layer = layers.pop()
    if layer == "Ethernet":
        bonded = [(d, p) for d, p in usable if d.bond is not None]
        if bonded:
            d, p = bonded[0]
            b = d.bond
            if len(usable) > 1:
                notes.append("a bonded device and other RoCE ports are both closest; "
                             "only the bond is used")
            if len(b.slaves) < 2:
                return fab("single-port", [(d, p)],
                           f"bond {b.name} has {len(b.slaves)} member(s)", b)
            if b.mode in ("active-backup", "broadcast") or b.mode_code in (1, 3):
                # an mlx5 LAG in active-backup sends on the active member only
                return fab("single-port", [(d, p)],
                           f"bond {b.name} is in mode {b.mode}: one member carries the "
                           f"traffic; fix: bond mode 802.3ad (or balance-xor) so both "
                           f"members are active", b)
            return fab("roce-lag", [(d, p)],
                       f"{d.name} sends through bond {b.name} (mode {b.mode}, "
                       f"xmit_hash_policy {b.hash_policy}) over {', '.join(b.slaves)}; "
                       f"{len(b.slaves)} ports with per-QP LAG affinity, 1 without", b)
        if len(usable) == 1:
            return fab("single-port", usable, f"one RoCE port ({usable[0][0].name})")
        if not multi_port:
            return fab("single-port", usable[:1], "multi-port off: the first port only")
        return fab("roce-multiport", usable,
                   f"{len(usable)} RoCE ports on {len({d.name for d, _ in usable})} "
                   f"device(s), no bond")
    if layer == "InfiniBand":
        # planes: several devices on one PCI function (or one sys_image_guid per function)
        by_pci: dict = {}
        for d, p in usable:
            by_pci.setdefault(d.pci, []).append((d, p))
        if any(k is not None and len({d.name for d, _ in v}) > 1 for k, v in by_pci.items()):
            return fab("multi-plane", usable,
                       f"{len(usable)} IB planes: several devices share one PCI function "
                       f"(QPs are laid out per device, [plane 0 | plane 1 | ...])")
        if len(usable) == 1:
            return fab("single-port", usable, f"one IB port ({usable[0][0].name})")
        if not multi_port:
            return fab("single-port", usable[:1], "multi-port off: the first port only")
        return fab("ib-multiport", usable,
                   f"{len(usable)} IB ports on {len({d.name for d, _ in usable})} "
                   f"device(s)")
    return fab("unknown", [], f"unknown link layer {layer!r}")


# --- NVSHMEM's own selection, modelled (kernels/internode/nvshmem_select.h) ---------------

def node_gpus(sysfs: str = "/sys") -> list[str]:
    """The node's NVIDIA GPUs (vendor 0x10de, display class 0x03xxxx where the class is
    there) as PCI bus ids in PCI order: local PE i is taken to drive the i-th (one process
    per GPU, the usual launch)."""
    base = os.path.join(sysfs, "bus", "pci", "devices")
    out = []
    for a in _listdir(base):
        cls = (_read(os.path.join(base, a, "class")) or "0x03").lower()
        if (_read(os.path.join(base, a, "vendor")) or "").lower() == "0x10de" and \
                cls.startswith("0x03"):
            out.append(a)
    return out


def _sys_path(chain: list[str]) -> str:
    """The sysfs path NVSHMEM's realpath gives for a PCI chain (root complex first), as
    /sys/devices/pciDDDD:BB/..., whatever root the tree was read from."""
    if not chain:
        return ""
    return "/sys/devices/pci" + chain[0][:7] + "/" + "/".join(chain)


def _ext():
    from jax_ep import _jax_ep_ext  # type: ignore[attr-defined]
    return _jax_ep_ext


def nvshmem_node(sysfs: str, devices: list[RdmaDevice], gpus: list[str]) -> dict:
    """The node as the model takes it: devices (in name order, which the fixtures and
    `ibv_devices` on usual hosts show; NVSHMEM goes by ibv_get_device_list's order) with
    their PCI paths and ports, and the GPUs of the node's PEs."""
    devs = [(d.name, _sys_path(d.pci_path), -1 if d.numa_node is None else d.numa_node,
             [(p.num, p.active, p.link_layer in ("InfiniBand", "Ethernet"))
              for p in d.ports]) for d in sorted(devices, key=lambda d: d.name)]
    paths, numa = [], []
    for g in gpus:
        link = os.path.join(sysfs, "bus", "pci", "devices", g)
        paths.append(_sys_path(_pci_chain(sysfs, link)[1]))
        n = _read(os.path.join(link, "numa_node"))
        numa.append(int(n) if n and n.lstrip("-").isdigit() else -1)
    return {"devices": devs, "gpu_paths": paths, "gpu_numa": numa}


def node_ports(sysfs: str, gpus: list[str], multi_port: bool = True) -> list[str]:
    """Every port some GPU of the node would stripe over (its closest devices' active
    ports, or its bond), as dev:port in device-name order: the node's list that
    `nvshmem_env_for` hands every PE, so NVSHMEM counts all of the node's devices."""
    want = set()
    for g in gpus:
        want.update(discover(sysfs, g, multi_port).selected)
    return [f"{d}:{p}" for d, p in sorted(want)]


def _node_process_gpus(sysfs: str, gpu: str, n: int, what: str):
    """(gpu's PCI address, the GPUs of the node's n processes, one each): the first n of the
    tree, `gpu` replacing the last if not among them; processes whose GPU the tree does not
    show are counted beside it (same distances)."""
    gpus = node_gpus(sysfs)
    g = _normalize_pci(gpu)
    if n < 1:
        raise ValueError(f"{what} must be >= 1, got {n}")
    out = gpus[:n]
    if g not in out:
        out = out[:n - 1] + [g]
    return g, out + [g] * (n - len(out))


def nvshmem_selection(env: dict, *, sysfs: str, gpu: str, pes_per_node: int,
                      num_qps: int, qp_api: bool = True,
                      devices: list[RdmaDevice] | None = None) -> dict:
    """What NVSHMEM opens for `gpu`'s PE with `env` (its NVSHMEM_* variables) when the
    node runs `pes_per_node` PEs on its first GPUs: {"list", "max_devices_per_pe",
    "devices", "distance", "qp_ports" (handle i's device:port, creation order),
    "default_handles", "note", "error"}."""
    g, pe_gpus = _node_process_gpus(sysfs, gpu, pes_per_node, "pes_per_node")
    if devices is None:
        devices = discover(sysfs, g).devices
    node = nvshmem_node(sysfs, devices, pe_gpus)
    return dict(_ext().nvshmem_select(node["devices"], node["gpu_paths"], node["gpu_numa"],
                                      {k: str(v) for k, v in env.items()},
                                      pe_gpus.index(g), int(num_qps), bool(qp_api)))


# --- NCCL GIN's placement, modelled (kernels/internode/nccl_select.h) ---------------------

# The NCCL variables the model reads (the user's win over what nccl_env_for sets).
NCCL_SELECT_VARS = ("NCCL_IB_HCA", "NCCL_IB_DISABLE", "NCCL_IB_DEVICE_PCI_ORDER",
                    "NCCL_IB_MERGE_NICS", "NCCL_NETDEVS_POLICY", "NCCL_GIN_NCONNECTIONS",
                    "NCCL_GIN_TYPE", "NCCL_GIN_ENABLE", "NCCL_GIN_GDAKI_LAG_AWARE_DISABLE")


def nccl_selection(env: dict, *, sysfs: str, gpu: str, ranks_per_node: int,
                   num_contexts: int, devices: list[RdmaDevice] | None = None,
                   version: int = 23206, gdaki_port_one: bool = True) -> dict:
    """Where NCCL puts the GIN contexts of `gpu`'s rank with `env` (its NCCL_* variables)
    when the node runs `ranks_per_node` ranks on its first GPUs: {"backend", "ib_devs"
    (NCCL's device:port list), "local_ib_devs", "nets_per_gpu", "connections" (the
    device:port each GIN connection listens on), "contexts_created", "context_ports"
    (context i's wire device:port), "context_ib_dev", "context_connection",
    "context_id", "context_lag_member" (bonds: 1-based member, -1 not pinned, 0 no bond),
    "notes", "error"}. The rule is the C++ one (nccl_select.h); version: NCCL_VERSION_CODE
    (23206 = the 2.32.6 wheel); gdaki_port_one: GDAKI's port-1 assumption (True, as
    NCCL's source has it)."""
    g, rank_gpus = _node_process_gpus(sysfs, gpu, ranks_per_node, "ranks_per_node")
    if devices is None:
        devices = discover(sysfs, g).devices
    node = nvshmem_node(sysfs, devices, rank_gpus)
    lag = {d.name: len(d.bond.slaves) for d in devices if d.bond and len(d.bond.slaves) > 1}
    return dict(_ext().nccl_select(node["devices"], node["gpu_paths"], node["gpu_numa"],
                                   {k: str(v) for k, v in env.items()}, rank_gpus.index(g),
                                   int(num_contexts), lag, int(version),
                                   bool(gdaki_port_one)))


def nccl_wire_ports(sel: dict) -> list[str]:
    """The distinct wire ports (device:port, or device:port/member for a pinned bond) the
    contexts of a selection use, in first-use order."""
    out = []
    for p, m in zip(sel["context_ports"], sel["context_lag_member"]):
        k = f"{p}/{m}" if m > 0 else p
        if k not in out:
            out.append(k)
    return out


def nccl_env_for(fabric: Fabric, cfg, ranks_per_node: int | None = None,
                 environ: dict | None = None) -> dict:
    """The NCCL variables the bootstrap sets so GIN puts the plan's contexts (cfg.num_qps)
    on the ports the plan stripes over, decided by the C++ rule (nccl_selection): nothing
    where NCCL's defaults already do it; NCCL_NETDEVS_POLICY=ALL where the GPU shares its
    NIC with other GPUs and AUTO would give it fewer of its ports than the plan has; for a
    bond NCCL_GIN_GDAKI_LAG_AWARE_DISABLE=0 (NCCL >= 2.32 then pins contexts to members).
    NCCL_IB_HCA and NCCL_IB_MERGE_NICS are left to the user: NCCL's default device list
    already holds every active port, and merging does not apply to GIN. Empty for an
    unknown fabric or a GPU the tree does not show. environ: the user's variables (they
    win, as for NVSHMEM)."""
    cls = fabric.fabric_class
    if cls == "unknown" or not fabric.selected or fabric.gpu is None:
        return {}
    gpus = node_gpus(fabric.sysfs)
    if fabric.gpu not in gpus:
        return {}
    rpn = ranks_per_node or len(gpus)
    user = {k: v for k, v in (environ or {}).items() if k in NCCL_SELECT_VARS}
    env: dict[str, str] = {}
    if cls == "roce-lag":
        env["NCCL_GIN_GDAKI_LAG_AWARE_DISABLE"] = "0"
        return env
    want = cfg.num_ports
    base = nccl_selection(user, sysfs=fabric.sysfs, gpu=fabric.gpu, ranks_per_node=rpn,
                          num_contexts=cfg.num_qps, devices=fabric.devices)
    if not base["error"] and len(base["local_ib_devs"]) < min(want, 4):
        trial = nccl_selection({**user, "NCCL_NETDEVS_POLICY": "ALL"}, sysfs=fabric.sysfs,
                               gpu=fabric.gpu, ranks_per_node=rpn, num_contexts=cfg.num_qps,
                               devices=fabric.devices)
        if len(trial["local_ib_devs"]) > len(base["local_ib_devs"]):
            env["NCCL_NETDEVS_POLICY"] = "ALL"
    return env


# --- what the bootstrap does with it ------------------------------------------------------

def plan_config_for(fabric: Fabric, cfg, lag_affinity: str = "alternate"):
    """(the TransportConfig to run, [loud messages]) for this fabric.

    The plan's num_ports is what the wire can carry: the selected ports (multi-port),
    the bond's members (roce-lag; each QP pinned to a member by LAG affinity), else 1.
    """
    import dataclasses as dc
    msgs = []
    if lag_affinity not in ("none", "alternate"):
        raise ValueError(f"lag_affinity must be 'none' or 'alternate', got {lag_affinity!r}")
    cls = fabric.fabric_class
    if cls == "unknown":
        msgs.append(f"jax_ep: fabric unknown ({fabric.reason}); the plan's "
                    f"{cfg.num_ports} ports are an assumption, not checked")
        return cfg, msgs
    if cls == "roce-lag":
        new = dc.replace(cfg, lag="bond", num_channels=None)
        if lag_affinity == "none" and cfg.num_ports > 1:
            msgs.append(
                f"jax_ep: RoCE LAG {fabric.bond.name if fabric.bond else ''} without "
                f"per-QP LAG affinity: GPU-initiated QPs bypass the bond's hash, so every "
                f"QP may sit on ONE member (half the NIC). Fix: let jax_ep set the QPs' "
                f"lag_tx_port_affinity (JAX_EP_LAG_AFFINITY=alternate)")
        return new, msgs
    ports = fabric.usable_ports
    if cls == "single-port" and cfg.num_ports > 1:
        msgs.append(f"jax_ep: this node has one usable port ({fabric.reason}); the plan's "
                    f"{cfg.num_ports} ports would all land on it: running on one port")
        return cfg.single_port(), msgs
    sel = ", ".join(f"{n}:{p}" for n, p in fabric.selected)
    if cls in ("ib-multiport", "roce-multiport", "multi-plane") and ports < cfg.num_ports:
        msgs.append(f"jax_ep: the plan stripes over {cfg.num_ports} ports but this node "
                    f"has {ports} ({sel}); QP q sits on port q % {ports}, so the plan's "
                    f"port of a QP is not the wire's. Fix: JAX_EP_NUM_PORTS={ports}")
    elif cls in ("ib-multiport", "roce-multiport", "multi-plane") and ports > cfg.num_ports:
        msgs.append(f"jax_ep: the plan uses {cfg.num_ports} of the {ports} ports closest to "
                    f"the GPU ({sel}; NVSHMEM_HCA_LIST names the first {cfg.num_ports}); "
                    f"JAX_EP_NUM_PORTS={ports} would use them all")
    return cfg, msgs


def nvshmem_env_for(fabric: Fabric, cfg, node_list: list[str] | None = None) -> dict:
    """NVSHMEM's device selection for the plan, the same on every PE of the node: the
    node's whole port list (`node_list`, default `node_ports` of the fabric's tree), multi-
    port on where the plan has several ports, PE mapping off. NVSHMEM then gives each PE
    n_devices / PEs-per-node devices, the closest (nvshmem_select.h): both ports of its
    own NIC on the standard node. A list of one PE's own ports would leave it
    2 / 8 -> 1 device. Empty for an unknown fabric (NVSHMEM's own choice is left alone)."""
    cls = fabric.fabric_class
    if cls == "unknown" or not fabric.selected:
        return {}
    if node_list is None:
        gpus = node_gpus(fabric.sysfs)
        node_list = node_ports(fabric.sysfs, gpus) if gpus else []
        if not node_list:  # no GPUs in the tree: this GPU's own ports
            node_list = [f"{d}:{p}" for d, p in sorted(fabric.selected)]
    env = {"NVSHMEM_ENABLE_NIC_PE_MAPPING": "0", "NVSHMEM_HCA_LIST": ",".join(node_list)}
    n = 1 if cls in ("roce-lag", "single-port") else cfg.num_ports
    multi = "1" if n > 1 else "0"
    env["NVSHMEM_ENABLE_MULTI_PORT"] = multi
    env["NVSHMEM_IBGDA_ENABLE_MULTI_PORT"] = multi
    return env


def nvshmem_plan(fabric: Fabric, cfg, pes_per_node: int, env: dict | None = None,
                 environ: dict | None = None):
    """The plan checked against NVSHMEM's own selection before it starts: (cfg, env,
    selection, [loud messages]). env: what jax_ep sets (default `nvshmem_env_for`); the
    user's NVSHMEM_* variables in `environ` win, as the bootstrap keeps them. Where
    NVSHMEM would open fewer devices for this GPU than the plan has ports (the QPs would
    share them), the plan shrinks to what it opens, loudly; where it would open none, or
    none of this GPU's closest ports, that is a RuntimeError naming the fabric and the
    fix."""
    import dataclasses as dc
    if env is None:
        env = nvshmem_env_for(fabric, cfg)
    user = {k: v for k, v in (environ or {}).items() if k in (
        "NVSHMEM_HCA_LIST", "NVSHMEM_HCA_PE_MAPPING", "NVSHMEM_HCA_PREFIX",
        "NVSHMEM_ENABLE_MULTI_PORT", "NVSHMEM_IBGDA_ENABLE_MULTI_PORT",
        "NVSHMEM_ENABLE_NIC_PE_MAPPING")}
    msgs = []
    if not env or fabric.gpu is None:
        return cfg, env, None, msgs
    if fabric.gpu not in node_gpus(fabric.sysfs):
        msgs.append(f"jax_ep: GPU {fabric.gpu} is not under {fabric.sysfs}/bus/pci/devices, "
                    f"so NVSHMEM's device selection for it is not modelled or checked")
        return cfg, env, None, msgs
    sel = nvshmem_selection({**env, **user}, sysfs=fabric.sysfs, gpu=fabric.gpu,
                            pes_per_node=pes_per_node, num_qps=cfg.num_qps,
                            devices=fabric.devices)
    eff = ", ".join(f"{k}={v}" for k, v in sorted({**env, **user}.items()))
    if sel["error"]:
        raise RuntimeError(
            f"jax_ep: on this {fabric.fabric_class} node NVSHMEM would open no RDMA device "
            f"for GPU {fabric.gpu} ({sel['error']}; {eff}). Fix: unset the NVSHMEM_* "
            f"device variables above so jax_ep chooses, or JAX_EP_FABRIC=off")
    own = {f"{d}:{p}" for d, p in fabric.selected}
    opened = sel["devices"]
    if not set(opened) <= own:
        raise RuntimeError(
            f"jax_ep: on this {fabric.fabric_class} node NVSHMEM would open "
            f"{', '.join(opened)} for GPU {fabric.gpu}, not its closest ports "
            f"({', '.join(sorted(own))}): its traffic would cross the PCI tree to another "
            f"GPU's NIC ({eff}). Fix: unset NVSHMEM_HCA_LIST / NVSHMEM_HCA_PE_MAPPING / "
            f"NVSHMEM_ENABLE_NIC_PE_MAPPING so jax_ep chooses, or JAX_EP_FABRIC=off")
    wire = len(opened) if fabric.fabric_class != "roce-lag" else cfg.num_ports
    if wire < cfg.num_ports:
        why = sel["note"] or "its selection rules"
        msgs.append(f"jax_ep: NVSHMEM opens {', '.join(opened)} for GPU {fabric.gpu} "
                    f"({why}) on this {fabric.fabric_class} node, so the plan's "
                    f"{cfg.num_ports} ports would share {wire}: running on {wire}")
        cfg = cfg.single_port() if wire == 1 else dc.replace(cfg, num_ports=wire,
                                                             num_channels=None)
        return nvshmem_plan(fabric, cfg, pes_per_node, nvshmem_env_for(fabric, cfg),
                            environ)[:3] + (msgs,)
    return cfg, env, sel, msgs


def nccl_plan(fabric: Fabric, cfg, ranks_per_node: int, environ: dict | None = None):
    """The plan checked against NCCL's own placement of the GIN contexts (the C++ rule,
    nccl_selection) before NCCL starts: (cfg, env, selection, [loud messages]). env: what
    jax_ep sets (`nccl_env_for`); the user's NCCL_* variables in `environ` win. Where the
    plan's QPs (contexts) would land on fewer distinct wire ports than the plan has (GDAKI
    makes every QP of a one-device dual-port NIC on port 1), the plan shrinks to them,
    loudly; where NCCL would open no device, that is a RuntimeError naming the fabric."""
    import dataclasses as dc
    msgs: list[str] = []
    if fabric.gpu is None or fabric.gpu not in node_gpus(fabric.sysfs):
        return cfg, {}, None, msgs
    env = nccl_env_for(fabric, cfg, ranks_per_node=ranks_per_node, environ=environ)
    user = {k: v for k, v in (environ or {}).items() if k in NCCL_SELECT_VARS}
    sel = nccl_selection({**env, **user}, sysfs=fabric.sysfs, gpu=fabric.gpu,
                         ranks_per_node=ranks_per_node, num_contexts=cfg.num_qps,
                         devices=fabric.devices)
    if sel["error"]:
        eff = ", ".join(f"{k}={v}" for k, v in sorted({**env, **user}.items())) or "defaults"
        raise RuntimeError(f"jax_ep: on this {fabric.fabric_class} node NCCL would open no "
                           f"GIN device for GPU {fabric.gpu} ({sel['error']}; {eff})")
    wires = nccl_wire_ports(sel)
    if len(wires) < cfg.num_ports:
        why = "; ".join(sel["notes"]) or "its selection rules"
        msgs.append(f"jax_ep: NCCL puts the plan's {cfg.num_qps} GIN contexts of GPU "
                    f"{fabric.gpu} on {', '.join(wires)} ({why}) on this "
                    f"{fabric.fabric_class} node, so the plan's {cfg.num_ports} ports would "
                    f"share {len(wires)}: running on {len(wires)}")
        n = max(len(wires), 1)
        cfg = cfg.single_port() if n == 1 else dc.replace(cfg, num_ports=n,
                                                          num_channels=None)
        return nccl_plan(fabric, cfg, ranks_per_node, environ)[:3] + (msgs,)
    return cfg, env, sel, msgs


def qp_table(fabric: Fabric, cfg, handles, lag_affinity: str = "alternate",
             affinity_applied: bool | None = None) -> list[dict]:
    """The QP handle -> (device, port) table for the plan's logical QPs.

    NVSHMEM's QP API places the i-th created QP on selected device i mod D (the devices
    in NVSHMEM_HCA_LIST order, see `nvshmem_env_for`). Under a LAG the device is the bond
    and the port is the member the QP's lag_tx_port_affinity pins it to (1-based), or
    "firmware" when no affinity was applied. `handles[q]` is logical QP q's handle (None
    when not created).
    """
    sel = sorted(fabric.selected)
    out = []
    for q in range(cfg.num_qps):
        h = handles[q] if q < len(handles) else None
        row = {"qp": q, "handle": h, "planned_port": q % cfg.num_ports}
        if not sel:
            row.update(device="unknown", port="unknown", wire_port=None)
        elif fabric.fabric_class == "roce-lag":
            members = max(fabric.usable_ports, 1)
            applied = (lag_affinity == "alternate") if affinity_applied is None else \
                affinity_applied
            row.update(device=sel[0][0],
                       port=(q % members) + 1 if applied else "firmware",
                       member=(fabric.bond.slaves[q % members]
                               if applied and fabric.bond else None),
                       wire_port=(q % members) if applied else None)
        else:
            d, p = sel[q % len(sel)]
            row.update(device=d, port=p, wire_port=q % len(sel))
        row["on_plan"] = row["wire_port"] == row["planned_port"]
        out.append(row)
    return out


def handle_order_for_plan(table: list[dict], num_ports: int) -> list[int] | None:
    """A permutation `order` with table[order[q]]["wire_port"] == q % num_ports for every
    logical QP q, so the stripe follows the real handle -> port table whatever order
    NVSHMEM laid the QPs out in ([NIC 0 QPs | NIC 1 QPs | ...] included); None if the
    table cannot carry the plan (unknown ports, or too few QPs on some port)."""
    free: dict = {}
    for i, row in enumerate(table):
        wp = row.get("wire_port")
        if wp is None:
            return None
        free.setdefault(wp, []).append(i)
    order = []
    for q in range(len(table)):
        lst = free.get(q % num_ports)
        if not lst:
            return None
        order.append(lst.pop(0))
    return order


def agree(summary: dict, client, rank: int, world: int, *, key_prefix: str,
          timeout_ms: int) -> list[str]:
    """Publishes this process's fabric summary through the JAX key-value store and reads
    every other's. Returns [] when all agree, else one line per process that differs from
    process 0 (the caller decides how loud to be)."""
    mine = json.dumps(summary, sort_keys=True)
    client.key_value_set(f"{key_prefix}/fabric/{rank}", mine)
    ref = None
    diffs = []
    for r in range(world):
        other = mine if r == rank else client.blocking_key_value_get(
            f"{key_prefix}/fabric/{r}", timeout_ms)
        if ref is None:
            ref = other
        elif other != ref:
            diffs.append(f"process {r}: {other} (process 0: {ref})")
    return diffs


# --- CLI ------------------------------------------------------------------------------------

def format_report(f: Fabric) -> str:
    lines = [f"fabric: {f.fabric_class} ({f.reason})",
             f"usable ports: {f.usable_ports}" + (f" (for GPU {f.gpu})" if f.gpu else ""),
             "selected: " + (", ".join(f"{n}:{p}" for n, p in f.selected) or "none")]
    if f.bond:
        lines.append(f"bond {f.bond.name}: mode {f.bond.mode} ({f.bond.mode_code}), "
                     f"xmit_hash_policy {f.bond.hash_policy}, members "
                     f"{' '.join(f.bond.slaves)}")
    for d in f.devices:
        ports = "; ".join(f"port {p.num} {p.link_layer} {p.state} {p.rate}"
                          + (f" via {p.netdev}" if p.netdev else "") for p in d.ports)
        lines.append(f"  {d.name}: pci {d.pci} numa {d.numa_node} netdevs "
                     f"{','.join(d.netdevs) or '-'}: {ports or 'no ports'}")
    for w in f.warnings:
        lines.append(f"note: {w}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jax_ep.network.fabric",
                                 description="what RDMA fabric this node has (from sysfs)")
    ap.add_argument("--sysfs", default="/sys", help="sysfs root (a copy, for tests)")
    ap.add_argument("--gpu", default=None, help="PCI bus id of the GPU (e.g. 0000:18:00.0)")
    ap.add_argument("--no-multi-port", action="store_true",
                    help="model NVSHMEM with multi-port off")
    ap.add_argument("--pes-per-node", type=int, default=None, metavar="N",
                    help="with --gpu: NVSHMEM's selection for that GPU's PE when the node "
                         "runs N PEs (what jax_ep sets, the devices it opens, each planned "
                         "QP's device:port)")
    ap.add_argument("--num-ports", type=int, default=2, help="the plan's ports (default 2)")
    ap.add_argument("--qps-per-port", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    try:
        f = discover(a.sysfs, a.gpu, multi_port=not a.no_multi_port)
        out = f.to_json()
        if a.pes_per_node is not None:
            if a.gpu is None:
                raise ValueError("--pes-per-node needs --gpu")
            out["nvshmem"] = nvshmem_report(f, a.pes_per_node, a.num_ports, a.qps_per_port)
    except (ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if a.json:
        print(json.dumps(out, indent=1))
    else:
        print(format_report(f))
        if "nvshmem" in out:
            n = out["nvshmem"]
            print("nvshmem env: " + " ".join(f"{k}={v}" for k, v in n["env"].items()))
            print(f"nvshmem opens: {', '.join(n['devices'])}; planned QPs on: "
                  f"{', '.join(n['qp_ports'])}")
            for m in n["messages"]:
                print(m)
    return 0


def nvshmem_report(f: Fabric, pes_per_node: int, num_ports: int = 2,
                   qps_per_port: int = 1) -> dict:
    """The CLI's "nvshmem" object: what the bootstrap sets for this GPU's PE, the devices
    NVSHMEM opens (modelled), and the device:port of each planned QP (logical QP q uses
    the handle `handle_order_for_plan` gives it, as the runtime orders them)."""
    from jax_ep.network.transport import TransportConfig
    cfg, msgs = plan_config_for(f, TransportConfig(num_ports=num_ports,
                                                   qps_per_port=qps_per_port))
    cfg, env, sel, more = nvshmem_plan(f, cfg, pes_per_node)
    if sel is None:
        return {"env": env, "devices": [], "qp_ports": [], "messages": msgs + more}
    created = sel["qp_ports"]
    if f.fabric_class == "roce-lag" and f.bond:  # the member each QP's affinity names
        m = len(f.bond.slaves)
        created = [f"{c}@{f.bond.slaves[i % m]}" for i, c in enumerate(created)]
    own = list(dict.fromkeys(created))
    table = [{"wire_port": own.index(c)} for c in created]
    order = handle_order_for_plan(table, cfg.num_ports) or list(range(len(created)))
    return {"env": env, "devices": sel["devices"], "qp_ports": [created[h] for h in order],
            "num_ports": cfg.num_ports, "messages": msgs + more}


if __name__ == "__main__":
    sys.exit(main())


# --- at NVSHMEM start (called from jax_ep.nvshmem_bootstrap.initialize) ------------------------

@dataclasses.dataclass
class FabricSetup:
    """What the bootstrap decided from discovery: the config to run, the NVSHMEM device
    selection, whether the LAG shim is armed, and the loud messages said."""

    fabric: Fabric
    config: object            # TransportConfig
    env: dict                 # NVSHMEM_* device selection and bootstrap interface
                              # (merged into the library's)
    lag_affinity: str         # "alternate" | "none"
    shim_armed: bool = False
    messages: list = dataclasses.field(default_factory=list)
    shim_table: list | None = None  # the shim's per-RC-QP record after NVSHMEM started
    world: int = 1
    handle_order: list | None = None  # logical QP q uses the handle created order[q]-th
    created_handles: list | None = None  # the explicit QP handles in creation order
    # NVSHMEM's bootstrap interface and why (jax_ep.network.bootstrap_iface)
    bootstrap_iface: object | None = None
    # NVSHMEM's selection for this PE as modelled before it started (nvshmem_selection)
    nvshmem: dict | None = None


_setup: FabricSetup | None = None
_said: set = set()


def _say(msg: str) -> None:
    """Once per process, on stderr and as a warning: where the plan cannot be on the
    wire, the reason and the fix."""
    if msg in _said:
        return
    _said.add(msg)
    print(msg, file=sys.stderr, flush=True)
    import warnings as _w
    _w.warn(msg, stacklevel=3)


def _gpu_bus_id() -> str | None:
    """This process's GPU as a PCI bus id, where JAX or the environment says it."""
    from jax_ep import config
    env = config.current().gpu_pci_bus_id  # JAX_EP_GPU_PCI_BUS_ID
    if env:
        return env
    try:
        import jax
        d = jax.local_devices()[0]
    except Exception:  # noqa: BLE001 - no backend, no GPU
        return None
    for attr in ("pci_bus_id", "bus_id"):
        v = getattr(d, attr, None)
        if isinstance(v, str) and v:
            return v
    return None


def setup_for_bootstrap(cfg, environ, rank: int, world: int, client, *, key_prefix: str,
                        timeout_ms: int, sysfs: str | None = None,
                        gpu: str | None = None, coordinator: str | None = None,
                        route_table: str | None = None) -> FabricSetup:
    """Discovery, the config the wire can carry, NVSHMEM's device selection, agreement
    across processes and (RoCE) the LAG shim, before NVSHMEM starts; and NVSHMEM's
    bootstrap interface.

    JAX_EP_FABRIC=off skips the fabric part (NVSHMEM's own selection, the plan
    unchecked); JAX_EP_SYSFS points discovery at another sysfs root; JAX_EP_LAG_AFFINITY=none
    leaves the QPs' LAG affinity alone. Processes that classify their nodes differently
    are an error (their plans would differ), naming each process.

    The bootstrap interface (NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME, unless set) is the one
    that routes to `coordinator` (default: jax.distributed's) in `route_table` (default:
    JAX_EP_ROUTE_TABLE, else /proc/net/route); see jax_ep.network.bootstrap_iface. It is
    chosen per node, so it is not part of any agreement; where none can be chosen and
    there are several processes, that is said with the fix.
    """
    global _setup
    from jax_ep import config
    settings = config.settings_for(environ)  # the JAX_EP_* settings (jax_ep.config)
    off = not settings.fabric
    lag_aff = settings.lag_affinity
    root = sysfs or settings.sysfs
    if off:
        f = Fabric(root, None, [], [], "unknown", 0, "discovery off (JAX_EP_FABRIC=off)")
    else:
        try:
            f = discover(root, gpu if gpu is not None else _gpu_bus_id())
        except ValueError as e:  # an odd bus id from the runtime: count every device
            f = discover(root, None)
            f.warnings.append(str(e))
    new_cfg, msgs = plan_config_for(f, cfg, lag_aff)
    if off or not f.devices:
        msgs = []  # nothing to check against: no RDMA here (one node) or discovery off
    env = nvshmem_env_for(f, new_cfg) if not off else {}
    selection = None
    if env and not off and f.gpu is not None and not environ.get("NVSHMEM_HCA_PE_MAPPING"):
        from jax_ep.network import topology as _topo
        ppn = _topo.detect(world, environ=environ).gpus_per_node
        new_cfg, env, selection, more = nvshmem_plan(f, new_cfg, ppn, env, dict(environ))
        msgs.extend(more)
    if env and environ.get("NVSHMEM_HCA_PE_MAPPING"):
        # the user's mapping wins; NVSHMEM refuses it together with an HCA list
        env = {k: v for k, v in env.items()
               if k not in ("NVSHMEM_HCA_LIST", "NVSHMEM_ENABLE_NIC_PE_MAPPING")}
        msgs.append("jax_ep: NVSHMEM_HCA_PE_MAPPING is set, so jax_ep sets no "
                    "NVSHMEM_HCA_LIST: the device order on every node is the user's")
    from jax_ep.network import bootstrap_iface as _bi
    iface = _bi.choose(coordinator if coordinator is not None else _bi.jax_coordinator(),
                       environ, route_table=route_table or settings.route_table)
    env = {**env, **iface.env()}
    if iface.warning and world > 1:  # one process reaches itself on any interface
        msgs.append(iface.warning)
    if world > 1 and not off and client is not None and hasattr(
            client, "blocking_key_value_get_bytes"):
        diffs = _agree_bytes(f.summary(), client, rank, world, key_prefix, timeout_ms)
        if diffs:
            raise RuntimeError(
                "jax_ep: the processes see different fabrics, so their striping plans "
                "would differ: " + "; ".join(diffs) + ". Fix the nodes' NIC setup, or set "
                "the same JAX_EP_NUM_PORTS everywhere and JAX_EP_FABRIC=off")
    armed = False
    if f.fabric_class != "unknown" and not off and f.selected:
        armed, why = _arm_shim(f, new_cfg, lag_aff, world)
        if why:
            msgs.append(why)
    for m in msgs:
        _say(m)
    _setup = FabricSetup(f, new_cfg, env, lag_aff, armed, msgs, None, world,
                         bootstrap_iface=iface, nvshmem=selection)
    return _setup


def _agree_bytes(summary, client, rank, world, key_prefix, timeout_ms) -> list[str]:
    class _Str:  # the bytes store through agree's string interface
        def key_value_set(self, k, v):
            client.key_value_set_bytes(k, v.encode())

        def blocking_key_value_get(self, k, t):
            return bytes(client.blocking_key_value_get_bytes(k, t)).decode()

    return agree(summary, _Str(), rank, world, key_prefix=key_prefix, timeout_ms=timeout_ms)


def _arm_shim(f: Fabric, cfg, lag_aff: str, world: int) -> tuple[bool, str | None]:
    """Loads and configures the DevX shim before NVSHMEM starts: on a LAG it pins QPs to
    members, on RoCE it gives each QP its own UDP source port, everywhere it records
    which device each QP was created on."""
    from jax_ep.network import lag_affinity as la

    lag = f.fabric_class == "roce-lag"
    roce = f.fabric_class in ("roce-lag", "roce-multiport") or (
        f.fabric_class == "single-port" and f.bond is not None)
    members = f.usable_ports if (lag and lag_aff == "alternate") else 0
    try:
        shim = la.load_shim()
    except (OSError, AttributeError) as e:  # unloadable, or an older build's shim
        shim, err = None, f"not usable ({e})"
    else:
        err = "not built (libjax_ep_lag_shim.so next to the extension)"
    if shim is None:
        if lag and lag_aff == "alternate":
            return False, (
                f"jax_ep: cannot set the LAG TX affinity of the QPs on {f.selected[0][0]}: "
                f"the DevX shim is {err}. Every QP may sit on ONE bond member: the model "
                f"(python -m jax_ep.plan --fabric roce-lag --lag-affinity none) doubles the "
                f"busiest port's time. Fix: rebuild jax_ep (make build) so the shim is "
                f"installed")
        return False, None
    # NVSHMEM 3.8 (ibgda.cpp, ibgda_setup_rc_endpoints) creates a QP slot's RC QPs to the
    # other PEs one after another (none to itself), and nvshmemx_qp_create makes one slot
    # per handle: a group of world - 1 QPs shares a slot, so the member alternates slot
    # by slot, i.e. handle by handle.
    shim.configure(members=members, group=max(world - 1, 1),
                   sport_base=la.ROCE_SPORT_MIN if roce else 0)
    return True, None


def after_nvshmem_start() -> None:
    """Reads what the shim did once NVSHMEM created its QPs; says so loudly where the
    LAG affinity did not reach them."""
    s = _setup
    if s is None or not s.shim_armed:
        return
    from jax_ep.network import lag_affinity as la

    shim = la.load_shim()
    if shim is None:
        return
    shim.disable()  # only the QPs NVSHMEM created at start
    s.shim_table = shim.table()
    want = sorted({d for d, _ in s.fabric.selected})
    used = sorted({r["device"] for r in s.shim_table if r.get("device")})
    need = 1 if s.fabric.fabric_class == "roce-lag" else s.config.num_ports
    if used and all(not u.startswith("ctx:") for u in used) and (
            len(used) < min(len(want), need) or not set(used) <= set(want)):
        _say(f"jax_ep: NVSHMEM created its RC QPs on {len(used)} device(s) "
             f"({', '.join(used)}), the plan stripes over {s.config.num_ports} port(s) on "
             f"{', '.join(want)}: QPs the plan puts on other ports share these. Fix: check "
             f"NVSHMEM_HCA_LIST / NVSHMEM_ENABLE_MULTI_PORT in the environment (a user value "
             f"is kept), or set JAX_EP_NUM_PORTS={max(len(used), 1)}")
    if s.fabric.fabric_class != "roce-lag" or s.lag_affinity != "alternate":
        return
    dev = s.fabric.selected[0][0] if s.fabric.selected else "?"
    if not s.shim_table:
        _say(f"jax_ep: the DevX shim saw no RC QP being created on {dev}: NVSHMEM bound "
             f"libmlx5 before the shim was loaded (or does not use DevX), so the QPs' LAG "
             f"affinity is the firmware's and may put every QP on ONE member. Fix: import "
             f"jax_ep before anything loads libmlx5, or LD_PRELOAD=libjax_ep_lag_shim.so")
        return
    # the affinity holds where RST2INIT carried it or the RTS2RTS after RTS was accepted
    failed = [r for r in s.shim_table if not (r["patched"] & (la.PATCHED_RST2INIT_AFFINITY |
                                                              la.PATCHED_RTS2RTS_AFFINITY))]
    if failed:
        _say(f"jax_ep: the LAG affinity did not reach {len(failed)} of "
             f"{len(s.shim_table)} RC QPs on {dev} (first: qpn {failed[0]['qpn']:#x}, "
             f"RTS2RTS status {failed[0]['rts2rts_status']}): those QPs use the member "
             f"the firmware chooses")


def state() -> FabricSetup | None:
    return _setup


def apply_handle_order(rt, cfg) -> list[int] | None:
    """Makes the recorded handle -> port table decide the stripe: computes the order that
    puts logical QP q on port q % num_ports (`handle_order_for_plan`, from the table in
    creation order) and has the runtime reorder the kernels' handle array by it
    (`rt.set_qp_order`), whatever order NVSHMEM laid the QPs out in. Where no order can
    carry the plan (unknown ports, too few QPs on a port), says so and leaves the
    creation order. Returns the order applied, or None."""
    s = _setup
    get = getattr(rt, "qp_handles", None)
    if s is None or get is None or not hasattr(rt, "set_qp_order"):
        return None
    s.handle_order = s.created_handles = None
    handles = list(get() or [])
    if len(handles) != cfg.num_qps or len(set(handles)) != len(handles):
        return None  # no explicit handles (fallback): nothing to order
    table = recorded_qp_table(cfg, handles)
    s.created_handles = handles
    order = handle_order_for_plan(table, cfg.num_ports)
    if order is None:
        ports = [r.get("wire_port") for r in table]
        if cfg.num_ports > 1:
            _say(f"jax_ep: the QP handle -> port table ({ports}) cannot carry the plan's "
                 f"{cfg.num_ports}-port stripe (unknown ports or too few QPs on one): the "
                 f"QPs keep NVSHMEM's order. Fix: check NVSHMEM_HCA_LIST / "
                 f"NVSHMEM_ENABLE_MULTI_PORT, or set JAX_EP_NUM_PORTS")
        return None
    if order != list(range(len(order))):
        rt.set_qp_order(order)
    s.handle_order = order
    return order


def recorded_qp_table(cfg, handles) -> list[dict] | None:
    """The QP handle -> (device, port) table of the running transport (None before the
    bootstrap ran discovery). `handles[q]` is the handle logical QP q uses (the kernels'
    table, as the runtime reports it); each row describes that handle's QPs, found by its
    place in the creation order, so a reorder the kernels did not get shows off plan."""
    s = _setup
    if s is None:
        return None
    created = s.created_handles
    if created is not None and handles is not None and list(handles) != created and \
            sorted(handles) == sorted(created):
        by_creation = recorded_qp_table_created(cfg, created)
        rows = []
        for q, h in enumerate(handles):
            row = dict(by_creation[created.index(h)], qp=q, planned_port=q % cfg.num_ports)
            row["on_plan"] = row.get("wire_port") == row["planned_port"]
            rows.append(row)
        return rows
    return recorded_qp_table_created(cfg, handles)


def recorded_qp_table_created(cfg, handles) -> list[dict] | None:
    """`recorded_qp_table` for handles in creation order (row q: the q-th created)."""
    s = _setup
    if s is None:
        return None
    applied = None
    if s.fabric.fabric_class == "roce-lag":
        applied = bool(s.shim_table) and s.lag_affinity == "alternate"
    table = qp_table(s.fabric, cfg, handles, s.lag_affinity, applied)
    if s.shim_table and s.world > 1:
        _from_shim(table, s.shim_table, s.world, s.fabric, applied)
    return table


def _handle_records(table, shim_table, world):
    """The shim's records of each handle's QPs: the handles' QPs are the last ones
    NVSHMEM created, world - 1 per handle in handle order (NVSHMEM 3.8's
    nvshmemx_qp_create: one slot per handle, its QPs to the other PEs in a row)."""
    per = max(world - 1, 1)
    base = len(shim_table) - per * len(table)
    return [shim_table[base + q * per: base + (q + 1) * per] if base >= 0 else []
            for q in range(len(table))]


def _from_shim(table: list[dict], shim_table: list[dict], world: int, fabric: Fabric,
               lag_applied: bool | None) -> None:
    """Replaces the modelled device (and, on a LAG, member) of each handle with what the
    shim recorded for its QPs; a handle whose QPs differ says "mixed"."""
    sel = sorted(fabric.selected)
    names = [d for d, _ in sel]
    recs_of = _handle_records(table, shim_table, world)
    if fabric.fabric_class != "roce-lag":
        for row, recs in zip(table, recs_of):
            devs = {r.get("device") for r in recs}
            if len(devs) != 1 or None in devs:
                row.update(device="mixed" if recs else "unknown", port="unknown",
                           wire_port=None, on_plan=False)
                continue
            d = devs.pop()
            if d.startswith("ctx:"):
                continue  # no device name: keep the model
            i = names.index(d) if d in names else None
            row.update(device=d, port=sel[i][1] if i is not None else "unknown",
                       wire_port=i, on_plan=i == row["planned_port"],
                       qpns=[r["qpn"] for r in recs])
        return
    if not lag_applied:
        return
    members = fabric.usable_ports
    for q, (row, recs) in enumerate(zip(table, recs_of)):
        affs = {r["affinity"] for r in recs}
        if len(affs) != 1 or 0 in affs:
            row.update(port="mixed" if recs else "unknown", wire_port=None, member=None,
                       on_plan=False)
            continue
        a = affs.pop()
        row.update(port=a, wire_port=a - 1, on_plan=(a - 1) == row["planned_port"],
                   member=(fabric.bond.slaves[a - 1] if fabric.bond and a <= members
                           else None),
                   qpns=[r["qpn"] for r in recs], udp_sports=[r["udp_sport"] for r in recs])
