"""The latency-aware model (jax_ep.bench.perf_model.device_time_latency, a MODEL of H200 time,
not a measurement) and the emulator's rounds and bytes in flight that feed it
(kernels/emu/emu_counters.cc, "Rounds")."""
from __future__ import annotations

import json

import pytest

from jax_ep.bench import emulated as be
from jax_ep.bench import perf_model as model


def copy_counters(*, blocks, warps_per_block, loads_in_flight, rounds_per_warp, width=16):
    """The counters the emulator keeps for a copy kernel "copy" of one launch whose every
    lane reads a peer's memory `loads_in_flight` accesses of `width` bytes at a time (then
    stores them locally), `rounds_per_warp` times: the same names and units as
    kernels/emu/emu_counters.cc writes (millirounds, bytes retired per round)."""
    warps = blocks * warps_per_block
    per_round = 32 * loads_in_flight * width  # one warp's bytes in flight
    moved = warps * rounds_per_warp * per_round
    return {"kernel:copy:launches": 1, "kernel:copy:blocks": blocks,
            "kernel:copy:warps": warps, f"load_bytes:peer:{width}": moved,
            f"store_bytes:local:{width}": moved,
            "warp_mrounds:peer:copy": warps * rounds_per_warp * 1000,
            "round_bytes:peer": moved,
            "longest:mrounds:peer": rounds_per_warp * 1000,  # data rounds: the loads
            "block_max:accesses:peer": warps_per_block * rounds_per_warp * 32 * loads_in_flight,
            "block_max:accesses:local": warps_per_block * rounds_per_warp * 32 * loads_in_flight}


def modelled_GBps(per_gpu_at, constants=None):
    """The model's NVLink GB/s through the path the real kernels' counts take
    (emulated.model_entry: counted points, scaled to the intranode target, per GPU),
    `per_gpu_at(tokens, hidden)` giving one GPU's counters at a counted shape."""
    pts = []
    for t, h in ((8, 256), (16, 256), (8, 512)):
        shape = dict(be.TARGETS["intranode"], tokens=t, hidden=h)
        per = [per_gpu_at(t, h)] * shape["ranks"]
        pts.append({"shape": shape, "dispatch": per, "combine": per})
    e = be.model_entry("intranode", pts, constants)
    return e["latency_ops"]["dispatch"], e


def test_one_warp_one_16B_load_per_lane_in_flight_is_slow():
    """Little's law: one warp, one 16-byte load per lane in flight, moves 512 bytes per
    NVLink round trip (1 us): about 0.5 GB/s; the model must say well under 5 GB/s, bound
    by the chain of round trips, while the old roofline (bytes over per-SM rates) rates it
    at its per-SM 25 GB/s."""
    # rounds grow with T*H, as a copy's do (tokens * hidden * 2 bytes / 512 per round)
    def one_warp(t, h):
        return copy_counters(blocks=1, warps_per_block=1, loads_in_flight=1,
                             rounds_per_warp=t * h * 2 // 512)

    o, e = modelled_GBps(one_warp)
    assert o["latency_aware"] is True
    assert o["bound"] in ("chain", "inflight")
    assert o["inflight_bytes_per_warp"]["peer"] == pytest.approx(512)
    assert o["nvlink_GBps"] < 5
    assert o["nvlink_GBps"] == pytest.approx(0.512, rel=0.01)
    assert e["ops"]["dispatch"]["nvlink_fraction"] * 450 > 5  # the old model could not say no


def test_many_warps_with_several_loads_in_flight_are_fast():
    """24 blocks of 16 warps, each lane with four 16-byte loads in flight: 384 warps x 2 KiB
    = 786 KB in flight per microsecond, over NVLink's 450 GB/s: link-bound, more than 100 x
    the single warp."""
    def wide(t, h):
        return copy_counters(blocks=24, warps_per_block=16, loads_in_flight=4,
                             rounds_per_warp=t * h // 256)

    o, _ = modelled_GBps(wide)
    assert o["bound"] == "link"
    assert o["nvlink_GBps"] > 400
    assert o["inflight_bytes_per_warp"]["peer"] == pytest.approx(2048)


def test_inflight_term_is_littles_law_and_moves_with_latency():
    """Half the warps' bytes in flight, twice the time; double the latency, twice again."""
    c = copy_counters(blocks=2, warps_per_block=4, loads_in_flight=2, rounds_per_warp=1000)
    r = model.device_time_latency(c)
    # 8 warps x 1 KiB in flight per 1 us round: 1000 rounds -> 1 ms
    assert r["inflight_s"] == pytest.approx(1000 * 1e-6)
    assert r["chain_s"] == pytest.approx(1000 * 1e-6)
    slow = model.Constants(nvlink_latency_s=2e-6)
    assert model.device_time_latency(c, slow)["inflight_s"] == pytest.approx(2e-3)
    half = copy_counters(blocks=2, warps_per_block=4, loads_in_flight=1, rounds_per_warp=2000)
    assert model.device_time_latency(half)["inflight_s"] == pytest.approx(2e-3)


def test_issue_limit_by_width():
    """An SM moves min(32 w, 128) bytes per clock: 1-byte accesses at a quarter of 4-byte."""
    k = model.H200
    assert model.issue_Bps(k, 16) == model.issue_Bps(k, 4) == pytest.approx(128 * 1.98e9)
    assert model.issue_Bps(k, 1) == pytest.approx(32 * 1.98e9)
    c = {"store_bytes:local:1": 10**9, "kernel:k:launches": 1, "kernel:k:blocks": 10}
    assert model.device_time_latency(c)["issue_s"] == pytest.approx(1e9 / (32 * 1.98e9) / 10)


def test_rdma_chain_and_work_request_rate():
    """Polls of signals an RDMA put wrote cost the RDMA latency each; WRs over the NIC's
    rate bound the link."""
    c = {"chain:mrounds:rdma": 10_000, "chain:wrs": 20, "wrs:rdma": 400_000,
         "kernel:k:launches": 1, "kernel:k:blocks": 1}
    r = model.device_time_latency(c)
    assert r["chain_s"] == pytest.approx(10 * 3e-6 + 20 * 0.1e-6)
    assert r["link_s"] == pytest.approx(400_000 / 200e6)
    assert r["bound"] == "link"


# ----------------------------------------------------------------------------- the emulator

def _loads(c):
    plain = sum(v for k, v in c.items() if k.startswith("load_bytes:"))
    return plain + sum(v for k, v in c.items() if k.startswith("tma_bytes:load:"))


@pytest.mark.parametrize("mode,shape", [
    ("intranode", dict(ranks=4, tokens=8, hidden=128, topk=4, experts=16)),
    ("internode_ll", dict(ranks=4, nodes=2, tokens=4, hidden=128, topk=4, experts=16)),
])
def test_emulator_retires_every_load_in_a_round(mode, shape):
    """Every byte the kernels load (plain and bulk) is retired by exactly one data round:
    the rounds' bytes add up to the loads, each GPU's warps made rounds, and the longest
    thread's rounds are at least one per launch that loaded."""
    res = be.count_mode(mode, shape)
    for op in ("dispatch", "combine"):
        for c in res[op]:
            retired = sum(v for k, v in c.items() if k.startswith("round_bytes:"))
            assert retired == _loads(c), (op, {k: v for k, v in c.items()
                                               if "round" in k or "load" in k})
            warp = sum(v for k, v in c.items() if k.startswith("warp_mrounds:"))
            assert warp > 0 and all(v >= 0 for v in c.values())
            # each kernel's rounds under the name of its launches (no "@bound" suffix)
            for k in c:
                if k.startswith("warp_mrounds:"):
                    assert f"kernel:{k.split(':', 2)[2]}:warps" in c, (op, k)
            assert sum(v for k, v in c.items()
                       if k.startswith(("longest:mrounds:", "chain:mrounds:"))) >= 1000


def test_internode_ll_polls_rdma_signals():
    """The low-latency receive waits for signals written over RDMA by the other node: its
    longest thread has RDMA rounds, counted from the signals' writers."""
    res = be.count_mode("internode_ll", dict(ranks=4, nodes=2, tokens=4, hidden=128, topk=4,
                                             experts=16))
    assert max(c.get("chain:mrounds:rdma", 0) for c in res["dispatch"]) >= 1000


def test_latency_counts_scale_linearly_in_tokens_and_hidden():
    """The model counts small shapes and fits each counter as a + b T + c T H: the latency
    counters must follow that law. Counted at T = 8, 16, 32 (H = 128) and H = 256: the fit
    of three points predicts the fourth within 15% for the bulk of the rounds."""
    base = dict(ranks=4, topk=4, experts=16)
    pts = [dict(base, tokens=t, hidden=h) for t, h in ((8, 128), (16, 128), (8, 256))]
    check = dict(base, tokens=32, hidden=256)

    def total(p, op):
        out = {}
        for c in be.count_mode("intranode", p)[op]:
            for k, v in c.items():
                if k.startswith(("warp_mrounds:", "round_bytes:")):
                    out[k] = out.get(k, 0) + v
        return out

    for op in ("dispatch", "combine"):
        fit = model.scale_counters([(p, total(p, op)) for p in pts], check)
        got = total(check, op)
        big = {k: v for k, v in got.items() if v >= 0.05 * max(got.values())}
        assert big
        for k, v in big.items():
            assert fit.get(k, 0) == pytest.approx(v, rel=0.15), (op, k, fit.get(k), v)


# ----------------------------------------------------------------------------- the JSON

def _points(name, per_gpu_at):
    shape0 = be.MODEL_COUNT[name]
    pts = []
    for t, h in ((8, 256), (16, 256), (8, 512)):
        shape = dict(shape0, tokens=t, hidden=h)
        per = [per_gpu_at(t, h)] * shape["ranks"]
        pts.append({"shape": shape, "dispatch": per, "combine": per})
    return pts


def _chain_bound(t, h):
    c = copy_counters(blocks=8, warps_per_block=4, loads_in_flight=1,
                      rounds_per_warp=t * h // 1024)
    c.update({"put_bytes:rdma": t * h * 100, "wrs:rdma": t * 4, "chain:wrs": t,
              "chain:mrounds:rdma": t * 1000})
    return c


def test_json_writes_each_mode_from_the_model(tmp_path):
    """`--model --json PATH` (here from saved counts, --model-from): per mode the issue's
    keys, latency_aware, derived from the counts and constants: a latency changed with
    --model-set moves the numbers."""
    saved = tmp_path / "counts.json"
    entries = [{"target": n, "points": _points(n, _chain_bound)} for n in be.SUMMARY_TARGETS.values()]
    saved.write_text(json.dumps({"model": {"entries": entries}}))

    def run(*settings):
        out = tmp_path / "out.json"
        args = ["--model-from", str(saved), "--json", str(out)]
        for s in settings:
            args += ["--model-set", s]
        be.main(args)
        return json.loads(out.read_text())["modes"]

    modes = run()
    assert set(modes) == {"intranode", "hierarchical", "direct", "low_latency"}
    for m, row in modes.items():
        assert row["latency_aware"] is True and row["sms"] == 8
        keys = ("dispatch_us", "combine_us") if m == "low_latency" else ("dispatch_gbs", "combine_gbs")
        for k in keys:
            assert isinstance(row[k], float) and row[k] > 0, (m, k)
    slow = run("nvlink_latency_s=2e-6", "rdma_latency_s=6e-6")
    assert slow["intranode"]["dispatch_gbs"] < 0.75 * modes["intranode"]["dispatch_gbs"]
    assert slow["low_latency"]["dispatch_us"] > 1.3 * modes["low_latency"]["dispatch_us"]
    assert slow["hierarchical"]["combine_gbs"] < modes["hierarchical"]["combine_gbs"]


def test_documented_latency_tables_are_the_stored_counts_remodelled():
    """docs/performance.md's two latency tables, "before" (docs/model_counts/before/) and
    "after" (docs/model_counts/latency_*.json, today's kernels), are what
    scripts/latency_table.py makes of their stored counts with today's model (regenerate:
    `python scripts/latency_table.py --write`); every stored target is in its table."""
    import importlib.util
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location(
        "latency_table", os.path.join(root, "scripts", "latency_table.py"))
    lt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lt)
    doc = open(os.path.join(root, "docs", "performance.md")).read()
    assert doc.index(lt.SETS["before"][1][1]) < doc.index(lt.SETS["after"][1][0])
    for which in ("before", "after"):
        files = lt.count_files(which)
        assert files, which
        es = lt.entries(which=which)
        assert len(es) == len(files), which
        assert lt.block(doc, which) == lt.table(es), which
        assert all(e["latency_ops"]["dispatch"]["latency_aware"] for e in es)


def test_stored_counts_name_each_kernels_rounds_as_its_launches():
    """Every "warp_mrounds:<space>:<kernel>" in the stored counts (before and after) names a
    kernel that has "kernel:<kernel>:warps": the model averages a kernel's rounds over its
    warps, and a name the two counters spell differently (a launch-bound instance's
    "name@bound") would drop that kernel's in-flight term without a word."""
    import glob
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    files = sorted(glob.glob(os.path.join(root, "docs", "model_counts", "latency_*.json"))
                   + glob.glob(os.path.join(root, "docs", "model_counts", "before",
                                            "latency_*.json")))
    assert files
    for path in files:
        with open(path) as f:
            for e in json.load(f)["model"]["entries"]:
                for pt in e.get("points", ()):
                    for op in ("dispatch", "combine"):
                        for c in pt[op]:
                            for k in c:
                                if k.startswith("warp_mrounds:"):
                                    name = k.split(":", 2)[2]
                                    assert f"kernel:{name}:warps" in c, (path, op, k)
