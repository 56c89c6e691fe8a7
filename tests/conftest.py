"""Shared test set-up: 8 virtual CPU devices, mesh builders, a runner for the per-shard
ops under jit(shard_map) and a NumPy model of the per-shard contract (DESIGN.md)."""
from __future__ import annotations

import functools
import os

# Must happen before jax is imported anywhere in the test process.
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_force_host_platform_device_count=8").strip()
# The virtual-rank harness runs each rank on a stream of its own and needs a hardware queue
# per rank (CUDA_DEVICE_MAX_CONNECTIONS, default 8); the driver reads it once, when CUDA
# initialises, so it is set here, before jax starts a GPU backend. A value set outside wins.
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_ep  # noqa: E402

BACKENDS = ("reference", "ffi")
AUTO = jax.sharding.AxisType.Auto


def ep_mesh(R: int, axis: str = "ep") -> jax.sharding.Mesh:
    """A 1-D mesh of the first R CPU devices."""
    return jax.make_mesh((R,), (axis,), axis_types=(AUTO,), devices=jax.devices()[:R])


def ep_mesh_2d(D: int, R: int) -> jax.sharding.Mesh:
    """A (data, expert) mesh: D EP groups of R ranks each."""
    return jax.make_mesh((D, R), ("data", "expert"), axis_types=(AUTO, AUTO),
                         devices=jax.devices()[:D * R])


@pytest.fixture(autouse=True)
def _restore_jax_ep_config():
    """jax_ep.config as it was before the test (tests set settings with
    jax_ep.config.update; the kernels' copies are filled again too)."""
    before = jax_ep.config.current()
    yield
    if jax_ep.config.current() != before:
        jax_ep.config._set(before)


@pytest.fixture(scope="session")
def mesh8():
    return ep_mesh(8)


@pytest.fixture(scope="session")
def mesh_2x4():
    return ep_mesh_2d(2, 4)


def _per_rank(h, out):
    """Handle fields and outputs of one rank, each with a leading rank axis of 1."""
    return dict(
        num_recv=h.num_recv[None], num_dropped=h.num_dropped[None],
        per_expert=h.num_recv_tokens_per_expert[None], src_rank=h.src_rank[None],
        src_index=h.src_index[None], send_row=h.send_row[None], out=out[None])


@functools.lru_cache(maxsize=None)
def ep_program(R: int, E: int, C, backend: str):
    """jit(shard_map(dispatch + combine)) over R ranks, cached per static config.

    Takes global x[R*T, H], topk_idx[R*T, K], topk_weights[R*T, K], y[R*C', H] (C' the
    effective capacity) and returns a dict of per-rank arrays with a leading axis R.
    """
    mesh = ep_mesh(R)

    def f(x, idx, w, y):
        rx, ri, rw, h = jax_ep.dispatch(x, idx, w, num_experts=E, axis_name="ep",
                                        capacity=C, backend=backend)
        out = jax_ep.combine(y, h, backend=backend)
        d = _per_rank(h, out)
        d.update(recv_x=rx[None], recv_idx=ri[None], recv_w=rw[None])
        return d

    return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))


def run_ep(x, idx, w, y, *, E, C, backend):
    """Runs ep_program on per-rank inputs x[R, T, H], idx/w[R, T, K], y[R, C, H]; returns
    NumPy arrays with a leading rank axis."""
    R, T = idx.shape[:2]
    flat = lambda a: a.reshape((a.shape[0] * a.shape[1],) + a.shape[2:])  # noqa: E731
    res = ep_program(R, E, C, backend)(flat(x), flat(idx), flat(w), flat(y))
    return {k: np.asarray(v) for k, v in res.items()}


# ----------------------------------------------------------------------------- model

def np_layout(idx, E, R):
    """Layout of one rank's topk_idx[T, K] per the contract."""
    el = E // R
    owner = np.where(idx >= 0, idx // el, -1)
    in_rank = (owner[:, :, None] == np.arange(R)).any(axis=1)
    per_expert = np.bincount(idx[idx >= 0].ravel(), minlength=E).astype(np.int32)
    return dict(num_tokens_per_rank=in_rank.sum(0).astype(np.int32),
                num_tokens_per_expert=per_expert, is_token_in_rank=in_rank)


def np_model(x, idx, w, y, E, C):
    """The contract in plain NumPy on per-rank inputs x[R, T, H], idx/w[R, T, K],
    y[R, C, H]. Returns per-rank arrays with a leading rank axis, named like run_ep."""
    R, T, K = idx.shape
    H = x.shape[2]
    el = E // R
    owner = np.where(idx >= 0, idx // el, -1)
    in_rank = (owner[..., None] == np.arange(R)).any(axis=2)  # [R_s, T, R_d]
    res = dict(
        recv_x=np.zeros((R, C, H), x.dtype), recv_idx=np.full((R, C, K), -1, np.int32),
        recv_w=np.zeros((R, C, K), np.float32), num_recv=np.zeros(R, np.int32),
        num_dropped=np.zeros(R, np.int32), per_expert=np.zeros((R, el), np.int32),
        src_rank=np.full((R, C), -1, np.int32), src_index=np.full((R, C), -1, np.int32),
        send_row=np.full((R, T, R), -1, np.int32))
    for r in range(R):
        rows = [(s, t) for s in range(R) for t in range(T) if in_rank[s, t, r]]
        kept = rows[:C]
        res["num_recv"][r] = len(kept)
        res["num_dropped"][r] = len(rows) - len(kept)
        for i, (s, t) in enumerate(kept):
            res["recv_x"][r, i] = x[s, t]
            local = np.where(owner[s, t] == r, idx[s, t] - r * el, -1)
            res["recv_idx"][r, i] = local
            res["recv_w"][r, i] = np.where(local >= 0, w[s, t], np.float32(0))
            for e in local[local >= 0]:
                res["per_expert"][r, e] += 1
            res["src_rank"][r, i] = s
            res["src_index"][r, i] = t
            res["send_row"][s, t, r] = i
    res["out"] = np_combine(y, res["send_row"])
    return res


def np_combine(y, send_row):
    """combine per the contract on per-rank rows y[R, C, ...] and the handles' send_row
    [R, T, R]: out[s, t] = float32 sum over receivers r, ascending, of y[r, send_row[s, t,
    r]] where it is >= 0, cast to y.dtype."""
    R, T, _ = send_row.shape
    out = np.zeros((R, T) + y.shape[2:], np.float32)
    for r in range(R):
        rows = send_row[:, :, r]
        out[rows >= 0] += y[r, rows[rows >= 0]].astype(np.float32)
    return out.astype(y.dtype)


def np_gather(g, src_rank, src_index):
    """combine's transpose per the contract on per-rank g[R, T, ...]: out[r, i] =
    g[src_rank[r, i], src_index[r, i]] for kept rows, zero elsewhere."""
    out = np.zeros(src_rank.shape + g.shape[2:], g.dtype)
    used = src_rank >= 0
    out[used] = g[src_rank[used], src_index[used]]
    return out


def bits(a):
    """A view of `a` as unsigned ints, so comparisons are bit for bit (NaN, -0.0)."""
    a = np.asarray(a)
    if a.dtype.kind == "f" or a.dtype == jnp.bfloat16:
        return a.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])
    return a


def assert_bitwise_equal(got: dict, want: dict, keys=None, what=""):
    for k in keys or want:
        g, w = np.asarray(got[k]), np.asarray(want[k])
        assert g.shape == w.shape, f"{what}{k}: shape {g.shape} != {w.shape}"
        assert g.dtype == w.dtype, f"{what}{k}: dtype {g.dtype} != {w.dtype}"
        if not np.array_equal(bits(g), bits(w)):
            bad = np.argwhere(bits(g) != bits(w))[:5].tolist()
            raise AssertionError(f"{what}{k} differs at {bad}:\n got {g}\nwant {w}")


# ---- the internode matrix on both transports (tests/emu/test_internode*_emu.py) ----------
# A module that names the `transport` fixture (pytestmark usefixtures) runs each of its
# tests over the emulated NVSHMEM and over the emulated NCCL GIN, with ids `nvshmem` and
# `nccl`; a test of one transport's own machinery says so with
# `@pytest.mark.transport_only("nvshmem")` and runs on that one alone.
TRANSPORTS = ("nvshmem", "nccl")  # tests/emu/internode_emu_util.py TRANSPORTS


def pytest_generate_tests(metafunc):
    if "transport" in metafunc.fixturenames:
        only = metafunc.definition.get_closest_marker("transport_only")
        params = list(only.args) if only else list(TRANSPORTS)
        metafunc.parametrize("transport", params, indirect=True, ids=params)


@pytest.fixture
def transport(request):
    import internode_emu_util  # tests/emu (its modules put it on sys.path)
    assert internode_emu_util.TRANSPORTS == TRANSPORTS
    old = internode_emu_util.DEFAULT["transport"]
    internode_emu_util.DEFAULT["transport"] = request.param
    yield request.param
    internode_emu_util.DEFAULT["transport"] = old
