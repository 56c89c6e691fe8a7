"""The intranode and low-latency CUDA kernels on the emulated GPU, for the tests: inputs,
routings, and the reference backend (jax_ep._src.backends.reference under shard_map) as the
oracle. Arrays carry a leading rank axis: x[R, T, H], topk_idx/topk_weights[R, T, K],
y[R, C, H], g[R, T, H]."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.sharding import PartitionSpec as P

import jax_ep
from jax_ep import fp8
from jax_ep._src.backends import reference as reference_backend
from jax_ep._src.emu import Emulator

AUTO = jax.sharding.AxisType.Auto
DTYPES = {"f32": np.float32, "bf16": ml_dtypes.bfloat16, "f16": np.float16}


def routing(kind: str, R: int, T: int, K: int, E: int, rng) -> np.ndarray:
    """topk_idx[R, T, K] int32 of a named shape: random (with -1s), skewed (most slots on
    rank 0's experts), collapsed (every slot the same expert), none (all -1), silent_rank
    (no token picks the last rank's experts: it receives nothing but sends)."""
    el = E // R
    if kind == "random":
        idx = rng.integers(-1, E, size=(R, T, K))
    elif kind == "skewed":
        idx = np.where(rng.random((R, T, K)) < 0.8, rng.integers(0, el, (R, T, K)),
                       rng.integers(-1, E, (R, T, K)))
    elif kind == "collapsed":
        idx = np.full((R, T, K), E - 1)
    elif kind == "none":
        idx = np.full((R, T, K), -1)
    elif kind == "silent_rank":
        idx = rng.integers(-1, E - el, size=(R, T, K))
    else:
        raise ValueError(kind)
    return idx.astype(np.int32)


def rows(dtype: str, shape, rng) -> np.ndarray:
    """Random rows of a float dtype name, or FP8 pairs packed as uint8 rows ("fp8")."""
    if dtype == "fp8":
        *lead, H = shape
        x = jnp.asarray(rng.standard_normal(shape).astype(np.float32))
        q, s = fp8.quantize(x, block=32)
        return np.asarray(fp8.pack(q, s))
    return rng.standard_normal(shape).astype(DTYPES[dtype])


def mesh(R):
    return jax.make_mesh((R,), ("ep",), axis_types=(AUTO,), devices=jax.devices()[:R])


@functools.lru_cache(maxsize=None)
def _ref_program(R, E, C):
    def f(x, idx, w, y, g):
        rx, ri, rw, h = jax_ep.dispatch(x, idx, w, num_experts=E, axis_name="ep", capacity=C,
                                        backend="reference")
        out = jax_ep.combine(y, h, backend="reference")
        gx = reference_backend.gather(g, h, None)
        d = dict(recv_x=rx, recv_idx=ri, recv_w=rw, num_recv=h.num_recv,
                 num_dropped=h.num_dropped, per_expert=h.num_recv_tokens_per_expert,
                 src_rank=h.src_rank, src_index=h.src_index, send_row=h.send_row,
                 out=out, gather=gx)
        return {k: v[None] for k, v in d.items()}

    return jax.jit(jax.shard_map(f, mesh=mesh(R), in_specs=P("ep"), out_specs=P("ep")))


def reference(x, idx, w, y, g, *, E, C):
    """dispatch (+ handle), combine(y) and gather(g) of the reference backend, per rank."""
    flat = lambda a: a.reshape((a.shape[0] * a.shape[1],) + a.shape[2:])  # noqa: E731
    res = _ref_program(idx.shape[0], E, C)(flat(x), flat(idx), flat(w), flat(y), flat(g))
    return {k: np.asarray(v) for k, v in res.items()}


def bits(a):
    a = np.asarray(a)
    if a.dtype.kind == "f" or a.dtype in (np.dtype(ml_dtypes.bfloat16),):
        return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])
    return a


def assert_same(got: dict, want: dict, keys, what=""):
    for k in keys:
        g, w = np.asarray(got[k]), np.asarray(want[k])
        assert g.shape == w.shape, f"{what}{k}: shape {g.shape} != {w.shape}"
        if not np.array_equal(bits(g), bits(w)):
            bad = np.argwhere(bits(g) != bits(w))[:5].tolist()
            raise AssertionError(f"{what}{k} differs at {bad}: got {g.ravel()[:16]}, "
                                 f"want {w.ravel()[:16]}")


DISPATCH_KEYS = ("recv_x", "recv_idx", "recv_w", "num_recv", "num_dropped", "per_expert",
                 "src_rank", "src_index", "send_row")


def run_intranode(emu: Emulator, x, idx, w, y, g, *, E, C):
    """dispatch, combine(y) and gather(g) on the emulated GPU; a dict like reference()."""
    d = emu.dispatch(x, idx, w, num_experts=E, capacity=C)
    d["out"] = emu.combine(y, d["send_row"])
    d["gather"] = emu.gather(g, d["src_rank"], d["src_index"])
    return d


# ------------------------------------------------------------------ low-latency mode

def ll_routing(R, S, K, E, rng, p_unused=0.2) -> np.ndarray:
    """topk_idx[R, S, K]: distinct experts per token (the low-latency mode rejects repeats),
    some slots -1."""
    idx = np.stack([np.stack([rng.choice(E, K, replace=False) for _ in range(S)])
                    for _ in range(R)]).astype(np.int32)
    return np.where(rng.random(idx.shape) < p_unused, -1, idx).astype(np.int32)


@functools.lru_cache(maxsize=None)
def _ll_ref_program(R, E, M, rows_per_dest):
    from jax_ep._src.common import Cfg
    cfg = Cfg(E, R, M, "ep", backend="reference", check_ids=False)

    def f(x, idx, w, y):
        recv = reference_backend.ll_dispatch_recv(
            reference_backend.ll_dispatch_send(x, idx, cfg), cfg)
        first_row, row_count = recv[4], recv[5]
        # The combine sends back y, rows laid out like the dispatch's receive blocks.
        sent = reference_backend.ll_combine_send(y[0], first_row, row_count, rows_per_dest, cfg)
        out = reference_backend.ll_combine_recv(sent, idx, w, cfg)
        names = ("recv_x", "recv_count", "src_rank", "src_index", "first_row", "row_count")
        d = {n: v[None] for n, v in zip(names, recv)}
        d["out"] = out[None]
        return d

    return jax.jit(jax.shard_map(f, mesh=mesh(R), in_specs=P("ep"), out_specs=P("ep")))


# The low-latency receive sum's wide-row case (kernels/cuda/ll_combine_sum.cuh), which the
# intranode and the internode low-latency kernels share: top-10, more rows than one batch
# of loads in flight (kLLSumRows = 8), some slots unused, rows wider than one item
# (kLLSumChunk = 64 units): 260 float32 are 65 16-byte vectors, two items, the second one
# vector; 99 float16 (198 bytes) go element by element, two items.
LL_WIDE_ROWS = dict(R=2, S=3, K=10, E=16, M=3)
LL_WIDE_ROW_KINDS = [(260, "f32"), (99, "f16")]


def check_wide_row_routing(idx):
    """The routing reaches past one batch and leaves slots unused."""
    assert (idx == -1).any() and ((idx >= 0).sum(-1) > 8).any()


def ll_reference(x, idx, w, y, *, E, M, rows_per_dest):
    """Low-latency dispatch (send + receive) of x and combine of y[R, E_l, R*M, H] with the
    dispatch's handle, reference backend, per rank."""
    flat = lambda a: a.reshape((a.shape[0] * a.shape[1],) + a.shape[2:])  # noqa: E731
    res = _ll_ref_program(idx.shape[0], E, M, rows_per_dest)(flat(x), flat(idx), flat(w), y)
    return {k: np.asarray(v) for k, v in res.items()}


LL_DISPATCH_KEYS = ("recv_x", "recv_count", "src_rank", "src_index", "first_row", "row_count")
