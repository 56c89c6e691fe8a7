"""jax_ep.bench.perf_model (a MODEL of H200 time from the emulated GPU's counts, not a measurement):
the formula on hand-made counters, the linear scaling, and the benchmark's refusal to time
the internode modes in one process."""
from __future__ import annotations

import pytest

from jax_ep.bench import exchange as bench

from jax_ep.bench import perf_model as model


def test_link_bound_time_and_fraction_by_hand():
    """45 GB stored into peers at 16 bytes by 20 blocks of one launch: NVLink takes
    45e9 / 450e9 = 0.1 s; the SMs 45e9 / 25e9 / 20 = 0.09 s; plus one launch (3 us) and a
    chain of 10 system fences (8 us)."""
    c = {"store_bytes:peer:16": 45_000_000_000, "kernel:k:launches": 1, "kernel:k:blocks": 20,
         "chain:fences:system": 10}
    r = model.device_time(c)
    assert r["sms"] == 20 and r["launches"] == 1
    assert r["link_s"] == pytest.approx(0.1)
    assert r["sm_s"] == pytest.approx(0.09)
    assert r["fixed_s"] == pytest.approx(3e-6 + 8e-6)
    assert r["time_s"] == pytest.approx(0.1 + 11e-6)
    assert r["bound"] == "link"
    assert r["nvlink_fraction"] == pytest.approx(0.1 / (0.1 + 11e-6))


def test_template_kernel_names_count():
    """A templated kernel's name holds "::" (combine_channel_kernel<FloatKind::kBF16>)."""
    c = {"kernel:k<FloatKind::kBF16>:launches": 2, "kernel:k<FloatKind::kBF16>:blocks": 48}
    r = model.device_time(c)
    assert r["launches"] == 2 and r["sms"] == 24
    from jax_ep._src.emu import summarize
    assert summarize(c)["kernels"] == {"k<FloatKind::kBF16>": {
        "launches": 2, "blocks": 48, "threads_per_block": 0}}


def test_narrow_accesses_cost_sm_time():
    """The same bytes at 4-byte width take 4x the SM time: the op becomes SM-bound."""
    c = {"store_bytes:peer:4": 45_000_000_000, "kernel:k:launches": 1, "kernel:k:blocks": 20}
    r = model.device_time(c)
    assert r["sm_s"] == pytest.approx(0.36)
    assert r["bound"] == "sm"
    assert r["nvlink_fraction"] == pytest.approx(0.1 / (0.36 + 3e-6))


def test_the_busiest_block_bounds_the_sm_time():
    """1 GB stored into peers at 16 bytes by a launch of 20 blocks: spread, 1e9 / 25e9 / 20
    = 2 ms; but one block made 50e6 of those 62.5e6 accesses (the rest spread thin), and
    its 50e6 * 16 / 25e9 = 32 ms is the SM time. Local accesses of another block: 10e6 *
    16 / 100e9 = 1.6 ms, less; each space's busiest block counts on its own."""
    c = {"store_bytes:peer:16": 1_000_000_000, "kernel:k:launches": 1, "kernel:k:blocks": 20,
         "block_max:accesses:peer": 50_000_000, "block_max:accesses:local": 10_000_000}
    r = model.device_time(c)
    assert r["busiest_block_s"] == pytest.approx(0.032)
    assert r["sm_s"] == pytest.approx(0.032)
    assert r["bound"] == "sm"
    even = dict(c, **{"block_max:accesses:peer": 62_500_000 // 20,
                      "block_max:accesses:local": 0})
    assert model.device_time(even)["sm_s"] == pytest.approx(0.002)


def test_bulk_copies_take_their_own_rate_beside_the_warps():
    """Bulk copies (TMA) of 48 GB local over 24 blocks: HBM 48e9 / 4.8e12 = 10 ms of link
    time (added to 24 GB of the warps' local accesses: 15 ms), 48e9 / 200e9 / 24 = 10 ms
    of SM time beside the warps' 24e9 / 100e9 / 24 = 10 ms (the larger: 10 ms), or after
    them (the sum, 20 ms) with tma_overlaps off. The busiest block likewise: its 2.4e9
    bulk bytes take 12 ms at 200 GB/s beside its accesses' 1e8 * 16 / 100e9 = 16 ms."""
    c = {"tma_bytes:load:local": 24_000_000_000, "tma_bytes:store:local": 24_000_000_000,
         "load_bytes:local:16": 24_000_000_000, "kernel:k:launches": 1, "kernel:k:blocks": 24}
    r = model.device_time(c)
    assert r["local_bytes"] == 72_000_000_000 and r["tma_bytes"] == 48_000_000_000
    assert r["link_s"] == pytest.approx(0.015)
    assert r["sm_s"] == pytest.approx(0.010)
    serial = model.Constants(tma_overlaps=False)
    assert model.device_time(c, serial)["sm_s"] == pytest.approx(0.020)
    busy = dict(c, **{"block_max:tma_bytes": 2_400_000_000, "block_max:accesses:local": 100_000_000})
    assert model.device_time(busy)["busiest_block_s"] == pytest.approx(0.016)
    assert model.device_time(busy, serial)["busiest_block_s"] == pytest.approx(0.028)
    assert model.device_time(busy, model.Constants(sm_tma_Bps=100e9))["busiest_block_s"] == (
        pytest.approx(0.024))


def test_rdma_puts_use_the_nic_rate():
    r = model.device_time({"put_bytes:rdma": 50_000_000_000, "chain:wrs": 1000})
    assert r["link_s"] == pytest.approx(1.0)
    assert r["fixed_s"] == pytest.approx(1000 * 0.1e-6)
    assert r["rdma_GBps"] == pytest.approx(50 / (1 + 1e-4))


def test_op_time_is_the_slowest_gpu():
    fast = {"store_bytes:peer:16": 1_000_000}
    slow = {"store_bytes:peer:16": 9_000_000}
    assert model.op_time([fast, slow])["nvlink_bytes"] == 9_000_000


def test_scale_counters_recovers_a_linear_law():
    """A counter of 5 + 3T + 2TH and a launch count of 4 at any T: scaled exactly."""
    pts = []
    for T, H in ((8, 16), (16, 16), (8, 32)):
        pts.append(({"tokens": T, "hidden": H},
                    {"store_bytes:peer:16": 5 + 3 * T + 2 * T * H, "kernel:k:launches": 4}))
    got = model.scale_counters(pts, {"tokens": 4096, "hidden": 7168})
    assert got["store_bytes:peer:16"] == pytest.approx(5 + 3 * 4096 + 2 * 4096 * 7168)
    assert got["kernel:k:launches"] == 4


def test_chains_scale_with_tokens_only():
    """A chain that grows with T (4 and 6 releases at T = 8 and 16) scales with T; the
    release more at (T, 2H) than at (T, H), which is interleaving, does not turn into
    thousands at the target's T*H (fitted in T*H too it would be 2 + 4096/8 +
    4096*7168/128 = 229890)."""
    pts = [({"tokens": 8, "hidden": 16}, {"chain:release_stores": 4}),
           ({"tokens": 16, "hidden": 16}, {"chain:release_stores": 6}),
           ({"tokens": 8, "hidden": 32}, {"chain:release_stores": 5})]
    got = model.scale_counters(pts, {"tokens": 4096, "hidden": 7168})
    # least squares in (1, T) over the three points: 4.5 at T = 8, 6 at T = 16
    assert got["chain:release_stores"] == pytest.approx(3 + 4096 * 0.1875)
    assert got["chain:release_stores"] < 1000


def test_op_chains_take_the_longest_over_the_gpus():
    """The GPUs' chains are replaced by their longest; the other counters stay per GPU."""
    per = [{"chain:release_stores": 16, "chain:wrs": 7, "store_bytes:peer:16": 1},
           {"chain:release_stores": 12, "store_bytes:peer:16": 2}]
    got = model.op_chains(per)
    assert [c["chain:release_stores"] for c in got] == [16, 16]
    assert [c["chain:wrs"] for c in got] == [7, 7]
    assert [c["store_bytes:peer:16"] for c in got] == [1, 2]
    assert per[1]["chain:release_stores"] == 12  # the input is not changed


def test_model_entry_does_not_extrapolate_interleaving():
    """Two GPUs whose chains swap between 12 and 16 from one counted shape to the next (what
    the emulated scheduler does) give the target the constant 16 of the op's longest
    chain, not a slope carried to T = 4096."""
    from jax_ep.bench import emulated as be

    def pt(tokens, hidden, chains):
        shape = dict(be.TARGETS["intranode"], tokens=tokens, hidden=hidden)
        per = [{"chain:release_stores": r, "kernel:k:launches": 1, "kernel:k:blocks": 24}
               for r in chains] * (shape["ranks"] // 2)
        return {"shape": shape, "dispatch": per, "combine": per}

    e = be.model_entry("intranode", [pt(8, 256, (16, 12)), pt(16, 256, (12, 16)),
                                     pt(8, 512, (13, 16))])
    for op in ("dispatch", "combine"):
        assert e["ops"][op]["fixed_s"] == pytest.approx(3e-6 + 16 * 0.5e-6)


@pytest.mark.parametrize("mode", bench.INTERNODE_MODES)
def test_internode_modes_without_gpus_and_nvshmem_say_why(mode, monkeypatch):
    """They launch one process per rank (jax_ep/bench/launch.py), which needs GPUs and an
    NVSHMEM build: without them the call names both before any process starts."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # no GPU, whatever this machine has
    with pytest.raises(NotImplementedError, match=f"--mode {mode}: the internode modes run "
                       "one NVSHMEM PE per process on GPUs; here the platform is 'cpu'"):
        bench.main(["--mode", mode, "--ranks", "2"])


def test_gpu_check_bench_stage_records_the_bench_json():
    """The stage that produces the first GPU numbers: the script parses, `--only bench` is
    a stage name, the stage writes each bench's JSON where the report collects it
    (s6*.json into gpu_check.json), and docs/performance.md names that command."""
    import os
    import re
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = os.path.join(root, "scripts", "gpu_check.sh")
    assert subprocess.run(["bash", "-n", script]).returncode == 0
    text = open(script).read()
    assert re.search(r"NAMES=\(.*\bbench\b.*\)", text)
    stage = text[text.index("stage_bench() {"):]
    stage = stage[:stage.index("\n}\n")]
    cmd = stage[stage.index('-m jax_ep.bench --virtual-ranks --ranks 8'):]
    cmd = cmd[:cmd.index("|| rc=1")]
    assert '--json "$WORK/s6_bench.json"' in cmd and "--hidden 7168" in cmd
    assert '--mode low_latency --virtual-ranks' in stage
    report = open(os.path.join(root, "scripts", "gpu_check_report.py")).read()
    assert 's{n}*.json' in report
    doc = open(os.path.join(root, "docs", "performance.md")).read()
    assert "`bash scripts/gpu_check.sh --only bench`" in doc


def test_count_mode_keys_its_cache_on_the_resident_blocks(monkeypatch):
    """A count at one co-residency is not returned for another (--resident-blocks): the
    cache key holds it."""
    from jax_ep.bench import emulated as be

    calls = []

    def fake(mode, shape, *, seed=0, resident_blocks=None):
        calls.append(resident_blocks)
        return {"resident": resident_blocks}

    monkeypatch.setattr(be, "_count_mode", fake)
    monkeypatch.setattr(be, "_CACHE", {})
    shape = {"ranks": 2, "tokens": 1, "hidden": 8, "topk": 1, "experts": 2}
    assert be.count_mode("hierarchical", shape, resident_blocks=16)["resident"] == 16
    assert be.count_mode("hierarchical", shape)["resident"] is None
    assert be.count_mode("hierarchical", shape, resident_blocks=16)["resident"] == 16
    assert calls == [16, None]


def test_counting_routing_is_prefix_stable_and_distinct_per_token():
    # The model's points (T, H), (2T, H), (T, 2H) must differ only in what they add: the
    # routing has no H, and the first T tokens at 2T route as at T.
    import numpy as np

    from jax_ep.bench.emulated import _routing
    R, T, K, E = 4, 24, 8, 64
    a, b = _routing(0, R, T, K, E), _routing(0, R, 2 * T, K, E)
    np.testing.assert_array_equal(b[:, :T], a)
    assert not np.array_equal(b[:, T:2 * T], a)  # the added tokens are fresh draws
    assert a.dtype == np.int32 and a.min() >= 0 and a.max() < E
    assert all(len(set(t)) == K for t in a.reshape(-1, K).tolist())
    assert not np.array_equal(_routing(1, R, T, K, E), a)  # the seed matters
    assert not np.array_equal(a[0], a[1])  # ranks draw their own streams


def test_model_set_changes_constants_and_names_a_bad_setting(capsys):
    """--model-set NAME=VALUE: each constant in its own type; an unknown name, a value of
    the wrong type or a rate that is not positive is refused, naming the setting."""
    from jax_ep.bench import emulated as be
    from jax_ep.bench import perf_model as model

    k = be.model_constants(["sm_tma_Bps=100e9", "tma_overlaps=false", "num_sms=24"])
    assert (k.sm_tma_Bps, k.tma_overlaps, k.num_sms) == (100e9, False, 24)
    assert k.nvlink_Bps == model.H200.nvlink_Bps  # the others as they were
    assert be.model_constants(["tma_overlaps=1"]).tma_overlaps is True
    for bad, words in [("nvlink=1", "NAME one of nvlink_Bps"), ("sm_tma_Bps", "NAME=VALUE"),
                       ("tma_overlaps=maybe", "tma_overlaps takes a bool"),
                       ("num_sms=1.5", "num_sms takes a int"),
                       ("sm_tma_Bps=-1", "sm_tma_Bps must be positive")]:
        with pytest.raises(ValueError, match=words):
            be.model_constants([bad])
    with pytest.raises(SystemExit):
        be.parse_args(["--model-from", "x.json", "--model-set", "fence_s=1"])
    assert "--model-set 'fence_s=1'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        be.parse_args(["--model-only", "--model-tokens", "0"])
    assert "--model-tokens must be a positive number" in capsys.readouterr().err


def test_model_from_remodels_with_the_set_constants(tmp_path):
    """`--model-from JSON --model-set ...` remodels saved counts with other constants: the
    bulk copies beside the warps' accesses (the larger time) or after them (the sum), by
    hand. Counters equal at every counted shape scale to themselves."""
    import json

    from jax_ep.bench import emulated as be

    c = {"kernel:k:launches": 1, "kernel:k:blocks": 24,
         "block_max:accesses:peer": 1_000_000,  # 16 MB at 25 GB/s: 640 us
         "block_max:tma_bytes": 40_000_000,     # 200 us at 200 GB/s, 400 at 100
         "tma_bytes:load:local": 480_000_000}   # 100 us over 24 SMs at 200 GB/s
    pts = [{"shape": dict(be.TARGETS["intranode"], tokens=t, hidden=h),
            "dispatch": [c] * 8, "combine": [c] * 8} for t, h in ((8, 256), (16, 256), (8, 512))]
    saved = tmp_path / "counts.json"
    saved.write_text(json.dumps({"model": {"entries": [{"target": "intranode", "points": pts}]}}))

    def time_us(*settings):
        args = ["--model-from", str(saved), "--json", str(tmp_path / "out.json")]
        for s in settings:
            args += ["--model-set", s]
        rep = be.main(args)
        return rep["model"]["entries"][0]["ops"]["dispatch"]["time_s"] * 1e6, rep

    beside, rep = time_us()
    assert beside == pytest.approx(640 + 3)  # + one launch
    assert rep["model"]["constants"]["tma_overlaps"] is True
    after, rep = time_us("tma_overlaps=false")
    assert after == pytest.approx(640 + 200 + 3)
    assert rep["model"]["constants"]["tma_overlaps"] is False
    assert time_us("tma_overlaps=0", "sm_tma_Bps=100e9")[0] == pytest.approx(640 + 400 + 3)


def test_model_tokens_sets_the_counted_shapes(monkeypatch):
    """--model-tokens T: the targets are counted at T and 2T tokens (and T at 2H)."""
    from jax_ep.bench import emulated as be

    seen = []

    def fake(mode, shape, *, seed=0, resident_blocks=None):
        seen.append((shape["tokens"], shape["hidden"]))
        per = [{"kernel:k:launches": 1, "kernel:k:blocks": 24}] * shape["ranks"]
        return {"dispatch": per, "combine": per}

    monkeypatch.setattr(be, "count_mode", fake)
    e = be.run_model(["intranode"], progress=False, tokens=96)[0]
    assert seen == [(96, 256), (192, 256), (96, 512)]
    assert [p["tokens"] for p in e["counted_at"]] == [96, 192, 96]
    seen.clear()
    be.run_model(["intranode"], progress=False)
    assert seen[0] == (be.MODEL_COUNT["intranode"]["tokens"], 256)


def test_stored_intranode_counts_remodel_to_the_documented_numbers():
    """docs/model_counts holds the intranode counts that docs/performance.md's model table
    (T = 192) and its counting-shape sensitivity (T = 48, 192, 384) were modelled from:
    remodelled by today's code they give the documented times and fractions."""
    import json
    import os
    import re

    from jax_ep.bench import emulated as be

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    doc = open(os.path.join(root, "docs", "performance.md")).read()

    def remodel(t, *settings):
        with open(os.path.join(root, "docs", "model_counts", f"intranode_t{t}.json")) as f:
            e = json.load(f)["model"]["entries"][0]
        assert e["counted_at"][0]["tokens"] == t
        return be.model_entry("intranode", e["points"], be.model_constants(list(settings)))["ops"]

    ops = remodel(192)
    table = doc[doc.index("<!-- model:begin -->"):doc.index("<!-- model:end -->")]
    for op in ("dispatch", "combine"):
        row = re.search(rf"^\| intranode \| {op} \|(.*)$", table, re.M).group(1).split("|")
        after_us, after_frac = float(row[5]), float(row[8])
        assert ops[op]["time_s"] * 1e6 == pytest.approx(after_us, abs=0.05)
        assert round(ops[op]["nvlink_fraction"], 2) == after_frac
    for t, label in ((48, "T = 48, 96"), (192, "T = 192, 384 (the table above)"),
                     (384, "T = 384, 768")):
        row = re.search(rf"^\s*\| {re.escape(label)} \| (\d+) us, ([\d.]+) .*\| ([\d.]+) / "
                        rf"([\d.]+) / ([\d.]+) \|$", doc, re.M)
        assert row, label
        d = remodel(t)["dispatch"]
        assert round(d["time_s"] * 1e6) == int(row.group(1))
        assert round(d["nvlink_fraction"], 2) == float(row.group(2))
        for rate, want in zip(("100e9", "200e9", "400e9"), row.group(3, 4, 5)):
            frac = remodel(t, f"sm_tma_Bps={rate}", "tma_overlaps=false")["dispatch"]
            assert round(frac["nvlink_fraction"], 2) == float(want), (t, rate)
