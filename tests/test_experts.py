"""jax_ep.experts: grouping by expert, capacity drops, tiled SwiGLU, gradients."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from jax_ep import experts as ex


def _routing(C, K, el, fill, seed):
    """Received-style routing: the first `fill` rows name 1..min(K, el) distinct local
    experts in [0, el) at random slots (-1 elsewhere); the rest are empty."""
    rng = np.random.default_rng(seed)
    idx = np.full((C, K), -1, np.int32)
    for i in range(fill):
        n = rng.integers(1, min(K, el) + 1)
        slots = rng.choice(K, n, replace=False)
        idx[i, slots] = rng.choice(el, n, replace=False)
    w = (rng.random((C, K)).astype(np.float32) + 0.1) * (idx >= 0)
    return idx, w


def _weights(el, H, F, seed, scale=0.3):
    rng = np.random.default_rng(seed)
    return tuple(np.asarray(rng.standard_normal(s) * scale, np.float32)
                 for s in ((el, H, F), (el, H, F), (el, F, H)))


def _np_kept(idx, el, cap):
    """bool[C, K]: pairs kept when each expert keeps its first `cap` pairs in (row, slot)
    order."""
    kept = np.zeros(idx.shape, bool)
    seen = np.zeros(el, int)
    for i in range(idx.shape[0]):
        for k in range(idx.shape[1]):
            e = idx[i, k]
            if e >= 0:
                kept[i, k] = seen[e] < cap
                seen[e] += 1
    return kept


def _np_grouped(x, idx, w, wg, wu, wd, cap):
    x, wg, wu, wd = (np.asarray(a, np.float64) for a in (x, wg, wu, wd))
    kept = _np_kept(idx, wg.shape[0], cap)
    y = np.zeros_like(x)
    for i in range(x.shape[0]):
        for k in range(idx.shape[1]):
            if kept[i, k]:
                e = idx[i, k]
                g = x[i] @ wg[e]
                y[i] += w[i, k] * ((g / (1 + np.exp(-g))) * (x[i] @ wu[e])) @ wd[e]
    return y, int((idx >= 0).sum() - kept.sum())


def test_group_by_expert_layout_and_drops():
    idx = np.array([[0, 2], [1, -1], [0, 1], [-1, 2], [0, -1], [-1, -1]], np.int32)
    w = np.arange(1, 13, dtype=np.float32).reshape(6, 2) * (idx >= 0)
    g = jax.jit(lambda i, w: ex.group_by_expert(i, w, 3, 2))(idx, w)
    C = 6
    np.testing.assert_array_equal(g.rows, [[0, 2], [1, 2], [0, 3]])
    np.testing.assert_array_equal(g.weights, [[1, 5], [3, 6], [2, 8]])
    np.testing.assert_array_equal(g.counts, [3, 2, 2])
    assert int(g.dropped) == 1  # expert 0's third pair (row 4)
    g = ex.group_by_expert(jnp.asarray(idx), jnp.asarray(w), 3, 4)
    np.testing.assert_array_equal(g.rows, [[0, 2, 4, C], [1, 2, C, C], [0, 3, C, C]])
    np.testing.assert_array_equal(g.weights, [[1, 5, 9, 0], [3, 6, 0, 0], [2, 8, 0, 0]])
    assert int(g.dropped) == 0


@pytest.mark.parametrize("cap,tile", [(40, 128), (12, 8), (7, 4), (3, 2)])
def test_grouped_swiglu_matches_numpy(cap, tile):
    C, K, el, H, F = 40, 3, 4, 8, 12
    idx, w = _routing(C, K, el, fill=31, seed=cap)
    x = np.random.default_rng(1).standard_normal((C, H)).astype(np.float32)
    x[31:] = 0
    wg, wu, wd = _weights(el, H, F, seed=2)
    f = jax.jit(lambda *a: ex.grouped_swiglu(*a, capacity=cap, tile=tile))
    y, groups = f(x, idx, w, wg, wu, wd)
    want, dropped = _np_grouped(x, idx, w, wg, wu, wd, cap)
    assert y.dtype == jnp.float32 and y.shape == (C, 8)
    np.testing.assert_allclose(y, want, rtol=2e-5, atol=2e-5)
    assert int(groups.dropped) == dropped
    if cap >= C:
        assert dropped == 0
    else:
        assert dropped > 0


def test_grouped_swiglu_grads_match_batched_blocks():
    """The loop's hand-written backward against autodiff of the batched blocks."""
    C, K, el, H, F, cap = 48, 4, 4, 16, 8, 20
    idx, w = _routing(C, K, el, fill=40, seed=3)
    rng = np.random.default_rng(4)
    x = rng.standard_normal((C, H)).astype(np.float32)
    ct = rng.standard_normal((C, H)).astype(np.float32)
    ws = _weights(el, H, F, seed=5)

    def fused(x, w, wg, wu, wd):
        return ex.grouped_swiglu(x, idx, w, wg, wu, wd, capacity=cap, tile=8)[0]

    def blocks(x, w, wg, wu, wd):
        g = ex.group_by_expert(jnp.asarray(idx), w, el, cap)
        yb = ex.swiglu_blocks(ex.gather_blocks(x, g.rows), wg, wu, wd)
        return ex.scatter_blocks(yb, g, C)

    args = (x, w, *ws)
    ya, va = jax.vjp(fused, *args)
    yb, vb = jax.vjp(blocks, *args)
    np.testing.assert_allclose(ya, yb, rtol=1e-5, atol=1e-5)
    for a, b in zip(va(jnp.asarray(ct)), vb(jnp.asarray(ct))):
        assert float(jnp.abs(b).max()) > 0
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def test_grouped_swiglu_numerical_grads():
    C, K, el, H, F, cap = 12, 2, 2, 4, 6, 5
    idx, w = _routing(C, K, el, fill=10, seed=6)
    x = np.random.default_rng(7).standard_normal((C, H)).astype(np.float32)
    ws = _weights(el, H, F, seed=8, scale=0.5)

    def f(x, w, wg, wu, wd):
        return ex.grouped_swiglu(x, idx, w, wg, wu, wd, capacity=cap, tile=2)[0]

    check_grads(f, (x, w, *ws), order=1, modes=("rev",), eps=1e-2, atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("tile", [4, 5, 64])
def test_swiglu_blocks_counts(tile):
    el, N, H, F = 3, 13, 8, 4
    rng = np.random.default_rng(9)
    xb = rng.standard_normal((el, N, H)).astype(np.float32)
    ws = _weights(el, H, F, seed=10)
    counts = np.array([13, 0, 6], np.int32)
    mask = (np.arange(N)[None, :] < counts[:, None])[..., None]
    dense = ex.swiglu_blocks(jnp.asarray(xb), *ws)
    got = jax.jit(lambda xb, c, *w: ex.swiglu_blocks(xb, *w, c, tile=tile))(xb, counts, *ws)
    np.testing.assert_allclose(got, np.where(mask, dense, 0), rtol=1e-5, atol=1e-5)
    ct = jnp.asarray(rng.standard_normal((el, N, H)), jnp.float32)
    _, va = jax.vjp(lambda xb, *w: ex.swiglu_blocks(xb, *w, jnp.asarray(counts), tile=tile),
                    jnp.asarray(xb), *ws)
    _, vb = jax.vjp(lambda xb, *w: ex.swiglu_blocks(xb * mask, *w) * mask, jnp.asarray(xb),
                    *ws)
    for a, b in zip(va(ct), vb(ct)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("tile", [4, 64])
def test_swiglu_blocks_counts_ignore_rows_past_the_count(tile):
    """Rows past an expert's count are unspecified (the GPU low-latency dispatch does not
    write them): NaN there changes neither the outputs nor any gradient."""
    el, N, H, F = 3, 13, 8, 4
    rng = np.random.default_rng(19)
    xb = rng.standard_normal((el, N, H)).astype(np.float32)
    ws = _weights(el, H, F, seed=20)
    counts = jnp.asarray(np.array([13, 2, 6], np.int32))
    past = np.arange(N)[None, :, None] >= np.asarray(counts)[:, None, None]
    dirty = np.where(past, np.float32(np.nan), xb)
    ct = jnp.asarray(rng.standard_normal((el, N, H)), jnp.float32)

    def run(x):
        y, vjp = jax.vjp(lambda xb, *w: ex.swiglu_blocks(xb, *w, counts, tile=tile),
                         jnp.asarray(x), *ws)
        return (y,) + vjp(ct)

    for a, b, name in zip(run(xb), run(dirty), ("y", "dx", "dw_gate", "dw_up", "dw_down")):
        a, b = np.asarray(a), np.asarray(b)
        if name in ("y", "dx"):  # rows past the counts: zero output, no gradient
            a, b = np.where(past, 0, a), np.where(past, 0, b)
        np.testing.assert_array_equal(a, b, err_msg=name)


def test_bfloat16_close_to_float32():
    C, K, el, H, F, cap = 32, 2, 2, 16, 16, 32
    idx, w = _routing(C, K, el, fill=30, seed=11)
    x = np.random.default_rng(12).standard_normal((C, H)).astype(np.float32)
    ws = _weights(el, H, F, seed=13)
    y32 = ex.grouped_swiglu(jnp.asarray(x), idx, w, *ws, capacity=cap)[0]
    y16 = ex.grouped_swiglu(jnp.asarray(x, jnp.bfloat16), idx, w, *ws, capacity=cap)[0]
    assert y16.dtype == jnp.float32
    np.testing.assert_allclose(y16, y32, rtol=5e-2, atol=5e-2)
    g = jax.grad(lambda x: jnp.sum(ex.grouped_swiglu(x, idx, w, *ws, capacity=cap)[0]))(
        jnp.asarray(x, jnp.bfloat16))
    assert g.dtype == jnp.bfloat16 and bool(jnp.all(jnp.isfinite(g.astype(jnp.float32))))


def test_expert_capacity_and_errors():
    assert ex.expert_capacity(1024 * 4, 4, 1.25) == 1280
    assert ex.expert_capacity(100, 3, 1.0) == 40          # ceil(33.3) -> 34 -> 40
    assert ex.expert_capacity(100, 3, 1.0, multiple=1) == 34
    assert ex.expert_capacity(4096, 4, 2.0, limit=1500) == 1500
    for bad in (0, -1.0, "2", True):
        with pytest.raises(ValueError, match="capacity_factor"):
            ex.expert_capacity(16, 2, bad)
    idx = jnp.zeros((4, 2), jnp.int32)
    with pytest.raises(ValueError, match="capacity"):
        ex.group_by_expert(idx, jnp.zeros((4, 2)), 2, 0)
    with pytest.raises(ValueError, match="topk_weights"):
        ex.group_by_expert(idx, jnp.zeros((4, 3)), 2, 4)
    with pytest.raises(ValueError, match="swiglu_blocks"):
        ex.swiglu_blocks(jnp.zeros((2, 4, 8)), jnp.zeros((2, 8, 4)), jnp.zeros((2, 8, 4)),
                         jnp.zeros((2, 4)))
    with pytest.raises(ValueError, match="counts"):
        ex.swiglu_blocks(jnp.zeros((2, 4, 8)), jnp.zeros((2, 8, 4)), jnp.zeros((2, 8, 4)),
                         jnp.zeros((2, 4, 8)), jnp.zeros((3,), jnp.int32))


def test_layer_benchmark_smoke(tmp_path, capsys):
    """`python -m jax_ep.bench --layer`, small: one JSON with both layers, both programs,
    timings, memory, drops and the target ratios."""
    from jax_ep.bench import exchange as bench

    out = tmp_path / "layer.json"
    report = bench.main(["--layer", "--quick", "--data", "2", "--expert", "2",
                         "--capacity-factors", "1.0,none", "--repeats", "1",
                         "--warmup", "0", "--input-sets", "1", "--json", str(out)])
    import json
    assert json.loads(out.read_text())["config"] == json.loads(json.dumps(report["config"]))
    names = {(r["layer"], r["program"]) for r in report["results"]}
    assert names == {(n, p) for n in ("dense", "moe cf=1.0", "moe cf=None")
                     for p in ("fwd", "fwd_bwd")}
    for r in report["results"]:
        assert r["median_s"] > 0 and len(r["times_s"]) == 1
        assert r["cpu_median_s"] > 0 and len(r["cpu_times_s"]) == 1
    for n in ("dense", "moe cf=1.0", "moe cf=None"):
        assert report["memory"][n]["fwd_bwd"]["peak_bytes"] > 0
    assert report["dropped"]["moe cf=None"]["dropped_slots"] == 0
    assert report["dropped"]["moe cf=1.0"]["slots"] == 256 * 2
    assert set(report["targets"]) == {"moe cf=1.0", "moe cf=None"}
    assert report["targets"]["moe cf=1.0"]["cpu_time_over_dense"]["fwd_bwd"] > 0
    printed = capsys.readouterr().out
    assert "x dense" in printed and "cpu ms" in printed and "load average" in printed
    with pytest.raises(SystemExit):
        bench.main(["--layer", "--capacity-factors", "zero"])


def test_layer_profile_smoke():
    """`python -m jax_ep.bench --layer --profile`, small: every piece timed, shares of the
    layer's fwd_bwd."""
    from jax_ep.bench import exchange as bench

    report = bench.main(["--layer", "--quick", "--profile", "--data", "2", "--expert", "2",
                         "--capacity-factors", "1.0", "--repeats", "1", "--warmup", "0"])
    assert set(report["pieces"]) == {"layer", "dense", "router", "exchange", "group",
                                     "experts", "matmuls"}
    assert report["shares_of_layer"]["layer"] == 1.0
    for k, v in report["pieces"].items():
        assert v["median_s"] > 0 and report["shares_of_layer"][k] > 0, k
    assert report["config"]["receive_rows"] == 128  # 2 * 64: the worst case here
    assert report["config"]["expert_matmul"] == "tiles"
    assert len(report["load_average"]["start"]) == 3


def test_aligned_pairs_layout():
    idx = np.array([[0, 2], [1, -1], [0, 1], [-1, 2], [0, -1], [-1, -1]], np.int32)
    w = np.arange(1, 13, dtype=np.float32).reshape(6, 2) * (idx >= 0)
    g = ex.group_by_expert(jnp.asarray(idx), jnp.asarray(w), 3, 3)
    rows, wts, starts, sizes = ex.aligned_pairs(g, 2, 6)
    # expert 0: rows 0, 2, 4 (run of 4 places); expert 1: 1, 2; expert 2: 0, 3.
    np.testing.assert_array_equal(starts, [0, 4, 6])
    np.testing.assert_array_equal(sizes, [4, 2, 2])
    np.testing.assert_array_equal(rows, [0, 2, 4, 6, 1, 2, 0, 3, 6, 6, 6, 6])
    np.testing.assert_array_equal(wts, [1, 5, 9, 0, 3, 6, 2, 8, 0, 0, 0, 0])


@pytest.mark.parametrize("max_chunk", [1, 8, 32, 1024])
def test_grouped_swiglu_chunk_sizes(max_chunk):
    """Any mix of chunk sizes gives the NumPy sums, and its gradients agree with
    autodiff of the batched blocks (the runs here take chunks of 4, 8, 16 and 32)."""
    C, K, el, H, F, cap = 96, 3, 3, 8, 12, 60
    idx, w = _routing(C, K, el, fill=90, seed=11)
    rng = np.random.default_rng(12)
    x = rng.standard_normal((C, H)).astype(np.float32)
    ct = jnp.asarray(rng.standard_normal((C, H)), jnp.float32)
    ws = _weights(el, H, F, seed=13)

    def chunked(x, w, wg, wu, wd):
        return ex.grouped_swiglu(x, idx, w, wg, wu, wd, capacity=cap, tile=4,
                                 max_chunk=max_chunk)[0]

    def blocks(x, w, wg, wu, wd):
        g = ex.group_by_expert(jnp.asarray(idx), w, el, cap)
        return ex.scatter_blocks(ex.swiglu_blocks(ex.gather_blocks(x, g.rows), wg, wu, wd),
                                 g, C)

    want, _ = _np_grouped(x, idx, w, *ws, cap)
    ya, va = jax.vjp(jax.jit(chunked), x, w, *ws)
    np.testing.assert_allclose(ya, want, rtol=2e-5, atol=2e-5)
    _, vb = jax.vjp(blocks, x, w, *ws)
    for a, b in zip(va(ct), vb(ct)):
        assert float(jnp.abs(b).max()) > 0
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def test_grouped_swiglu_defaults_match_numpy_and_blocks():
    """The layer's settings (tile 32, chunks up to 1024): runs of 60 to 120 pairs take
    chunks of 64 and 32; outputs against NumPy, every gradient against the blocks."""
    C, K, el, H, F, cap = 160, 3, 3, 8, 12, 150
    idx, w = _routing(C, K, el, fill=150, seed=16)
    rng = np.random.default_rng(17)
    x = rng.standard_normal((C, H)).astype(np.float32)
    ct = jnp.asarray(rng.standard_normal((C, H)), jnp.float32)
    ws = _weights(el, H, F, seed=18)

    def default(x, w, wg, wu, wd):
        return ex.grouped_swiglu(x, idx, w, wg, wu, wd, capacity=cap)[0]

    def blocks(x, w, wg, wu, wd):
        g = ex.group_by_expert(jnp.asarray(idx), w, el, cap)
        return ex.scatter_blocks(ex.swiglu_blocks(ex.gather_blocks(x, g.rows), wg, wu, wd),
                                 g, C)

    counts = np.bincount(idx[idx >= 0], minlength=el)
    assert np.all(counts % 32) and counts.min() > 32  # every run ends in a padded chunk
    want, _ = _np_grouped(x, idx, w, *ws, cap)
    ya, va = jax.vjp(jax.jit(default), x, w, *ws)
    np.testing.assert_allclose(ya, want, rtol=2e-5, atol=2e-5)
    _, vb = jax.vjp(blocks, x, w, *ws)
    for a, b in zip(va(ct), vb(ct)):
        assert float(jnp.abs(b).max()) > 0
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def test_grouped_swiglu_max_chunk_checked():
    idx, w = _routing(8, 2, 2, fill=8, seed=14)
    ws = _weights(2, 4, 4, seed=15)
    with pytest.raises(ValueError, match="max_chunk"):
        ex.grouped_swiglu(np.ones((8, 4), np.float32), idx, w, *ws, capacity=8, max_chunk=0)


def _dots_outside_loops(hlo: str) -> list[str]:
    """The dot instructions of compiled HLO text that no while loop's body reaches."""
    import re

    comps, cur = {}, None
    for line in hlo.splitlines():
        m = re.match(r"^(?:ENTRY )?%?([\w.\-]+) ", line)
        if m and line.rstrip().endswith("{"):
            cur = m.group(1)
            comps[cur] = []
        elif cur is not None:
            comps[cur].append(line)
    callees = {c: set(re.findall(r"(?:calls|body|condition|to_apply|branch_computations)"
                                 r"=\{?%?([\w.\-]+)", " ".join(ls)))
               for c, ls in comps.items()}
    stack = [b for ls in comps.values() for b in re.findall(r"body=%?([\w.\-]+)",
                                                            " ".join(ls))]
    inside = set()
    while stack:
        c = stack.pop()
        if c not in inside:
            inside.add(c)
            stack += list(callees.get(c, ()))
    return [ln.strip() for c, ls in comps.items() if c not in inside for ln in ls
            if re.search(r" dot\(", ln)]


@pytest.mark.parametrize("el,cap", [(2, 512), (1, 1024), (4, 256)])
def test_grouped_swiglu_matmuls_stay_in_their_loops(el, cap):
    """With the packed length M = el * cap equal to max_chunk (the demo's shape: 2
    experts of 512 places, chunks up to 1024), a chunk of all M rows would slice whole
    arrays at a constant offset, and XLA would hoist its matmuls out of its loop to run
    on every call (3x the demo layer's time). No matmul of the forward or backward may
    sit outside the loops."""
    C, K, H, F = 1024, 2, 16, 32
    idx, w = _routing(C, K, el, fill=C, seed=21)
    x = np.ones((C, H), np.float32)
    ws = _weights(el, H, F, seed=22)

    def loss(x, w, wg, wu, wd):
        y, _ = ex.grouped_swiglu(x, idx, w, wg, wu, wd, capacity=cap, max_chunk=1024)
        return jnp.sum(y * y)

    hlo = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4))).lower(x, w, *ws).compile()
    assert _dots_outside_loops(hlo.as_text()) == []
    assert ex._chunk_sizes(32, 1024, el * cap)[-1] < el * cap


def test_train_step_benchmark_smoke(tmp_path, capsys):
    """`python -m jax_ep.bench --train-step`, small: the demo script's step and its dense
    twin timed in one run, the ratio written, and `--baseline` flags a ratio more than
    15% above a recorded one (exit 1) and passes one within it."""
    import json

    from jax_ep.bench import exchange as bench

    from jax_ep.bench import layer as bench_layer

    out = tmp_path / "train.json"
    quick = ["--train-step", "--quick", "--steps", "1", "--rounds", "2", "--warmup", "1"]
    # one run against a recorded ratio no step can reach: flagged, exit 1, the report
    # written first
    slow = tmp_path / "recorded.json"
    slow.write_text(json.dumps({"demo_over_dense": 1e-9}))
    with pytest.raises(SystemExit) as e:
        bench.main(quick + ["--json", str(out), "--baseline", str(slow)])
    assert e.value.code == 1
    report = json.loads(out.read_text())
    assert set(report["results"]) == {"demo", "dense"}
    for r in report["results"].values():
        assert r["median_s"] > 0 and len(r["times_s"]) == 2 and r["steps_per_s"] > 0
    ratio = report["demo_over_dense"]
    assert ratio == pytest.approx(report["results"]["demo"]["median_s"]
                                  / report["results"]["dense"]["median_s"])
    assert report["baseline"]["regressed"] and "REGRESSION" in report["baseline"]["message"]
    assert "steps/s" in capsys.readouterr().out

    assert bench_layer.compare_to_baseline({"demo_over_dense": 1.14},
                                           {"demo_over_dense": 1.0})[0] is False
    regressed, msg = bench_layer.compare_to_baseline({"demo_over_dense": 1.16},
                                                     {"demo_over_dense": 1.0})
    assert regressed and "REGRESSION" in msg
