"""The low-latency mode's CUDA real-rank path of the ffi backend, checked without a GPU:
the program lowered for the cuda platform (the custom calls the CUDA handlers decode,
their operands and attributes, compute between the halves), the low-latency area's
sizes in jax_ep.cuda.setup / buffer_bytes, argument errors, and source-level facts of
the handlers (command-buffer trait, no host sync). Nothing here runs a GPU kernel; the
protocol's kernels run on the emulated GPU (tests/emu/test_low_latency_emu.py)."""
from __future__ import annotations

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from conftest import ep_mesh
from test_ordering import _root
from jax_ep._src import ext as _ext
from jax_ep import config
from jax_ep import cuda as jcuda
from jax_ep import low_latency as ll
from jax_ep._src.common import Cfg
from jax_ep._src.backends import ffi as ffi_backend

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
R, T, M, H, K, E = 4, 6, 8, 16, 3, 8
NAMES = ("dispatch_send", "dispatch_recv", "combine_send", "combine_recv")
needs_bindings = pytest.mark.skipif(
    _ext.ext is None or not hasattr(_ext.ext, "cuda_ll_layout"),
    reason="no CUDA host functions in this build (nvcc missing)")


def _read(*parts):
    with open(os.path.join(ROOT, *parts)) as f:
        return f.read()


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((R * T, H)).astype(np.float32)
    idx = np.stack([rng.permutation(E)[:K] for _ in range(R * T)]).astype(np.int32)
    w = rng.random((R * T, K)).astype(np.float32)
    return x, idx, w


def _lower_cuda(f, *args):
    g = jax.jit(jax.shard_map(f, mesh=ep_mesh(R), in_specs=P("ep"), out_specs=P("ep")))
    with config.override(collective_stream=False):  # the calls' own structure, no regions
        return g.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _calls(text):
    """[(target, line index, result name, operand names, attrs dict)] of the jax_ep_ll_*
    custom calls in a lowered module."""
    out = []
    for i, line in enumerate(text.splitlines()):
        m = re.search(r"(%[\w#:]+) = stablehlo\.custom_call @(jax_ep_ll_\w+)\(([^)]*)\)", line)
        if not m:
            continue
        attrs = dict(re.findall(r"(\w+) = (-?\d+) : i64",
                                line.split("mhlo.backend_config = {", 1)[1].split("}")[0]))
        result = m.group(1).split(":")[0]
        operands = [o.strip() for o in m.group(3).split(",") if o.strip()]
        out.append((m.group(2), i, result, operands, attrs, line))
    return out


def _handler_bindings():
    """{target: (number of operands, number of results, [attr names], graph safe)} of the
    real-rank CUDA handlers, from the signature table their bindings are made from
    (xla_ffi/common/op_tables.h)."""
    out = {}
    for target, sig in _ext.ffi_signatures()["CUDA"].items():
        if target.startswith("jax_ep_ll_") and "harness" not in target:
            out[target] = (len(sig.operands), len(sig.results), [a[0] for a in sig.attrs],
                           sig.graph_safe)
    return out


# ----------------------------------------------------------------------------- lowering

def _split_program(x, idx, w, a):
    kw = dict(num_experts=E, axis_name="ep", max_tokens_per_rank=M, backend="ffi")
    st = ll.dispatch_send(x, idx, **kw)
    a = jnp.tanh(a @ a)  # independent of the dispatch
    recv, _, h = ll.dispatch_recv(st)
    cst = ll.combine_send(recv * 2.0, idx, w, h, backend="ffi")
    b = jnp.sin(a @ a)  # independent of the combine
    return ll.combine_recv(cst), b


def test_cuda_lowering_has_both_halves_with_compute_between():
    x, idx, w = _inputs()
    text = _lower_cuda(_split_program, x, idx, w, np.ones((R * 32, 32), np.float32))
    calls = _calls(text)
    assert [c[0] for c in calls] == [f"jax_ep_ll_{n}" for n in NAMES]
    lines = text.splitlines()
    pos = {c[0][len("jax_ep_ll_"):]: c for c in calls}
    dots = [i for i, line in enumerate(lines) if "stablehlo.dot_general" in line]
    assert len(dots) == 2
    for (send, recv), dot in zip((("dispatch_send", "dispatch_recv"),
                                  ("combine_send", "combine_recv")), dots):
        s, r = pos[send], pos[recv]
        assert s[1] < dot < r[1], (send, dot)
        # The compute reads nothing the send produced, so it may run while rows fly ...
        assert f"{s[2]}#" not in lines[dot]
        # ... and the receive half takes the send half's results (the epoch travels in
        # them on CUDA).
        # (Through the barriers that order EP calls: output i of one is its input i.)
        roots = [_root(text, o) for o in r[3]]
        assert f"{s[2]}#0" in roots and f"{s[2]}#1" in roots
    # Every call carries its own call site (XLA cannot merge two of them).
    sites = [int(c[4]["call_site"]) for c in calls]
    assert len(set(sites)) == len(sites)


def test_cuda_lowering_matches_the_cuda_handlers_bindings():
    """What the lowered calls pass is what the real-rank CUDA handlers decode: operand
    and result counts and the int64 attributes, for each of the four targets and the
    FP8 dispatch's two."""
    x, idx, w = _inputs(1)
    text = _lower_cuda(_split_program, x, idx, w, np.ones((R * 32, 32), np.float32))
    binding = _handler_bindings()
    assert set(binding) == {f"jax_ep_ll_{n}" for n in NAMES} | {
        "jax_ep_ll_dispatch_send_fp8", "jax_ep_ll_dispatch_recv_fp8"}

    def fp8(x, idx):
        st = ll.dispatch_send(x, idx, num_experts=E, axis_name="ep", max_tokens_per_rank=M,
                              fp8=True, round_scale=True, backend="ffi")
        (q, s), _, _ = ll.dispatch_recv(st)
        return q.astype(jnp.float32)[None], s[None]

    fp8_calls = _calls(_lower_cuda(fp8, np.tile(x, (1, 8)), idx))
    assert [c[0] for c in fp8_calls] == ["jax_ep_ll_dispatch_send_fp8",
                                         "jax_ep_ll_dispatch_recv_fp8"]
    assert int(fp8_calls[0][4]["round_scale"]) == 1
    for target, _, result, operands, attrs, line in _calls(text) + fp8_calls:
        n_args, n_rets, names, cmd_buffer = binding[target]
        assert len(operands) == n_args, (target, operands)
        n_results = int(re.match(r"%\w+:(\d+)", line.strip()).group(1)) \
            if re.match(r"%\w+:\d+ =", line.strip()) else 1
        assert n_results == n_rets, (target, line)
        assert sorted(attrs) == sorted(names), (target, attrs, names)
        assert "mhlo.backend_config = {" in line  # typed FFI attributes, as the handlers'
        assert "api_version" not in line or "api_version = 4" in line
        assert cmd_buffer, f"{target} is not registered command-buffer compatible"
    assert int(_calls(text)[0][4]["num_ranks"]) == R
    assert int(_calls(text)[0][4]["max_tokens"]) == M


def test_fused_ops_and_gradients_lower_for_cuda_in_pairs():
    x, idx, w = _inputs(2)
    kw = dict(num_experts=E, axis_name="ep", max_tokens_per_rank=M, backend="ffi")

    def f(x, idx, w):
        def loss(x, w):
            recv, _, h = ll.dispatch(x, idx, **kw)
            return jnp.sum(ll.combine(jnp.tanh(recv), idx, w, h, backend="ffi") ** 2)

        return jax.grad(loss, argnums=(0, 1))(x, w)

    text = _lower_cuda(f, x, idx, w)
    names = [c[0] for c in _calls(text)]
    for op in ("dispatch", "combine"):
        assert names.count(f"jax_ep_ll_{op}_send") == names.count(f"jax_ep_ll_{op}_recv")
    # forward: 1 + 1; backward: d x (combine), d y (dispatch), d w (combine)
    assert names.count("jax_ep_ll_dispatch_send") == 2
    assert names.count("jax_ep_ll_combine_send") == 3


def test_fp8_split_dispatch_is_one_send_and_one_receive():
    """The FP8 dispatch_send is one send half that casts x in the kernel (values and
    scales in one message per (token, expert)), and dispatch_recv one receive half; the
    CUDA area still has two data halves (n % 2) for two sends in flight."""
    x, idx, _ = _inputs(3)
    x = np.tile(x, (1, 8))  # H = 128

    def f(x, idx):
        st = ll.dispatch_send(x, idx, num_experts=E, axis_name="ep", max_tokens_per_rank=M,
                              fp8=True, backend="ffi")
        (q, s), cnt, h = ll.dispatch_recv(st)
        return q.astype(jnp.float32)[None], s[None]

    names = [c[0] for c in _calls(_lower_cuda(f, x, idx))]
    assert names == ["jax_ep_ll_dispatch_send_fp8", "jax_ep_ll_dispatch_recv_fp8"]
    lay = jcuda.low_latency_layout(R, M, H * 8 * 2, K, E)
    assert lay["bytes"] == lay["cstage"] + 2 * lay["cstage_half"]
    assert lay["slot_tok"] == lay["slots"] + 2 * lay["slots_half"]


def _fitting_gpu_area(monkeypatch):
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(jcuda, "_ll_area", dict(num_ranks=R, max_tokens_per_rank=M, topk=K,
                                                num_experts=E, row_bytes=H * 4, bytes=1))


def _ffi_halves(x, idx, w):
    """Dispatch and combine through the ffi backend's four halves (what jax_ep.low_latency
    calls per shard), the combine on the dispatch's handle."""
    cfg = _cfg()
    recv, _, _, _, fr, rc = ffi_backend.ll_dispatch_recv(
        ffi_backend.ll_dispatch_send(x, idx, cfg), cfg)
    sent = ffi_backend.ll_combine_send(recv, fr, rc, M * min(K, E // R), cfg)
    return ffi_backend.ll_combine_recv(sent, idx, w, cfg)


def _result_types(line):
    """The tensor types after the '->' of a custom call line."""
    return re.findall(r"tensor<([^>]*)>", line.rsplit("->", 1)[1])


def test_gpu_send_halves_stage_no_rows(monkeypatch):
    """On GPUs the send halves push rows into the peers' areas: their staging outputs are
    zero-row placeholders ([0, H] and [R, 0, H]), not XLA buffers of every staged row
    (R * M * min(K, E_local) rows of H per combine, 117 MB at the EP8 decode shape). The
    receive halves still get H and the dtype from them, and the epoch from stage_idx and
    status."""
    x, idx, w = _inputs(4)
    cpu = {c[0]: _result_types(c[5]) for c in _calls(_lower_cuda(_ffi_halves, x, idx, w))}
    _fitting_gpu_area(monkeypatch)
    gpu = {c[0]: _result_types(c[5]) for c in _calls(_lower_cuda(_ffi_halves, x, idx, w))}
    rows = M * min(K, E // R)
    assert cpu["jax_ep_ll_dispatch_send"][0] == f"{T}x{H}xf32"
    assert gpu["jax_ep_ll_dispatch_send"] == [f"0x{H}xf32", f"{T}x{K}xi32", f"{E}xi32"]
    assert cpu["jax_ep_ll_combine_send"] == [f"{R}x{rows}x{H}xf32", "i32"]
    assert gpu["jax_ep_ll_combine_send"] == [f"{R}x0x{H}xf32", "i32"]
    # Everything else is the same lowering: the receive halves' results and all operands.
    for name in ("jax_ep_ll_dispatch_recv", "jax_ep_ll_combine_recv"):
        assert gpu[name] == cpu[name], name
    src = _read("xla_ffi", "cuda", "low_latency_handlers.cc")
    assert "HasShape(stage_x->dimensions(), {0, width})" in src  # width: H, or FP8 bytes
    assert "HasShape(stage->dimensions(), {R, 0, H})" in src


# ----------------------------------------------------------------------------- handlers

def test_real_rank_handlers_never_allocate_or_sync():
    src = _read("xla_ffi", "cuda", "low_latency_handlers.cc")
    real = src.split("// ------------------------------ real ranks", 1)[1]
    real = real.split("}  // namespace\n", 1)[0]
    for banned in ("cudaMalloc", "cudaFree", "Synchronize", "cudaMemcpy(", "cudaMemset(",
                   "cudaHostAlloc", "std::lock_guard"):
        assert banned not in real, banned
    for fn in ("RankDispatchSendImpl", "RankDispatchRecvImpl", "RankCombineSendImpl",
               "RankCombineRecvImpl"):
        assert f"ffi::Error {fn}(" in real
    # The harness allocates lazily: it must not claim command-buffer compatibility.
    sigs = _ext.ffi_signatures()["CUDA"]
    assert not any(sigs[f"jax_ep_ll_harness_{n}"].graph_safe for n in NAMES)


def test_every_receive_half_gets_its_send_halfs_epoch():
    """A receive half that took the last epoch sent would mix up two pairs XLA interleaves
    (send, send, recv, recv: the simulator's planted "latest_epoch"). Real ranks hand the
    epoch over in stage_idx / status, the harness in its token, one entry per rank."""
    src = _read("xla_ffi", "cuda", "low_latency_handlers.cc")
    impls = {name: src.split(f"ffi::Error {name}(", 1)[1].split("\n}\n", 1)[0]
             for name in ("DispatchSendImpl", "DispatchRecvImpl", "CombineSendImpl",
                          "CombineRecvImpl", "RankDispatchSend", "RankDispatchRecv",
                          "RankCombineSendImpl", "RankCombineRecvImpl")}
    for name, body in impls.items():
        field = "epoch_out" if "Send" in name else "epoch_in"
        assert re.search(rf"\.{field} = \w+(\.|->)typed_data\(\)", body), name
    for name in ("DispatchSendImpl", "CombineSendImpl"):
        assert "b.epoch_out = token->typed_data() + r;" in impls[name]
    for name in ("DispatchRecvImpl", "CombineRecvImpl"):
        assert "b.epoch_in = token.typed_data() + r;" in impls[name]
        assert 'ExpectShape("token", token.dimensions(), {R})' in impls[name]


@pytest.mark.skipif(_ext.ext is None or "CUDA" not in _ext.ext.registrations(),
                    reason="this build has no CUDA handlers")
def test_cuda_registers_the_cpu_target_names():
    regs = _ext.ext.registrations()
    targets = {f"jax_ep_ll_{n}" for n in NAMES}
    assert targets <= set(regs["CUDA"]) and targets <= set(regs["cpu"])
    harness = {f"jax_ep_ll_harness_{n}" for n in NAMES}
    assert harness <= set(regs["CUDA"])


@needs_bindings
@pytest.mark.parametrize("record, text", [
    ((2, 1, 3, 10, 5, 0), "timed out in low-latency dispatch (waiting for an owner's credit) "
                          "waiting for rank 3 (epoch 5)"),
    ((2, 0, 1, 9, 7, 0), "timed out in low-latency combine waiting for rank 1 (epoch 7)"),
    ((5, 2, 0, 8, 11, 12), "low-latency dispatch: rank 0 is in another EP call"),
    ((6, 2, 3, 9, 0, 0), "low-latency combine: rank 3 had an error and moved no data"),
    ((1, 0, 4, 1, 2, -1), "topk_idx[4, 1] = 2 names an expert an earlier slot of token 4"),
    ((1, 0, 4, 1, 9, 8), "topk_idx[4, 1] = 9 is outside [-1, 8)"),
    ((3, 1, 2, -1, 0, 9), "low-latency combine: rank 2 was given a handle.first_row/row_count"),
    ((3, 1, 0, 1, 99, 9), "low-latency combine: handle.first_row/row_count do not fit y"),
])
def test_device_errors_read_as_the_low_latency_mode(record, text):
    """What jax_ep.cuda.check_errors() says for the records the low-latency kernels write
    (code, rank, a, b, c, d as in kernels/cuda/low_latency_kernels.cu)."""
    msg = _ext.ext.cuda_describe_error(*record)
    assert text in msg, msg
    assert msg.endswith(f"[GPU 0, rank {record[1]}]")


# ----------------------------------------------------------------------------- sizes

def test_buffer_bytes_low_latency_area():
    kw = dict(max_tokens_per_rank=128, num_experts=256)
    big = jcuda.buffer_bytes(8, 4096, 7168, 8, jnp.bfloat16, **kw)
    one = jcuda.buffer_bytes(8, 1, 7168, 8, jnp.bfloat16, **kw)
    none = jcuda.buffer_bytes(8, None, 7168, 8, jnp.bfloat16, **kw)
    # Fixed by (R, M, H, K, E): the normal mode's token count changes nothing.
    assert big["low_latency"] == one["low_latency"] == none["low_latency"]
    assert none["dispatch"] == none["combine"] == none["gather"] == 0
    row = 7168 * 2
    el = 256 // 8
    slots = el * 8 * 128 * row              # E * M rows of H
    stage = 8 * 128 * min(8, el) * row       # R * M * min(K, E_local) rows
    assert 2 * (slots + stage) <= big["low_latency"] <= 2 * (slots + stage) + (1 << 20)
    assert big["low_latency"] % 256 == 0
    assert "low_latency" not in jcuda.buffer_bytes(8, 4096, 7168, 8)
    # More tokens per rank, more experts or wider rows: a larger area.
    for other in (dict(max_tokens_per_rank=256, num_experts=256),
                  dict(max_tokens_per_rank=128, num_experts=512)):
        assert jcuda.buffer_bytes(8, None, 7168, 8, **other)["low_latency"] > big["low_latency"]
    assert (jcuda.buffer_bytes(8, None, 7168, 8, jnp.float32, **kw)["low_latency"]
            > big["low_latency"])


def test_low_latency_layout_hand_checked():
    # R = 2, M = 5, rows of 3 bytes (stride 16), K = 1, E = 6 (3 local experts): halves of
    # 30 slots (480 B -> 512), their tokens (120 B -> 256), 6 arrival words per rank pair
    # (96 B -> 256) and 2 x 5 combine rows (160 B -> 256), after a 4096-byte header
    lay = jcuda.low_latency_layout(2, 5, 3, 1, 6)
    assert (lay["stride"], lay["rows_per_dest"]) == (16, 5)
    assert (lay["slots_half"], lay["tok_half"], lay["counts_half"], lay["cstage_half"]) == (
        512, 256, 256, 256)
    assert (lay["header"], lay["slots"], lay["slot_tok"], lay["counts"]) == (
        4096, 4096, 4096 + 2 * 512, 5120 + 2 * 256)
    # two [M * K] position scratches and [E] offsets, 256 bytes each, then the stage
    assert (lay["pos"], lay["pos_combine"], lay["offsets"], lay["cstage"], lay["bytes"]) == (
        6144, 6400, 6656, 6912, 6912 + 2 * 256)
    with pytest.raises(ValueError):
        jcuda.low_latency_layout(2, 5, 3, 1, 7)  # E not a multiple of R


class _FakeGpu:
    platform = "gpu"
    process_index = 0

    def __init__(self, i):
        self.id = self.local_hardware_id = i


class _FakeMesh:
    def __init__(self, n):
        self.axis_names = ("ep",)
        self.devices = np.array([_FakeGpu(i) for i in range(n)], dtype=object)


class _FakeExt:
    def __init__(self):
        self.alloc, self.domains = [], []

    def cuda_alloc_buffer(self, ordinal, areas):
        self.alloc.append((ordinal, list(areas)))
        return 0x1000 * (ordinal + 1), b""

    def cuda_enable_peer_access(self, a, b):
        return True

    def cuda_set_domain(self, ordinal, rank, group, R, peers, areas, ll_shape):
        self.domains.append((ordinal, rank, R, list(areas), list(ll_shape)))


@pytest.fixture
def fake_setup(monkeypatch):
    ext = _FakeExt()
    monkeypatch.setattr(jcuda, "_bindings", lambda: ext)
    monkeypatch.setattr(jcuda, "_ll_area", None)
    return ext


def test_setup_allocates_the_area_when_asked(fake_setup):
    sizes = jcuda.setup(_FakeMesh(4), "ep", num_tokens=None, hidden=64, topk=2,
                        dtype=jnp.float32, max_tokens_per_rank=16, num_experts=8)
    want = jcuda.buffer_bytes(4, None, 64, 2, jnp.float32, max_tokens_per_rank=16,
                              num_experts=8)["low_latency"]
    assert sizes["low_latency"] == want > 0
    assert [a[1] for a in fake_setup.alloc] == [[0, 0, 0, want]] * 4
    assert [d[1] for d in fake_setup.domains] == [0, 1, 2, 3]
    assert all(d[4] == [16, 2, 8, 64 * 4] for d in fake_setup.domains)
    assert jcuda.low_latency_area() == dict(num_ranks=4, max_tokens_per_rank=16, topk=2,
                                            num_experts=8, row_bytes=256, bytes=want)


def test_setup_without_the_option_keeps_three_areas(fake_setup):
    sizes = jcuda.setup(_FakeMesh(2), "ep", num_tokens=8, hidden=16, topk=2)
    assert set(sizes) == {"dispatch", "combine", "gather"}
    assert all(len(a[1]) == 3 for a in fake_setup.alloc)
    assert all(d[4] == [] for d in fake_setup.domains)
    assert jcuda.low_latency_area() is None


@pytest.mark.parametrize("kw, match", [
    (dict(max_tokens_per_rank=8), "needs num_experts"),
    (dict(max_tokens_per_rank=8, num_experts=6), "multiple of the 4 ranks"),
    (dict(max_tokens_per_rank=0, num_experts=8), "max_tokens_per_rank must be >= 1"),
    (dict(max_tokens_per_rank=8, num_experts=2048), "at most 1024"),
    (dict(), "num_tokens=None reserves no normal-mode buffers"),
])
def test_setup_argument_errors(fake_setup, kw, match):
    with pytest.raises(ValueError, match=match):
        jcuda.setup(_FakeMesh(4), "ep", num_tokens=None, hidden=16, topk=2, **kw)
    assert fake_setup.alloc == []


def test_buffer_bytes_argument_errors():
    with pytest.raises(ValueError, match="needs num_experts"):
        jcuda.buffer_bytes(4, None, 16, 2, max_tokens_per_rank=8)
    with pytest.raises(ValueError, match="multiple"):
        jcuda.buffer_bytes(4, None, 16, 2, max_tokens_per_rank=8, num_experts=10)


# ----------------------------------------------------------------------------- ffi checks

def _cfg(Mn=M, En=E):
    return Cfg(En, R, Mn, "ep", "ffi")


def test_gpu_without_area_names_the_setup_option(monkeypatch):
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(jcuda, "_ll_area", None)
    x, idx = jnp.zeros((M, H), jnp.bfloat16), jnp.zeros((M, K), jnp.int32)
    with pytest.raises(ValueError, match=r"jax_ep\.cuda\.setup\(.*max_tokens_per_rank=M, "
                                         r"num_experts=E\)"):
        ffi_backend.ll_dispatch_send(x, idx, _cfg())
    y = jnp.zeros((E // R, R * M, H), jnp.bfloat16)
    fr = jnp.zeros((E // R, R), jnp.int32)
    with pytest.raises(ValueError, match="low-latency area"):
        ffi_backend.ll_combine_send(y, fr, fr, M * K, _cfg())


def test_gpu_area_too_small_names_what_does_not_fit(monkeypatch):
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(jcuda, "_ll_area", dict(num_ranks=R, max_tokens_per_rank=M, topk=K,
                                                num_experts=E, row_bytes=H * 2, bytes=1))
    ok = (jnp.zeros((M, H), jnp.bfloat16), jnp.zeros((M, K), jnp.int32))
    cases = [(ok, _cfg(Mn=2 * M), "max_tokens_per_rank=16 exceeds the area's 8"),
             (ok, _cfg(En=2 * E), "num_experts=16, the area's 8"),
             ((ok[0].astype(jnp.float32), ok[1]), _cfg(), "rows of 64 bytes exceed"),
             ((ok[0], jnp.zeros((M, K + 1), jnp.int32)), _cfg(), "topk=4 exceeds")]
    for (x, idx), cfg, match in cases:
        with pytest.raises(ValueError, match=match):
            ffi_backend.ll_dispatch_send(x, idx, cfg)


def test_other_accelerators_are_not_implemented(monkeypatch):
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    with pytest.raises(NotImplementedError, match="ll_"):
        ffi_backend.ll_dispatch_send(jnp.zeros((M, H)), jnp.zeros((M, K), jnp.int32), _cfg())
