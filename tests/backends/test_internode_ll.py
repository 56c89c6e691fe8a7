"""The low-latency mode (jax_ep.low_latency) on the internode (NVSHMEM) backend, without
a GPU: programs are lowered for CUDA and their HLO checked for the two custom calls per op
(send and receive halves) with their attributes; argument errors; the area's size against
hand-computed values; the bootstrap allocating the area. No kernel runs here (the
kernels run on the emulated GPU in tests/emu/test_internode_ll_emu.py)."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_ep import config, low_latency as ll, nvshmem_bootstrap, ops

from jax_ep._src import ext as _ext
from jax_ep._src.backends import internode
from jax_ep.network.transport import TransportConfig

from conftest import ep_mesh
from test_internode import _calls, _tensor_shapes
from test_ordering import _root

R, M, T, H, K, E = 8, 6, 5, 16, 3, 16
EL = E // R
RANK = 5
LIMITS = dict(max_tokens_per_rank=M, hidden=H, topk=K, num_experts=E, row_bytes=4 * H,
              area_bytes=0)


def _state(monkeypatch, low_latency=LIMITS, rank=RANK, world=R):
    st = nvshmem_bootstrap.BootstrapState(
        rank=rank, world=world, heap_bytes=1 << 30,
        config=TransportConfig(num_ports=2, qps_per_port=2, chunk_bytes=65536), env={},
        low_latency=None if low_latency is None else dict(low_latency))
    monkeypatch.setattr(nvshmem_bootstrap, "_state", st)
    return st


@pytest.fixture
def forced(monkeypatch):
    """NVSHMEM 'running' as PE RANK of R with the low-latency area, every op on the
    internode backend."""
    _state(monkeypatch)
    monkeypatch.setattr(ops, "resolve_backend", lambda backend: "internode")
    monkeypatch.setattr(ll, "resolve_backend", lambda backend: "internode")
    return monkeypatch


def _inputs(seed=0, dtype=jnp.float32, t=T):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((R * t, H)), dtype)
    idx = np.stack([rng.choice(E, K, replace=False) for _ in range(R * t)]).astype(np.int32)
    idx[::4, 1] = -1
    w = jnp.asarray(rng.random((R * t, K)), jnp.float32)
    return x, jnp.asarray(idx), w


def _lower(f, *args, n_out=1):
    mesh = ep_mesh(R)
    spec = jax.sharding.PartitionSpec("ep")
    out_specs = spec if n_out == 1 else (spec,) * n_out
    g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=spec, out_specs=out_specs))
    with config.override(collective_stream=False):  # the calls' own structure, no regions
        return g.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


BASE = dict(num_experts=E, num_ranks=R, rank=RANK, max_tokens=M, num_ports=2, qps_per_port=2)


def _attrs(c):
    return {k: c[k] for k in BASE}


def test_dispatch_and_combine_lower_to_two_internode_calls_each(forced):
    def f(x, idx, w):
        recv_x, count, h = ll.dispatch(x, idx, num_experts=E, axis_name="ep",
                                       max_tokens_per_rank=M)
        return ll.combine(recv_x * 2, idx, w, h)

    hlo = _lower(f, *_inputs())
    for name in ("dispatch_send", "dispatch_recv", "combine_send", "combine_recv"):
        assert f"@jax_ep_ll_{name}(" not in hlo  # not the CPU/intranode targets
    (ds,) = _calls(hlo, "jax_ep_internode_ll_dispatch_send")
    (dr,) = _calls(hlo, "jax_ep_internode_ll_dispatch_recv")
    (cs,) = _calls(hlo, "jax_ep_internode_ll_combine_send")
    (cr,) = _calls(hlo, "jax_ep_internode_ll_combine_recv")
    for c in (ds, dr, cs, cr):
        assert _attrs(c) == BASE
    sites = [c["call_site"] for c in (ds, dr, cs, cr)]
    assert len(set(sites)) == 4
    # staged to M rows (padded), the token, the receive blocks, the combine rows
    assert _tensor_shapes(ds["_operands"]) == [(M, H), (M, K)]
    assert _tensor_shapes(ds["_results"]) == [(2,)]
    assert _tensor_shapes(dr["_operands"]) == [(2,)]
    assert _tensor_shapes(dr["_results"]) == [(EL, R * M, H), (EL,), (EL, R * M), (EL, R * M),
                                              (EL, R), (EL, R)]
    assert cs["rows_per_dest"] == M * min(K, EL)
    assert _tensor_shapes(cs["_operands"]) == [(EL, R * M, H), (EL, R), (EL, R)]
    assert _tensor_shapes(cr["_operands"]) == [(2,), (M, K), (M, K)]
    assert _tensor_shapes(cr["_results"]) == [(M, H)]
    assert "tensor<2xi32>" in dr["_operands"] and "f32" in dr["_results"]


def test_receive_half_takes_the_send_token_and_compute_fits_between(forced):
    def f(x, idx, w):
        st = ll.dispatch_send(x, idx, num_experts=E, axis_name="ep", max_tokens_per_rank=M)
        other = jnp.tanh(x @ jnp.ones((H, H), x.dtype))  # independent of the send
        recv_x, _, h = ll.dispatch_recv(st)
        return recv_x.sum(axis=(0, 1))[None] + other.sum()

    hlo = _lower(f, *_inputs())
    lines = hlo.splitlines()
    send = next(i for i, l in enumerate(lines) if "@jax_ep_internode_ll_dispatch_send(" in l)
    recv = next(i for i, l in enumerate(lines) if "@jax_ep_internode_ll_dispatch_recv(" in l)
    result = lines[send].split("=")[0].strip().split(":")[0]
    # The token may pass through the optimization barriers that order EP calls.
    tok = lines[recv].split("@jax_ep_internode_ll_dispatch_recv(")[1].split(")")[0]
    assert _root(hlo, tok.split(",")[0].strip()).split("#")[0] == result
    dot = next(i for i, l in enumerate(lines) if "stablehlo.dot_general" in l)
    assert result not in lines[dot]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_grad_lowers_to_internode_ll_calls_only(forced, dtype):
    x, idx, w = _inputs(1, dtype)

    def f(x, idx, w):
        def loss(x, w):
            recv_x, _, h = ll.dispatch(x, idx, num_experts=E, axis_name="ep",
                                       max_tokens_per_rank=M)
            out = ll.combine(recv_x * 3, idx, w, h)
            return jnp.sum(out.astype(jnp.float32) ** 2)
        return jax.grad(loss, argnums=(0, 1))(x, w)

    hlo = _lower(f, x, idx, w, n_out=2)
    assert "@jax_ep_ll_" not in hlo
    sends = _calls(hlo, "jax_ep_internode_ll_dispatch_send")
    # forward dispatch; the combine's transpose dispatches M * K one-slot tokens
    assert sorted(_tensor_shapes(c["_operands"])[0] for c in sends) == [(M, H), (M * K, H)]
    assert len(_calls(hlo, "jax_ep_internode_ll_dispatch_recv")) == 2
    # forward combine, dispatch's transpose, and the weights' row gather
    assert len(_calls(hlo, "jax_ep_internode_ll_combine_send")) == 3
    assert len(_calls(hlo, "jax_ep_internode_ll_combine_recv")) == 3


def test_fp8_dispatch_is_one_send_and_one_receive(forced):
    """The FP8 dispatch casts in the send kernel: one send of x's rows (round_scale an
    attribute) and one receive returning the values and the scales."""
    x, idx, _ = _inputs(2)
    x = jnp.concatenate([x] * 8, axis=1)  # H = 128

    def f(x, idx):
        (q, s), _, _ = ll.dispatch(x, idx, num_experts=E, axis_name="ep",
                                   max_tokens_per_rank=M, fp8=True)
        return (q.astype(jnp.float32).sum() + s.sum())[None]

    # An FP8 message of H = 128: 128 values and one scale, padded to 144 bytes.
    forced.setattr(nvshmem_bootstrap, "_state", dataclasses.replace(
        nvshmem_bootstrap.state(), low_latency=dict(LIMITS, hidden=128, row_bytes=144)))
    hlo = _lower(f, x, idx)
    assert not _calls(hlo, "jax_ep_internode_ll_dispatch_send")
    assert not _calls(hlo, "jax_ep_internode_ll_dispatch_recv")
    sends = _calls(hlo, "jax_ep_internode_ll_dispatch_send_fp8")
    assert len(sends) == 1 and sends[0]["round_scale"] == 0
    assert _tensor_shapes(sends[0]["_operands"])[0] == (M, 128)
    recvs = _calls(hlo, "jax_ep_internode_ll_dispatch_recv_fp8")
    assert len(recvs) == 1
    assert "f8E4M3FN" in recvs[0]["_results"]
    assert _tensor_shapes(recvs[0]["_results"])[:2] == [(EL, R * M, 128), (EL, R * M, 1)]


# ----------------------------------------------------------------------------- errors

def test_without_the_area_the_error_names_low_latency(monkeypatch):
    _state(monkeypatch, low_latency=None)
    monkeypatch.setattr(ll, "resolve_backend", lambda backend: "internode")
    with pytest.raises(nvshmem_bootstrap.NvshmemBootstrapError, match="low_latency=dict"):
        _lower(lambda x, idx: ll.dispatch(x, idx, num_experts=E, axis_name="ep",
                                          max_tokens_per_rank=M)[0], *_inputs()[:2])


@pytest.mark.parametrize("kw,match", [
    (dict(max_tokens_per_rank=M + 2), "max_tokens_per_rank=8 is more than"),
    (dict(num_experts=2 * E), "num_experts=32"),
])
def test_calls_beyond_the_area_are_errors(forced, kw, match):
    args = dict(num_experts=E, axis_name="ep", max_tokens_per_rank=M)
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        _lower(lambda x, idx: ll.dispatch(x, idx, **args)[0], *_inputs()[:2])


def test_wider_rows_than_the_area_are_errors(forced):
    forced.setattr(nvshmem_bootstrap, "_state", dataclasses.replace(
        nvshmem_bootstrap.state(), low_latency=dict(LIMITS, row_bytes=2 * H)))
    with pytest.raises(ValueError, match="do not fit"):
        _lower(lambda x, idx: ll.dispatch(x, idx, num_experts=E, axis_name="ep",
                                          max_tokens_per_rank=M)[0], *_inputs()[:2])


def test_ep_axis_must_span_every_pe(monkeypatch):
    _state(monkeypatch, world=2 * R)
    monkeypatch.setattr(ll, "resolve_backend", lambda backend: "internode")
    with pytest.raises(internode.InternodeRankError, match="every NVSHMEM PE"):
        _lower(lambda x, idx: ll.dispatch(x, idx, num_experts=E, axis_name="ep",
                                          max_tokens_per_rank=M)[0], *_inputs()[:2])


def test_contract_checks_still_come_first(forced):
    x, idx, _ = _inputs(t=M + 1)
    with pytest.raises(ValueError, match="T > M"):
        _lower(lambda x, idx: ll.dispatch(x, idx, num_experts=E, axis_name="ep",
                                          max_tokens_per_rank=M)[0], x, idx)


# ----------------------------------------------------------------------------- the area

def test_area_hand_checked():
    # R = 2, M = 4, H = 16 bf16 (32-byte rows), K = 2, E = 4 (2 local experts): dispatch
    # rows 32 + 16, combine rows 32, headers 32 + 4 x 2 -> 48, 4 x 2 combine rows per
    # destination; every region rounds up to 256 bytes
    small = [4 * 2 * 2 * 8, 4 * 2 * 8, 4 * 2 * 8,  # data, header and credit signals
             4 * 2 * 48, 4 * 2 * 48, 2 * 16,       # headers, staged headers, bad flags
             4 * 2 * 4, 4 * 4, 4 * 4, 4 * 4]       # positions, counts, offsets, done
    rows = [2 * 4 * 2 * 48, 2 * 2 * 2 * 4 * 48,    # staged and received dispatch rows
            2 * 2 * 8 * 32, 2 * 2 * 8 * 32]        # combine staging and received rows
    want = sum(-(-n // 256) * 256 for n in small + rows)
    assert want == 7424
    assert nvshmem_bootstrap.ll_area_bytes_for(num_ranks=2, max_tokens_per_rank=4, hidden=16,
                                               topk=2, num_experts=4) == want
    lay = _ext.require_ext().ll_area_layout(2, 4, 32, 2, 4)
    assert (lay["rows_per_dest"], lay["drecv"], lay["crecv"]) == (8, 3840, 6400)
    with pytest.raises(ValueError, match="multiple"):
        nvshmem_bootstrap.ll_area_bytes_for(num_ranks=2, max_tokens_per_rank=4, hidden=16,
                                            topk=2, num_experts=5)


def test_area_does_not_depend_on_tokens_and_has_the_expected_big_terms():
    a = nvshmem_bootstrap.ll_area_bytes_for(num_ranks=32, max_tokens_per_rank=128, hidden=7168,
                                            topk=8, num_experts=256)
    row = 7168 * 2
    recv = 2 * 256 * 128 * (row + 16)               # two buffers of E * M dispatch rows
    back = 4 * 32 * 128 * min(8, 8) * row           # 2 x (stage + R * M * min(K, E_local))
    stage = 2 * 128 * 8 * (row + 16)                # 2 x M * K staged tokens
    assert recv + back + stage < a < recv + back + stage + 2**20


class _FakeRuntime:
    def __init__(self):
        self.calls = []

    def unique_id(self):
        return bytes(128)

    def init(self, *a):
        self.calls.append(("init",) + a)

    def ll_init(self, *a):
        self.calls.append(("ll_init",) + a)

    def qp_api_available(self):
        return True

    def init_status(self):
        return 0

    def finalize(self):
        self.calls.append(("finalize",))


class _FakeClient:
    def key_value_set_bytes(self, k, v):
        pass

    def wait_at_barrier(self, k, t):
        pass


def test_bootstrap_allocates_the_area_and_sizes_the_symmetric_heap(monkeypatch):
    from jax_ep import nvshmem_bootstrap as rt
    monkeypatch.setattr(rt, "_state", None)
    monkeypatch.setattr(rt, "_check_one_process_per_gpu", lambda: None)
    fake = _FakeRuntime()
    env = {}
    lim = dict(max_tokens_per_rank=64, hidden=512, topk=4, num_experts=16)
    st = rt.initialize(heap_bytes=64 << 20, num_ranks=1, runtime=fake, client=_FakeClient(),
                       environ=env, low_latency=lim)
    area = rt.ll_area_bytes_for(num_ranks=1, **lim)
    assert [c[0] for c in fake.calls] == ["init", "ll_init"]
    assert fake.calls[0][4] == 64 << 20            # the heap halves keep their size
    assert fake.calls[1][1:] == (1, 64, 512 * 2, 4, 16)
    assert int(env["NVSHMEM_SYMMETRIC_SIZE"]) == (64 << 20) + -(-area // (2 << 20)) * (2 << 20)
    assert st.low_latency["area_bytes"] == area and st.low_latency["row_bytes"] == 1024
    with pytest.raises(rt.NvshmemBootstrapError, match="low-latency area"):
        rt.initialize(heap_bytes=1 << 20, num_ranks=1, runtime=fake, client=_FakeClient(),
                      environ=env, low_latency=dict(lim, max_tokens_per_rank=65))
    with pytest.raises(ValueError, match="missing"):
        rt._ll_limits(dict(hidden=1), 1)
    monkeypatch.setattr(rt, "_state", None)


def test_global_view_partitions_into_internode_ll_calls(forced, tmp_path):
    """jax_ep._src.sharded_low_latency under jit with a mesh: XLA runs the partitioning when it
    compiles and there is no CUDA compiler here, so the host compile partitions the step
    and stops at the internode targets (CUDA handlers only); its dumped HLO is checked."""
    import re

    import jax_ep._src.sharded_low_latency as sll

    def step(x, idx, w):
        recv_x, count, h = sll.dispatch(x, idx, num_experts=E, mesh_axis="ep",
                                        max_tokens_per_rank=M, backend="internode")
        return sll.combine(recv_x * 2, idx, w, h, backend="internode")

    with jax.set_mesh(ep_mesh(R)):
        lowered = jax.jit(step).trace(*_inputs()).lower()
        with pytest.raises(Exception, match=r"jax_ep_internode_ll_\w+ on a platform Host"):
            lowered.compile({"xla_dump_to": str(tmp_path)})
    (path,) = tmp_path.glob("*jit_step*cpu_after_optimizations.txt")
    calls = {}
    for line in path.read_text().splitlines():
        m = re.search(r'custom_call_target="(jax_ep_\w+)"', line)
        if m:
            attrs = dict((k, int(v)) for k, v in re.findall(r"(\w+) = (-?\d+) : i64", line))
            calls.setdefault(m.group(1), []).append(attrs)
    assert sorted((k, len(v)) for k, v in calls.items()) == [
        ("jax_ep_internode_ll_combine_recv", 1), ("jax_ep_internode_ll_combine_send", 1),
        ("jax_ep_internode_ll_dispatch_recv", 1), ("jax_ep_internode_ll_dispatch_send", 1)]
    for (a,) in calls.values():
        assert {k: a[k] for k in BASE} == BASE


def test_bootstrap_for_the_low_latency_mode_only(monkeypatch):
    from jax_ep import nvshmem_bootstrap as rt
    monkeypatch.setattr(rt, "_state", None)
    monkeypatch.setattr(rt, "_check_one_process_per_gpu", lambda: None)
    fake = _FakeRuntime()
    lim = dict(max_tokens_per_rank=8, hidden=64, topk=2, num_experts=4, dtype="float32")
    st = rt.initialize(num_ranks=2, runtime=fake, client=_FakeClient(), environ={},
                       low_latency=lim)
    assert st.heap_bytes == rt.heap_bytes_for(num_ranks=2, max_tokens=1, hidden=1, topk=1)
    assert fake.calls[1] == ("ll_init", 1, 8, 256, 2, 4)
    monkeypatch.setattr(rt, "_state", None)
    with pytest.raises(ValueError, match="give heap_bytes"):
        rt.initialize(num_ranks=2, runtime=fake, client=_FakeClient(), environ={})


def test_hot_path_has_no_host_sync_or_allocation():
    """The per-call host code of the six targets (the FP8 dispatch's two too) never
    waits for the device nor allocates (the area is allocated once at start), and each
    handler is declared command-buffer compatible."""
    import pathlib
    root = pathlib.Path(__file__).resolve().parents[2]
    src = (root / "kernels" / "internode" / "low_latency_host.cu").read_text()
    for fn in ("std::string DispatchSend(", "std::string DispatchRecv(",
               "std::string CombineSend(", "std::string CombineRecv(", "std::string MakeG("):
        body = src[src.index(fn):]
        body = body[:body.index("\n}\n")]
        for bad in ("Synchronize", "cudaMemcpy", "cudaMalloc", "nvshmem_malloc",
                    "nvshmem_barrier"):
            assert bad not in body, (fn, bad)
    sigs = _ext.ffi_signatures()["CUDA"]  # the handlers' table rows (op_tables.h)
    for name in ("dispatch_send", "dispatch_recv", "combine_send", "combine_recv",
                 "dispatch_send_fp8", "dispatch_recv_fp8"):
        assert sigs[f"jax_ep_internode_ll_{name}"].graph_safe, name


def test_area_is_sized_for_every_process_as_it_is_allocated(monkeypatch):
    """ll_init allocates the area for the NVSHMEM world (every process); the symmetric
    size must count that area, not one sized for a num_ranks given for the heap halves."""
    from jax_ep import nvshmem_bootstrap as rt
    monkeypatch.setattr(rt, "_state", None)
    monkeypatch.setattr(rt, "_check_one_process_per_gpu", lambda: None)
    fake = _FakeRuntime()
    lim = dict(max_tokens_per_rank=8, hidden=64, topk=2, num_experts=4)
    st = rt.initialize(heap_bytes=8 << 20, num_ranks=4, runtime=fake, client=_FakeClient(),
                       environ={}, low_latency=lim)
    world = jax.process_count()
    assert fake.calls[1][1] == world
    assert st.low_latency["area_bytes"] == rt.ll_area_bytes_for(num_ranks=world, **lim)
    assert st.low_latency["area_bytes"] != rt.ll_area_bytes_for(num_ranks=4, **lim)
    monkeypatch.setattr(rt, "_state", None)
