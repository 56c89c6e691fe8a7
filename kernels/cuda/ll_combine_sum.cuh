// The low-latency combine's receive sum, one implementation for the intranode
// (kernels/cuda/low_latency_kernels.cu) and internode (kernels/internode/low_latency_kernels.cu)
// kernels: out[t] = sum over k ascending of w[t, k] * row(t, k), each product rounded to
// float32 before its add (ll_weighted_add, never fused), the sum cast once. Slots without a
// row (id -1, a position past M, a foreign owner) add nothing: not even 0 * row, which
// would turn a -0 sum into +0 and a garbage NaN into the output.
//
// Why it is shaped so. A lane that loads one 16-byte vector of one row, adds it and loads
// the next waits a memory round trip per 16 bytes of every row (a 7168-wide bf16 token of
// top-8 is 7168 such waits over a warp); the receive is then bound by that one chain, not
// by bytes. Here:
// - work is an item (token, chunk): a chunk is kLLSumCols x 32 consecutive units of the
//   output row (16-byte vectors, or elements where rows are not whole vectors), each lane
//   taking units lane + 32 c; the items of all tokens are dealt over every warp of the
//   launch (the caller's grid, cut to the mode's SMs), not a warp per token;
// - per item, lane k first finds slot k's row and weight (one round for the whole top-k,
//   the lanes in parallel), then the rows are taken kLLSumRows at a time: each lane
//   issues the loads of kLLSumRows rows x kLLSumCols units before its first add, so
//   kLLSumRows x kLLSumCols x 16 = 256 bytes per lane (8 KiB per warp) are in flight per
//   round; the adds then run k ascending per element, as the contract orders them, and
//   each output unit is stored once.
// Rows are peer- or NIC-written (a peer's stores over NVLink, a landed put): loaded with
// the copy engine's CopySrc::kPeerWritten (.cg, never the non-coherent path).
#pragma once

#include <cstdint>

#include "kernels/common/dtype_convert.h"
#include "kernels/common/low_latency_math.h"
#include "kernels/cuda/copy_engine.cuh"

namespace jax_ep {

// Rows whose loads a lane issues before its first add, and output units per lane per item.
// 8 rows covers the usual top-8 in one batch; 8 x 2 vectors are 64 registers of loaded
// data beside 16 float32 sums, well inside a 256-thread block's 255 registers (no spills:
// tests/test_ptxas_spills.py).
constexpr int kLLSumRows = 8;
constexpr int kLLSumCols = 2;
// Output units (16-byte vectors or elements) one item covers.
constexpr int64_t kLLSumChunk = 32 * kLLSumCols;

// One slot of a token: its row (nullptr: the slot adds nothing) and weight.
struct LLSumSlot {
  const char* row;
  float w;
};

// Units of a row: 16-byte vectors where the row and the output allow them (`vec`), else
// elements.
__host__ __device__ __forceinline__ int64_t ll_sum_units(bool vec, int64_t row_bytes, int64_t H) {
  return vec ? row_bytes / 16 : H;
}

// Items per token: ceil(units / kLLSumChunk), at least 1 (a zero-width row still has a
// token to visit).
__host__ __device__ __forceinline__ int64_t ll_sum_chunks(int64_t units) {
  return units > kLLSumChunk ? (units + kLLSumChunk - 1) / kLLSumChunk : 1;
}

namespace llsum_detail {

template <FloatKind kKind>
constexpr int kPer = kKind == FloatKind::kF32 ? 4 : 8;  // elements per 16-byte vector

template <FloatKind kKind>
__device__ __forceinline__ float elem_of(const uint4& v, int j) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
  if constexpr (kKind == FloatKind::kF32) {
    return __uint_as_float(w[j]);
  } else {
    const uint16_t h = static_cast<uint16_t>(j & 1 ? w[j >> 1] >> 16 : w[j >> 1] & 0xffffu);
    return kKind == FloatKind::kBF16 ? bf16_to_f32(h) : f16_to_f32(h);
  }
}

template <FloatKind kKind>
__device__ __forceinline__ uint4 pack(const float* in) {
  uint32_t w[4];
  if constexpr (kKind == FloatKind::kF32) {
    for (int j = 0; j < 4; ++j) w[j] = __float_as_uint(in[j]);
  } else {
    for (int j = 0; j < 4; ++j) {
      const uint32_t lo = kKind == FloatKind::kBF16 ? f32_to_bf16(in[2 * j]) : f32_to_f16(in[2 * j]);
      const uint32_t hi =
          kKind == FloatKind::kBF16 ? f32_to_bf16(in[2 * j + 1]) : f32_to_f16(in[2 * j + 1]);
      w[j] = lo | (hi << 16);
    }
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// One element of a peer-written row, through a volatile load (not an L1 line cached
// before the peer's store; the copy engine's rule for narrow peer-written loads).
template <FloatKind kKind>
__device__ __forceinline__ float load_elem(const char* row, int64_t x) {
  if constexpr (kKind == FloatKind::kF32)
    return __uint_as_float(*reinterpret_cast<const volatile uint32_t*>(row + 4 * x));
  else if constexpr (kKind == FloatKind::kBF16)
    return bf16_to_f32(*reinterpret_cast<const volatile uint16_t*>(row + 2 * x));
  else
    return f16_to_f32(*reinterpret_cast<const volatile uint16_t*>(row + 2 * x));
}

template <FloatKind kKind>
__device__ __forceinline__ void store_elem(char* dst, int64_t x, float v) {
  if constexpr (kKind == FloatKind::kF32)
    *reinterpret_cast<float*>(dst + 4 * x) = v;
  else if constexpr (kKind == FloatKind::kBF16)
    *reinterpret_cast<uint16_t*>(dst + 2 * x) = f32_to_bf16(v);
  else
    *reinterpret_cast<uint16_t*>(dst + 2 * x) = f32_to_f16(v);
}

// Rows kg .. kg + kLLSumRows - 1 of the current 32-slot batch (`nb` slots in it), from
// the lanes that hold them; rows past the batch are nullptr. Every lane of the warp calls
// it together (the shuffles take the full mask).
__device__ __forceinline__ void batch_rows(const LLSumSlot& mine, int kg, int nb,
                                           const char* (&row)[kLLSumRows], float (&wk)[kLLSumRows]) {
#pragma unroll
  for (int u = 0; u < kLLSumRows; ++u) {
    const int src = (kg + u) & 31;
    row[u] = reinterpret_cast<const char*>(__shfl_sync(
        0xffffffffu, static_cast<unsigned long long>(reinterpret_cast<uintptr_t>(mine.row)), src));
    wk[u] = __shfl_sync(0xffffffffu, mine.w, src);
    if (kg + u >= nb) row[u] = nullptr;
  }
}

template <FloatKind kKind, class SlotOf>
__device__ __forceinline__ void sum_item(int K, int64_t units, bool vec, int64_t chunk, char* dst,
                                         const SlotOf& slot_of, bool nan_out, int lane) {
  const int64_t first = chunk * kLLSumChunk + lane;  // this lane's units: first + 32 c
  constexpr int kP = kPer<kKind>;
  // Sums of this lane's units, element j of unit c at acc[c][j] (vec), or acc[c][0].
  float acc[kLLSumCols][kP];
#pragma unroll
  for (int c = 0; c < kLLSumCols; ++c)
#pragma unroll
    for (int j = 0; j < kP; ++j) acc[c][j] = 0.0f;
  // Slots in batches of 32 (a lane each), rows of a batch kLLSumRows at a time; both
  // ascending, so every element's adds run k ascending.
  for (int kb = 0; kb < K; kb += 32) {
    LLSumSlot mine{nullptr, 0.0f};
    if (kb + lane < K) mine = slot_of(kb + lane);
    const int nb = K - kb < 32 ? K - kb : 32;
    for (int kg = 0; kg < nb; kg += kLLSumRows) {
      const char* row[kLLSumRows];
      float wk[kLLSumRows];
      batch_rows(mine, kg, nb, row, wk);
      if (vec) {
        // Every load of the batch before the first add.
        uint4 v[kLLSumRows][kLLSumCols];
#pragma unroll
        for (int u = 0; u < kLLSumRows; ++u)
#pragma unroll
          for (int c = 0; c < kLLSumCols; ++c)
            if (row[u] != nullptr && first + 32 * c < units)
              v[u][c] = engine_load16<CopySrc::kPeerWritten>(row[u] + (first + 32 * c) * 16);
#pragma unroll
        for (int u = 0; u < kLLSumRows; ++u)
#pragma unroll
          for (int c = 0; c < kLLSumCols; ++c)
            if (row[u] != nullptr && first + 32 * c < units)
#pragma unroll
              for (int j = 0; j < kP; ++j)
                acc[c][j] = ll_weighted_add(acc[c][j], wk[u], elem_of<kKind>(v[u][c], j));
      } else {
        float v[kLLSumRows][kLLSumCols];
#pragma unroll
        for (int u = 0; u < kLLSumRows; ++u)
#pragma unroll
          for (int c = 0; c < kLLSumCols; ++c)
            if (row[u] != nullptr && first + 32 * c < units)
              v[u][c] = load_elem<kKind>(row[u], first + 32 * c);
#pragma unroll
        for (int u = 0; u < kLLSumRows; ++u)
#pragma unroll
          for (int c = 0; c < kLLSumCols; ++c)
            if (row[u] != nullptr && first + 32 * c < units)
              acc[c][0] = ll_weighted_add(acc[c][0], wk[u], v[u][c]);
      }
    }
  }
  const float nan = __int_as_float(0x7fc00000);  // a failed call's sums: never plausible
#pragma unroll
  for (int c = 0; c < kLLSumCols; ++c) {
    const int64_t x = first + 32 * c;
    if (x >= units) continue;
    if (nan_out)
#pragma unroll
      for (int j = 0; j < kP; ++j) acc[c][j] = nan;
    if (vec) engine_store16(dst + x * 16, pack<kKind>(acc[c]));
    else store_elem<kKind>(dst, x, acc[c][0]);
  }
}

}  // namespace llsum_detail

// One item (token row `dst`, chunk `chunk` of its `units`) by the calling warp; every
// lane calls it with the same arguments (the slot shuffles take the full warp).
// slot_of(k) is slot k's row and weight (called by lane k % 32 only, for k < K); K = 0
// loads nothing. nan_out: a failed call's output, NaN in every element, no loads.
template <class SlotOf>
__device__ __forceinline__ void ll_sum_item(FloatKind kind, int K, int64_t units, bool vec,
                                            int64_t chunk, char* dst, const SlotOf& slot_of,
                                            bool nan_out, int lane) {
  if (nan_out) K = 0;
  switch (kind) {
    case FloatKind::kF32:
      llsum_detail::sum_item<FloatKind::kF32>(K, units, vec, chunk, dst, slot_of, nan_out, lane);
      break;
    case FloatKind::kBF16:
      llsum_detail::sum_item<FloatKind::kBF16>(K, units, vec, chunk, dst, slot_of, nan_out, lane);
      break;
    default:
      llsum_detail::sum_item<FloatKind::kF16>(K, units, vec, chunk, dst, slot_of, nan_out, lane);
      break;
  }
}

}  // namespace jax_ep
