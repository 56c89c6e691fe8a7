#include "kernels/cpu/cpu_kernels.h"

#include <cstring>
#include <sstream>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "kernels/common/combine_order.h"
#include "kernels/common/dtype_convert.h"
#include "kernels/common/layout_math.h"

namespace jax_ep {

// Large outputs usually arrive as fresh, untouched pages from the allocator (glibc maps
// big blocks anew on every allocation), so writing them costs one page fault per 4 KiB;
// with 8 ranks writing gigabytes per call on a few cores, faulting dominated dispatch.
// Asking for transparent huge pages on the 2 MiB-aligned interior makes that one fault
// per 2 MiB. It is only a hint: contents are unchanged and errors are ignored.
void AdviseHugePages(void* p, size_t n) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t{2} << 20;
  if (p == nullptr || n < 2 * kHuge) return;
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  const uintptr_t b = (a + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t e = (a + n) & ~(kHuge - 1);
  if (e > b) (void)madvise(reinterpret_cast<void*>(b), e - b, MADV_HUGEPAGE);
#else
  (void)p;
  (void)n;
#endif
}

std::string CheckTopkIds(const int32_t* topk_idx, int T, int K, int E) {
  for (int64_t i = 0; i < static_cast<int64_t>(T) * K; ++i) {
    const int32_t v = topk_idx[i];
    if (v < -1 || v >= E) {
      std::ostringstream s;
      s << "topk_idx[" << i / K << ", " << i % K << "] = " << v << " is outside [-1, " << E
        << ") (num_experts=" << E << ")";
      return s.str();
    }
  }
  return {};
}

void LayoutCpu(const int32_t* topk_idx, const RoutingShape& s, int32_t* tokens_per_rank,
               int32_t* tokens_per_expert, bool* is_token_in_rank) {
  const int R = s.num_ranks, K = s.topk, el = s.experts_per_rank();
  std::memset(tokens_per_rank, 0, sizeof(int32_t) * R);
  std::memset(tokens_per_expert, 0, sizeof(int32_t) * s.num_experts);
  std::memset(is_token_in_rank, 0, sizeof(bool) * static_cast<size_t>(s.num_tokens) * R);
  for (int t = 0; t < s.num_tokens; ++t) {
    const int32_t* row = topk_idx + static_cast<int64_t>(t) * K;
    for (int k = 0; k < K; ++k) {
      if (row[k] < 0) continue;
      tokens_per_expert[row[k]]++;
      if (is_first_slot_for_rank(row, k, el)) {
        const int r = owner_rank(row[k], el);
        tokens_per_rank[r]++;
        is_token_in_rank[static_cast<int64_t>(t) * R + r] = true;
      }
    }
  }
}

void TokensPerRankCpu(const int32_t* topk_idx, const RoutingShape& s, int32_t* per_rank) {
  const int K = s.topk, el = s.experts_per_rank();
  std::memset(per_rank, 0, sizeof(int32_t) * s.num_ranks);
  for (int64_t t = 0; t < s.num_tokens; ++t) {
    const int32_t* row = topk_idx + t * K;
    for (int k = 0; k < K; ++k)
      if (is_first_slot_for_rank(row, k, el)) per_rank[owner_rank(row[k], el)]++;
  }
}

void DispatchRecvCpu(int rank, const RoutingShape& s, size_t row_bytes,
                     const void* const* peer_x, const int32_t* const* peer_idx,
                     const float* const* peer_w, const int32_t* counts, void* recv_x,
                     int32_t* recv_idx, float* recv_w, int32_t* src_rank,
                     int32_t* src_index, int32_t* num_recv, int32_t* num_dropped,
                     int32_t* recv_per_expert) {
  const int R = s.num_ranks, T = s.num_tokens, K = s.topk, C = s.capacity;
  const int el = s.experts_per_rank();
  const int64_t total = recv_total(counts, R, rank);
  const int32_t kept = kept_rows(total, C);
  AdviseHugePages(recv_x, static_cast<size_t>(C) * row_bytes);
  std::memset(recv_per_expert, 0, sizeof(int32_t) * el);
  int64_t row = 0;
  for (int src = 0; src < R && row < kept; ++src) {
    const int32_t* idx = peer_idx[src];
    const float* w = peer_w[src];
    const char* x = static_cast<const char*>(peer_x[src]);
    // The source's count bounds the scan: stop once its last row for us is found.
    int64_t left = counts[src * R + rank];
    for (int t = 0; t < T && row < kept && left > 0; ++t) {
      const int32_t* irow = idx + static_cast<int64_t>(t) * K;
      if (!token_in_rank(irow, K, el, rank)) continue;
      --left;
      std::memcpy(static_cast<char*>(recv_x) + row * row_bytes, x + t * row_bytes, row_bytes);
      for (int k = 0; k < K; ++k) {
        const int32_t local = local_expert_id(irow[k], el, rank);
        recv_idx[row * K + k] = local;
        recv_w[row * K + k] = local >= 0 ? w[static_cast<int64_t>(t) * K + k] : 0.0f;
        if (local >= 0) recv_per_expert[local]++;
      }
      src_rank[row] = src;
      src_index[row] = t;
      ++row;
    }
  }
  // Rows past the last received are defined as zero (-1 for ids and sources).
  std::memset(static_cast<char*>(recv_x) + kept * row_bytes, 0, (C - kept) * row_bytes);
  for (int64_t i = kept; i < C; ++i) {
    src_rank[i] = -1;
    src_index[i] = -1;
    for (int k = 0; k < K; ++k) {
      recv_idx[i * K + k] = -1;
      recv_w[i * K + k] = 0.0f;
    }
  }
  *num_recv = kept;
  *num_dropped = static_cast<int32_t>(total - kept);
}

void DispatchSendRowsCpu(int rank, const RoutingShape& s, const int32_t* topk_idx,
                         const int32_t* counts, int32_t* send_row) {
  const int R = s.num_ranks, T = s.num_tokens, K = s.topk, C = s.capacity;
  const int el = s.experts_per_rank();
  std::vector<int64_t> next(R);
  for (int r = 0; r < R; ++r) next[r] = recv_base(counts, R, rank, r);
  for (int64_t i = 0; i < static_cast<int64_t>(T) * R; ++i) send_row[i] = -1;
  for (int t = 0; t < T; ++t) {
    const int32_t* row = topk_idx + static_cast<int64_t>(t) * K;
    for (int k = 0; k < K; ++k) {
      if (!is_first_slot_for_rank(row, k, el)) continue;
      const int r = owner_rank(row[k], el);
      const int64_t pos = next[r]++;
      send_row[static_cast<int64_t>(t) * R + r] = pos < C ? static_cast<int32_t>(pos) : -1;
    }
  }
}

namespace {
template <FloatKind kKind>
struct Elem;
template <>
struct Elem<FloatKind::kF32> {
  using T = float;
  static float load(T v) { return v; }
  static T store(float v) { return v; }
};
template <>
struct Elem<FloatKind::kBF16> {
  using T = uint16_t;
  static float load(T v) { return bf16_to_f32(v); }
  static T store(float v) { return f32_to_bf16(v); }
};
template <>
struct Elem<FloatKind::kF16> {
  using T = uint16_t;
  static float load(T v) { return f16_to_f32(v); }
  static T store(float v) { return f32_to_f16(v); }
};

// acc[h] += row[h] for one [H] row of a bias term, converted to float32.
void AddBiasRow(const CombineBias& b, int64_t offset, int H, float* acc) {
  switch (b.kind) {
    case FloatKind::kF32: {
      const float* v = static_cast<const float*>(b.data) + offset;
      for (int h = 0; h < H; ++h) acc[h] += v[h];
      return;
    }
    case FloatKind::kBF16: {
      const uint16_t* v = static_cast<const uint16_t*>(b.data) + offset;
      for (int h = 0; h < H; ++h) acc[h] += bf16_to_f32(v[h]);
      return;
    }
    case FloatKind::kF16: {
      const uint16_t* v = static_cast<const uint16_t*>(b.data) + offset;
      for (int h = 0; h < H; ++h) acc[h] += f16_to_f32(v[h]);
      return;
    }
  }
}

template <FloatKind kKind>
void CombineTyped(int R, int T, int H, const int32_t* send_row, const void* const* peer_y,
                  void* out_v, const CombineBias* bias, int num_bias, int node_size) {
  using E = Elem<kKind>;
  using V = typename E::T;
  V* out = static_cast<V*>(out_v);
  AdviseHugePages(out_v, static_cast<size_t>(T) * H * sizeof(V));
  const int G = combine_node_size(R, node_size);
  const int nodes = combine_num_nodes(R, G);
  const bool rounds = combine_rounds_partials(nodes);
  std::vector<float> acc(H), part(rounds ? H : 0);
  for (int t = 0; t < T; ++t) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int n = 0; n < nodes; ++n) {
      // One node: the partial is the sum itself. Several: each node's partial is summed
      // on its own, rounded to the element type (as it crosses the network), then added.
      float* p = rounds ? part.data() : acc.data();
      if (rounds) std::fill(part.begin(), part.end(), 0.0f);
      const int end = (n + 1) * G < R ? (n + 1) * G : R;
      for (int r = n * G; r < end; ++r) {
        const int32_t i = send_row[static_cast<int64_t>(t) * R + r];
        if (i < 0) continue;
        const V* y = static_cast<const V*>(peer_y[r]) + static_cast<int64_t>(i) * H;
        for (int h = 0; h < H; ++h) p[h] += E::load(y[h]);
      }
      if (rounds)
        for (int h = 0; h < H; ++h) acc[h] += E::load(E::store(part[h]));
    }
    // The bias joins the float32 sum after the ranks, so the one cast below rounds once.
    for (int b = 0; b < num_bias; ++b)
      AddBiasRow(bias[b], static_cast<int64_t>(t) * H, H, acc.data());
    V* o = out + static_cast<int64_t>(t) * H;
    for (int h = 0; h < H; ++h) o[h] = E::store(acc[h]);
  }
}
}  // namespace

void CombineCpu(FloatKind kind, int num_ranks, int T, int H, const int32_t* send_row,
                const void* const* peer_y, void* out, const CombineBias* bias,
                int num_bias, int node_size) {
  switch (kind) {
    case FloatKind::kF32:
      return CombineTyped<FloatKind::kF32>(num_ranks, T, H, send_row, peer_y, out, bias,
                                           num_bias, node_size);
    case FloatKind::kBF16:
      return CombineTyped<FloatKind::kBF16>(num_ranks, T, H, send_row, peer_y, out, bias,
                                            num_bias, node_size);
    case FloatKind::kF16:
      return CombineTyped<FloatKind::kF16>(num_ranks, T, H, send_row, peer_y, out, bias,
                                           num_bias, node_size);
  }
}

void GatherByHandleCpu(int C, size_t row_bytes, const int32_t* src_rank,
                       const int32_t* src_index, const void* const* peer_g, void* out) {
  char* o = static_cast<char*>(out);
  AdviseHugePages(out, static_cast<size_t>(C) * row_bytes);
  for (int64_t i = 0; i < C; ++i) {
    if (src_rank[i] < 0) {
      std::memset(o + i * row_bytes, 0, row_bytes);
      continue;
    }
    const char* g = static_cast<const char*>(peer_g[src_rank[i]]);
    std::memcpy(o + i * row_bytes, g + static_cast<int64_t>(src_index[i]) * row_bytes, row_bytes);
  }
}

}  // namespace jax_ep
