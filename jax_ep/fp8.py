"""FP8 activations for dispatch: block-scaled float8_e4m3fn values and their packing.

`quantize(x)` turns x[..., H] into the pair (x_fp8 float8_e4m3fn [..., H], scales float32
[..., H // block]), one scale per 1 x block run of a row (`scale = amax / 448`).
`dequantize` inverts it up to the FP8 rounding.

`pack` puts one row's FP8 values and its scales into one row of H + 4 * H / block bytes
(H + H / 32 for block 128), viewed as PAYLOAD_DTYPE (a 16-bit float): every backend copies
16-bit rows bit for bit, so the pair travels through any dispatch unchanged. `unpack`
splits a payload row back into the pair.
"""
from __future__ import annotations

import operator

import jax
import jax.numpy as jnp
import numpy as np

# Largest finite float8_e4m3fn value, and its float32 reciprocal.
E4M3_MAX = 448.0
INV_E4M3_MAX = np.float32(1.0 / 448.0)
# The amax of an all-zero (or tiny) block is raised to this, so its scale is a finite,
# normal float32 and x / scale stays finite.
AMAX_FLOOR = 1e-10
DEFAULT_BLOCK = 128
FP8_DTYPE = jnp.dtype(jnp.float8_e4m3fn)
# The dtype a packed row travels as: 16 bits, one of the dtypes every backend moves.
PAYLOAD_DTYPE = jnp.dtype(jnp.bfloat16)


def _block(block) -> int:
    try:
        b = operator.index(block)
    except TypeError:
        raise TypeError(f"block must be a static Python int, got {block!r}") from None
    if b < 1:
        raise ValueError(f"block must be >= 1, got {b}")
    return b


def _check_hidden(name, hidden, block):
    if hidden % block != 0:
        raise ValueError(f"{name}'s last dim H={hidden} must be a multiple of block={block}")


def _ceil_pow2(s):
    """Smallest power of two >= s, for positive normal float32 s (exact: bit arithmetic,
    the UE8M0 rounding)."""
    bits = jax.lax.bitcast_convert_type(s, jnp.uint32)
    exponent = (bits >> 23) & jnp.uint32(0xFF)
    exponent = exponent + ((bits & jnp.uint32(0x7FFFFF)) != 0).astype(jnp.uint32)
    return jax.lax.bitcast_convert_type(exponent << 23, jnp.float32)


def quantize(x, *, block: int = DEFAULT_BLOCK, round_scale: bool = False):
    """x[..., H] (any float dtype) -> (x_fp8 float8_e4m3fn [..., H], scales float32
    [..., H // block]).

    Each 1 x block run of a row gets `scale = max(amax, AMAX_FLOOR) * float32(1 / 448)`
    (amax / 448 to within one rounding; amax in float32);
    with `round_scale=True` the scale is rounded up to a power of two (UE8M0). The values
    are `x / scale`, clipped to +-448, rounded to nearest even in FP8. The low-latency
    FP8 dispatch casts in its send kernels and CPU handlers with the same rule, stated
    once in C++ in kernels/common/fp8_quant.h: a change here must go there too.
    """
    block = _block(block)
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"x must be a float array, got {x.dtype}")
    if x.ndim < 1:
        raise ValueError(f"x must have at least one dim [..., H], got shape {x.shape}")
    H = x.shape[-1]
    _check_hidden("x", H, block)
    xb = x.astype(jnp.float32).reshape(*x.shape[:-1], H // block, block)
    amax = jnp.max(jnp.abs(xb), axis=-1)
    # A product, not a quotient: XLA may turn division by a constant into this product
    # anyway, and the product rounds the same way on every platform.
    scales = jnp.maximum(amax, jnp.float32(AMAX_FLOOR)) * INV_E4M3_MAX
    if round_scale:
        scales = _ceil_pow2(scales)
    q = jnp.clip(xb / scales[..., None], -E4M3_MAX, E4M3_MAX)
    return q.astype(FP8_DTYPE).reshape(x.shape), scales


def _check_pair(x_fp8, scales):
    x_fp8 = jnp.asarray(x_fp8)
    scales = jnp.asarray(scales)
    if x_fp8.dtype != FP8_DTYPE:
        raise TypeError(f"x_fp8 must be float8_e4m3fn, got {x_fp8.dtype}")
    if scales.dtype != jnp.float32:
        raise TypeError(f"scales must be float32, got {scales.dtype}")
    if x_fp8.ndim < 1 or scales.shape[:-1] != x_fp8.shape[:-1] or scales.ndim != x_fp8.ndim:
        raise ValueError(f"scales must have x_fp8's leading shape {x_fp8.shape[:-1]} and one "
                         f"last dim, got x_fp8 {x_fp8.shape}, scales {scales.shape}")
    nb = scales.shape[-1]
    H = x_fp8.shape[-1]
    if nb < 1 or H % nb != 0:
        raise ValueError(f"scales' last dim ({nb}) must divide x_fp8's last dim H={H}")
    return x_fp8, scales, H // nb


def dequantize(x_fp8, scales):
    """(x_fp8 float8_e4m3fn [..., H], scales float32 [..., H // block]) -> float32 [..., H],
    each block's values times its scale."""
    x_fp8, scales, block = _check_pair(x_fp8, scales)
    v = x_fp8.astype(jnp.float32).reshape(*scales.shape, block) * scales[..., None]
    return v.reshape(x_fp8.shape)


def is_pair(x) -> bool:
    """True for a (x_fp8, scales) pair as `dispatch` takes it in place of x."""
    return (isinstance(x, (tuple, list)) and len(x) == 2
            and jnp.dtype(getattr(x[0], "dtype", None) or jnp.float32) == FP8_DTYPE)


def payload_bytes(hidden: int, block: int = DEFAULT_BLOCK) -> int:
    """Bytes of one packed row: H FP8 values plus H // block float32 scales."""
    block = _block(block)
    _check_hidden("x", hidden, block)
    return hidden + 4 * (hidden // block)


def payload_width(hidden: int, block: int = DEFAULT_BLOCK) -> int:
    """Number of PAYLOAD_DTYPE elements of one packed row."""
    n = payload_bytes(hidden, block)
    if n % PAYLOAD_DTYPE.itemsize:
        raise ValueError(f"H={hidden} must be even to pack FP8 rows into 16-bit elements")
    return n // PAYLOAD_DTYPE.itemsize


def pack(x_fp8, scales):
    """(x_fp8 [..., H], scales float32 [..., H // block]) -> payload PAYLOAD_DTYPE
    [..., (H + 4 * H // block) // 2]: the row's FP8 bytes then its scales' bytes, bit for
    bit."""
    x_fp8, scales, block = _check_pair(x_fp8, scales)
    lead, H = x_fp8.shape[:-1], x_fp8.shape[-1]
    width = payload_width(H, block)
    vb = jax.lax.bitcast_convert_type(x_fp8, jnp.uint8)
    sb = jax.lax.bitcast_convert_type(scales, jnp.uint8).reshape(*lead, -1)
    row = jnp.concatenate([vb, sb], axis=-1).reshape(*lead, width, PAYLOAD_DTYPE.itemsize)
    return jax.lax.bitcast_convert_type(row, PAYLOAD_DTYPE)


def unpack(payload, *, block: int = DEFAULT_BLOCK):
    """payload PAYLOAD_DTYPE [..., W] from `pack` -> (x_fp8 [..., H], scales float32
    [..., H // block]), H = 2 * W * block / (block + 4)."""
    block = _block(block)
    payload = jnp.asarray(payload)
    if payload.dtype != PAYLOAD_DTYPE or payload.ndim < 1:
        raise TypeError(f"payload must be {PAYLOAD_DTYPE} [..., W] made by pack, got "
                        f"{payload.dtype} {payload.shape}")
    lead, W = payload.shape[:-1], payload.shape[-1]
    nbytes = W * PAYLOAD_DTYPE.itemsize
    H, rem = divmod(nbytes * block, block + 4)
    if rem or H % block or payload_bytes(H, block) != nbytes:
        raise ValueError(f"payload's last dim W={W} is not a packed row for block={block}")
    b = jax.lax.bitcast_convert_type(payload, jnp.uint8).reshape(*lead, nbytes)
    x_fp8 = jax.lax.bitcast_convert_type(b[..., :H], FP8_DTYPE)
    scales = jax.lax.bitcast_convert_type(
        b[..., H:].reshape(*lead, H // block, 4), jnp.float32)
    return x_fp8, scales
