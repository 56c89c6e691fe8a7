// Math of the low-latency mode that the CPU and CUDA kernels must agree on bit for bit:
// element loads and stores by FloatKind, the weighted-sum step of combine (one float32
// product, then one float32 add, never fused), the fixed buffer sizes, and the index math
// of the CUDA buffers (slots, stage rows, call tags), which the CUDA kernels run on the
// emulated GPU (tests/emu/test_low_latency_emu.py) and the CPU kernels both follow.
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

// Owner's slot of source s's p-th row for local expert e: slots are [E_local][R][M_area],
// M_area being the M the buffer was sized for (a call may use fewer rows).
JEP_HD int64_t ll_slot(int e, int s, int p, int R, int M_area) {
  return (static_cast<int64_t>(e) * R + s) * M_area + p;
}

// Row of (local expert e, p-th row) in an owner's stage region for one source: that
// source's rows of the experts before e, then p. `per_expert[i * stride]` is the rows of
// local expert i (an owner reads its handle's row_count column, stride R; a source its
// own capped counts, stride 1), so both ends compute the same row.
JEP_HD int64_t ll_stage_row(const int32_t* per_expert, int stride, int e, int64_t p) {
  int64_t off = 0;
  for (int i = 0; i < e; ++i) off += per_expert[static_cast<int64_t>(i) * stride];
  return off + p;
}

// Epoch n of an op kind uses data half n % 2 (two send halves may be in flight).
JEP_HD int ll_half(uint64_t n) { return static_cast<int>(n & 1u); }

// A send half hands its epoch to the receive half as 31 bits in an int32 XLA buffer; the
// receive half recovers the full epoch from its own send counter `seq` (the latest epoch
// sent, never more than a few ahead of the one received).
constexpr uint32_t kLLEpochMask = 0x7fffffffu;
JEP_HD int32_t ll_epoch_low(uint64_t n) { return static_cast<int32_t>(n & kLLEpochMask); }
JEP_HD uint64_t ll_epoch_from_low(uint64_t seq, int32_t low) {
  const uint32_t back = (static_cast<uint32_t>(seq) - static_cast<uint32_t>(low)) & kLLEpochMask;
  return seq - back;
}

// Arrival word of one (expert, source) pair: the epoch in the high 32 bits, the pair's
// row count in the low 32. One release store of it follows the pair's rows, so a reader
// that sees its epoch also sees the rows and the count, and a word left from an older
// epoch (or zeroed by reset) never matches.
JEP_HD uint64_t ll_count_word(uint64_t n, int32_t count) {
  return (n << 32) | static_cast<uint32_t>(count);
}
JEP_HD bool ll_word_is_epoch(uint64_t word, uint64_t n) {
  return (word >> 32) == (n & 0xffffffffull);
}
JEP_HD int32_t ll_word_count(uint64_t word) {
  return static_cast<int32_t>(word & 0xffffffffull);
}

// 64-bit tag of one low-latency call: a rank writes it before each arrival signal and the
// receiver compares it with its own, so calls with other shapes, dtype (folded into
// `kind` by the caller) or call site never mix. Never 0 (an empty word) nor -1
// (kSiteFailed).
JEP_HD uint64_t ll_mix(uint64_t h, uint64_t v) {
  h ^= v + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
  h *= 0xff51afd7ed558ccdull;
  return h ^ (h >> 33);
}
JEP_HD int64_t ll_call_tag(int64_t call_site, int kind, int64_t S, int64_t K, int64_t M,
                           int64_t row_bytes, int64_t E) {
  uint64_t h = 0x6a65702d6c6cull;  // "jep-ll"
  const int64_t parts[7] = {call_site, kind, S, K, M, row_bytes, E};
  for (int i = 0; i < 7; ++i) h = ll_mix(h, static_cast<uint64_t>(parts[i]));
  int64_t t = static_cast<int64_t>(h >> 1);  // non-negative
  return t == 0 ? 1 : t;
}

}  // namespace jax_ep
