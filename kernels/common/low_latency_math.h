// Math of the low-latency mode that the CPU and CUDA kernels must agree on bit for bit:
// element loads and stores by FloatKind, the weighted-sum step of combine (one float32
// product, then one float32 add, never fused), and the fixed buffer sizes.
#pragma once

#include <cstdint>

#include "kernels/common/dtype_convert.h"
#include "kernels/common/layout_math.h"  // JEP_HD

namespace jax_ep {

JEP_HD float ll_load(FloatKind k, const void* row, int64_t h) {
  switch (k) {
    case FloatKind::kF32: return static_cast<const float*>(row)[h];
    case FloatKind::kBF16: return bf16_to_f32(static_cast<const uint16_t*>(row)[h]);
    default: return f16_to_f32(static_cast<const uint16_t*>(row)[h]);
  }
}

JEP_HD void ll_store(FloatKind k, void* row, int64_t h, float v) {
  switch (k) {
    case FloatKind::kF32: static_cast<float*>(row)[h] = v; break;
    case FloatKind::kBF16: static_cast<uint16_t*>(row)[h] = f32_to_bf16(v); break;
    default: static_cast<uint16_t*>(row)[h] = f32_to_f16(v); break;
  }
}

// acc + w * v with the product rounded to float32 first, as XLA computes the reference's
// `acc + w * y` (the CPU build compiles these kernels with -ffp-contract=off).
JEP_HD float ll_weighted_add(float acc, float w, float v) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(acc, __fmul_rn(w, v));
#else
  return acc + w * v;
#endif
}

// Rows one expert owner returns to one source rank in combine: each of the source's M
// tokens names at most min(K, E_local) of the owner's experts.
JEP_HD int64_t ll_rows_per_dest(int64_t M, int64_t K, int64_t experts_per_rank) {
  return M * (K < experts_per_rank ? K : experts_per_rank);
}

}  // namespace jax_ep
