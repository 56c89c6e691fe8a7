"""The host protocol simulator (tests/sim/hierarchical_sim.py) of the hierarchical and
direct internode dispatch: bit-exact against the NumPy model of the contract for random
routing at 32 ranks, ring wrap-around with the header's ring sizes, bytes per port, fault
cases, and every planted mistake reported. A simulator run is a model of the wire, not a
GPU run. What the emulated kernels cover (results at 2x2, 2x4 and 4x2 with drops, ring
wraps, interleavings, the combine reduced within the node) runs there
(tests/emu/test_internode_hier_emu.py), not here."""
import numpy as np
import pytest

import hierarchical_sim as hs
from conftest import assert_bitwise_equal, np_model
from jax_ep.network import modes
from jax_ep.network.topology import Topology

KEYS = ["recv_x", "recv_idx", "recv_w", "num_recv", "num_dropped", "per_expert", "src_rank",
        "src_index", "send_row"]
SMALL_RINGS = dict(chunk_rows=2, ring_chunks=2, nvl_rows=3)


def make_inputs(N, G, T=10, H=4, K=3, experts_per_rank=2, C=None, dtype=np.float32, seed=0,
                unused=0.15):
    """Per-rank x[R, T, H], idx/w[R, T, K], y[R, C, H]; values spread over many binades
    so that a change of summation order changes the bits."""
    R = N * G
    E = experts_per_rank * R
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((R, T, H)) * 10.0 ** rng.integers(-3, 4, (R, T, H))).astype(dtype)
    idx = np.array([[rng.choice(E, K, replace=False) for _ in range(T)] for _ in range(R)],
                   dtype=np.int32).reshape(R, T, K)
    idx[rng.random(idx.shape) < unused] = -1
    w = rng.random((R, T, K)).astype(np.float32)
    C = max(R * T, 1) if C is None else C
    y = (rng.standard_normal((R, C, H)) * 10.0 ** rng.integers(-4, 5, (R, C, H))).astype(dtype)
    return x, idx, w, y, E, C


def stacked(res):
    return {k: np.stack([o[k] for o in res.outputs]) for k in KEYS}


def model(x, idx, w, y, E, C):
    """The NumPy model's dispatch outputs (its combine is not simulated here)."""
    m = np_model(x, idx, w, y, E, C)
    return {k: m[k] for k in KEYS}


def run_checked(cfg, x, idx, w, y, E, C):
    res = hs.run(cfg, x, idx, w, E=E, C=C)
    assert all(e is None for e in res.errors), res.errors
    assert_bitwise_equal(stacked(res), model(x, idx, w, y, E, C),
                         what=f"{cfg.nodes}x{cfg.gpus} {cfg.mode}: ")
    return res


@pytest.mark.parametrize("mode", ["hierarchical", "direct"])
# 2x2 and 2x4 run on the kernels themselves (tests/emu/test_internode_hier_emu.py); the
# emulated GPU does not reach 32 ranks
@pytest.mark.parametrize("N,G,seed", [(4, 8, 2)])
def test_bit_exact_against_the_model(mode, N, G, seed):
    x, idx, w, y, E, C = make_inputs(N, G, T=10 if N * G < 32 else 6, seed=seed)
    res = run_checked(hs.Config(N, G, mode=mode, seed=seed, **SMALL_RINGS), x, idx, w, y, E, C)
    if mode == "hierarchical":
        kinds = {r.kind for r in res.net_dispatch.rings if r.wrapped}
        assert {"rdma", "nvl"} <= kinds, f"no ring went round: {kinds}"


def test_header_ring_sizes_wrap_with_enough_tokens():
    # the layout constants of the header (via jax_ep.network.modes), no override
    # tokens enough for a source's stream to the other node (most tokens) to exceed a ring
    T = 3 * modes.RDMA_CHUNK_ROWS * modes.RDMA_RING_CHUNKS // 2
    x, idx, w, y, E, C = make_inputs(2, 2, T=T, H=2, K=4, seed=4, unused=0.0)
    cfg = hs.Config(2, 2, seed=4)
    assert (cfg.chunk_rows, cfg.ring_chunks, cfg.nvl_rows) == (
        modes.RDMA_CHUNK_ROWS, modes.RDMA_RING_CHUNKS, modes.NVL_RING_ROWS)
    res = run_checked(cfg, x, idx, w, y, E, C)
    assert any(r.wrapped for r in res.net_dispatch.rings if r.kind == "rdma")


def test_token_crosses_once_per_node_and_ports_balanced():
    N, G = 2, 4
    x, idx, w, y, E, C = make_inputs(N, G, T=16, seed=6)
    topo = Topology(N * G, G)
    cfg = hs.Config(N, G, num_ports=2, qps_per_port=2, seed=6, **SMALL_RINGS)
    res = hs.run(cfg, x, idx, w, E=E, C=C)
    net = res.net_dispatch
    row = modes.hier_dispatch_row_stride(x.shape[2] * 4, idx.shape[2])
    for s in range(topo.num_ranks):
        tr = modes.traffic(idx[s], s, topo, E)
        inter = sum(b.sum() for (a, d), b in net.peer_port_bytes.items()
                    if a == s and topo.node_of(d) != topo.node_of(s))
        # once per (token, remote node): the model's count, and only to the rail peer
        assert inter == tr["remote_node_rows"] * row
        for (a, d), b in net.peer_port_bytes.items():
            if a == s and topo.node_of(d) != topo.node_of(s):
                assert topo.local_of(d) == topo.local_of(s)
                assert b.max() - b.min() <= cfg.chunk_rows * row  # within one chunk
    # direct mode on the same routing sends at least as many inter-node bytes
    res_d = hs.run(hs.Config(N, G, mode="direct", seed=6, **SMALL_RINGS), x, idx, w, E=E, C=C)
    inter_d = sum(b.sum() for (a, d), b in res_d.net_dispatch.peer_port_bytes.items()
                  if topo.node_of(a) != topo.node_of(d))
    inter_h = sum(b.sum() for (a, d), b in net.peer_port_bytes.items()
                  if topo.node_of(a) != topo.node_of(d))
    assert inter_h < inter_d


# --- fault cases ------------------------------------------------------------------------

def _errors(res, skip=()):
    return [e for r, e in enumerate(res.errors) if r not in skip]


@pytest.mark.parametrize("mode", ["hierarchical", "direct"])
def test_empty_call_takes_part(mode):
    x, idx, w, y, E, C = make_inputs(2, 2, T=0, seed=7)
    res = run_checked(hs.Config(2, 2, mode=mode, **SMALL_RINGS), x, idx, w, y, E, C)
    assert res.net_dispatch.clock > 0


def test_rank_late_past_the_timeout_errors_everywhere_and_in_time_is_fine():
    x, idx, w, y, E, C = make_inputs(2, 2, seed=9)
    late = hs.run(hs.Config(2, 2, late={1: 5000}, timeout_steps=300, **SMALL_RINGS),
                  x, idx, w, E=E, C=C)
    assert all(e is not None for e in late.errors), late.errors
    assert any("rank 1" in e and "timed out" in e for e in late.errors)
    run_checked(hs.Config(2, 2, late={1: 150}, timeout_steps=10_000, **SMALL_RINGS),
                x, idx, w, y, E, C)


def test_other_shapes_on_one_rank_is_an_error_naming_both():
    x, idx, w, y, E, C = make_inputs(2, 2, seed=10)
    xs = list(x)
    xs[3] = np.zeros((x.shape[1], x.shape[2] + 1), x.dtype)
    res = hs.run(hs.Config(2, 2, **SMALL_RINGS), xs, idx, w, E=E, C=C)
    assert all(e is not None and "not in the same call" in e for e in res.errors), res.errors
    assert any(f"{x.shape[2] + 1}" in e and f"{x.shape[2]}" in e for e in res.errors)


def test_sequence_mismatch_is_an_error():
    x, idx, w, y, E, C = make_inputs(2, 2, seed=11)
    res = hs.run(hs.Config(2, 2, seq_override={1: 8}, **SMALL_RINGS), x, idx, w,
                 E=E, C=C, seq=7)
    assert all(e is not None and "seq" in e for e in res.errors), res.errors


def test_bad_id_on_one_rank_reaches_every_rank():
    x, idx, w, y, E, C = make_inputs(2, 2, seed=12)
    idx = idx.copy()
    idx[2, 0, 0] = E + 3
    res = hs.run(hs.Config(2, 2, **SMALL_RINGS), x, idx, w, E=E, C=C)
    assert all(e is not None and "rank 2" in e and "topk_idx" in e for e in res.errors), \
        res.errors


# --- planted mistakes ------------------------------------------------------------------

def _caught(bug, mode, seeds=range(3)):
    """For every seed: the simulator reports a violation, a rank errors, or the result
    differs from the model. Returns the reports."""
    reports = []
    for seed in seeds:
        x, idx, w, y, E, C = make_inputs(2, 4, T=16, seed=seed)
        cfg = hs.Config(2, 4, mode=mode, seed=seed, bugs=frozenset({bug}), **SMALL_RINGS)
        try:
            res = hs.run(cfg, x, idx, w, E=E, C=C)
        except hs.Violation as v:
            reports.append(f"violation: {v}")
            continue
        if any(e is not None for e in res.errors):
            reports.append("error: " + next(e for e in res.errors if e is not None))
            continue
        try:
            assert_bitwise_equal(stacked(res), model(x, idx, w, y, E, C))
        except AssertionError:
            reports.append("result differs from the model")
            continue
        pytest.fail(f"planted mistake {bug!r} ({mode}) not caught with seed {seed}")
    return reports


@pytest.mark.parametrize("bug,mode,expect", [
    ("forward_before_land", "hierarchical", "before it landed"),
    ("forward_before_land", "direct", ("before it landed", "after its reader reset")),
    ("nvl_publish_early", "hierarchical", "before it landed"),
    ("missing_close", "hierarchical", "closing signal"),
    ("missing_close", "direct", "closing signal"),
    ("shared_signal_word", "hierarchical", "written from"),
    ("shared_signal_word", "direct", "written from"),
    ("no_final_credit_wait", "hierarchical", "after its reader reset"),
])
def test_planted_mistake_is_caught(bug, mode, expect):
    reports = _caught(bug, mode)
    expect = (expect,) if isinstance(expect, str) else expect
    assert all(any(e in r for e in expect) for r in reports), reports


def test_unknown_bug_name_is_an_error():
    with pytest.raises(ValueError, match="bugs"):
        hs.Config(2, 2, bugs=frozenset({"typo"}))


def test_a_word_left_set_at_the_end_of_a_call_is_reported(monkeypatch):
    # a reader that forgets to reset its data words leaves the half unusable two calls
    # later: check_quiet (run after every call that ends without error) reports it
    monkeypatch.setattr(hs.RdmaStream, "finish", lambda self: None)
    x, idx, w, y, E, C = make_inputs(2, 2, seed=14)
    with pytest.raises(hs.Violation, match="never reset"):
        hs.run(hs.Config(2, 2, **SMALL_RINGS), x, idx, w, E=E, C=C)
