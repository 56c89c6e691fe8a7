"""python -m jax_ep.bench: byte accounting, the JSON schema and a --quick run (no timing
is asserted: this machine is shared)."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from jax_ep import bench

from conftest import run_ep  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A hand-built routing: R=2 ranks, E=4 experts (2 per rank), T=3 tokens per rank, K=2.
#   rank 0: t0 -> experts 0,1 (both on rank 0: one row to rank 0)
#           t1 -> experts 0,2 (one row to rank 0, one to rank 1)
#           t2 -> unused slots only (no row)
#   rank 1: t0 -> experts 3,2 (one row to rank 1)
#           t1 -> expert 1 and an unused slot (one row to rank 0)
#           t2 -> experts 2,0 (one row to rank 1, one to rank 0)
HAND_IDX = np.array([[0, 1], [0, 2], [-1, -1],
                     [3, 2], [1, -1], [2, 0]], np.int32)


def test_routing_rows_hand_built():
    r = bench.routing_rows(HAND_IDX, num_ranks=2, num_experts=4, capacity=6)
    assert r["counts"] == [[2, 1], [2, 2]]
    assert r["received"] == [4, 3]
    assert r["kept"] == [4, 3]
    assert r["rows"] == 7
    # A capacity of 3 drops the last row arriving at rank 0.
    r3 = bench.routing_rows(HAND_IDX, num_ranks=2, num_experts=4, capacity=3)
    assert r3["kept"] == [3, 3] and r3["rows"] == 6


def test_op_bytes_exact():
    # 7 rows of H=5 float32 (20 bytes each) and bfloat16 (10 bytes each).
    assert bench.op_bytes(7, 5, 4) == {"dispatch": 140, "combine": 140, "roundtrip": 280,
                                       "roundtrip_fwd_bwd": 560}
    assert bench.op_bytes(7, 5, 2) == {"dispatch": 70, "combine": 70, "roundtrip": 140,
                                       "roundtrip_fwd_bwd": 280}
    assert bench.op_bytes(6, 2048, 2)["roundtrip"] == 2 * 6 * 4096


@pytest.mark.parametrize("capacity", [6, 3])
def test_rows_match_what_dispatch_keeps(capacity):
    """The accounting counts exactly the rows the op keeps (sum of num_recv)."""
    R, T, K, H, E = 2, 3, 2, 5, 4
    idx = HAND_IDX.reshape(R, T, K)
    x = np.arange(R * T * H, dtype=np.float32).reshape(R, T, H)
    w = np.ones((R, T, K), np.float32)
    y = np.zeros((R, capacity, H), np.float32)
    res = run_ep(x, idx, w, y, E=E, C=capacity, backend="reference")
    want = bench.routing_rows(HAND_IDX, num_ranks=R, num_experts=E, capacity=capacity)
    assert res["num_recv"].tolist() == want["kept"]
    assert int(res["num_recv"].sum()) == want["rows"]


def check_report(rep: dict, backends, ops=bench.OPS):
    """The JSON schema the issue fixes, plus the consistency of its numbers."""
    assert {"config", "memcpy_GBps", "results"} <= set(rep)
    cfg = rep["config"]
    for k in ("ranks", "tokens", "hidden", "topk", "experts", "dtype", "capacity",
              "repeats"):
        assert k in cfg, k
    mem = rep["memcpy_GBps"]
    assert isinstance(mem, float) and mem > 0
    seen = set()
    row_bytes = cfg["hidden"] * bench.DTYPE_BYTES[cfg["dtype"]]
    for r in rep["results"]:
        assert {"backend", "op", "median_s", "min_s", "max_s", "bytes", "GBps",
                "floor_s"} <= set(r)
        assert isinstance(r["backend"], str) and r["op"] in bench.OPS
        assert isinstance(r["bytes"], int) and r["bytes"] > 0
        assert 0 < r["min_s"] <= r["median_s"] <= r["max_s"]
        assert r["bytes"] == bench.OP_ROW_FACTOR[r["op"]] * cfg["rows"] * row_bytes
        assert math.isclose(r["GBps"], r["bytes"] / r["median_s"] / 1e9, rel_tol=1e-9)
        assert math.isclose(r["floor_s"], r["bytes"] / (mem * 1e9), rel_tol=1e-9)
        seen.add((r["backend"], r["op"]))
    assert seen == {(b, o) for b in backends for o in ops}


def test_quick_run_in_process(tmp_path):
    """--quick with both backends and all ops, --json."""
    js = tmp_path / "b.json"
    rep = bench.main(["--quick", "--no-progress", "--json", str(js)])
    on_disk = json.loads(js.read_text())
    check_report(on_disk, ["ffi", "reference"])
    assert on_disk["results"] == json.loads(json.dumps(rep["results"]))
    assert on_disk["config"]["quick"] is True
    # Peak memory of the programs, from XLA's memory analysis.
    m = on_disk["memory"]["ffi"]["dispatch"]
    assert m["peak_bytes"] >= m["in_out_bytes"] > 0
    assert "roundtrip_speedup_ffi_vs_reference" in on_disk["targets"]


def test_quick_run_as_script_with_plot(tmp_path):
    """`python -m jax_ep.bench` sets the CPU device count itself from --ranks; --plot
    sweeps token counts."""
    js, png = tmp_path / "s.json", tmp_path / "s.png"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    out = subprocess.run(
        [sys.executable, "-m", "jax_ep.bench", "--quick", "--ranks", "4", "--backends",
         "ffi", "--ops", "roundtrip,combine", "--repeats", "2", "--no-progress", "--json",
         str(js), "--plot", str(png), "--sweep-tokens", "32"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    rep = json.loads(js.read_text())
    assert rep["config"]["ranks"] == 4 and rep["config"]["num_devices"] == 4
    check_report(rep, ["ffi"], ops=["roundtrip", "combine"])
    assert [s["tokens"] for s in rep["sweep"]] == [32, rep["config"]["tokens"]]
    assert png.stat().st_size > 1000
    assert "roundtrip" in out.stdout
