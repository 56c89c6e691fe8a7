"""The low-latency mode on a CUDA real rank (backend='ffi' after jax_ep.cuda.setup's
low-latency area): one GPU as an EP group of one rank runs every real-rank kernel
(credits, tags, epochs, both data halves) against the reference backend, bit for bit.
Marked `gpu`: skipped where JAX sees no GPU (multi-rank groups need several GPUs or
processes; their kernels run on the emulated GPU, tests/emu/test_low_latency_emu.py)."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jax_ep._src import ext as _ext
from jax_ep import cuda as jcuda
from jax_ep import low_latency as ll

AUTO = jax.sharding.AxisType.Auto
T, M, H, K, E = 5, 8, 128, 2, 4


def _gpus():
    try:
        return jax.devices("gpu")
    except RuntimeError:
        return []


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not _gpus() or not _ext.build_info()["cuda"],
    reason="no NVIDIA GPU visible to JAX here; run scripts/gpu_check.sh on a GPU machine")]


@pytest.fixture(scope="module")
def mesh():
    m = jax.make_mesh((1,), ("ep",), axis_types=(AUTO,), devices=_gpus()[:1])
    try:
        jcuda.setup(m, "ep", num_tokens=None, hidden=H, topk=K, dtype=jnp.float32,
                    max_tokens_per_rank=M, num_experts=E)
    except RuntimeError as e:  # this process already set the GPU up another way
        pytest.skip(f"GPU 0 already has another communication buffer: {e}")
    jcuda.check_errors()
    return m


@functools.lru_cache(maxsize=None)
def _program(mesh, backend, split=False, fp8=False):
    kw = dict(num_experts=E, axis_name="ep", max_tokens_per_rank=M, backend=backend)

    def f(x, idx, w, y):
        if split:
            recv, cnt, h = ll.dispatch_recv(ll.dispatch_send(x, idx, fp8=fp8, **kw))
            out = ll.combine_recv(ll.combine_send(y, idx, w, h, backend=backend))
        else:
            recv, cnt, h = ll.dispatch(x, idx, **kw)
            out = ll.combine(y, idx, w, h, backend=backend)
        if fp8:
            recv = recv[0].astype(jnp.float32) + recv[1].sum()
        return recv, cnt, h.src_index, h.row_count, out

    return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P(), out_specs=P(),
                                 check_vma=False))


def _inputs(seed, dtype=np.float32):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((T, H)).astype(dtype)
    idx = np.stack([rng.permutation(E)[:K] for _ in range(T)]).astype(np.int32)
    idx[rng.random((T, K)) < 0.2] = -1
    w = rng.random((T, K)).astype(np.float32)
    y = rng.standard_normal((E, M, H)).astype(dtype)
    return x, idx, w, y


def _same(a, b):
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        u, v = np.asarray(u), np.asarray(v)
        assert u.shape == v.shape and u.dtype == v.dtype
        assert u.tobytes() == v.tobytes()


def test_real_rank_matches_reference_over_repeated_calls(mesh):
    # The split halves are the calls the fused ops make (one program each keeps it short).
    ffi, ref = _program(mesh, "ffi", True), _program(mesh, "reference", True)
    for seed in range(3):  # epochs 1, 2, 3: both halves, reused after their credit
        args = _inputs(seed)
        _same(ffi(*args), ref(*args))
    jcuda.check_errors()


def test_real_rank_fp8_cast_in_the_send_kernel(mesh):
    ffi, ref = _program(mesh, "ffi", True, True), _program(mesh, "reference", True, True)
    args = _inputs(7)
    _same(ffi(*args), ref(*args))
    jcuda.check_errors()


def test_real_rank_reports_a_repeated_id(mesh):
    x, idx, w, y = _inputs(11)
    idx[1] = [2, 2]
    jax.block_until_ready(_program(mesh, "ffi", True)(x, idx, w, y))
    with pytest.raises(RuntimeError, match=r"topk_idx\[1, 1\] = 2 names an expert an "
                                           r"earlier slot"):
        jcuda.check_errors()
    # A bad id is no protocol error: the next call is exact again.
    args = _inputs(12)
    _same(_program(mesh, "ffi", True)(*args), _program(mesh, "reference", True)(*args))
    jcuda.check_errors()
