// CPU kernels of the low-latency mode; see low_latency_kernels.h. Built with
// -ffp-contract=off so combine's float32 steps round like the reference's.
#include "kernels/cpu/low_latency_kernels.h"

#include <algorithm>
#include <cstring>
#include <sstream>
#include <vector>

#include "kernels/common/low_latency_math.h"
#include "kernels/cpu/cpu_kernels.h"  // AdviseHugePages

namespace jax_ep {

std::string CheckLowLatencyIds(const int32_t* topk_idx, int S, int K, int E) {
  for (int t = 0; t < S; ++t) {
    const int32_t* row = topk_idx + static_cast<int64_t>(t) * K;
    for (int k = 0; k < K; ++k) {
      if (row[k] < -1 || row[k] >= E) {
        std::ostringstream m;
        m << "topk_idx[" << t << ", " << k << "] = " << row[k] << " is outside [-1, " << E
          << ") (num_experts=" << E << ")";
        return m.str();
      }
      for (int j = 0; j < k; ++j) {
        if (row[k] >= 0 && row[j] == row[k]) {
          std::ostringstream m;
          m << "jax_ep.low_latency: topk_idx[" << t << "] names expert " << row[k]
            << " more than once (duplicate ids in one token's top-k)";
          return m.str();
        }
      }
    }
  }
  return {};
}

void ExpertCountsCpu(const int32_t* topk_idx, int S, int K, int E, int32_t* counts) {
  std::fill(counts, counts + E, 0);
  for (int64_t i = 0; i < static_cast<int64_t>(S) * K; ++i)
    if (topk_idx[i] >= 0) ++counts[topk_idx[i]];
}

void LowLatencyDispatchRecvCpu(int me, const LowLatencyShape& s, const void* const* src_x,
                               const int32_t* const* src_idx,
                               const int32_t* const* src_counts, void* recv_x,
                               int32_t* recv_count, int32_t* src_rank, int32_t* src_index,
                               int32_t* first_row, int32_t* row_count) {
  const int R = s.num_ranks, el = s.experts_per_rank(), M = s.max_tokens;
  const int64_t RM = s.block_rows();
  const size_t rb = s.row_bytes;
  const int lo = me * el;
  for (int e = 0; e < el; ++e) {
    int32_t total = 0;
    for (int src = 0; src < R; ++src) {
      const int32_t n = std::min(src_counts[src][lo + e], M);
      first_row[e * R + src] = total;
      row_count[e * R + src] = n;
      total += n;
    }
    recv_count[e] = total;
  }
  char* out = static_cast<char*>(recv_x);
  // The fixed blocks are large (E * M * H elements per rank) and fresh from XLA: fault
  // them in 2 MiB at a time.
  AdviseHugePages(out, static_cast<size_t>(el * RM) * rb);
  std::vector<int32_t> next(el);
  for (int src = 0; src < R; ++src) {
    for (int e = 0; e < el; ++e) next[e] = first_row[e * R + src];
    const char* x = static_cast<const char*>(src_x[src]);
    const int32_t* idx = src_idx[src];
    // The counts bound the scan: stop after this source's last row for us.
    int64_t left = 0;
    for (int e = 0; e < el; ++e) left += row_count[e * R + src];
    for (int t = 0; t < s.stage_rows && left > 0; ++t) {
      const int32_t* irow = idx + static_cast<int64_t>(t) * s.topk;
      for (int k = 0; k < s.topk; ++k) {
        const int32_t e = irow[k] - lo;
        if (irow[k] < 0 || e < 0 || e >= el) continue;
        const int32_t row = next[e];
        if (row >= first_row[e * R + src] + row_count[e * R + src]) continue;  // past M
        next[e] = row + 1;
        --left;
        const int64_t i = e * RM + row;
        std::memcpy(out + i * rb, x + static_cast<int64_t>(t) * rb, rb);
        src_rank[i] = src;
        src_index[i] = t;
      }
    }
  }
  for (int e = 0; e < el; ++e) {
    const int64_t i = e * RM + recv_count[e];
    const int64_t n = RM - recv_count[e];
    std::memset(out + i * rb, 0, static_cast<size_t>(n) * rb);
    std::fill(src_rank + i, src_rank + i + n, -1);
    std::fill(src_index + i, src_index + i + n, -1);
  }
}

std::string LowLatencyCombineStageCpu(const LowLatencyShape& s, const void* y,
                                      const int32_t* first_row, const int32_t* row_count,
                                      int64_t rows_per_dest, void* stage) {
  const int R = s.num_ranks, el = s.experts_per_rank();
  const int64_t RM = s.block_rows();
  const size_t rb = s.row_bytes;
  const char* yb = static_cast<const char*>(y);
  char* st = static_cast<char*>(stage);
  AdviseHugePages(st, static_cast<size_t>(R * rows_per_dest) * rb);
  for (int d = 0; d < R; ++d) {
    int64_t off = 0;
    for (int e = 0; e < el; ++e) {
      const int64_t first = first_row[e * R + d], n = row_count[e * R + d];
      if (first < 0 || n < 0 || first + n > RM || off + n > rows_per_dest)
        return "jax_ep.low_latency: handle.first_row/row_count do not fit y; the handle "
               "does not belong to this call";
      std::memcpy(st + (d * rows_per_dest + off) * rb, yb + (e * RM + first) * rb,
                  static_cast<size_t>(n) * rb);
      off += n;
    }
  }
  return {};
}

namespace {
template <FloatKind kKind>
void WeightedRow(float* acc, float w, const void* row, int64_t H) {
  for (int64_t h = 0; h < H; ++h) acc[h] = ll_weighted_add(acc[h], w, ll_load(kKind, row, h));
}

template <FloatKind kKind>
void StoreRow(void* dst, const float* acc, int64_t H) {
  for (int64_t h = 0; h < H; ++h) ll_store(kKind, dst, h, acc[h]);
}

template <FloatKind kKind>
void CombineRecvTyped(int me, const LowLatencyShape& s, int64_t rows_per_dest,
                      const void* const* peer_stage, const int32_t* topk_idx,
                      const float* topk_w, void* out) {
  const int E = s.num_experts, el = s.experts_per_rank(), M = s.max_tokens, K = s.topk;
  const int64_t H = s.hidden;
  const size_t rb = s.row_bytes;
  // Where each expert's rows start in its owner's stage for us, then a running row.
  std::vector<int32_t> counts(E);
  ExpertCountsCpu(topk_idx, s.stage_rows, K, E, counts.data());
  std::vector<int64_t> next(E);
  for (int r = 0; r < s.num_ranks; ++r) {
    int64_t off = 0;
    for (int e = 0; e < el; ++e) {
      next[r * el + e] = off;
      off += std::min(counts[r * el + e], M);
    }
  }
  std::vector<int64_t> limit(E);
  for (int g = 0; g < E; ++g) limit[g] = next[g] + std::min(counts[g], M);
  std::vector<float> acc(H);
  char* o = static_cast<char*>(out);
  for (int t = 0; t < s.stage_rows; ++t) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int k = 0; k < K; ++k) {
      const int64_t i = static_cast<int64_t>(t) * K + k;
      const int32_t g = topk_idx[i];
      if (g < 0) continue;
      const int64_t row = next[g]++;
      if (row >= limit[g]) continue;  // past M rows: never stored (the counts cap at M)
      const char* st = static_cast<const char*>(peer_stage[g / el]);
      WeightedRow<kKind>(acc.data(), topk_w[i], st + (me * rows_per_dest + row) * rb, H);
    }
    StoreRow<kKind>(o + t * rb, acc.data(), H);
  }
}
}  // namespace

void LowLatencyCombineRecvCpu(int me, FloatKind kind, const LowLatencyShape& s,
                              int64_t rows_per_dest, const void* const* peer_stage,
                              const int32_t* topk_idx, const float* topk_w, void* out) {
  switch (kind) {
    case FloatKind::kF32:
      return CombineRecvTyped<FloatKind::kF32>(me, s, rows_per_dest, peer_stage, topk_idx,
                                               topk_w, out);
    case FloatKind::kBF16:
      return CombineRecvTyped<FloatKind::kBF16>(me, s, rows_per_dest, peer_stage, topk_idx,
                                                topk_w, out);
    case FloatKind::kF16:
      return CombineRecvTyped<FloatKind::kF16>(me, s, rows_per_dest, peer_stage, topk_idx,
                                               topk_w, out);
  }
}

}  // namespace jax_ep
