"""Fixture nodes: sysfs trees of whole GPU nodes with their PCI topology, for the fabric
model and the emulated NVSHMEM (tests/data/sysfs/node8_* are these, checked in).

    python -m jax_ep.network.fixtures OUT_DIR   # writes every node8_* tree under OUT_DIR

Two sockets (root complexes pci0000:00 on NUMA 0 for GPUs 0-3, pci0000:80 on NUMA 1 for
GPUs 4-7); each GPU (and its NIC) below a PCIe switch of its own, except where a NIC is
shared. tests/network/test_nvshmem_select.py checks the checked-in trees equal a fresh
run, so edit this file and rerun it (into tests/data/sysfs) rather than the trees.

  node8_ib_dualport    (a) one dual-port InfiniBand HCA per GPU (mlx5_<g>, ports 1 and 2)
  node8_roce_pairs     (b) two single-port RoCE functions per GPU (mlx5_<2g>, mlx5_<2g+1>)
  node8_roce_bond      (c) one 802.3ad bond of two RoCE ports per GPU (mlx5_bond_<g>)
  node8_shared_nic     (d) four dual-port IB HCAs, each below the switch of two GPUs
  node8_multi_plane    (e) two IB planes (devices) of one PCI function per GPU
  node8_single_port    (f) one single-port IB device per GPU
"""
from __future__ import annotations

import os
import shutil
import sys

GPUS = 8
RATE = "200 Gb/sec (4X HDR)"


def _w(path, text):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text + "\n")


def _link(path, target):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    os.symlink(os.path.relpath(target, os.path.dirname(path)), path)


class _Node:
    """A node being written: switch k sits on socket k // (switches // 2)."""

    def __init__(self, root, switches):
        self.root, self.switches = root, switches

    def function(self, key, port, fn, vendor, cls):
        """A PCI function below downstream port `port` of switch `key`: (addr, path)."""
        numa = 0 if key < self.switches // 2 else 1
        rc, seg = ("pci0000:00", "0000:00") if numa == 0 else ("pci0000:80", "0000:80")
        up = int(seg[5:], 16) + 0x08 * (key + 1)  # the switch's upstream bus
        bus = up + 2 + port  # up + 1: the switch's internal bus
        addr = f"0000:{bus:02x}:00.{fn}"
        p = os.path.join(self.root, "devices", rc, f"{seg}:{key + 1:02x}.0",
                         f"0000:{up:02x}:00.0", f"0000:{up + 1:02x}:{port:02x}.0", addr)
        _w(os.path.join(p, "numa_node"), str(numa))
        _w(os.path.join(p, "vendor"), vendor)
        _w(os.path.join(p, "class"), cls)
        return addr, p

    def gpu(self, key, port):
        addr, p = self.function(key, port, 0, "0x10de", "0x030200")
        _link(os.path.join(self.root, "bus", "pci", "devices", addr), p)
        return addr

    def nic(self, key, port, fn=0):
        return self.function(key, port, fn, "0x15b3", "0x020700")[1]

    def rdma(self, name, pci_dir, ports, layer, netdev=None, guid="0c42:a103:0000:0000"):
        base = os.path.join(self.root, "class", "infiniband", name)
        _link(os.path.join(base, "device"), pci_dir)
        _w(os.path.join(base, "node_type"), "1: CA")
        _w(os.path.join(base, "sys_image_guid"), guid)
        for n in ports:
            pb = os.path.join(base, "ports", str(n))
            _w(os.path.join(pb, "state"), "4: ACTIVE")
            _w(os.path.join(pb, "phys_state"), "5: LinkUp")
            _w(os.path.join(pb, "link_layer"), layer)
            _w(os.path.join(pb, "rate"), RATE)
            if netdev:
                _w(os.path.join(pb, "gid_attrs", "ndevs", "0"), netdev)


def _guid(i):
    return f"0c42:a103:00{i:02x}:1f2a"


def build(kind: str, root: str) -> None:
    if kind == "node8_shared_nic":
        node = _Node(root, 4)
        for g in range(GPUS):
            node.gpu(g // 2, g % 2)
        for n in range(4):
            node.rdma(f"mlx5_{n}", node.nic(n, 2), (1, 2), "InfiniBand", guid=_guid(n))
        return
    node = _Node(root, GPUS)
    for g in range(GPUS):
        node.gpu(g, 0)
        if kind == "node8_ib_dualport":
            node.rdma(f"mlx5_{g}", node.nic(g, 1), (1, 2), "InfiniBand", guid=_guid(g))
        elif kind in ("node8_roce_pairs", "node8_roce_bond"):
            members = []
            for fn in (0, 1):
                p = node.nic(g, 1, fn)
                nd = f"ens{g}f{fn}np{fn}"
                members.append(nd)
                _w(os.path.join(p, "net", nd, "address"), f"02:00:00:00:{g:02x}:{fn:02x}")
                if kind == "node8_roce_pairs":
                    node.rdma(f"mlx5_{2 * g + fn}", p, (1,), "Ethernet", netdev=nd,
                              guid=_guid(g))
                else:
                    _w(os.path.join(root, "class", "net", nd, "master_name"), f"bond{g}")
                    _w(os.path.join(root, "class", "net", nd, "operstate"), "up")
            if kind == "node8_roce_bond":
                bond = os.path.join(root, "class", "net", f"bond{g}")
                _w(os.path.join(bond, "operstate"), "up")
                _w(os.path.join(bond, "bonding", "mode"), "802.3ad 4")
                _w(os.path.join(bond, "bonding", "xmit_hash_policy"), "layer3+4 1")
                _w(os.path.join(bond, "bonding", "slaves"), " ".join(members))
                node.rdma(f"mlx5_bond_{g}", node.nic(g, 1, 0), (1,), "Ethernet",
                          netdev=f"bond{g}", guid=_guid(g))
        elif kind == "node8_multi_plane":
            p = node.nic(g, 1)
            for plane in (0, 1):
                node.rdma(f"mlx5_{2 * g + plane}", p, (1,), "InfiniBand", guid=_guid(g))
        elif kind == "node8_single_port":
            node.rdma(f"mlx5_{g}", node.nic(g, 1), (1,), "InfiniBand", guid=_guid(g))
        else:
            raise ValueError(f"unknown fixture node {kind!r}")


def standard(root: str, gpus: int, ports: int) -> str:
    """The standard node at any size: `gpus` GPUs, each below its own switch with one
    InfiniBand HCA of `ports` ports (mlx5_<g>). Returns root."""
    node = _Node(root, max(gpus, 2))
    for g in range(gpus):
        node.gpu(g, 0)
        node.rdma(f"mlx5_{g}", node.nic(g, 1), tuple(range(1, ports + 1)), "InfiniBand",
                  guid=_guid(g))
    return root


KINDS = ("node8_ib_dualport", "node8_roce_pairs", "node8_roce_bond", "node8_shared_nic",
         "node8_multi_plane", "node8_single_port")


def main(out: str) -> None:
    for k in KINDS:
        d = os.path.join(out, k)
        shutil.rmtree(d, ignore_errors=True)
        build(k, d)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m jax_ep.network.fixtures OUT_DIR")
    main(sys.argv[1])
