"""Bytes per NIC port around a command, against the plan's per-port bytes.

    python -m jax_ep.network.portcheck [--sysfs ROOT] [--gpu PCI_BUS_ID]
        [--ports mlx5_0:1,mlx5_1:1] [--plan-bytes B0,B1,...] [--tolerance 0.1] [--json]
        -- COMMAND...

Reads, for each port NVSHMEM selects for the GPU (`jax_ep.network.fabric`), or those
given with --ports, `ports/N/counters/port_xmit_data` and `port_rcv_data` before and
after COMMAND runs. The kernel reports those two counters in 4-byte words (IB
PortCounters; mlx5 RoCE ports use the same unit), so bytes = 4 x delta. `hw_counters/*`
(RoCE) deltas are printed as they are (counts, not bytes). Under a RoCE LAG the port
counters of `mlx5_bond_0` add both members; the members' split comes from
`ethtool -S <member>` (`tx_vport_rdma_unicast_bytes`, `rx_vport_rdma_unicast_bytes`)
where ethtool is installed.

The plan's share of each port: `--plan-bytes` (bytes the plan puts on each port, e.g.
from `python -m jax_ep.plan --json`), else an equal share of the measured total (the
striping plan puts the same bytes on every port, give or take one chunk per peer). The
ratio measured / plan is printed per port; with `--tolerance T` the exit status is 1 if
any ratio is outside [1 - T, 1 + T]; it is 1 too when a counter could not be read, and
COMMAND's own status when COMMAND failed.

Other traffic on the same ports during COMMAND is counted too: run it on an idle node.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys

from jax_ep.network import fabric as fb

__all__ = ["WORD_BYTES", "read_port", "snapshot", "delta", "compare", "run", "main"]

WORD_BYTES = 4  # port_xmit_data / port_rcv_data count 4-byte words
_WRAP32 = 1 << 32
ETHTOOL_KEYS = ("tx_vport_rdma_unicast_bytes", "rx_vport_rdma_unicast_bytes")


def _int(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def read_port(sysfs: str, dev: str, port: int) -> dict:
    """{"xmit_words", "rcv_words", "hw": {name: value}} for one port (None if missing)."""
    base = os.path.join(sysfs, "class", "infiniband", dev, "ports", str(port))
    hw = {}
    hwd = os.path.join(base, "hw_counters")
    if os.path.isdir(hwd):
        for name in sorted(os.listdir(hwd)):
            v = _int(os.path.join(hwd, name))
            if v is not None:
                hw[name] = v
    return {"xmit_words": _int(os.path.join(base, "counters", "port_xmit_data")),
            "rcv_words": _int(os.path.join(base, "counters", "port_rcv_data")), "hw": hw}


def ethtool_stats(ifname: str) -> dict:
    """The RDMA byte counters of a netdev from `ethtool -S` ({} without ethtool)."""
    exe = shutil.which("ethtool")
    if exe is None:
        return {}
    try:
        out = subprocess.run([exe, "-S", ifname], capture_output=True, text=True,
                             timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    stats = {}
    for line in out.splitlines():
        k, _, v = line.strip().partition(":")
        if k in ETHTOOL_KEYS:
            try:
                stats[k] = int(v.strip())
            except ValueError:
                pass
    return stats


def snapshot(sysfs: str, ports: list[tuple[str, int]], members: list[str] = (),
             ethtool=ethtool_stats) -> dict:
    return {"ports": {f"{d}:{p}": read_port(sysfs, d, p) for d, p in ports},
            "members": {m: ethtool(m) for m in members}}


def _diff(a, b):
    if a is None or b is None:
        return None
    d = b - a
    return d + _WRAP32 if d < 0 and a < _WRAP32 else d  # a 32-bit counter wrapped


def delta(before: dict, after: dict) -> dict:
    """Bytes moved per port (and per LAG member where ethtool reports them)."""
    out = {}
    for k, b in before["ports"].items():
        a = after["ports"].get(k, {})
        tx = _diff(b["xmit_words"], a.get("xmit_words"))
        rx = _diff(b["rcv_words"], a.get("rcv_words"))
        out[k] = {"tx_bytes": None if tx is None else tx * WORD_BYTES,
                  "rx_bytes": None if rx is None else rx * WORD_BYTES,
                  "hw": {n: _diff(v, a.get("hw", {}).get(n)) for n, v in b["hw"].items()}}
    members = {}
    for m, b in before.get("members", {}).items():
        a = after.get("members", {}).get(m, {})
        members[m] = {"tx_bytes": _diff(b.get(ETHTOOL_KEYS[0]), a.get(ETHTOOL_KEYS[0])),
                      "rx_bytes": _diff(b.get(ETHTOOL_KEYS[1]), a.get(ETHTOOL_KEYS[1]))}
    return {"ports": out, "members": members}


def compare(measured: dict, plan_bytes: list[float] | None = None,
            tolerance: float | None = None) -> dict:
    """Per port (or per LAG member when their split is known): measured tx bytes, the
    plan's bytes and their ratio; "ok" is False when a ratio is outside the tolerance or
    a counter is missing."""
    rows = measured["members"] if any(
        v["tx_bytes"] is not None for v in measured.get("members", {}).values()) \
        else measured["ports"]
    names = list(rows)
    tx = [rows[n]["tx_bytes"] for n in names]
    ok = all(t is not None for t in tx)
    if plan_bytes is not None and len(plan_bytes) != len(names):
        raise ValueError(f"plan_bytes has {len(plan_bytes)} entries for {len(names)} ports "
                         f"({', '.join(names)})")
    total = sum(t for t in tx if t is not None)
    plan = list(plan_bytes) if plan_bytes is not None else (
        [total / len(names)] * len(names) if names else [])
    out = []
    for n, t, p in zip(names, tx, plan):
        ratio = (t / p) if (t is not None and p) else None
        if tolerance is not None and (ratio is None or abs(ratio - 1.0) > tolerance):
            ok = False
        out.append({"port": n, "tx_bytes": t, "rx_bytes": rows[n]["rx_bytes"],
                    "plan_bytes": p, "ratio": ratio})
    return {"rows": out, "total_tx_bytes": total, "ok": ok,
            "by": "lag member (ethtool)" if rows is measured.get("members") else "port"}


def run(command: list[str], sysfs: str = "/sys", ports=None, gpu: str | None = None,
        plan_bytes=None, tolerance=None, ethtool=ethtool_stats) -> dict:
    """Runs `command` between two counter snapshots; returns the comparison."""
    if not command:
        raise ValueError("give the command to measure after --")
    members: list[str] = []
    fabric = None
    if ports is None:
        fabric = fb.discover(sysfs, gpu)
        ports = list(fabric.selected)
        if fabric.bond is not None:
            members = list(fabric.bond.slaves)
    if not ports:
        raise ValueError("no RDMA port to read: " + (fabric.reason if fabric else "none given"))
    before = snapshot(sysfs, ports, members, ethtool)
    rc = subprocess.call(command)
    after = snapshot(sysfs, ports, members, ethtool)
    res = compare(delta(before, after), plan_bytes, tolerance)
    res.update(command=command, command_rc=rc,
               fabric=fabric.fabric_class if fabric else "given",
               hw=delta(before, after)["ports"])
    return res


def _ports_arg(text: str) -> list[tuple[str, int]]:
    out = []
    for item in text.split(","):
        dev, _, port = item.strip().partition(":")
        if not dev or not port.isdigit():
            raise ValueError(f"--ports must look like mlx5_0:1,mlx5_1:1, got {text!r}")
        out.append((dev, int(port)))
    return out


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--" in argv:
        i = argv.index("--")
        argv, command = argv[:i], argv[i + 1:]
    else:
        command = []
    ap = argparse.ArgumentParser(prog="python -m jax_ep.network.portcheck",
                                 description="bytes per NIC port around COMMAND vs the plan")
    ap.add_argument("--sysfs", default="/sys")
    ap.add_argument("--gpu", default=None)
    ap.add_argument("--ports", default=None, help="dev:port list (default: discovery)")
    ap.add_argument("--plan-bytes", default=None,
                    help="comma-separated bytes the plan puts on each port")
    ap.add_argument("--tolerance", type=float, default=None,
                    help="exit 1 when measured/plan is outside [1-T, 1+T] on a port")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    try:
        ports = _ports_arg(a.ports) if a.ports else None
        plan = [float(x) for x in a.plan_bytes.split(",")] if a.plan_bytes else None
        res = run(command, a.sysfs, ports, a.gpu, plan, a.tolerance)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if a.json:
        print(json.dumps(res, indent=1))
    else:
        print(f"portcheck ({res['fabric']}, by {res['by']}): {' '.join(command)} "
              f"exited {res['command_rc']}")
        print(f"{'port':24s} {'tx bytes':>16s} {'rx bytes':>16s} {'plan tx':>16s} "
              f"{'ratio':>7s}")
        for r in res["rows"]:
            ratio = f"{r['ratio']:.3f}" if r["ratio"] is not None else "-"
            print(f"{r['port']:24s} {str(r['tx_bytes']):>16s} {str(r['rx_bytes']):>16s} "
                  f"{r['plan_bytes']:16.0f} {ratio:>7s}")
        for port, d in res["hw"].items():
            nz = {k: v for k, v in d["hw"].items() if v}
            if nz:
                print(f"  {port} hw_counters: " + ", ".join(f"{k}+{v}" for k, v in nz.items()))
        print("within tolerance" if res["ok"] else "OUTSIDE the plan (or a counter missing)")
    if res["command_rc"] != 0:
        return res["command_rc"]
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
