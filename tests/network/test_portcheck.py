"""portcheck on a sysfs fixture whose counters change while the command runs."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from jax_ep.network import portcheck as pc

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DATA = os.path.join(ROOT, "tests", "data", "sysfs")
GPU = "0000:13:00.0"


def _copy(tmp_path, name):
    dst = tmp_path / name
    shutil.copytree(os.path.join(DATA, name), dst, symlinks=True)
    return str(dst)


def _bump(sysfs, dev, port, xmit, rcv, hw=None):
    """A command that adds to a port's counters (in 4-byte words), as traffic would."""
    base = os.path.join(sysfs, "class", "infiniband", dev, "ports", str(port))
    code = ["import os"]
    for f, add in (("counters/port_xmit_data", xmit), ("counters/port_rcv_data", rcv)) + tuple(
            (f"hw_counters/{k}", v) for k, v in (hw or {}).items()):
        p = os.path.join(base, f)
        code.append(f"v = int(open({p!r}).read()); open({p!r}, 'w').write(str(v + {add}))")
    return "; ".join(code)


def test_bytes_per_port_and_ratio(tmp_path):
    s = _copy(tmp_path, "ib_dualport")
    cmd = [sys.executable, "-c", _bump(s, "mlx5_0", 1, 1000, 10) + "\n" + _bump(
        s, "mlx5_1", 1, 3000, 20).replace("import os; ", "")]
    r = pc.run(cmd, s, gpu=GPU)
    rows = {x["port"]: x for x in r["rows"]}
    assert rows["mlx5_0:1"]["tx_bytes"] == 4000 and rows["mlx5_1:1"]["tx_bytes"] == 12000
    assert rows["mlx5_0:1"]["rx_bytes"] == 40
    assert rows["mlx5_0:1"]["plan_bytes"] == 8000  # equal share of the 16000 measured
    assert rows["mlx5_0:1"]["ratio"] == pytest.approx(0.5)
    assert rows["mlx5_1:1"]["ratio"] == pytest.approx(1.5)
    assert r["ok"] and r["command_rc"] == 0
    # no traffic at all: nothing to compare against, so outside any tolerance
    idle = pc.snapshot(s, [("mlx5_0", 1)])
    assert not pc.compare(pc.delta(idle, idle), None, 0.1)["ok"]


def test_tolerance_and_plan_bytes(tmp_path):
    s = _copy(tmp_path, "ib_dualport")
    even = [sys.executable, "-c", _bump(s, "mlx5_0", 1, 500, 0) + "\n" + _bump(
        s, "mlx5_1", 1, 500, 0).replace("import os; ", "")]
    assert pc.run(even, s, gpu=GPU, tolerance=0.05)["ok"]
    skew = [sys.executable, "-c", _bump(s, "mlx5_0", 1, 900, 0) + "\n" + _bump(
        s, "mlx5_1", 1, 100, 0).replace("import os; ", "")]
    assert not pc.run(skew, s, gpu=GPU, tolerance=0.05)["ok"]
    r = pc.run(skew, s, gpu=GPU, plan_bytes=[3600, 400], tolerance=0.01)
    assert r["ok"] and [x["ratio"] for x in r["rows"]] == [1.0, 1.0]
    with pytest.raises(ValueError, match="plan_bytes"):
        pc.run(skew, s, gpu=GPU, plan_bytes=[1.0])


def test_lag_members_from_ethtool(tmp_path):
    s = _copy(tmp_path, "roce_bond")
    calls = {"n": 0}

    def fake_ethtool(ifname):  # before: 0, after: member 0 sent 3x member 1
        calls["n"] += 1
        after = calls["n"] > 2
        tx = {"ens1f0np0": 3000, "ens1f1np1": 1000}[ifname] if after else 0
        return {"tx_vport_rdma_unicast_bytes": tx, "rx_vport_rdma_unicast_bytes": 0}

    r = pc.run([sys.executable, "-c", "pass"], s, gpu=GPU, ethtool=fake_ethtool,
               tolerance=0.1)
    assert r["by"] == "lag member (ethtool)" and r["fabric"] == "roce-lag"
    assert [x["tx_bytes"] for x in r["rows"]] == [3000, 1000] and not r["ok"]


def test_wrap_and_missing_counters(tmp_path):
    before = {"ports": {"d:1": {"xmit_words": (1 << 32) - 10, "rcv_words": None, "hw": {}}}}
    after = {"ports": {"d:1": {"xmit_words": 5, "rcv_words": 7, "hw": {}}}}
    d = pc.delta(before, after)
    assert d["ports"]["d:1"]["tx_bytes"] == 15 * 4 and d["ports"]["d:1"]["rx_bytes"] is None
    none = {"ports": {"d:1": {"tx_bytes": None, "rx_bytes": None}}, "members": {}}
    assert not pc.compare(none)["ok"]


def test_cli(tmp_path):
    s = _copy(tmp_path, "roce_two_devices")
    env = dict(os.environ, PYTHONPATH=ROOT)
    bump = _bump(s, "mlx5_0", 1, 250, 250, {"rx_write_requests": 3}) + "\n" + _bump(
        s, "mlx5_1", 1, 250, 250).replace("import os; ", "")
    out = subprocess.run([sys.executable, "-m", "jax_ep.network.portcheck", "--sysfs", s,
                          "--gpu", GPU, "--tolerance", "0.01", "--json", "--",
                          sys.executable, "-c", bump], env=env, capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert [x["tx_bytes"] for x in d["rows"]] == [1000, 1000]
    assert d["hw"]["mlx5_0:1"]["hw"]["rx_write_requests"] == 3
    out = subprocess.run([sys.executable, "-m", "jax_ep.network.portcheck", "--sysfs", s,
                          "--ports", "mlx5_0:1", "--", sys.executable, "-c",
                          "import sys; sys.exit(3)"], env=env, capture_output=True, text=True)
    assert out.returncode == 3  # the command's own failure comes through
    out = subprocess.run([sys.executable, "-m", "jax_ep.network.portcheck", "--sysfs",
                          str(tmp_path / "none"), "--", "true"], env=env,
                         capture_output=True, text=True)
    assert out.returncode == 2 and "no RDMA port" in out.stderr
