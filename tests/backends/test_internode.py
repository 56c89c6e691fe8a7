"""The per-shard ops on the internode (NVSHMEM) backend, without a GPU: programs are
lowered for CUDA and their HLO checked for the internode custom calls and attributes;
the handle mapping (kernels' counts/send_slot -> the contract's send_row), the static
rank derivation and the backend choice are checked on the host. The global view
(jax_ep.sharded) is checked the same way, and through XLA's partitioner on the host (see
test_global_view_partitions_into_internode_calls). No kernel runs here.
"""
from __future__ import annotations

import dataclasses
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_ep
from jax_ep import config, nvshmem_bootstrap, ops
from jax_ep._src import ext as _ext
from jax_ep._src.backends import internode
from jax_ep._src.common import Cfg
from jax_ep._src.types import DispatchHandle, InternodeHandleParts
from jax_ep.network.transport import TransportConfig

from conftest import ep_mesh, np_model

R, T, H, K, E = 8, 6, 16, 3, 16
RANK = 3


def _fake_state(monkeypatch, rank=RANK, world=R, config=None):
    st = nvshmem_bootstrap.BootstrapState(
        rank=rank, world=world, heap_bytes=1 << 30,
        config=(config or TransportConfig(num_ports=2, qps_per_port=4, chunk_bytes=65536)),
        env={})
    monkeypatch.setattr(nvshmem_bootstrap, "_state", st)
    return st


@pytest.fixture
def internode_forced(monkeypatch):
    """NVSHMEM 'running' as PE RANK of R, and every op resolving to the internode path."""
    st = _fake_state(monkeypatch)
    monkeypatch.setattr(ops, "resolve_backend", lambda backend: "internode")
    return st


def _inputs(seed=0, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((R * T, H)), dtype)
    idx = np.stack([rng.choice(E, K, replace=False) for _ in range(R * T)]).astype(np.int32)
    idx[::5, 0] = -1
    w = jnp.asarray(rng.random((R * T, K)), jnp.float32)
    return x, jnp.asarray(idx), w


def _lower_cuda(f, *args, n_out=1):
    mesh = ep_mesh(R)
    out_specs = P("ep") if n_out == 1 else (P("ep"),) * n_out
    g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("ep"), out_specs=out_specs))
    with config.override(collective_stream=False):  # the calls' own structure, no regions
        return g.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


_CALL = re.compile(r"stablehlo\.custom_call @(\w+)\((.*?)\)\s*\{(.*?)\}\s*:\s*\((.*?)\)\s*->\s*(.*)$")


def _calls(hlo: str, target: str) -> list[dict]:
    """[{attr: int, ..., '_results': 'types'}] of every custom call to `target`."""
    found = []
    for line in hlo.splitlines():
        m = _CALL.search(line)
        if not m or m.group(1) != target:
            continue
        cfg = re.search(r"mhlo\.backend_config = \{(.*?)\}", m.group(3))
        attrs = {}
        if cfg:
            for k, v in re.findall(r"(\w+) = (-?\d+) : i64", cfg.group(1)):
                attrs[k] = int(v)
        attrs["_operands"] = m.group(4)
        attrs["_results"] = m.group(5)
        found.append(attrs)
    return found


def _tensor_shapes(types_text: str) -> list[tuple]:
    out = []
    for dims in re.findall(r"tensor<([^>]*)>", types_text):
        parts = dims.split("x")[:-1]  # the last part is the element type
        out.append(tuple(int(p) for p in parts))
    return out


# ----------------------------------------------------------------------------- lowering

@pytest.mark.parametrize("capacity", [None, 20])
def test_dispatch_combine_lower_to_internode_calls(internode_forced, capacity):
    C = R * T if capacity is None else capacity
    seen = {}

    def f(x, idx, w):
        rx, ri, rw, h = jax_ep.dispatch(x, idx, w, num_experts=E, axis_name="ep",
                                        capacity=capacity)
        seen["handle"] = h
        return jax_ep.combine(rx * 2, h)

    hlo = _lower_cuda(f, *_inputs())
    assert "@jax_ep_dispatch" not in hlo and "@jax_ep_combine" not in hlo
    (d,) = _calls(hlo, "jax_ep_internode_dispatch")
    assert {k: d[k] for k in ("num_experts", "num_ranks", "rank", "capacity", "num_ports",
                              "qps_per_port", "chunk_bytes")} == dict(
        num_experts=E, num_ranks=R, rank=RANK, capacity=C, num_ports=2, qps_per_port=4,
        chunk_bytes=65536)
    assert _tensor_shapes(d["_results"]) == [
        (C, H), (C, K), (C, K), (), (), (E // R,), (C,), (C,), (R, R), (T, R)]
    (c,) = _calls(hlo, "jax_ep_internode_combine")
    assert {k: c[k] for k in ("num_ranks", "rank", "capacity", "topk", "num_ports",
                              "qps_per_port", "chunk_bytes")} == dict(
        num_ranks=R, rank=RANK, capacity=C, topk=K, num_ports=2, qps_per_port=4,
        chunk_bytes=65536)
    assert _tensor_shapes(c["_operands"]) == [(C, H), (R, R), (T, R)]
    assert _tensor_shapes(c["_results"]) == [(T, H)]

    h = seen["handle"]
    assert isinstance(h, DispatchHandle) and isinstance(h.extra, InternodeHandleParts)
    assert (h.extra.rank, h.extra.topk) == (RANK, K)
    assert h.extra.counts.shape == (R, R) and h.extra.send_slot.shape == (T, R)
    assert h.send_row.shape == (T, R) and h.src_rank.shape == (C,)
    assert (h.num_experts, h.num_ranks, h.capacity, h.axis_name) == (E, R, C, "ep")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_grad_lowers_to_internode_gather_and_combine(internode_forced, dtype):
    C = 24
    x, idx, w = _inputs(1, dtype)
    y = jnp.ones((R * C, H), dtype)

    def f(x, idx, w, y):
        def loss(x, w, y):
            rx, ri, rw, h = jax_ep.dispatch(x, idx, w, num_experts=E, axis_name="ep",
                                            capacity=C)
            out = jax_ep.combine(rx * rw[:, :1].astype(rx.dtype) + y, h)
            return jnp.sum(out.astype(jnp.float32) ** 2)
        return jax.grad(loss, argnums=(0, 1, 2))(x, w, y)

    hlo = _lower_cuda(f, x, idx, w, y, n_out=3)
    assert len(_calls(hlo, "jax_ep_internode_dispatch")) == 1
    gathers = _calls(hlo, "jax_ep_internode_gather")
    assert len(gathers) == 1
    g = gathers[0]
    assert {k: g[k] for k in ("num_ranks", "rank", "capacity", "topk", "num_ports",
                              "qps_per_port", "chunk_bytes")} == dict(
        num_ranks=R, rank=RANK, capacity=C, topk=K, num_ports=2, qps_per_port=4,
        chunk_bytes=65536)
    assert _tensor_shapes(g["_operands"]) == [(T, H), (R, R), (T, R)]
    assert _tensor_shapes(g["_results"]) == [(C, H)]
    # forward combine + dispatch's transpose for x and for the weights
    assert len(_calls(hlo, "jax_ep_internode_combine")) == 3
    for name in ("jax_ep_dispatch", "jax_ep_combine", "jax_ep_gather"):
        assert f"@{name}(" not in hlo


def test_transport_attributes_follow_the_bootstrapped_config(monkeypatch):
    cfg = TransportConfig(num_ports=2, qps_per_port=4, chunk_bytes=65536).resolve(
        {"JAX_EP_QPS_PER_PORT": "3", "JAX_EP_CHUNK_BYTES": "4096", "JAX_EP_NUM_PORTS": "1"})
    _fake_state(monkeypatch, config=cfg)
    monkeypatch.setattr(ops, "resolve_backend", lambda backend: "internode")

    def f(x, idx, w):
        rx, _, _, h = jax_ep.dispatch(x, idx, w, num_experts=E, axis_name="ep")
        return jax_ep.combine(rx, h)

    hlo = _lower_cuda(f, *_inputs())
    for target in ("jax_ep_internode_dispatch", "jax_ep_internode_combine"):
        (c,) = _calls(hlo, target)
        assert (c["num_ports"], c["qps_per_port"], c["chunk_bytes"]) == (1, 3, 4096)


def test_vmap_over_internode_dispatch_lowers_sequentially(internode_forced):
    def f(x, idx, w):
        def one(x):
            rx, _, _, h = jax_ep.dispatch(x, idx, w, num_experts=E, axis_name="ep",
                                          capacity=8)
            return jax_ep.combine(rx, h)
        return jax.vmap(one)(jnp.stack([x, 2 * x]))

    hlo = _lower_cuda(f, *_inputs())
    # vmap_method="sequential": one call per batch element, in a loop
    (d,) = _calls(hlo, "jax_ep_internode_dispatch")
    assert _tensor_shapes(d["_results"])[0] == (8, H)
    assert "stablehlo.while" in hlo


# ----------------------------------------------------------------------------- handle

def _kernel_handle(idx_r, rank_count):
    """NumPy model of the kernels' handle for per-rank routing idx_r[R, T, K]: counts[s, d]
    (rows s sends d) and send_slot_s[t, d] (t's position among s's rows for d, or -1)."""
    el = E // rank_count
    owner = np.where(idx_r >= 0, idx_r // el, -1)
    in_rank = (owner[..., None] == np.arange(rank_count)).any(axis=2)  # [s, t, d]
    counts = in_rank.sum(axis=1).astype(np.int32)
    slots = np.where(in_rank, np.cumsum(in_rank, axis=1) - 1, -1).astype(np.int32)
    return counts, slots


@pytest.mark.parametrize("C", [1, 7, 20, R * T])
def test_send_row_from_kernel_handle_matches_the_contract(C):
    x, idx, w = _inputs(2)
    xr = np.asarray(x).reshape(R, T, H)
    idx_r = np.asarray(idx).reshape(R, T, K)
    wr = np.asarray(w).reshape(R, T, K)
    want = np_model(xr, idx_r, wr, np.zeros((R, C, H), np.float32), E, C)["send_row"]
    counts, slots = _kernel_handle(idx_r, R)
    for s in range(R):
        got = np.asarray(internode.send_row_from(jnp.asarray(counts), jnp.asarray(slots[s]),
                                                 s, C))
        np.testing.assert_array_equal(got, want[s], err_msg=f"rank {s}, C={C}")


def test_handle_extra_defaults_to_none():
    # The contract fields stay what they were: a handle without extra is the default.
    h = DispatchHandle(*(jnp.zeros(()),) * 6, E, R, 4, "ep")
    assert h.extra is None
    assert len(jax.tree.leaves(h)) == 6


def test_internode_combine_rejects_a_handle_from_another_backend(monkeypatch):
    _fake_state(monkeypatch)

    def f(x, idx, w):
        rx, _, _, h = jax_ep.dispatch(x, idx, w, num_experts=E, axis_name="ep",
                                      backend="reference")
        assert h.extra is None
        return internode.combine(rx, h, Cfg.for_handle(h, "internode"))

    with pytest.raises(ValueError, match=r"internode combine needs the handle of an "
                                         r"internode dispatch"):
        _lower_cuda(f, *_inputs())


# ----------------------------------------------------------------------------- rank

def test_ep_rank_is_the_pe_index(monkeypatch):
    _fake_state(monkeypatch, rank=5, world=8)
    assert internode.ep_rank("ep", 8) == 5


def test_ep_rank_without_nvshmem_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(nvshmem_bootstrap, "_state", None)
    with pytest.raises(nvshmem_bootstrap.NvshmemBootstrapError,
                       match=r"nvshmem_bootstrap\.initialize.*nccl_bootstrap\.initialize"):
        internode.ep_rank("ep", 8)


def _fake_nccl_state(monkeypatch, ranks, world=R):
    from jax_ep import nccl_bootstrap
    monkeypatch.setattr(nvshmem_bootstrap, "_state", None)
    st = nccl_bootstrap.NcclState(
        ordinals=tuple(range(len(ranks))), ranks=tuple(ranks), world=world,
        heap_bytes=1 << 30, num_contexts=2, gpus_per_node=8,
        config=TransportConfig(num_ports=2, qps_per_port=1, chunk_bytes=4096))
    monkeypatch.setattr(nccl_bootstrap, "_state", st)
    return st


def test_ep_rank_over_nccl_one_gpu_per_process(monkeypatch):
    """NCCL GIN started with one GPU in this process: its rank is the EP rank, its
    TransportConfig the kernels' attributes, and the ops lower to the internode calls."""
    _fake_nccl_state(monkeypatch, ranks=[RANK])
    assert internode.ep_rank("ep", R) == RANK
    assert internode.transport_attrs() == dict(num_ports=2, qps_per_port=1, chunk_bytes=4096)
    monkeypatch.setattr(ops, "resolve_backend", lambda backend: "internode")

    def f(x, idx, w):
        rx, ri, rw, h = jax_ep.dispatch(x, idx, w, num_experts=E, axis_name="ep")
        return jax_ep.combine(rx, h)

    (d,) = _calls(_lower_cuda(f, *_inputs()), "jax_ep_internode_dispatch")
    assert (d["rank"], d["num_ports"], d["chunk_bytes"]) == (RANK, 2, 4096)


def test_internode_over_nccl_with_several_gpus_per_process_is_not_implemented(monkeypatch):
    _fake_nccl_state(monkeypatch, ranks=[4, 5, 6, 7])
    with pytest.raises(NotImplementedError, match="drives 4 GPUs.*one process per GPU"):
        internode.ep_rank("ep", R)


def test_backend_choice_counts_an_nccl_start(monkeypatch):
    _fake_nccl_state(monkeypatch, ranks=[RANK])
    monkeypatch.setattr(ops.jax, "process_count", lambda: R)
    assert ops._internode_ready("gpu") and not ops._internode_ready("cpu")


def test_ep_rank_needs_the_ep_group_to_be_every_pe(monkeypatch):
    _fake_state(monkeypatch, rank=1, world=16)
    with pytest.raises(internode.InternodeRankError,
                       match=r"every NVSHMEM PE \(16 processes.*'ep' has 8 ranks"):
        internode.ep_rank("ep", 8)


def test_ep_rank_checks_the_mesh_position(monkeypatch):
    _fake_state(monkeypatch, rank=2, world=8)
    monkeypatch.setattr(internode, "_mesh_position", lambda axis: 6)
    with pytest.raises(internode.InternodeRankError,
                       match=r"PE 2, but its device sits at index 6 on EP axis 'ep'"):
        internode.ep_rank("ep", 8)
    monkeypatch.setattr(internode, "_mesh_position", lambda axis: 2)
    assert internode.ep_rank("ep", 8) == 2


def test_ep_rank_error_surfaces_when_tracing_the_op(internode_forced, monkeypatch):
    _fake_state(monkeypatch, rank=0, world=4)

    def f(x, idx, w):
        return jax_ep.dispatch(x, idx, w, num_experts=E, axis_name="ep")[0]

    with pytest.raises(internode.InternodeRankError, match=r"4 processes"):
        _lower_cuda(f, *_inputs())


def _dev(p):
    return types.SimpleNamespace(process_index=p)


def test_position_in_mesh():
    # a (data=2, ep=4) mesh of 8 processes, one device each, in process order
    devs = np.array([[_dev(p) for p in range(4)], [_dev(p) for p in range(4, 8)]],
                    dtype=object)
    assert internode.position_in_mesh(devs, ("data", "ep"), ("ep",), 6) == 2
    assert internode.position_in_mesh(devs, ("data", "ep"), ("data", "ep"), 6) == 6
    assert internode.position_in_mesh(devs, ("data", "ep"), ("ep", "data"), 6) == 5
    # several devices of this process (a one-process CPU mesh), or none: unknown
    cpu = np.array([_dev(0)] * 4, dtype=object)
    assert internode.position_in_mesh(cpu, ("ep",), ("ep",), 0) is None
    assert internode.position_in_mesh(cpu, ("ep",), ("ep",), 1) is None


def test_mesh_position_with_a_mesh_in_context():
    mesh = ep_mesh(R)
    # one process, eight CPU devices: this process's position is not unique
    with jax.set_mesh(mesh):
        assert internode._mesh_position("ep") is None
    assert internode._mesh_position("ep") is None


# ----------------------------------------------------------------------------- backend

def _gpu_world(monkeypatch, processes, nvshmem):
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(jax, "process_count", lambda: processes)
    monkeypatch.setattr(_ext, "registered_platforms", lambda: frozenset({"cpu", "gpu"}))
    info = dict(_ext.build_info(), nvshmem=True)
    monkeypatch.setattr(_ext, "build_info", lambda: info)
    if nvshmem:
        _fake_state(monkeypatch, rank=0, world=processes)
    else:
        monkeypatch.setattr(nvshmem_bootstrap, "_state", None)


def test_auto_and_ffi_pick_internode_with_nvshmem_across_processes(monkeypatch):
    _gpu_world(monkeypatch, 2, nvshmem=True)
    assert ops.resolve_backend(None) == "internode"
    assert ops.resolve_backend("auto") == "internode"
    assert ops.resolve_backend("ffi") == "intranode"  # the deprecated name: never internode
    assert ops.resolve_backend("internode") == "internode"
    assert ops.resolve_backend("reference") == "reference"


def test_gpu_without_nvshmem_or_single_process_stays_intranode(monkeypatch):
    _gpu_world(monkeypatch, 2, nvshmem=False)
    assert ops.resolve_backend("auto") == "intranode"
    assert ops.resolve_backend("ffi") == "intranode"
    with pytest.raises(NotImplementedError, match=r"nvshmem_bootstrap\.initialize"):
        ops.resolve_backend("internode")
    _gpu_world(monkeypatch, 1, nvshmem=True)
    assert ops.resolve_backend("auto") == "intranode"
    assert ops.resolve_backend("ffi") == "intranode"


def test_cpu_backend_choice_is_unchanged(monkeypatch):
    assert ops.resolve_backend("auto") == "intranode"
    assert ops.resolve_backend("ffi") == "intranode"
    _fake_state(monkeypatch, rank=0, world=2)  # even with NVSHMEM state, CPU is CPU
    assert ops.resolve_backend("auto") == "intranode"
    with pytest.raises(NotImplementedError, match=r"backend='internode' needs GPUs"):
        ops.resolve_backend("internode")
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    assert ops.resolve_backend("auto") == "reference"


# ----------------------------------------------------------------------------- global view

def _global_step(backend, handles=None):
    """A training step through jax_ep.sharded (forward and backward) on an 8-rank mesh."""
    import jax_ep.sharded as sh

    def step(params, x, w, idx):
        def loss(params):
            x_in = jnp.tanh(x @ params[1])  # a layer before the MoE
            rx, ri, rw, h = sh.dispatch(x_in, idx, w, num_experts=E, mesh_axis="ep",
                                        backend=backend)
            if handles is not None:
                handles.append(h)
            y = jnp.einsum("ch,hd->cd", rx, params[0]) * jnp.sum(rw, 1, keepdims=True)
            return jnp.mean(sh.combine(y, h, backend=backend).astype(jnp.float32) ** 2)
        l, g = jax.value_and_grad(loss)(params)
        return l, params - 0.1 * g
    return step


def _step_args():
    x, idx, w = _inputs(4)
    params = jnp.asarray(np.random.default_rng(0).standard_normal((2, H, H)) * 0.1,
                         jnp.float32)
    return params, x, w, idx


def test_global_view_lowers_for_cuda_with_the_internode_handle(internode_forced):
    from jax_ep.sharded import ShardedDispatchHandle
    N = R * T
    handles = []
    with jax.set_mesh(ep_mesh(R)), config.override(collective_stream=False):
        hlo = jax.jit(_global_step("internode", handles)).trace(*_step_args()).lower(
            lowering_platforms=("cuda",)).as_text()
    (h,) = handles
    assert isinstance(h, ShardedDispatchHandle) and isinstance(h.extra, InternodeHandleParts)
    assert (h.extra.rank, h.extra.topk) == (RANK, K)
    assert h.extra.counts.shape == (R * R, R) and h.extra.send_slot.shape == (N, R)
    # XLA partitions at compile time: here the program holds the custom_partitioning
    # calls, whose results and operands carry the kernels' handle with Shardy factors.
    parts = _calls(hlo, "CustomSPMDPartitioning")
    assert len(parts) == 4  # dispatch, combine, dispatch's transpose (combine), gather
    d = next(c for c in parts if len(_tensor_shapes(c["_results"])) > 1)
    assert _tensor_shapes(d["_results"])[-2:] == [(R * R, R), (N, R)]
    for c in parts:
        if c is not d:
            assert _tensor_shapes(c["_operands"])[-2:] == [(R * R, R), (N, R)]
    assert "@jax_ep_dispatch" not in hlo and "@jax_ep_combine" not in hlo
    assert "all_gather" not in hlo


def test_global_view_partitions_into_internode_calls(internode_forced, tmp_path):
    """XLA runs custom_partitioning's partition callbacks when it compiles, and there is
    no CUDA compiler here: the host compile of the same step partitions and optimizes the
    program (the bodies lower the same for every platform), then stops at the internode
    targets, which have CUDA handlers only. Its dumped optimized HLO is checked."""
    N, C = R * T, R * T
    with jax.set_mesh(ep_mesh(R)):
        lowered = jax.jit(_global_step("internode")).trace(*_step_args()).lower()
        with pytest.raises(Exception, match=r"jax_ep_internode_\w+ on a platform Host"):
            lowered.compile({"xla_dump_to": str(tmp_path)})
    (path,) = tmp_path.glob("*jit_step*cpu_after_optimizations.txt")
    text = path.read_text()
    calls = {}
    for line in text.splitlines():
        m = re.search(r'custom_call_target="(jax_ep_\w+)"', line)
        if m:
            attrs = dict((k, int(v)) for k, v in re.findall(r"(\w+) = (-?\d+) : i64", line))
            calls.setdefault(m.group(1), []).append((line, attrs))
    assert sorted((k, len(v)) for k, v in calls.items()) == [
        ("jax_ep_internode_combine", 2), ("jax_ep_internode_dispatch", 1),
        ("jax_ep_internode_gather", 1)]
    transport = dict(num_ports=2, qps_per_port=4, chunk_bytes=65536)
    ((line, d),) = calls["jax_ep_internode_dispatch"]
    sites = [d.pop("call_site")] + [a.pop("call_site") for t in ("jax_ep_internode_combine",
                                                                 "jax_ep_internode_gather")
                                    for _, a in calls[t]]
    assert len(sites) == 4 and len(set(sites)) >= 3  # every call carries its call site
    assert d == dict(num_experts=E, num_ranks=R, rank=RANK, capacity=C, **transport)
    # per shard: counts[R, R] and send_slot[T, R] come out of the dispatch ...
    assert f"s32[{R},{R}]" in line.split("custom-call")[0]
    assert f"s32[{T},{R}]" in line.split("custom-call")[0]
    for target in ("jax_ep_internode_combine", "jax_ep_internode_gather"):
        for line, a in calls[target]:
            want = dict(num_ranks=R, rank=RANK, capacity=C, topk=K, **transport)
            if target == "jax_ep_internode_combine":  # combine's order: one node of R here
                want["gpus_per_node"] = R
            assert a == want
            # ... and go into every combine and gather (operands: rows, counts, send_slot)
            operands = re.search(r"operand_layout_constraints=\{(.*?)\}, api", line).group(1)
            assert f"s32[{R},{R}]" in operands and f"s32[{T},{R}]" in operands, line
    # No all-gather of a token tensor ([N, H]/[N, K] globally, or per-shard pieces).
    for line in text.splitlines():
        if re.search(r"\ball-gather(-start)?\(", line):
            assert not re.search(rf"\[({N}|{T}|{C}),\s*({H}|{K})\]", line), line


def test_global_view_combine_needs_the_internode_handle(monkeypatch):
    import jax_ep.sharded as sh
    _fake_state(monkeypatch)
    monkeypatch.setattr(ops, "resolve_backend",
                        lambda b: "internode" if b == "internode" else "reference")

    def f(x, idx, w):
        rx, _, _, h = sh.dispatch(x, idx, w, num_experts=E, mesh_axis="ep",
                                  backend="reference")
        assert h.extra is None
        return sh.combine(rx, h, backend="internode")

    with jax.set_mesh(ep_mesh(R)):
        with pytest.raises(ValueError, match=r"internode combine needs the handle of an "
                                             r"internode dispatch"):
            jax.jit(f).trace(*_inputs())


def test_global_view_rank_error_surfaces_when_tracing(internode_forced, monkeypatch):
    import jax_ep.sharded as sh
    _fake_state(monkeypatch, rank=0, world=4)

    def f(x, idx, w):
        return sh.dispatch(x, idx, w, num_experts=E, mesh_axis="ep")[0]

    with jax.set_mesh(ep_mesh(R)):
        with pytest.raises(internode.InternodeRankError, match=r"4 processes"):
            jax.jit(f).trace(*_inputs())


def test_global_view_resolves_backends_like_the_per_shard_ops(monkeypatch):
    from jax_ep import sharded
    mesh = ep_mesh(R)

    def resolved(b):
        with jax.set_mesh(mesh):
            return sharded._spec(R * T, E, "ep", None, b, None).backend

    _gpu_world(monkeypatch, 2, nvshmem=True)
    for b in (None, "auto", "internode"):
        assert resolved(b) == "internode"
    assert resolved("ffi") == "intranode"  # the deprecated name: never internode
    assert resolved("reference") == "reference"
    _gpu_world(monkeypatch, 2, nvshmem=False)
    assert resolved("auto") == "intranode" and resolved("ffi") == "intranode"


def test_global_view_cpu_handle_is_unchanged():
    import jax_ep.sharded as sh
    handles = []
    with jax.set_mesh(ep_mesh(R)):
        jax.jit(_global_step("ffi", handles)).trace(*_step_args())
    (h,) = handles
    assert h.extra is None
    assert len(jax.tree.leaves(h)) == 6


# --------------------------------------------- ordering, reports, errors, packaging

def test_internode_calls_carry_distinct_call_sites(internode_forced):
    def f(x, idx, w):
        rx, ri, rw, h = jax_ep.dispatch(x, idx, w, num_experts=E, axis_name="ep")
        a = jax_ep.combine(rx, h)
        return a + jax_ep.combine(rx * 3, h)

    hlo = _lower_cuda(f, *_inputs())
    sites = [c["call_site"] for t in ("jax_ep_internode_dispatch", "jax_ep_internode_combine")
             for c in _calls(hlo, t)]
    assert len(sites) == 3 and len(set(sites)) == 3  # XLA cannot merge any two


def test_transport_report_names_the_path(monkeypatch):
    rep = internode.transport_report(TransportConfig(num_ports=2, qps_per_port=3))
    assert rep["qp_path"] == "not started" and rep["qps_planned"] == 6
    assert [m["planned_port"] for m in rep["qp_map"]] == [0, 1, 0, 1, 0, 1]
    st = _fake_state(monkeypatch, config=TransportConfig(num_ports=1, qps_per_port=3))
    monkeypatch.setattr(nvshmem_bootstrap, "_state",
                        dataclasses.replace(st, qp_api=False))
    rep = internode.transport_report()
    assert rep["qp_path"] == "fallback" and rep["ports"] == 1
    assert any("one port" in n for n in rep["notes"])
    info = _ext.build_info()
    assert "nvshmem_qp_api" in info
    if info["nvshmem"]:
        assert rep["nvshmem_built"] and rep["headers_version"].startswith("3.")


def test_check_errors_is_quiet_without_an_error():
    internode.check_errors()  # nothing recorded in this process


def _extension_paths():
    """The main extension and, where built, the NVSHMEM module."""
    import importlib.util
    paths = [importlib.util.find_spec("jax_ep._jax_ep_ext").origin]
    spec = importlib.util.find_spec("jax_ep._jax_ep_nvshmem")
    return paths + ([spec.origin] if spec is not None else [])


def test_no_undefined_qp_api_symbols_and_nvshmem_hidden():
    """The extension must load with an NVSHMEM older than 3.8 (or none on the CPU path):
    no undefined nvshmemx_qp_* symbol (they are resolved with dlsym), and the static
    NVSHMEM device library's symbols are not exported."""
    import shutil
    import subprocess

    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("no nm")
    for so in _extension_paths():
        und = subprocess.run([nm, "-D", "--undefined-only", so], capture_output=True,
                             text=True, check=True).stdout
        bad = [l for l in und.splitlines() if "nvshmemx_qp_" in l]
        assert bad == [], (so, bad)
        defined = subprocess.run([nm, "-D", "--defined-only", so], capture_output=True,
                                 text=True, check=True).stdout
        leaked = [l for l in defined.splitlines() if "nvshmem" in l.lower()
                  and "PyInit__jax_ep_nvshmem" not in l]
        assert leaked == [], (so, leaked[:5])


def test_hot_path_has_no_host_sync_and_is_graph_safe():
    """Dispatch/Combine/Gather (the per-call host code) never wait for the device: errors
    go through the sticky mapped record, so XLA may capture the calls in CUDA graphs."""
    import pathlib

    src = (pathlib.Path(__file__).resolve().parents[2] / "kernels" / "internode" /
           "nvshmem_host.cu").read_text()
    for fn in ("std::string Dispatch(", "std::string Combine(", "std::string Gather(",
               "std::string BeginHandleCall(", "std::string MakeGeometry("):
        body = src[src.index(fn):]
        body = body[:body.index("\n}\n")]
        for sync in ("Synchronize", "cudaMemcpy(", "cudaMemcpyFromSymbol(", "cudaMalloc("):
            assert sync not in body, (fn, sync)
    for t in ("jax_ep_internode_dispatch", "jax_ep_internode_combine", "jax_ep_internode_gather"):
        assert _ext.ffi_signature(t, "CUDA").graph_safe
