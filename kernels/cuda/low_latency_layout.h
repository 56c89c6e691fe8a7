// The byte layout of one rank's low-latency buffer (kernels/cuda/low_latency_kernels.h
// describes the regions and the protocol). Host and device code without CUDA headers, so
// the CPU extension binds it too (intranode_ll_layout) and jax_ep.cuda sizes the area
// with it.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/common/low_latency_math.h"
#include "kernels/cuda/intranode_buffer.h"  // AlignUp, RowStride, kAreaAlign, JEP_HDX

namespace jax_ep {

// Bytes of the header (LowLatencyHeader; low_latency_kernels.h checks that it fits):
// fixed, so the host sizes the area without the struct.
constexpr size_t kLowLatencyHeaderBytes = 4096;

struct LowLatencyLayout {
  int R, E, M, K;
  size_t row_bytes, stride;
  int64_t rows_per_dest;
  // Offsets of half 0; half 1 of a region starts *_half bytes later.
  size_t slots_off, tok_off, counts_off, pos_off, pos_c_off, offsets_off, cstage_off, bytes;
  size_t slots_half, tok_half, counts_half, cstage_half;

  // Arrival words of half h: dispatch [E_local][R] (by source), then combine
  // [R][E_local] (by owner).
  JEP_HDX size_t dispatch_word_off(int h, int e, int s) const {
    return counts_off + h * counts_half + (static_cast<size_t>(e) * R + s) * 8;
  }
  JEP_HDX size_t combine_word_off(int h, int r, int e) const {
    return counts_off + h * counts_half + (static_cast<size_t>(E) + r * (E / R) + e) * 8;
  }

  JEP_HDX int experts_per_rank() const { return E / R; }
  JEP_HDX static LowLatencyLayout Make(int R, int M, size_t row_bytes, int K, int E) {
    LowLatencyLayout l;
    l.R = R;
    l.E = E;
    l.M = M;
    l.K = K;
    l.row_bytes = row_bytes;
    l.stride = RowStride(row_bytes);
    const size_t el = static_cast<size_t>(E / R);
    l.rows_per_dest = ll_rows_per_dest(M, K, E / R);
    const size_t slots = el * R * M;
    l.slots_half = AlignUp(slots * l.stride, kAreaAlign);
    l.tok_half = AlignUp(slots * 4, kAreaAlign);
    l.counts_half = AlignUp(el * R * 16, kAreaAlign);  // dispatch + combine words
    l.cstage_half = AlignUp(static_cast<size_t>(R) * l.rows_per_dest * l.stride, kAreaAlign);
    l.slots_off = kLowLatencyHeaderBytes;
    l.tok_off = l.slots_off + 2 * l.slots_half;
    l.counts_off = l.tok_off + 2 * l.tok_half;
    l.pos_off = l.counts_off + 2 * l.counts_half;
    l.pos_c_off = l.pos_off + AlignUp(static_cast<size_t>(M) * K * 4, kAreaAlign);
    l.offsets_off = l.pos_c_off + AlignUp(static_cast<size_t>(M) * K * 4, kAreaAlign);
    l.cstage_off = l.offsets_off + AlignUp(static_cast<size_t>(E) * 4, kAreaAlign);
    l.bytes = l.cstage_off + 2 * l.cstage_half;
    return l;
  }
};

}  // namespace jax_ep
