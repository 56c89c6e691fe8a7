"""The internode backend in mode "hierarchical", without a GPU: programs are lowered for
CUDA and checked for the hierarchical targets (jax_ep_internode_hier_*) with the direct
targets' operands, results and attributes plus gpus_per_node (and the handle's
src_index into combine); the global view is partitioned on the host and its per-shard
calls checked; the heap sizing covers both modes. No kernel runs here: the kernels are
compiled by the build, not run."""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest

import jax_ep
from jax_ep import nvshmem_bootstrap, ops
from jax_ep._src import ext as _ext
from jax_ep._src.backends import internode
from jax_ep.network import modes
from jax_ep.network.transport import TransportConfig

from conftest import ep_mesh
from test_internode import (E, H, K, R, RANK, T, _calls, _global_step, _inputs,
                            _lower_cuda, _step_args, _tensor_shapes)

TRANSPORT = dict(num_ports=2, qps_per_port=4, chunk_bytes=65536)


def _fake_state(monkeypatch, mode="hierarchical", gpn="4"):
    st = nvshmem_bootstrap.BootstrapState(
        rank=RANK, world=R, heap_bytes=1 << 30,
        config=TransportConfig(mode=mode, **TRANSPORT), env={})
    monkeypatch.setattr(nvshmem_bootstrap, "_state", st)
    monkeypatch.setattr(ops, "resolve_backend", lambda backend: "internode")
    if gpn is None:
        jax_ep.config.update("gpus_per_node", None)
    else:
        jax_ep.config.update("gpus_per_node", gpn)
    return st


def _dispatch_combine(capacity=None):
    def f(x, idx, w):
        rx, _, _, h = jax_ep.dispatch(x, idx, w, num_experts=E, axis_name="ep",
                                      capacity=capacity)
        return jax_ep.combine(rx * 2, h)
    return f


@pytest.mark.parametrize("mode,gpn", [("hierarchical", "4"), ("hierarchical", "2"),
                                      ("auto", "4"), ("auto", "2")])
@pytest.mark.parametrize("capacity", [None, 20])
def test_dispatch_combine_lower_to_hierarchical_calls(monkeypatch, mode, gpn, capacity):
    from jax_ep.network import topology
    monkeypatch.setattr(topology, "HIERARCHICAL_VERIFIED", True)  # auto may pick it
    _fake_state(monkeypatch, mode, gpn)
    C = R * T if capacity is None else capacity
    hlo = _lower_cuda(_dispatch_combine(capacity), *_inputs())
    assert not _calls(hlo, "jax_ep_internode_dispatch")
    assert not _calls(hlo, "jax_ep_internode_combine")
    (d,) = _calls(hlo, "jax_ep_internode_hier_dispatch")
    assert {k: d[k] for k in ("num_experts", "num_ranks", "rank", "capacity", "num_ports",
                              "qps_per_port", "chunk_bytes", "gpus_per_node")} == dict(
        num_experts=E, num_ranks=R, rank=RANK, capacity=C, gpus_per_node=int(gpn),
        **TRANSPORT)
    # the direct dispatch's results: rows, ids, weights, totals, sources, handle
    assert _tensor_shapes(d["_results"]) == [
        (C, H), (C, K), (C, K), (), (), (E // R,), (C,), (C,), (R, R), (T, R)]
    (c,) = _calls(hlo, "jax_ep_internode_hier_combine")
    assert {k: c[k] for k in ("num_ranks", "rank", "capacity", "topk", "gpus_per_node")} == \
        dict(num_ranks=R, rank=RANK, capacity=C, topk=K, gpus_per_node=int(gpn))
    # the direct combine's operands plus the handle's src_index
    assert _tensor_shapes(c["_operands"]) == [(C, H), (R, R), (T, R), (C,)]
    assert _tensor_shapes(c["_results"]) == [(T, H)]


# ("auto", "4"): direct until a GPU run has verified the hierarchical kernels
@pytest.mark.parametrize("mode,gpn", [("auto", "8"), ("auto", "1"), ("auto", "4"),
                                      ("direct", "4")])
def test_direct_where_the_mode_or_topology_says_so(monkeypatch, mode, gpn):
    _fake_state(monkeypatch, mode, gpn)
    hlo = _lower_cuda(_dispatch_combine(), *_inputs())
    assert len(_calls(hlo, "jax_ep_internode_dispatch")) == 1
    assert len(_calls(hlo, "jax_ep_internode_combine")) == 1
    assert "jax_ep_internode_hier_" not in hlo
    # the direct dispatch has no node size; the direct combine sums in the run's nodes
    # (kernels/common/combine_order.h)
    (d,) = _calls(hlo, "jax_ep_internode_dispatch")
    assert "gpus_per_node" not in d
    (c,) = _calls(hlo, "jax_ep_internode_combine")
    assert c["gpus_per_node"] == int(gpn)


def test_grad_lowers_to_hierarchical_gather_and_combine(monkeypatch):
    _fake_state(monkeypatch)
    C = 24
    x, idx, w = _inputs(1, jnp.bfloat16)
    y = jnp.ones((R * C, H), jnp.bfloat16)

    def f(x, idx, w, y):
        def loss(x, w, y):
            rx, _, rw, h = jax_ep.dispatch(x, idx, w, num_experts=E, axis_name="ep",
                                           capacity=C)
            out = jax_ep.combine(rx * rw[:, :1].astype(rx.dtype) + y, h)
            return jnp.sum(out.astype(jnp.float32) ** 2)
        return jax.grad(loss, argnums=(0, 1, 2))(x, w, y)

    hlo = _lower_cuda(f, x, idx, w, y, n_out=3)
    assert len(_calls(hlo, "jax_ep_internode_hier_dispatch")) == 1
    (g,) = _calls(hlo, "jax_ep_internode_hier_gather")
    assert (g["gpus_per_node"], g["capacity"], g["topk"]) == (4, C, K)
    assert _tensor_shapes(g["_operands"]) == [(T, H), (R, R), (T, R)]
    assert _tensor_shapes(g["_results"]) == [(C, H)]
    combines = _calls(hlo, "jax_ep_internode_hier_combine")
    assert len(combines) == 3  # forward, and dispatch's transpose for x and the weights
    for c in combines:
        assert _tensor_shapes(c["_operands"])[-1] == (C,)
    assert "@jax_ep_internode_dispatch(" not in hlo and "@jax_ep_internode_gather(" not in hlo


@pytest.fixture
def clean_global_view():
    """The global view caches its partitioned ops per spec, and the mode is process-wide
    state (fixed for a real run): clean caches before and after, so runs of the other
    mode in this process are not reused here or there."""
    _clear_global_view_caches()
    yield
    _clear_global_view_caches()


def test_global_view_partitions_into_hierarchical_calls(monkeypatch, tmp_path,
                                                       clean_global_view):
    """As the direct mode's test in test_internode.py: the host compile partitions the
    global step, then stops at the CUDA-only targets; the dumped HLO is checked."""
    _fake_state(monkeypatch)
    with jax.set_mesh(ep_mesh(R)):
        lowered = jax.jit(_global_step("internode")).trace(*_step_args()).lower()
        with pytest.raises(Exception, match=r"jax_ep_internode_hier_\w+ on a platform Host"):
            lowered.compile({"xla_dump_to": str(tmp_path)})
    (path,) = tmp_path.glob("*jit_step*cpu_after_optimizations.txt")
    calls = {}
    for line in path.read_text().splitlines():
        m = re.search(r'custom_call_target="(jax_ep_\w+)"', line)
        if m:
            attrs = dict((k, int(v)) for k, v in re.findall(r"(\w+) = (-?\d+) : i64", line))
            calls.setdefault(m.group(1), []).append((line, attrs))
    assert sorted((k, len(v)) for k, v in calls.items()) == [
        ("jax_ep_internode_hier_combine", 2), ("jax_ep_internode_hier_dispatch", 1),
        ("jax_ep_internode_hier_gather", 1)]
    for target, found in calls.items():
        for line, a in found:
            assert a["gpus_per_node"] == 4 and a["num_ranks"] == R, (target, a)
    for line, _ in calls["jax_ep_internode_hier_combine"]:
        operands = re.search(r"operand_layout_constraints=\{(.*?)\}, api", line).group(1)
        # rows, counts, send_slot and src_index of the shard's handle
        assert f"s32[{R},{R}]" in operands and f"s32[{T},{R}]" in operands, line
        assert f"s32[{R * T}]" in operands, line


def _clear_global_view_caches():
    import jax_ep.sharded as sh
    for fn in (sh._layout_op, sh._dispatch_op, sh._handle_driven_op, sh._combine_for):
        fn.cache_clear()
    jax.clear_caches()


def test_more_gpus_per_node_than_a_node_mask_holds_is_an_error(monkeypatch):
    from jax_ep.network import hier_layout
    assert hier_layout.MAX_GPUS_PER_NODE == 32  # one 32-bit node mask per row
    _fake_state(monkeypatch, "hierarchical", None)
    monkeypatch.setattr(hier_layout, "MAX_GPUS_PER_NODE", 4)  # R = 8 ranks on one node
    with pytest.raises(ValueError, match="GPUs per node.*JAX_EP_GPUS_PER_NODE"):
        internode.internode_mode(R)


def test_heap_holds_both_modes():
    kw = dict(num_ranks=16, max_tokens=512, hidden=1024, topk=8, x_dtype="bfloat16",
              y_dtype="float32")
    direct = nvshmem_bootstrap.heap_bytes_for(**kw)
    both = nvshmem_bootstrap.heap_bytes_for(**kw, gpus_per_node=4, num_qps=8)
    hier = modes.hier_state_bytes(16, 4, 8, 1024, 8, 4, 4)
    assert hier > 0
    # the hierarchical rings (both halves, at the widest element) come on top
    assert both >= direct + hier - (2 << 20) and both <= direct + hier + (2 << 20)
    assert both % (2 << 20) == 0
    with pytest.raises(ValueError, match="gpus_per_node"):
        nvshmem_bootstrap.heap_bytes_for(**kw, gpus_per_node=3)


def test_hierarchical_targets_are_registered_with_nvshmem():
    if not jax_ep.build_info().get("nvshmem"):
        pytest.skip("this build has no NVSHMEM backend")
    cuda = set(_ext.nvshmem_ext().registrations()["CUDA"])  # the NVSHMEM module's
    for op in ("dispatch", "combine", "gather"):
        assert f"jax_ep_internode_{op}" in cuda and f"jax_ep_internode_hier_{op}" in cuda


@pytest.mark.parametrize("mode,gpn,verified,want", [
    ("hierarchical", "4", False, 4), ("auto", "2", True, 2), ("auto", "2", False, None),
    ("auto", "8", True, None), ("direct", "4", True, None)])
def test_bootstrap_sizes_the_heap_for_the_mode_it_can_pick(monkeypatch, mode, gpn, verified,
                                                           want):
    from jax_ep.network import topology
    from jax_ep import nvshmem_bootstrap as rt
    monkeypatch.setattr(topology, "HIERARCHICAL_VERIFIED", verified)
    jax_ep.config.update("gpus_per_node", gpn)
    jax_ep.config.update("internode_mode", None)
    args = rt._hier_heap_args(R, TransportConfig(mode=mode, **TRANSPORT))
    if want is None:
        assert args == {}
    else:
        assert args == dict(gpus_per_node=want, num_qps=8)


@pytest.mark.parametrize("mode", ["hierarchical", "direct"])
def test_bench_combine_program_keeps_the_internode_handle(monkeypatch, mode):
    """python -m jax_ep.bench times combine as its own program on the handle dispatch
    returned: the internode parts of the handle (counts, send slots) must cross with it,
    or the internode combine refuses the handle."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    from jax_ep.bench import exchange as bench

    _fake_state(monkeypatch, mode, "4")
    mesh = ep_mesh(R)
    C = R * T
    progs = bench._programs(mesh, "internode", num_experts=E, capacity=C)
    x, idx, w = _inputs()
    disp = progs["dispatch"].trace(x, idx, w)
    rx, _, _, packed = disp.out_info
    assert len(packed) == 8  # six handle fields, then the internode counts and send slots
    sh = NamedSharding(mesh, P("ep"))
    args = (jax.ShapeDtypeStruct(rx.shape, rx.dtype, sharding=sh),
            tuple(jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=sh) for p in packed))
    hlo = progs["combine"].trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    prefix = "jax_ep_internode_hier_" if mode == "hierarchical" else "jax_ep_internode_"
    (c,) = _calls(hlo, prefix + "combine")
    assert _tensor_shapes(c["_operands"])[:3] == [(C, H), (R, R), (T, R)]
