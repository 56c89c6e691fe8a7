// Dispatch layout on the GPU: tokens per rank, slots per expert and is_token_in_rank
// for one rank's topk_idx[T, K], with the routing rules of kernels/common/layout_math.h.
#include <cstdint>

#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/cuda_kernels.h"
#include "kernels/cuda/launch.cuh"
#include "kernels/common/layout_math.h"

namespace jax_ep {
namespace {

JEP_DEVICE_GLOBAL ErrorRecord g_layout_error;

// One block per `tokens_per_block` tokens. Counts go to shared memory first (ranks
// always, experts when E fits), then one global atomic per non-zero counter.
__global__ void layout_kernel(const int32_t* __restrict__ topk_idx, int T, int K, int E, int R,
                              int tokens_per_block, bool smem_experts,
                              int32_t* __restrict__ per_rank, int32_t* __restrict__ per_expert,
                              bool* __restrict__ in_rank, ErrorRecord* host_err) {
  JEP_DYNAMIC_SMEM(int32_t, s_counts);  // [R] ranks, then [E] experts if smem_experts
  int32_t* s_rank = s_counts;
  int32_t* s_expert = s_counts + R;
  const int el = E / R;
  for (int i = threadIdx.x; i < R + (smem_experts ? E : 0); i += blockDim.x) s_counts[i] = 0;
  __syncthreads();

  const int t0 = blockIdx.x * tokens_per_block;
  const int t1 = min(T, t0 + tokens_per_block);
  for (int t = t0 + threadIdx.x; t < t1; t += blockDim.x) {
    const int32_t* row = topk_idx + static_cast<int64_t>(t) * K;
    bool* out = in_rank + static_cast<int64_t>(t) * R;
    for (int r = 0; r < R; ++r) out[r] = false;
    for (int k = 0; k < K; ++k) {
      const int32_t raw = row[k];
      const int32_t e = sanitized(raw, E);
      if (e != raw) record_error(&g_layout_error, host_err, kErrBadTopkId, -1, t, k, raw, E);
      if (e < 0) continue;
      if (smem_experts)
        atomicAdd(&s_expert[e], 1);
      else
        atomicAdd(&per_expert[e], 1);
      // Only the first slot that targets a rank counts it (is_first_slot_for_rank).
      const int o = owner_rank(e, el);
      bool first = true;
      for (int j = 0; j < k && first; ++j) first = owner_rank(sanitized(row[j], E), el) != o;
      if (first) {
        out[o] = true;
        atomicAdd(&s_rank[o], 1);
      }
    }
  }
  __syncthreads();
  for (int r = threadIdx.x; r < R; r += blockDim.x)
    if (s_rank[r] != 0) atomicAdd(&per_rank[r], s_rank[r]);
  if (smem_experts)
    for (int e = threadIdx.x; e < E; e += blockDim.x)
      if (s_expert[e] != 0) atomicAdd(&per_expert[e], s_expert[e]);
}

}  // namespace

cudaError_t LaunchLayout(cudaStream_t stream, const int32_t* topk_idx, int T, int K, int E,
                         int R, int32_t* tokens_per_rank, int32_t* tokens_per_expert,
                         bool* is_token_in_rank, ErrorRecord* host_err) {
  if (R < 1 || E % R != 0 || R > 4096) return cudaErrorInvalidValue;
  cudaError_t err = cudaMemsetAsync(tokens_per_rank, 0, sizeof(int32_t) * R, stream);
  if (err == cudaSuccess) err = cudaMemsetAsync(tokens_per_expert, 0, sizeof(int32_t) * E, stream);
  if (err != cudaSuccess || T == 0) return err;
  const LayoutPreset& p = kLayoutPreset;
  const bool smem_experts = E <= p.max_smem_experts;
  const int blocks = (T + p.tokens_per_block - 1) / p.tokens_per_block;
  const size_t smem = sizeof(int32_t) * (R + (smem_experts ? E : 0));
  JEP_LAUNCH(layout_kernel, blocks, p.threads, smem, stream)(topk_idx, T, K, E, R, p.tokens_per_block,
                                                     smem_experts, tokens_per_rank,
                                                     tokens_per_expert, is_token_in_rank, host_err);
  return cudaGetLastError();
}

cudaError_t ReadLayoutError(ErrorRecord* out, bool clear) {
  return ReadErrorSymbol(g_layout_error, out, clear);
}

}  // namespace jax_ep
