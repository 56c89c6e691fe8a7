// The FP8 rule of jax_ep.fp8.quantize (block 128) as scalar code for host and device, and
// the low-latency FP8 message: what the CPU handlers and the CUDA send kernels compute
// must equal the pure-JAX quantize bit for bit, so the rule lives here once.
//   scale  = max(amax, 1e-10) * float32(1 / 448), amax = max |x| over a 1 x 128 block in
//            float32; with round_scale, rounded up to a power of two (exponent bits, as
//            jax_ep.fp8._ceil_pow2)
//   value  = float8_e4m3fn(clip(x / scale, -448, 448)), x / scale an IEEE float32
//            quotient, the cast round to nearest even (XLA's and ml_dtypes' convert)
// A block holding a NaN is outside the promise: XLA's reduce-max may drop or keep it.
// Message of one (token, destination) (kernels/cuda/low_latency_kernels.h,
// kernels/internode/low_latency_wire.h): H FP8 bytes, then H / 128 float32 scales, padded
// to 16 bytes.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/common/dtype_convert.h"  // bits_to_f32, f32_to_bits, JEP_HD

namespace jax_ep {

constexpr int kFp8Block = 128;
// float32(1 / 448) and float32(1e-10), the constants of jax_ep.fp8 (INV_E4M3_MAX,
// AMAX_FLOOR), by their bits so no compiler rounds them another way.
constexpr uint32_t kFp8InvMaxBits = 0x3b124925u;
constexpr uint32_t kFp8AmaxFloorBits = 0x2edbe6ffu;

// Bytes of one FP8 message of a row of H elements (H a multiple of 128).
JEP_HD constexpr size_t ll_fp8_msg_bytes(int64_t H) {
  return (static_cast<size_t>(H) + 4 * static_cast<size_t>(H / kFp8Block) + 15) / 16 * 16;
}
// Offset of the scales in a message.
JEP_HD constexpr size_t ll_fp8_scales_off(int64_t H) { return static_cast<size_t>(H); }

// The scale of a block whose max |x| is amax (a NaN amax stays NaN, as jnp.maximum keeps it).
JEP_HD float fp8_block_scale(float amax, bool round_scale) {
  const float floor = bits_to_f32(kFp8AmaxFloorBits);
  const float a = (amax != amax || amax > floor) ? amax : floor;
#if defined(__CUDA_ARCH__)
  const float s = __fmul_rn(a, bits_to_f32(kFp8InvMaxBits));
#else
  const float s = a * bits_to_f32(kFp8InvMaxBits);
#endif
  if (!round_scale) return s;
  const uint32_t b = f32_to_bits(s);
  const uint32_t e = ((b >> 23) & 0xffu) + ((b & 0x7fffffu) != 0 ? 1u : 0u);
  return bits_to_f32(e << 23);
}

// float32 -> float8_e4m3fn bits, round to nearest even; |v| above 448 saturates (callers
// clip first), NaN stays NaN.
JEP_HD uint8_t f32_to_e4m3fn(float v) {
  const uint32_t b = f32_to_bits(v);
  const uint8_t sign = static_cast<uint8_t>((b >> 24) & 0x80u);
  const uint32_t a = b & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7f;  // NaN
  if (a >= 0x43e00000u) return sign | 0x7e;  // 448 and above
  const int exp = static_cast<int>(a >> 23) - 127;
  if (exp < -6) {
    // Below the smallest normal 2^-6: a multiple of 2^-9, the 24-bit significand shifted
    // down by 14 - exp and rounded (8 = 2^-6 itself, the encoding of the smallest normal).
    if (a < 0x00800000u) return sign;  // float32 subnormal: far below 2^-10
    const uint32_t mm = (a & 0x7fffffu) | 0x800000u;
    const int shift = 14 - exp;  // >= 21
    if (shift > 25) return sign;
    uint32_t q = mm >> shift;
    const uint32_t rem = mm & ((1u << shift) - 1u), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (q & 1u))) ++q;
    return sign | static_cast<uint8_t>(q);
  }
  // Normal: 3 of 23 mantissa bits kept, nearest even (a carry moves into the exponent).
  const uint32_t r = a + 0x7ffffu + ((a >> 20) & 1u);
  const uint32_t out = ((((r >> 23) - 127u + 7u) & 0xfu) << 3) | ((r >> 20) & 7u);
  return sign | static_cast<uint8_t>(out > 0x7eu ? 0x7eu : out);
}

// One value of a block with scale s: clip(x / s, -448, 448) cast to FP8.
JEP_HD uint8_t fp8_quantize_value(float x, float s) {
#if defined(__CUDA_ARCH__)
  float q = __fdiv_rn(x, s);
#else
  float q = x / s;
#endif
  if (q > 448.0f) q = 448.0f;
  if (q < -448.0f) q = -448.0f;
  return f32_to_e4m3fn(q);
}

// |v| with NaN kept, and a max that keeps NaN (jnp.max of |x| propagates it).
JEP_HD float fp8_amax_step(float acc, float v) {
  const float m = v < 0.0f ? -v : v;
  if (acc != acc || m != m) return acc != acc ? acc : m;
  return m > acc ? m : acc;
}

// A whole message from a row of H elements of `kind` (host code: the CPU handlers).
inline void fp8_quantize_row(FloatKind kind, const void* row, int64_t H, bool round_scale,
                             uint8_t* msg) {
  float* scales = reinterpret_cast<float*>(msg + ll_fp8_scales_off(H));
  for (int64_t b = 0; b < H / kFp8Block; ++b) {
    float amax = 0.0f;
    float v[kFp8Block];
    for (int j = 0; j < kFp8Block; ++j) {
      const int64_t h = b * kFp8Block + j;
      switch (kind) {
        case FloatKind::kF32: v[j] = static_cast<const float*>(row)[h]; break;
        case FloatKind::kBF16: v[j] = bf16_to_f32(static_cast<const uint16_t*>(row)[h]); break;
        default: v[j] = f16_to_f32(static_cast<const uint16_t*>(row)[h]); break;
      }
      amax = fp8_amax_step(amax, v[j]);
    }
    const float s = fp8_block_scale(amax, round_scale);
    for (int j = 0; j < kFp8Block; ++j) msg[b * kFp8Block + j] = fp8_quantize_value(v[j], s);
    scales[b] = s;
  }
  for (size_t i = static_cast<size_t>(H) + 4 * static_cast<size_t>(H / kFp8Block);
       i < ll_fp8_msg_bytes(H); ++i)
    msg[i] = 0;
}

}  // namespace jax_ep
