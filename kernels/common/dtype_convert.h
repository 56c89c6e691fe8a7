// Scalar conversions between float32 and the 16-bit float formats, round to nearest
// even, NaN kept quiet: the same results XLA's convert gives, so the CPU and CUDA
// combines are bit-identical to the pure-JAX reference. One definition for host and
// device code.
#pragma once

#include <cstdint>
#include <cstring>

#include "kernels/common/layout_math.h"  // JEP_HD

namespace jax_ep {

// The float formats of token rows, for the CPU, intranode and internode code alike.
enum class FloatKind : int { kF32 = 0, kBF16 = 1, kF16 = 2 };

JEP_HD constexpr int FloatKindBytes(FloatKind k) { return k == FloatKind::kF32 ? 4 : 2; }

JEP_HD float bits_to_f32(uint32_t b) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(b);
#else
  float f;
  std::memcpy(&f, &b, 4);
  return f;
#endif
}
JEP_HD uint32_t f32_to_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
#endif
}

JEP_HD float bf16_to_f32(uint16_t h) { return bits_to_f32(static_cast<uint32_t>(h) << 16); }

JEP_HD uint16_t f32_to_bf16(float f) {
  uint32_t b = f32_to_bits(f);
  if ((b & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((b >> 16) | 0x40u);
  const uint32_t lsb = (b >> 16) & 1u;
  b += 0x7fffu + lsb;
  return static_cast<uint16_t>(b >> 16);
}

JEP_HD float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  if (exp == 0) {
    if (mant == 0) return bits_to_f32(sign);
    // Subnormal half: renormalise into a float32 normal.
    int e = -1;
    do {
      ++e;
      mant <<= 1;
    } while ((mant & 0x400u) == 0);
    mant &= 0x3ffu;
    return bits_to_f32(sign | static_cast<uint32_t>(127 - 15 - e) << 23 | mant << 13);
  }
  if (exp == 31) return bits_to_f32(sign | 0x7f800000u | mant << 13 | (mant ? 0x400000u : 0u));
  return bits_to_f32(sign | (exp + 127 - 15) << 23 | mant << 13);
}

JEP_HD uint16_t f32_to_f16(float f) {
  const uint32_t b = f32_to_bits(f);
  const uint16_t sign = static_cast<uint16_t>((b >> 16) & 0x8000u);
  const uint32_t absb = b & 0x7fffffffu;
  if (absb > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u | ((absb >> 13) & 0x3ffu));
  if (absb >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to inf
  if (absb < 0x38800000u) {
    // Result is subnormal or zero: shift the full mantissa and round to nearest even.
    if (absb < 0x33000000u) return sign;  // below half the smallest subnormal
    const uint32_t e = absb >> 23;
    const uint32_t m = (absb & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126u - e;  // 14 + (113 - e) - ... puts the result in 10 bits
    const uint32_t q = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1u);
    const uint32_t half = 1u << (shift - 1u);
    uint32_t r = q;
    if (rem > half || (rem == half && (q & 1u))) ++r;
    return static_cast<uint16_t>(sign | r);
  }
  uint32_t v = absb - (112u << 23);  // rebias exponent from 127 to 15
  const uint32_t lsb = (v >> 13) & 1u;
  v += 0xfffu + lsb;
  return static_cast<uint16_t>(sign | (v >> 13));
}

}  // namespace jax_ep
