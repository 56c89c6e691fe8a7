"""FP8 (jax_ep.fp8): quantize against a NumPy model (ml_dtypes) bit for bit, packing, and
FP8 pairs through dispatch on the reference and CPU ffi backends, per shard and in the
global view: received values and scales are bit-exact copies (every byte pattern,
NaNs included); dispatch -> dequantize -> combine stays within the quantization error of
the bf16 path."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_ep
import jax_ep.sharded as sh
from conftest import BACKENDS, bits, ep_mesh, np_model
from jax_ep import fp8

R, E, K = 8, 16, 2


# ----------------------------------------------------------------------------- model

def np_quantize(x, block=128, round_scale=False):
    """The format in NumPy: per 1 x block run, scale = max(amax, floor) * float32(1/448),
    optionally rounded up to a power of two; values x / scale, clipped, rounded to
    nearest even in float8_e4m3fn by ml_dtypes."""
    x = np.asarray(x, np.float32)
    H = x.shape[-1]
    xb = x.reshape(*x.shape[:-1], H // block, block)
    amax = np.abs(xb).max(axis=-1)
    s = np.maximum(amax, np.float32(fp8.AMAX_FLOOR)) * np.float32(1 / 448)
    if round_scale:
        m, e = np.frexp(s)  # s = m * 2**e, m in [0.5, 1)
        s = np.where(m == 0.5, s, np.ldexp(np.float32(1.0), e)).astype(np.float32)
    q = np.clip(xb / s[..., None], -448.0, 448.0).astype(ml_dtypes.float8_e4m3fn)
    return q.reshape(x.shape), s


@pytest.mark.parametrize("round_scale", [False, True])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("shape,block", [((5, 256), 128), ((2, 3, 128), 128), ((4, 96), 32)])
def test_quantize_matches_numpy_bit_for_bit(shape, block, dtype, round_scale):
    rng = np.random.default_rng(0)
    x = rng.standard_normal(shape) * np.exp(rng.uniform(-8, 8, shape[:-1] + (1,)))
    x = np.array(jnp.asarray(x, dtype))  # the values quantize sees
    x.reshape(-1, shape[-1])[0, :block] = 0.0  # an all-zero block
    q, s = fp8.quantize(jnp.asarray(x), block=block, round_scale=round_scale)
    wq, ws = np_quantize(np.asarray(x, np.float32), block, round_scale)
    assert q.dtype == jnp.float8_e4m3fn and q.shape == x.shape
    assert s.dtype == jnp.float32 and s.shape == shape[:-1] + (shape[-1] // block,)
    np.testing.assert_array_equal(np.asarray(q).view(np.uint8), wq.view(np.uint8))
    np.testing.assert_array_equal(bits(s), bits(ws))
    assert np.all(np.isfinite(np.asarray(s))) and np.all(np.asarray(s) > 0)
    if round_scale:
        m, _ = np.frexp(np.asarray(s))
        assert np.all(m == 0.5), "UE8M0 scales are powers of two"
    # Dequantized values are within half an FP8 step (3 mantissa bits) of x.
    d = np.asarray(fp8.dequantize(q, s))
    sb = np.repeat(np.asarray(s), block, axis=-1).reshape(x.shape)
    err = np.abs(d - np.asarray(x, np.float32))
    assert np.all(err <= np.maximum(np.abs(x).astype(np.float32) / 16, sb * 2.0 ** -9) + 0)


def test_quantize_errors_name_the_argument():
    with pytest.raises(ValueError, match=r"x's last dim H=100 must be a multiple of block=128"):
        fp8.quantize(jnp.zeros((2, 100)))
    with pytest.raises(TypeError, match=r"x must be a float array"):
        fp8.quantize(jnp.zeros((2, 128), jnp.int32))
    with pytest.raises(ValueError, match=r"block must be >= 1"):
        fp8.quantize(jnp.zeros((2, 128)), block=0)
    q, s = fp8.quantize(jnp.ones((2, 256)))
    with pytest.raises(TypeError, match=r"scales must be float32"):
        fp8.dequantize(q, s.astype(jnp.bfloat16))
    with pytest.raises(TypeError, match=r"x_fp8 must be float8_e4m3fn"):
        fp8.dequantize(q.astype(jnp.float32), s)
    with pytest.raises(ValueError, match=r"scales must have x_fp8's leading shape"):
        fp8.dequantize(q, s[:1])


def _random_pair(rng, lead, H, block=128):
    """Arbitrary bytes: every FP8 pattern (NaNs 0x7f/0xff included) and scale words that
    are NaNs with payloads, infinities, denormals and negative zero."""
    q = rng.integers(0, 256, lead + (H,), dtype=np.uint8)
    q.reshape(-1)[:256] = np.arange(256, dtype=np.uint8)[: q.size]
    s = rng.integers(0, 2**32, lead + (H // block,), dtype=np.uint64).astype(np.uint32)
    special = np.array([0x7FC00001, 0xFFA5A5A5, 0x7F800000, 0x80000000, 0x00000001,
                        0x7F800001], np.uint32)
    s.reshape(-1)[: special.size] = special[: s.size]
    return (jnp.asarray(q.view(ml_dtypes.float8_e4m3fn)), jnp.asarray(s.view(np.float32)))


def test_pack_unpack_bit_exact():
    rng = np.random.default_rng(1)
    q, s = _random_pair(rng, (3, 4), 256)
    p = fp8.pack(q, s)
    assert p.dtype == fp8.PAYLOAD_DTYPE and p.shape == (3, 4, (256 + 256 // 32) // 2)
    assert fp8.payload_bytes(256) == 256 + 256 // 32
    q2, s2 = fp8.unpack(p)
    np.testing.assert_array_equal(np.asarray(q2).view(np.uint8), np.asarray(q).view(np.uint8))
    np.testing.assert_array_equal(bits(s2), bits(s))
    with pytest.raises(ValueError, match=r"not a packed row for block=128"):
        fp8.unpack(p[..., :-1])


# ----------------------------------------------------------------------------- dispatch

@functools.lru_cache(maxsize=None)
def _per_shard(backend, C):
    def f(q, s, idx, w):
        (rq, rs), ri, rw, h = jax_ep.dispatch((q, s), idx, w, num_experts=E, axis_name="ep",
                                              capacity=C, backend=backend)
        return rq, rs, h.src_rank, h.src_index
    return jax.jit(jax.shard_map(f, mesh=ep_mesh(R), in_specs=P("ep"), out_specs=P("ep")))


def _expected_rows(a, src_rank, src_index, T):
    """a[R*T, ...] gathered at (src_rank, src_index) per receiver; zero bytes in empty
    rows."""
    a = np.asarray(a)
    src_rank, src_index = np.asarray(src_rank), np.asarray(src_index)
    raw = a.view(np.uint8).reshape(a.shape[0], -1)
    out = np.zeros((src_rank.size, raw.shape[1]), np.uint8)
    used = src_rank >= 0
    out[used] = raw[src_rank[used] * T + src_index[used]]
    return out


@pytest.mark.parametrize("backend", BACKENDS)
def test_dispatch_fp8_pair_is_bit_exact(backend):
    T, H, C = 6, 256, 20  # C below R * T: some rows dropped, some empty rows elsewhere
    rng = np.random.default_rng(2)
    q, s = _random_pair(rng, (R * T,), H)
    idx = jnp.asarray(rng.integers(-1, E, (R * T, K)), jnp.int32)
    w = jnp.asarray(rng.random((R * T, K)), jnp.float32)
    rq, rs, src_rank, src_index = _per_shard(backend, C)(q, s, idx, w)
    assert rq.dtype == jnp.float8_e4m3fn and rq.shape == (R * C, H)
    assert rs.dtype == jnp.float32 and rs.shape == (R * C, H // 128)
    assert np.any(np.asarray(src_rank) >= 0)
    np.testing.assert_array_equal(np.asarray(rq).view(np.uint8).reshape(R * C, -1),
                                  _expected_rows(q, src_rank, src_index, T))
    np.testing.assert_array_equal(np.asarray(rs).view(np.uint8).reshape(R * C, -1),
                                  _expected_rows(s, src_rank, src_index, T))


@pytest.mark.parametrize("backend", BACKENDS)
def test_sharded_dispatch_fp8_pair_is_bit_exact(backend):
    T, H, C = 4, 128, 16
    rng = np.random.default_rng(3)
    q, s = _random_pair(rng, (R * T,), H)
    idx = jnp.asarray(rng.integers(-1, E, (R * T, K)), jnp.int32)
    w = jnp.asarray(rng.random((R * T, K)), jnp.float32)
    mesh = jax.make_mesh((R,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,))

    def f(q, s, idx, w):
        (rq, rs), _, _, h = sh.dispatch((q, s), idx, w, num_experts=E, mesh_axis="ep",
                                        capacity=C, backend=backend)
        return rq, rs, h.src_rank, h.src_index

    with jax.set_mesh(mesh):
        rq, rs, src_rank, src_index = jax.jit(f)(q, s, idx, w)
    np.testing.assert_array_equal(np.asarray(rq).view(np.uint8).reshape(R * C, -1),
                                  _expected_rows(q, src_rank, src_index, T))
    np.testing.assert_array_equal(np.asarray(rs).view(np.uint8).reshape(R * C, -1),
                                  _expected_rows(s, src_rank, src_index, T))


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp8_round_trip_within_quantization_error_of_bf16(backend):
    """dispatch (FP8) -> dequantize -> expert -> combine against the same with bf16 rows:
    the difference is bounded by the FP8 rounding (3 mantissa bits), and the FP8 error is
    far above bf16's own."""
    T, H = 8, 256
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.standard_normal((R * T, H)), jnp.bfloat16)
    idx = jnp.asarray(rng.integers(0, E, (R * T, K)), jnp.int32)
    w = jnp.asarray(rng.random((R * T, K)), jnp.float32)
    mesh = ep_mesh(R)

    def expert(rx, rw):  # a per-row weighted identity: out[t] = sum_k w[t, k] * x[t]
        return (rx.astype(jnp.float32) * jnp.sum(rw, axis=1, keepdims=True))

    def f(x, idx, w):
        rx, _, rw, h = jax_ep.dispatch(x, idx, w, num_experts=E, axis_name="ep",
                                       backend=backend)
        ref = jax_ep.combine(expert(rx, rw).astype(jnp.bfloat16), h, backend=backend)
        (rq, rs), _, rw8, h8 = jax_ep.dispatch(fp8.quantize(x), idx, w, num_experts=E,
                                               axis_name="ep", backend=backend)
        got = jax_ep.combine(expert(fp8.dequantize(rq, rs), rw8).astype(jnp.bfloat16), h8,
                             backend=backend)
        return ref, got

    ref, got = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))(
        x, idx, w)
    ref, got = np.asarray(ref, np.float32), np.asarray(got, np.float32)
    wsum = np.asarray(w).sum(1, keepdims=True)
    # Each element's FP8 error is at most half a step: |x| / 16 for normal FP8 values,
    # scale * 2**-10 for subnormal ones; bf16 casts add 2**-8 relative per rank.
    _, s = fp8.quantize(x)
    step = np.repeat(np.asarray(s), 128, axis=-1) * 2.0 ** -10
    bound = wsum * np.maximum(np.abs(np.asarray(x, np.float32)) / 16, step) + \
        np.abs(ref) * 2 ** -6 + 1e-6
    assert np.all(np.abs(got - ref) <= bound)
    assert np.abs(got - ref).max() > 0  # FP8 really was used


def test_bench_fp8_reports_payload_bytes():
    from jax_ep.bench import exchange as bench
    rep = bench.fp8_main(["--quick", "--tokens", "16", "--hidden", "256", "--repeats", "1",
                          "--warmup", "0", "--experts", "16", "--topk", "2"])
    assert rep["payload_bytes_per_row"] == {"bfloat16": 2 * 256, "fp8": 256 + 256 // 32}
    by = {(r["backend"], r["format"]): r for r in rep["results"]}
    for b in ("ffi", "reference"):
        assert by[(b, "fp8")]["rows"] == by[(b, "bfloat16")]["rows"] > 0
        assert by[(b, "fp8")]["bytes"] * 512 == by[(b, "bfloat16")]["bytes"] * 264
    with pytest.raises(SystemExit):
        bench.fp8_main(["--quick", "--hidden", "100"])
