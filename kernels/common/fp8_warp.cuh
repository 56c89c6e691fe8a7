// The warp-wide FP8 cast of one token row into a low-latency FP8 message (the layout and
// the scalar rule of kernels/common/fp8_quant.h), shared by the intranode and internode
// low-latency send kernels. CUDA device code (and the emulated GPU's build of it).
#pragma once

#include <cstdint>

#include "kernels/common/dtype_convert.h"
#include "kernels/common/fp8_quant.h"

namespace jax_ep {

// Eight elements of a row at element e0 (one 16-byte load of bf16/f16, two of f32),
// widened to float32.
template <class Load16>
__device__ __forceinline__ void fp8_load8(FloatKind kind, const char* row, int64_t e0, float* v,
                                          Load16 load16) {
  if (kind == FloatKind::kF32) {
    const uint4 a = load16(row + e0 * 4), b = load16(row + e0 * 4 + 16);
    const uint32_t w[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
    for (int j = 0; j < 8; ++j) v[j] = bits_to_f32(w[j]);
    return;
  }
  const uint4 a = load16(row + e0 * 2);
  const uint32_t w[4] = {a.x, a.y, a.z, a.w};
  for (int j = 0; j < 4; ++j) {
    const uint16_t lo = static_cast<uint16_t>(w[j] & 0xffffu), hi = static_cast<uint16_t>(w[j] >> 16);
    v[2 * j] = kind == FloatKind::kBF16 ? bf16_to_f32(lo) : f16_to_f32(lo);
    v[2 * j + 1] = kind == FloatKind::kBF16 ? bf16_to_f32(hi) : f16_to_f32(hi);
  }
}

// FP8 bytes of four values with scale s, the first in the lowest byte.
__device__ __forceinline__ uint32_t fp8_word(const float* v, float s) {
  uint32_t w = 0;
  for (int j = 0; j < 4; ++j) w |= static_cast<uint32_t>(fp8_quantize_value(v[j], s)) << (8 * j);
  return w;
}

// A warp casts one row of H elements (H a multiple of 128, src and dst 16-byte aligned)
// into an FP8 message at dst, four 1 x 128 blocks per step: eight lanes per block,
// sixteen elements per lane kept in registers; the block's amax by shuffles among its
// eight lanes; each lane stores its sixteen FP8 bytes at once (store16), the block's
// first lane its scale after the values (store4). load16 reads 16 bytes of the row.
template <class Load16, class Store16, class Store4>
__device__ void fp8_warp_cast_row(char* dst, const char* src, int64_t H, FloatKind kind,
                                  bool round_scale, int lane, Load16 load16, Store16 store16,
                                  Store4 store4) {
  constexpr int kLanesPerBlock = kFp8Block / 16;
  const int64_t nb = H / kFp8Block;
  const int sub = lane % kLanesPerBlock;
  float* scales = reinterpret_cast<float*>(dst + ll_fp8_scales_off(H));
  for (int64_t b0 = 0; b0 < nb; b0 += 32 / kLanesPerBlock) {
    const int64_t b = b0 + lane / kLanesPerBlock;
    const bool on = b < nb;
    const int64_t e0 = b * kFp8Block + sub * 16;
    float v[16];
    float amax = 0.0f;
    if (on) {
      fp8_load8(kind, src, e0, v, load16);
      fp8_load8(kind, src, e0 + 8, v + 8, load16);
      for (int j = 0; j < 16; ++j) amax = fp8_amax_step(amax, v[j]);
    }
    for (int o = kLanesPerBlock / 2; o >= 1; o /= 2)
      amax = fp8_amax_step(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    if (!on) continue;
    const float s = fp8_block_scale(amax, round_scale);
    store16(dst + e0, make_uint4(fp8_word(v, s), fp8_word(v + 4, s), fp8_word(v + 8, s),
                                 fp8_word(v + 12, s)));
    if (sub == 0) store4(scales + b, s);
  }
}

}  // namespace jax_ep
