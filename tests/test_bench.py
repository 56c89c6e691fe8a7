"""python -m jax_ep.bench: byte accounting, the JSON schema and a --quick run (no timing
is asserted: this machine is shared)."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P, SingleDeviceSharding

from jax_ep import cuda

from jax_ep.bench import exchange as bench

from conftest import ep_mesh, np_combine, np_gather, np_model, run_ep

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


def test_virtual_ranks_rejected_on_cpu():
    """On CPU, --ranks already means R virtual devices: --virtual-ranks is an error that
    says so (before anything is measured)."""
    with pytest.raises(SystemExit, match=r"--virtual-ranks.*'cpu'.*drop --virtual-ranks"):
        bench.main(["--virtual-ranks", "--quick", "--no-progress"])


# NumPy models of the virtual-rank harness (jax_ep.cuda.harness_*), run through
# jax.pure_callback so that the bench's jitted harness programs can run on CPU.

@pytest.fixture
def np_harness(monkeypatch):
    sds = jax.ShapeDtypeStruct
    calls = []

    def dispatch(x, idx, w, *, num_experts, capacity=None):
        R, T, H = x.shape
        K = idx.shape[2]
        C = R * T if capacity is None else capacity
        calls.append(("dispatch", x.shape, idx.shape, w.shape, num_experts, C))

        def host(x, idx, w):
            m = np_model(np.asarray(x), np.asarray(idx), np.asarray(w),
                         np.zeros((R, C, H), x.dtype), num_experts, C)
            return tuple(m[k] for k in ("recv_x", "recv_idx", "recv_w", "num_recv",
                                        "num_dropped", "per_expert", "src_rank",
                                        "src_index", "send_row"))

        i32 = jnp.int32
        shapes = (sds((R, C, H), x.dtype), sds((R, C, K), i32), sds((R, C, K), jnp.float32),
                  sds((R,), i32), sds((R,), i32), sds((R, num_experts // R), i32),
                  sds((R, C), i32), sds((R, C), i32), sds((R, T, R), i32))
        return cuda.HarnessDispatch(*jax.pure_callback(host, shapes, x, idx, w))

    def combine(y, send_row):
        calls.append(("combine", y.shape, send_row.shape))
        R, T, _ = send_row.shape
        return jax.pure_callback(np_combine, sds((R, T, y.shape[2]), y.dtype), y, send_row)

    def gather(g, src_rank, src_index):
        calls.append(("gather", g.shape, src_rank.shape))
        return jax.pure_callback(np_gather, sds(src_rank.shape + g.shape[2:], g.dtype),
                                 g, src_rank, src_index)

    monkeypatch.setattr(cuda, "harness_dispatch", dispatch)
    monkeypatch.setattr(cuda, "harness_combine", combine)
    monkeypatch.setattr(cuda, "harness_gather", gather)
    return calls


def test_virtual_inputs_are_the_mesh_inputs_stacked_per_rank(mesh8):
    """The harness gets the same values as the mesh path, as [R, T, ...] on device 0."""
    R, T, H, K, E = 8, 6, 4, 3, 16
    kw = dict(n_sets=2, hidden=H, topk=K, experts=E, dtype="float32", seed=5)
    flat, idx_flat = bench._make_inputs(NamedSharding(mesh8, P("ep")), (R * T,), **kw)
    dev0 = jax.devices()[0]
    stacked, idx_stacked = bench._make_inputs(SingleDeviceSharding(dev0), (R, T), **kw)
    for a, b in zip(idx_flat, idx_stacked):
        np.testing.assert_array_equal(a, b)
    for fs, ss in zip(flat, stacked):
        for f, s in zip(fs, ss):
            assert s.shape == (R, T) + f.shape[1:] and s.devices() == {dev0}
            np.testing.assert_array_equal(np.asarray(s).reshape(f.shape), np.asarray(f))


def test_harness_programs_match_the_mesh_programs(np_harness):
    """The four harness programs (harness mocked by the NumPy model) compute what the
    shard_map programs of the CPU ffi backend compute, the vjp included."""
    R, T, H, K, E, C = 4, 5, 3, 2, 8, 7  # C < what arrives: some rows drop
    rng = np.random.default_rng(0)
    x = rng.standard_normal((R, T, H)).astype(np.float32)
    ct = rng.standard_normal((R, T, H)).astype(np.float32)
    idx = np.argsort(rng.random((R, T, E)), axis=-1)[..., :K].astype(np.int32)
    w = rng.random((R, T, K), dtype=np.float32)
    flat = lambda a: jnp.asarray(a.reshape((R * T,) + a.shape[2:]))  # noqa: E731
    hp = bench._harness_programs(num_experts=E, capacity=C)
    mp = bench._programs(ep_mesh(R), "ffi", num_experts=E, capacity=C)
    h_disp, m_disp = hp["dispatch"](x, idx, w), mp["dispatch"](flat(x), flat(idx), flat(w))
    for h, m in zip(jax.tree.leaves(h_disp), jax.tree.leaves(m_disp)):
        np.testing.assert_array_equal(np.asarray(h).reshape(np.shape(m)), np.asarray(m))
    np.testing.assert_array_equal(
        np.asarray(hp["combine"](h_disp[0], h_disp[3])).reshape(R * T, H),
        np.asarray(mp["combine"](m_disp[0], m_disp[3])))
    np.testing.assert_array_equal(np.asarray(hp["roundtrip"](x, idx, w)).reshape(R * T, H),
                                  np.asarray(mp["roundtrip"](flat(x), flat(idx), flat(w))))
    for h, m in zip(hp["roundtrip_fwd_bwd"](x, idx, w, ct),
                    mp["roundtrip_fwd_bwd"](flat(x), flat(idx), flat(w), flat(ct))):
        np.testing.assert_allclose(np.asarray(h).reshape(R * T, H), np.asarray(m),
                                   rtol=1e-6, atol=1e-6)
    assert {c[0] for c in np_harness} == {"dispatch", "combine", "gather"}


@pytest.mark.parametrize("capacity", [None, 20])
def test_run_bench_virtual_inputs_and_bytes(np_harness, capacity):
    """run_bench(virtual=True) feeds the harness stacked per-rank inputs and accounts
    the same bytes as the mesh path: rows from the routing, which are the rows the
    harness kept (the sum of num_recv)."""
    R, T, H, K, E = 4, 16, 8, 2, 8
    kw = dict(ops=bench.OPS, ranks=R, tokens=T, hidden=H, topk=K, experts=E,
              dtype="float32", capacity=capacity, repeats=2, warmup=1, input_sets=2,
              memcpy_GBps=1.0, seed=3)
    config, results, memory, rows = bench.run_bench(backends=["ffi"], virtual=True, **kw)
    C = R * T if capacity is None else capacity
    assert ("dispatch", (R, T, H), (R, T, K), (R, T, K), E, C) in np_harness
    assert config["virtual_ranks"] is True and config["capacity"] == C
    assert "4 virtual ranks on device 0" in config["virtual_ranks_note"]
    assert config["kept_rows_per_set"]["ffi"] == config["rows_per_set"]
    assert rows == config["rows"]
    check_report({"config": config, "memcpy_GBps": 1.0, "results": results}, ["ffi"])
    # The same seed over a mesh of R CPU devices: the same routing, rows and bytes.
    m_config, m_results, _, m_rows = bench.run_bench(backends=["ffi"], **kw)
    assert m_config["rows_per_set"] == config["rows_per_set"] and m_rows == rows
    assert [r["bytes"] for r in m_results] == [r["bytes"] for r in results]
    assert set(memory) == {"ffi"}
    with pytest.raises(ValueError, match="backend 'ffi' only"):
        bench.run_bench(backends=["ffi", "reference"], virtual=True, **kw)


def test_table_says_why_a_backend_was_skipped():
    r = {"backend": "ffi", "op": "roundtrip", "median_s": 2.0, "min_s": 1.0, "max_s": 3.0,
         "bytes": 4_000_000, "GBps": 0.002, "floor_s": 1.0}
    t = bench.format_table([r], 1.0, skipped={"reference": bench.VIRTUAL_SKIP},
                           note=bench.VIRTUAL_NOTE.format(R=8))
    assert t.splitlines()[0].startswith("8 virtual ranks on device 0")
    assert "reference  skipped: cannot run R ranks on one device" in t
