"""CUDA backend: build facts and host-side logic (run everywhere), and the kernels through
the virtual-rank harness and the real handlers (marked `gpu`, skipped without a GPU)."""
from __future__ import annotations

import os
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_ep
from jax_ep._src import ext as _ext
from jax_ep import cuda as jcuda

from conftest import AUTO, assert_bitwise_equal, bits, np_layout, np_model

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _nvcc() -> bool:
    return shutil.which("nvcc") is not None or os.path.exists("/usr/local/cuda/bin/nvcc")


def _gpus():
    try:
        return jax.devices("gpu")
    except RuntimeError:
        return []


NO_GPU = "no NVIDIA GPU visible to JAX here; run scripts/gpu_check.sh on a GPU machine"
gpu = pytest.mark.gpu
needs_gpu = pytest.mark.skipif(not _gpus() or not _ext.build_info()["cuda"], reason=NO_GPU)
needs_bindings = pytest.mark.skipif(
    _ext.ext is None or not hasattr(_ext.ext, "cuda_presets"),
    reason="the extension module does not define the cuda_* host functions "
           "(module.cc must call jax_ep::DefineCudaBindings)")


# ----------------------------------------------------------------------------- host side

@pytest.mark.skipif(not _nvcc(), reason="nvcc not installed: CPU-only build expected")
def test_build_info_lists_cuda_archs():
    info = jax_ep.build_info()
    assert info["cuda"] is True
    assert "sm_90" in info["cuda_archs"]
    assert "sm_90a" in info["cuda_archs"]


@pytest.mark.skipif(not _nvcc(), reason="nvcc not installed: CPU-only build expected")
def test_cuda_targets_share_the_cpu_names():
    regs = _ext.ext.registrations()
    assert "CUDA" in regs
    cuda, cpu = set(regs["CUDA"]), set(regs["cpu"])
    core = {"jax_ep_layout", "jax_ep_dispatch", "jax_ep_combine", "jax_ep_gather"}
    assert core <= cpu and core <= cuda, f"CUDA lacks {core - cuda}"
    # Low-latency (jax_ep_ll_*) targets get CUDA handlers of their own files, if at all.
    assert {"jax_ep_harness_dispatch", "jax_ep_harness_combine",
            "jax_ep_harness_gather"} <= cuda


def test_buffer_bytes_formulas(monkeypatch):
    jax_ep.config.update("ring_tokens", None)
    jax_ep.config.update("cuda_preset", None)
    b = jcuda.buffer_bytes(8, 4096, 7168, 8, jnp.bfloat16)
    row = 7168 * 2
    # Dispatch, combine and gather stage rows in channels x ranks rings (ids and weights
    # beside the dispatch rows, token ids beside gather's), whatever the tokens or capacity;
    # dispatch runs a channel per block (two per combine channel) up to 16 ranks.
    ch, q = b["channels"], b["ring_tokens"]
    assert 1 <= ch <= 12 and q >= 1
    assert b["dispatch_channels"] == 2 * ch
    assert b["dispatch"] >= 2 * ch * 8 * q * (row + 8 * 8 + 8)
    assert b["combine"] >= ch * 8 * q * row
    assert b["gather"] >= ch * 8 * q * (row + 4)
    small = jcuda.buffer_bytes(8, 4096, 7168, 8, jnp.bfloat16, capacity=100)
    big = jcuda.buffer_bytes(8, 65536, 7168, 8, jnp.bfloat16)
    assert small["dispatch"] == b["dispatch"] == big["dispatch"]
    assert small["combine"] == b["combine"] == big["combine"]
    assert small["gather"] == b["gather"] == big["gather"]
    for k in ("dispatch", "combine", "gather", "header"):
        assert b[k] % 256 == 0
    # ep8: 24 blocks, 12 channels, 128-slot rings; a dispatch ring holds 128 rows of 14336
    # bytes, then their words (row, token, 8 ids, 8 weights), each part to 256 bytes
    assert (ch, b["dispatch_channels"], q) == (12, 24, 128)
    assert b["dispatch"] == 24 * 8 * (128 * 14336 + 128 * 18 * 4)
    assert b["combine"] == 12 * 8 * 128 * 14336
    assert b["gather"] == 12 * 8 * (128 * 14336 + 128 * 4)
    assert b["header"] == 128 * 1024
    assert jcuda.buffer_bytes(32, 16, 16, 2)["dispatch_channels"] == jcuda.channels(32)
    assert (jcuda.channels(32), jcuda.dispatch_channels(32), jcuda.dispatch_channels(16)) == (
        16, 16, 24)  # ep32: 32 blocks; above 16 ranks two blocks share a dispatch channel
    assert jcuda.MAX_RANKS == 32
    jax_ep.config.update("ring_tokens", "5000")
    assert jcuda.ring_tokens() == 4096
    with pytest.raises(ValueError, match="ring_tokens"):
        jax_ep.config.update("ring_tokens", "many")
    jax_ep.config.update("ring_tokens", "3")
    jax_ep.config.update("cuda_preset", "ep2")  # 16 blocks: 8 channels at any R
    tiny = jcuda.buffer_bytes(8, 16, 7, 2, jnp.bfloat16)
    assert (tiny["channels"], tiny["dispatch_channels"], tiny["ring_tokens"]) == (8, 16, 3)
    # rings of 3 rows of 16 bytes (14 to 16) and their words, each part to 256 bytes
    assert tiny["dispatch"] == 16 * 8 * (256 + 256)
    assert tiny["combine"] == 8 * 8 * 256
    assert tiny["gather"] == 8 * 8 * (256 + 256)
    with pytest.raises(ValueError, match="num_ranks"):
        jcuda.buffer_bytes(33, 16, 16, 2)


@needs_bindings
def test_presets_table():
    ps = jcuda.presets()
    assert ps, "no presets"
    caps = [p["max_ranks"] for p in ps]
    assert caps == sorted(caps) and caps[-1] >= jcuda.MAX_RANKS
    for p in ps:
        assert p["num_sms"] >= 2 and p["num_sms"] % 2 == 0
    assert len({p["name"] for p in ps}) == len(ps)


def test_presets_header_is_one_table():
    """Launch sizes live in kernels/common/configs.h only, not as literals in the kernels."""
    with open(os.path.join(ROOT, "kernels", "cuda", "intranode_kernels.cu")) as f:
        src = f.read()
    # the channel kernels: grid and block from configs.h / intranode_buffer.h, the launch
    # bound the instance's preset block size
    assert src.count("kThreads, 2 * a.c.channels, ChannelRoleThreads(R)") == 2  # combine, gather
    assert "kThreads, DispatchBlocks(R, b.c.channels), DispatchRoleThreads(R)" in src  # dispatch
    assert not re.search(r"JEP_LAUNCH\(\w+(<[^>]*>)?,\s*[^,]+,\s*\d", src), "a literal block size"
    assert not re.search(r"JEP_LAUNCH_T\(\w+,\s*\d", src), "a literal launch bound"
    assert not re.search(r"JEP_LAUNCH_T\(\w+,\s*[^,]+,\s*[^,]+,\s*\d", src), "a literal block size"
    assert "kPlanThreads" in src


def test_group_numbering_matches_ops():
    """setup() numbers ranks and groups like jax_ep.ops: rank along the EP axis, group
    row-major over the other axes."""
    devs = np.array(jax.devices("cpu")[:8]).reshape(2, 4)
    mesh = jax.sharding.Mesh(devs, ("data", "expert"))
    groups, members, R = jcuda._group_members(mesh, "expert")
    assert R == 4 and sorted(groups) == [0, 1]
    assert groups[1] == list(devs[1])
    by_dev = {m.device.id: (m.rank, m.group) for m in members}
    assert by_dev[devs[1, 2].id] == (2, 1)
    groups, _, R = jcuda._group_members(mesh, ("data", "expert"))
    assert R == 8 and list(groups) == [0] and groups[0] == list(devs.ravel())


@pytest.mark.skipif(bool(_gpus()), reason="checks the CPU-only refusal")
def test_setup_refuses_cpu_meshes():
    mesh = jax.sharding.Mesh(np.array(jax.devices("cpu")[:2]), ("ep",))
    with pytest.raises((ValueError, RuntimeError)):
        jcuda.setup(mesh, "ep", num_tokens=4, hidden=8, topk=2)


def test_available_is_false_without_a_gpu():
    if not _gpus():
        assert jcuda.available() is False


def test_harness_options_are_checked():
    attrs = jcuda._harness_attrs(3, None, True, -1)
    assert attrs["call_sites"].tolist() == [jcuda.HARNESS_CALL_SITE] * 3
    assert int(attrs["concurrent"]) == 1 and int(attrs["absent_rank"]) == -1
    assert jcuda._harness_attrs(2, [7, 8], True, 1)["call_sites"].tolist() == [7, 8]
    with pytest.raises(ValueError, match="call_sites must list one id per rank"):
        jcuda._harness_attrs(3, [1, 2], True, -1)
    with pytest.raises(ValueError, match="absent_rank"):
        jcuda._harness_attrs(3, None, True, 3)
    with pytest.raises(ValueError, match="concurrent=False"):
        jcuda._harness_attrs(3, None, False, -1)


class _FakeGpu:
    platform = "gpu"
    process_index = 0

    def __init__(self, i, hw):
        self.id, self.local_hardware_id = i, hw


class _FakeMesh:
    def __init__(self, devices):
        self.axis_names = ("ep",)
        self.devices = np.array(devices, dtype=object)


class _Allocated(Exception):
    pass


def test_setup_rejects_groups_beyond_legacy_peer_access(monkeypatch):
    """Legacy peer access reaches 8 peers: a group over 10 GPUs is refused with a message;
    10 ranks sharing one GPU (several processes on it) pass that check."""
    class Ext:
        def cuda_alloc_buffer(self, *a):
            raise _Allocated()
    monkeypatch.setattr(jcuda, "_bindings", lambda: Ext())
    with pytest.raises(ValueError, match="at most 8 peers"):
        jcuda.setup(_FakeMesh([_FakeGpu(i, i) for i in range(10)]), "ep", num_tokens=4,
                    hidden=8, topk=2)
    with pytest.raises(_Allocated):
        jcuda.setup(_FakeMesh([_FakeGpu(i, 0) for i in range(10)]), "ep", num_tokens=4,
                    hidden=8, topk=2)


@needs_bindings
def test_no_gpu_in_use_means_nothing_to_check():
    """check_errors() and reset() touch only GPUs this process used for EP work."""
    if not _gpus():
        assert list(_ext.ext.cuda_devices_in_use()) == []
        jcuda.check_errors()
        assert jcuda.reset() == []


def test_kernels_check_the_call_site_and_fail_safely():
    """Source-level facts of the fail-safe protocol that no CPU run can show: every
    request and data signal carries the call site, receivers compare it, waits give up
    once a timeout is recorded, handlers have no host-side early return."""
    with open(os.path.join(ROOT, "kernels", "cuda", "intranode_kernels.cu")) as f:
        k = f.read()
    with open(os.path.join(ROOT, "xla_ffi", "cuda", "cuda_handlers.cc")) as f:
        h = f.read()
    assert k.count("wait_and_check(") == 1 + 3  # definition + every data/request wait
    # site_arr: also the failed rank's mark at the end of its dispatch channel kernel
    assert k.count("site_req[kOp") == 2 and k.count("site_arr[kOp") == 5
    # gather: each side posts its site per (channel, peer), the other reads it, and a
    # failed rank marks both at the end of its channel kernel
    assert k.count("g_req_site[") == 3 and k.count("g_arr_site[") == 3
    assert "&g_intranode_stop" in k
    assert "PendingMirrorError" not in h and "call_site, &k" in h


# ----------------------------------------------------------------------------- GPU

def _inputs(R, T, H, K, E, dtype, seed, C):
    rng = np.random.default_rng(seed)
    idx = np.stack([np.stack([rng.choice(E, K, replace=False) for _ in range(T)])
                    for _ in range(R)]).astype(np.int32)
    idx[rng.random(idx.shape) < 0.15] = -1           # unused slots
    if K >= 2:
        idx[:, ::7, 1] = idx[:, ::7, 0]               # the same expert twice in a row
    x = rng.standard_normal((R, T, H)).astype(np.float32).astype(dtype)
    w = rng.random((R, T, K)).astype(np.float32)
    y = rng.standard_normal((R, C, H)).astype(np.float32).astype(dtype)
    return x, idx, w, y


def _cpu_ffi(x, idx, w, y, E, C):
    """The CPU ffi backend on R CPU devices, per-rank results like np_model."""
    R = idx.shape[0]
    mesh = jax.make_mesh((R,), ("ep",), axis_types=(AUTO,), devices=jax.devices("cpu")[:R])

    def f(x, idx, w, y):
        rx, ri, rw, h = jax_ep.dispatch(x, idx, w, num_experts=E, axis_name="ep",
                                        capacity=C, backend="ffi")
        out = jax_ep.combine(y, h, backend="ffi")
        return dict(recv_x=rx[None], recv_idx=ri[None], recv_w=rw[None],
                    num_recv=h.num_recv[None], num_dropped=h.num_dropped[None],
                    per_expert=h.num_recv_tokens_per_expert[None], src_rank=h.src_rank[None],
                    src_index=h.src_index[None], send_row=h.send_row[None], out=out[None])

    flat = lambda a: a.reshape((-1,) + a.shape[2:])  # noqa: E731
    prog = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
    sh = jax.sharding.NamedSharding(mesh, P("ep"))  # placed on the CPU mesh, not GPU 0
    res = prog(*(jax.device_put(flat(a), sh) for a in (x, idx, w, y)))
    return {k: np.asarray(v) for k, v in res.items()}


def _harness(x, idx, w, y, E, C, concurrent=True):
    d = jcuda.harness_dispatch(jnp.asarray(x), jnp.asarray(idx), jnp.asarray(w),
                               num_experts=E, capacity=C, concurrent=concurrent)
    out = jcuda.harness_combine(jnp.asarray(y), d.send_row, concurrent=concurrent)
    return dict(recv_x=d.recv_x, recv_idx=d.recv_topk_idx, recv_w=d.recv_topk_weights,
                num_recv=d.num_recv, num_dropped=d.num_dropped,
                per_expert=d.num_recv_tokens_per_expert, src_rank=d.src_rank,
                src_index=d.src_index, send_row=d.send_row, out=out)


CASES = [  # R, T, H, K, E, C (None: R*T), dtype
    (2, 16, 64, 2, 4, None, jnp.float32),
    (4, 37, 48, 3, 8, None, jnp.bfloat16),
    (8, 64, 256, 8, 64, None, jnp.bfloat16),
    (8, 50, 72, 4, 32, 40, jnp.float16),      # drops rows: capacity below what arrives
    (3, 9, 5, 2, 6, 4, jnp.bfloat16),         # odd row bytes: the unaligned copy path
    (1, 12, 32, 2, 4, None, jnp.float32),
]


@gpu
@needs_gpu
@pytest.mark.parametrize("R,T,H,K,E,C,dtype", CASES)
def test_harness_matches_model_and_cpu_ffi(R, T, H, K, E, C, dtype):
    Ce = R * T if C is None else C
    x, idx, w, y = _inputs(R, T, H, K, E, dtype, seed=R * 1000 + T, C=Ce)
    got = {k: np.asarray(v) for k, v in _harness(x, idx, w, y, E, Ce).items()}
    want = np_model(x, idx, w, y, E, Ce)
    assert_bitwise_equal(got, want, what="harness vs model: ")
    assert_bitwise_equal(got, _cpu_ffi(x, idx, w, y, E, Ce), what="harness vs cpu ffi: ")
    jcuda.check_errors()


@gpu
@needs_gpu
def test_harness_empty_ranks():
    """Rank 1 sends nothing, nobody sends to rank 2."""
    R, T, H, K, E = 4, 20, 40, 2, 8
    x, idx, w, y = _inputs(R, T, H, K, E, jnp.bfloat16, seed=42, C=R * T)
    idx[1] = -1
    idx[(idx == 4) | (idx == 5)] = -1  # rank 2 holds experts 4 and 5
    got = {k: np.asarray(v) for k, v in _harness(x, idx, w, y, E, R * T).items()}
    assert got["num_recv"][2] == 0 and (got["send_row"][1] == -1).all()
    assert_bitwise_equal(got, np_model(x, idx, w, y, E, R * T), what="harness vs model: ")
    assert_bitwise_equal(got, _cpu_ffi(x, idx, w, y, E, R * T), what="harness vs cpu ffi: ")


@gpu
@needs_gpu
def test_harness_repeated_calls_are_bitwise_stable():
    R, T, H, K, E = 8, 96, 512, 8, 64
    x, idx, w, y = _inputs(R, T, H, K, E, jnp.bfloat16, seed=7, C=R * T)
    first = {k: bits(np.asarray(v)) for k, v in _harness(x, idx, w, y, E, R * T).items()}
    for _ in range(3):  # epochs advance; buffers are reused
        again = _harness(x, idx, w, y, E, R * T)
        for k, v in again.items():
            assert np.array_equal(bits(np.asarray(v)), first[k]), k


@gpu
@needs_gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_harness_gather_is_combine_transpose(dtype):
    R, T, H, K, E = 4, 40, 96, 4, 16
    C = 3 * T  # below the worst case: the gather of a handle with dropped rows
    x, idx, w, _ = _inputs(R, T, H, K, E, dtype, seed=3, C=C)
    d = jcuda.harness_dispatch(jnp.asarray(x), jnp.asarray(idx), jnp.asarray(w),
                               num_experts=E, capacity=C)
    g = np.random.default_rng(1).standard_normal((R, T, H)).astype(np.float32).astype(dtype)
    out = np.asarray(jcuda.harness_gather(jnp.asarray(g), d.src_rank, d.src_index))
    sr, si = np.asarray(d.src_rank), np.asarray(d.src_index)
    want = np.zeros_like(out)
    for r in range(R):
        for i in range(sr.shape[1]):
            if sr[r, i] >= 0:
                want[r, i] = g[sr[r, i], si[r, i]]
    assert np.array_equal(bits(out), bits(want))
    jcuda.check_errors()


@gpu
@needs_gpu
@needs_bindings
def test_call_site_mismatch_is_reported_and_later_calls_skip_until_reset():
    jcuda.reset()
    R, T, H, K, E = 2, 16, 32, 2, 4
    x, idx, w, y = _inputs(R, T, H, K, E, jnp.float32, seed=9, C=R * T)
    d = jcuda.harness_dispatch(jnp.asarray(x), jnp.asarray(idx), jnp.asarray(w),
                               num_experts=E, capacity=R * T, call_sites=[5, 6])
    assert (np.asarray(d.num_recv) == 0).all() and (np.asarray(d.send_row) == -1).all()
    assert not np.asarray(d.recv_x).any()
    # A well-formed call after it moves no data either (the error is sticky) ...
    again = {k: np.asarray(v) for k, v in _harness(x, idx, w, y, E, R * T).items()}
    assert (again["num_recv"] == 0).all() and not again["out"].any()
    with pytest.raises(RuntimeError, match="is in another EP call"):
        jcuda.check_errors(clear=False)
    # ... until reset(), after which the same call is exact again.
    assert jcuda.reset() == [_gpus()[0].local_hardware_id]
    got = {k: np.asarray(v) for k, v in _harness(x, idx, w, y, E, R * T).items()}
    assert_bitwise_equal(got, np_model(x, idx, w, y, E, R * T), what="after reset: ")
    jcuda.check_errors()


@gpu
@needs_gpu
@needs_bindings
def test_missing_peer_times_out_then_reset_recovers(monkeypatch):
    jcuda.reset()
    jax_ep.config.update("timeout_s", "1")
    R, T, H, K, E = 3, 16, 32, 2, 6
    x, idx, w, y = _inputs(R, T, H, K, E, jnp.float32, seed=13, C=R * T)
    d = jcuda.harness_dispatch(jnp.asarray(x), jnp.asarray(idx), jnp.asarray(w),
                               num_experts=E, capacity=R * T, concurrent=True, absent_rank=1)
    out = jcuda.harness_combine(jnp.asarray(y), d.send_row, concurrent=True, absent_rank=1)
    jax.block_until_ready(out)
    assert (np.asarray(d.num_recv)[[0, 2]] == 0).all()  # the ranks that ran skipped
    with pytest.raises(RuntimeError, match="timed out in .* waiting for rank 1"):
        jcuda.check_errors()
    jax_ep.config.update("timeout_s", None)
    jcuda.reset()
    got = {k: np.asarray(v) for k, v in _harness(x, idx, w, y, E, R * T, True).items()}
    assert_bitwise_equal(got, np_model(x, idx, w, y, E, R * T), what="after reset: ")
    jcuda.check_errors()


@gpu
@needs_gpu
@needs_bindings
def test_timeout_after_a_bad_id_still_stops_the_ranks(monkeypatch):
    """A bad id is the record's first error (first error wins) and stops nothing; a timeout
    after it must still count as a failure: the ranks that ran move no data, and
    check_errors names both errors."""
    jcuda.reset()
    jax_ep.config.update("timeout_s", "1")
    R, T, H, K, E = 3, 16, 32, 2, 6
    x, idx, w, y = _inputs(R, T, H, K, E, jnp.float32, seed=17, C=R * T)
    bad = idx.copy()
    bad[2, 3, 1] = E + 5
    first = jcuda.harness_dispatch(jnp.asarray(x), jnp.asarray(bad), jnp.asarray(w),
                                   num_experts=E, capacity=R * T, concurrent=True)
    jax.block_until_ready(first.recv_x)
    assert np.asarray(first.num_recv).sum() > 0  # a value error moves data on
    d = jcuda.harness_dispatch(jnp.asarray(x), jnp.asarray(idx), jnp.asarray(w),
                               num_experts=E, capacity=R * T, concurrent=True, absent_rank=1)
    out = jcuda.harness_combine(jnp.asarray(y), d.send_row, concurrent=True, absent_rank=1)
    jax.block_until_ready(out)
    ran = [0, 2]
    assert (np.asarray(d.num_recv)[ran] == 0).all()  # rank 2 received nothing from rank 0
    assert (np.asarray(d.send_row)[ran] == -1).all() and not np.asarray(d.recv_x)[ran].any()
    assert not np.asarray(out)[ran].any()
    with pytest.raises(RuntimeError, match=r"(?s)topk_idx\[3, 1\] = 11 is outside.*"
                                           r"timed out in .* waiting for rank 1"):
        jcuda.check_errors()
    jcuda.check_errors()  # cleared, the failed state with it
    jax_ep.config.update("timeout_s", None)
    jcuda.reset()
    got = {k: np.asarray(v) for k, v in _harness(x, idx, w, y, E, R * T, True).items()}
    assert_bitwise_equal(got, np_model(x, idx, w, y, E, R * T), what="after reset: ")
    jcuda.check_errors()


@gpu
@needs_gpu
def test_layout_kernel_matches_model():
    from jax_ep import ops
    rng = np.random.default_rng(0)
    for T, K, E, R in [(4096, 8, 256, 8), (33, 3, 12, 4), (5, 1, 2, 1)]:
        idx = rng.integers(-1, E, size=(T, K)).astype(np.int32)
        lay = ops.get_dispatch_layout(jnp.asarray(idx), num_experts=E, num_ranks=R, backend="ffi")
        want = np_layout(idx, E, R)
        assert np.array_equal(np.asarray(lay.num_tokens_per_rank), want["num_tokens_per_rank"])
        assert np.array_equal(np.asarray(lay.num_tokens_per_expert), want["num_tokens_per_expert"])
        assert np.array_equal(np.asarray(lay.is_token_in_rank), want["is_token_in_rank"])


@gpu
@needs_gpu
@needs_bindings
def test_bad_ids_are_reported_not_silent():
    jcuda.check_errors()  # start clean
    R, T, H, K, E = 2, 8, 32, 2, 4
    x, idx, w, y = _inputs(R, T, H, K, E, jnp.float32, seed=5, C=R * T)
    idx[1, 3, 1] = E + 5
    d = jcuda.harness_dispatch(jnp.asarray(x), jnp.asarray(idx), jnp.asarray(w),
                               num_experts=E, capacity=R * T)
    jax.block_until_ready(d.recv_x)
    with pytest.raises(RuntimeError, match=r"topk_idx\[3, 1\] = 9 is outside \[-1, 4\)"):
        jcuda.check_errors()
    jcuda.check_errors()  # cleared


@gpu
@needs_gpu
@needs_bindings
def test_real_handlers_on_one_gpu_group():
    """The collective handlers themselves (not the harness) on an EP group of one GPU:
    everything a rank sends goes through its own buffer."""
    dev = _gpus()[:1]
    mesh = jax.make_mesh((1,), ("ep",), axis_types=(AUTO,), devices=dev)
    T, H, K, E = 64, 128, 4, 8
    jcuda.setup(mesh, "ep", num_tokens=T, hidden=H, topk=K, dtype=jnp.float32)
    x, idx, w, y = _inputs(1, T, H, K, E, jnp.float32, seed=11, C=T)

    def f(x, idx, w, y):
        rx, ri, rw, h = jax_ep.dispatch(x, idx, w, num_experts=E, axis_name="ep", backend="ffi")
        return rx, h.send_row, jax_ep.combine(y, h, backend="ffi")

    prog = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
    for _ in range(2):
        rx, send_row, out = prog(x[0], idx[0], w[0], y[0])
        want = np_model(x, idx, w, y, E, T)
        assert np.array_equal(bits(np.asarray(rx)), bits(want["recv_x"][0]))
        assert np.array_equal(np.asarray(send_row), want["send_row"][0])
        assert np.array_equal(bits(np.asarray(out)), bits(want["out"][0]))
    jcuda.check_errors()
    jcuda.setup(mesh, "ep", num_tokens=T, hidden=H, topk=K, dtype=jnp.float32)  # again: fine
    assert dev[0].local_hardware_id in jcuda.reset()
    rx, send_row, out = prog(x[0], idx[0], w[0], y[0])  # epochs start over after reset
    assert np.array_equal(bits(np.asarray(out)), bits(want["out"][0]))
    jcuda.check_errors()
