// Routing math shared by the CPU and CUDA kernels, so both obey one definition of
// which rank a token goes to, where its row lands and how rows are numbered.
//
// Conventions (see DESIGN.md): R ranks, E experts, E_local = E / R experts per rank,
// expert e lives on rank e / E_local, topk ids are in [-1, E) with -1 = unused slot.
// Rows received by rank r are ordered by (source rank, source token); the first
// `capacity` of them are kept.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define JEP_HD __host__ __device__ __forceinline__
#else
#define JEP_HD inline
#endif

namespace jax_ep {

// Rank that owns expert `e`, or -1 for an unused slot.
JEP_HD int owner_rank(int32_t e, int experts_per_rank) {
  return e < 0 ? -1 : static_cast<int>(e / experts_per_rank);
}

// True if slot k of a token's row is the first slot that targets its owner rank.
// Counting only first slots sends each token to a rank at most once.
JEP_HD bool is_first_slot_for_rank(const int32_t* row, int k, int experts_per_rank) {
  const int o = owner_rank(row[k], experts_per_rank);
  if (o < 0) return false;
  for (int j = 0; j < k; ++j) {
    if (owner_rank(row[j], experts_per_rank) == o) return false;
  }
  return true;
}

// True if the token (one row of topk_idx, K slots) has an expert on rank r.
JEP_HD bool token_in_rank(const int32_t* row, int K, int experts_per_rank, int r) {
  for (int k = 0; k < K; ++k) {
    if (owner_rank(row[k], experts_per_rank) == r) return true;
  }
  return false;
}

// Local expert id on rank r for global id e, or -1 if e is not on r.
JEP_HD int32_t local_expert_id(int32_t e, int experts_per_rank, int r) {
  return owner_rank(e, experts_per_rank) == r ? e - r * experts_per_rank : -1;
}

// First row on receiver r of source s's tokens: sum of counts[s'][r] for s' < s.
// `counts` is the [R_src, R_dst] matrix of tokens each source sends each receiver.
JEP_HD int64_t recv_base(const int32_t* counts, int num_ranks, int s, int r) {
  int64_t base = 0;
  for (int j = 0; j < s; ++j) base += counts[j * num_ranks + r];
  return base;
}

// Total rows arriving at receiver r, before the capacity cut.
JEP_HD int64_t recv_total(const int32_t* counts, int num_ranks, int r) {
  return recv_base(counts, num_ranks, num_ranks, r);
}

// Rows kept out of `total` under `capacity`, and the number dropped.
JEP_HD int32_t kept_rows(int64_t total, int capacity) {
  return static_cast<int32_t>(total < capacity ? total : capacity);
}

}  // namespace jax_ep
