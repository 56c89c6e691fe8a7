"""FP8 low-latency dispatch helpers of the emulated tests: the reference backend's FP8
dispatch (jax_ep.fp8.quantize's rule) and rows that reach FP8's edges."""
from __future__ import annotations

import functools

import jax
import ml_dtypes
import numpy as np
from jax.sharding import PartitionSpec as P

from emu_intranode_util import mesh
from jax_ep import low_latency as ll


@functools.lru_cache(maxsize=None)
def _program(R, E, M, round_scale):
    def f(x, idx):
        (q, s), cnt, h = ll.dispatch(x, idx, num_experts=E, axis_name="ep",
                                     max_tokens_per_rank=M, fp8=True,
                                     round_scale=round_scale, backend="reference")
        return dict(recv_x=q[None], recv_scales=s[None], recv_count=cnt[None],
                    src_rank=h.src_rank[None], src_index=h.src_index[None],
                    first_row=h.first_row[None], row_count=h.row_count[None])

    return jax.jit(jax.shard_map(f, mesh=mesh(R), in_specs=P("ep"), out_specs=P("ep")))


def fp8_reference(x, idx, *, E, M, round_scale):
    """The reference backend's FP8 low-latency dispatch of x[R, S, H] with idx[R, S, K],
    per rank: recv_x (float8_e4m3fn), recv_scales and the handle, as NumPy arrays."""
    R = x.shape[0]
    flat = lambda a: a.reshape((a.shape[0] * a.shape[1],) + a.shape[2:])  # noqa: E731
    res = _program(R, E, M, bool(round_scale))(flat(x), flat(idx))
    return {k: np.asarray(v) for k, v in res.items()}


def fp8_rows(R, S, H, dtype, rng):
    """x[R, S, H] of a dtype name whose 1 x 128 blocks reach FP8's edges: plain normals;
    values at and near 448 with ties between FP8 neighbours (amax 448: scale 1); values
    landing on FP8 subnormals and their ties; zeros; tiny values (amax below the floor)."""
    x = rng.standard_normal((R, S, H)).astype(np.float32) * 3
    nb = H // 128
    for r in range(R):
        for t in range(S):
            kind = (r * S + t) % 5
            b = (r + t) % nb
            blk = x[r, t, b * 128:(b + 1) * 128]
            if kind == 1:
                blk[:] = rng.choice([448.0, -448.0, 416.0, 432.0, 440.0, 424.0, 17.0, 18.0,
                                     0.59375, 0.53125], 128)
            elif kind == 2:
                # k * 2^-9 are FP8 subnormals; (2k + 1) * 2^-10 ties between two of them
                blk[:] = rng.choice([2.0 ** -9, 3 * 2.0 ** -10, 2.0 ** -7, 5 * 2.0 ** -10,
                                     9 * 2.0 ** -10, 2.0 ** -6, 7 * 2.0 ** -10, 5 * 2.0 ** -11],
                                    128) * rng.choice([1, -1], 128)
                blk[0] = 448.0
            elif kind == 3:
                blk[:] = 0.0
            elif kind == 4:
                blk[:] *= 1e-12
    return x.astype({"f32": np.float32, "bf16": ml_dtypes.bfloat16, "f16": np.float16}[dtype])


def fp8_msg_bytes(H):
    """Bytes of one FP8 message (kernels/common/fp8_quant.h)."""
    return (H + 4 * (H // 128) + 15) // 16 * 16
