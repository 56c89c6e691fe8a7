// CUDA kernels of the low-latency mode; protocol and buffer in low_latency_kernels.h.
#include "kernels/cuda/low_latency_kernels.h"

#include "kernels/common/low_latency_math.h"
#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/peer_transport.cuh"

namespace jax_ep {

__device__ ErrorRecord g_ll_error;

namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kOpLowLatency = 8;  // op kind reported in timeout errors

__device__ __forceinline__ LowLatencyHeader* ll_header(const LowLatencyArgs& a, int r) {
  return reinterpret_cast<LowLatencyHeader*>(a.peers.base[r]);
}
__device__ __forceinline__ char* ll_at(const LowLatencyArgs& a, int r, size_t off) {
  return a.peers.base[r] + off;
}

// ------------------------------- dispatch --------------------------------

// One block. Thread g walks this rank's routing in token order and numbers the slots that
// name expert g; ids outside [-1, E) and repeats within a token are recorded as errors
// and their slots left unused.
__global__ void ll_dispatch_plan(LowLatencyArgs a) {
  LowLatencyHeader* h = ll_header(a, a.me);
  const int E = a.L.E, el = a.L.experts_per_rank(), M = a.L.M, R = a.L.R;
  const int n_slots = a.S * a.K;
  int32_t* pos = reinterpret_cast<int32_t*>(ll_at(a, a.me, a.L.pos_off));
  if (threadIdx.x == 0) {
    h->seq_dispatch += 1;
    h->done_dispatch = 0;
  }
  for (int i = threadIdx.x; i < n_slots; i += blockDim.x) {
    const int32_t g = a.topk_idx[i];
    bool bad = g < -1 || g >= E;
    const int t = i / a.K, k = i % a.K;
    for (int j = 0; j < k && !bad; ++j) bad = g >= 0 && a.topk_idx[t * a.K + j] == g;
    if (bad) record_error(&g_ll_error, a.host_err, kErrBadTopkId, a.me, t, k, g, E);
    pos[i] = -1;
  }
  __syncthreads();
  for (int g = threadIdx.x; g < E; g += blockDim.x) {
    int c = 0;
    for (int i = 0; i < n_slots; ++i) {
      if (a.topk_idx[i] != g) continue;
      const int t = i / a.K, k = i % a.K;
      bool dup = false;
      for (int j = 0; j < k; ++j) dup = dup || a.topk_idx[t * a.K + j] == g;
      if (dup) continue;
      pos[i] = c < M ? c : -1;
      ++c;
    }
    const int r = g / el, e = g % el;
    int32_t* counts = reinterpret_cast<int32_t*>(ll_at(a, r, a.L.counts_off));
    counts[e * R + a.me] = c < M ? c : M;
  }
}

// A warp per (token, slot): the token's row into its expert's slot on the owner. The
// last block to finish tells every owner its rows and counts are there.
__global__ void ll_dispatch_push(LowLatencyArgs a) {
  const int el = a.L.experts_per_rank(), M = a.L.M, R = a.L.R;
  const int n_slots = a.S * a.K;
  const int32_t* pos = reinterpret_cast<const int32_t*>(ll_at(a, a.me, a.L.pos_off));
  const int lane = threadIdx.x % 32;
  const int warp = blockIdx.x * kWarps + threadIdx.x / 32;
  for (int i = warp; i < n_slots; i += gridDim.x * kWarps) {
    const int p = pos[i];
    if (p < 0) continue;
    const int32_t g = a.topk_idx[i];
    const int r = g / el, e = g % el;
    const size_t slot = (static_cast<size_t>(e) * R + a.me) * M + p;
    warp_copy_row<true>(ll_at(a, r, a.L.slots_off + slot * a.L.stride),
                  static_cast<const char*>(a.x) + static_cast<size_t>(i / a.K) * a.L.row_bytes,
                  a.L.row_bytes, lane);
    if (lane == 0) reinterpret_cast<int32_t*>(ll_at(a, r, a.L.tok_off))[slot] = i / a.K;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    LowLatencyHeader* h = ll_header(a, a.me);
    peer::fence_data();
    if (atomicAdd(&h->done_dispatch, 1u) == gridDim.x - 1) {
      peer::fence_data();
      const uint64_t n = h->seq_dispatch;
      for (int r = 0; r < R; ++r) peer::signal(&ll_header(a, r)->arrive_dispatch[a.me], n);
    }
  }
}

__device__ bool ll_wait_all(const LowLatencyArgs& a, const uint64_t* flags, uint64_t n) {
  __shared__ int ok;
  if (threadIdx.x == 0) ok = 1;
  __syncthreads();
  for (int s = threadIdx.x; s < a.L.R; s += blockDim.x) {
    if (!peer::wait_geq(&flags[s], n, a.timeout_ns)) {
      record_error(&g_ll_error, a.host_err, kErrTimeout, a.me, s, kOpLowLatency,
                   static_cast<int32_t>(n), 0);
      ok = 0;
    }
  }
  __syncthreads();
  return ok != 0;
}

// Owner: a warp per output row (e, i) of the [E_local, R * M] blocks.
__global__ void ll_dispatch_recv(LowLatencyArgs a) {
  LowLatencyHeader* h = ll_header(a, a.me);
  const uint64_t n = h->seq_dispatch;
  ll_wait_all(a, h->arrive_dispatch, n);  // on timeout the rows still get defined values
  const int el = a.L.experts_per_rank(), M = a.L.M, R = a.L.R;
  const int64_t RM = static_cast<int64_t>(R) * M;
  const int32_t* counts = reinterpret_cast<const int32_t*>(ll_at(a, a.me, a.L.counts_off));
  const int32_t* tok = reinterpret_cast<const int32_t*>(ll_at(a, a.me, a.L.tok_off));
  if (blockIdx.x == 0) {
    for (int e = threadIdx.x; e < el; e += blockDim.x) {
      int32_t total = 0;
      for (int s = 0; s < R; ++s) {
        const int32_t c = peer::load_cg_s32(&counts[e * R + s]);
        a.first_row[e * R + s] = total;
        a.row_count[e * R + s] = c;
        total += c;
      }
      a.recv_count[e] = total;
    }
  }
  const int lane = threadIdx.x % 32;
  const int warp = blockIdx.x * kWarps + threadIdx.x / 32;
  for (int64_t w = warp; w < el * RM; w += static_cast<int64_t>(gridDim.x) * kWarps) {
    const int e = static_cast<int>(w / RM);
    const int64_t i = w % RM;
    int s = 0;
    int64_t first = 0;
    for (; s < R; ++s) {
      const int32_t c = peer::load_cg_s32(&counts[e * R + s]);
      if (i < first + c) break;
      first += c;
    }
    char* dst = static_cast<char*>(a.recv_x) + w * a.L.row_bytes;
    if (s == R) {
      warp_zero_row(dst, a.L.row_bytes, lane);
      if (lane == 0) a.src_rank[w] = a.src_index[w] = -1;
      continue;
    }
    const size_t slot = (static_cast<size_t>(e) * R + s) * M + (i - first);
    warp_copy_row<false>(dst, ll_at(a, a.me, a.L.slots_off + slot * a.L.stride), a.L.row_bytes, lane);
    if (lane == 0) {
      a.src_rank[w] = s;
      a.src_index[w] = peer::load_cg_s32(&tok[slot]);
    }
  }
}

// -------------------------------- combine --------------------------------

__global__ void ll_combine_plan(LowLatencyArgs a) {
  LowLatencyHeader* h = ll_header(a, a.me);
  h->seq_combine += 1;
  h->done_combine = 0;
}

// Owner: a warp per row (e, i) of y; rows of source d go to d's cstage[me], expert after
// expert, each expert's rows in order.
__global__ void ll_combine_push(LowLatencyArgs a) {
  const int el = a.L.experts_per_rank(), M = a.L.M, R = a.L.R;
  const int64_t RM = static_cast<int64_t>(R) * M;
  const int lane = threadIdx.x % 32;
  const int warp = blockIdx.x * kWarps + threadIdx.x / 32;
  for (int64_t w = warp; w < el * RM; w += static_cast<int64_t>(gridDim.x) * kWarps) {
    const int e = static_cast<int>(w / RM);
    const int64_t i = w % RM;
    int d = 0;
    for (; d < R; ++d) {
      const int32_t f = a.first_row[e * R + d], c = a.row_count[e * R + d];
      if (f < 0 || c < 0 || f + c > RM) {
        if (lane == 0) record_error(&g_ll_error, a.host_err, kErrBadHandle, a.me, e, d, f, 1);
        d = R;
        break;
      }
      if (i >= f && i < f + c) break;
    }
    if (d == R) continue;  // row past the counts
    int64_t off = i - a.first_row[e * R + d];
    for (int e2 = 0; e2 < e; ++e2) off += a.row_count[e2 * R + d];
    if (off >= a.L.rows_per_dest) continue;
    const size_t at = a.L.cstage_off + (static_cast<size_t>(a.me) * a.L.rows_per_dest + off) *
                                           a.L.stride;
    warp_copy_row<true>(ll_at(a, d, at), static_cast<const char*>(a.y) + w * a.L.row_bytes,
                  a.L.row_bytes, lane);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    LowLatencyHeader* h = ll_header(a, a.me);
    peer::fence_data();
    if (atomicAdd(&h->done_combine, 1u) == gridDim.x - 1) {
      peer::fence_data();
      const uint64_t n = h->seq_combine;
      for (int d = 0; d < R; ++d) peer::signal(&ll_header(a, d)->arrive_combine[a.me], n);
    }
  }
}

// Source, one block: positions of this call's routing (as the dispatch numbered them)
// and where each expert's rows start in its owner's stage.
__global__ void ll_combine_recv_plan(LowLatencyArgs a) {
  const int E = a.L.E, el = a.L.experts_per_rank(), M = a.L.M;
  const int n_slots = a.S * a.K;
  int32_t* pos = reinterpret_cast<int32_t*>(ll_at(a, a.me, a.L.pos_off));
  int32_t* offsets = reinterpret_cast<int32_t*>(ll_at(a, a.me, a.L.offsets_off));
  __shared__ int32_t cnt[1024];
  for (int i = threadIdx.x; i < n_slots; i += blockDim.x) pos[i] = -1;
  __syncthreads();
  for (int g = threadIdx.x; g < E; g += blockDim.x) {
    int c = 0;
    for (int i = 0; i < n_slots; ++i) {
      if (a.topk_idx[i] != g) continue;
      pos[i] = c < M ? c : -1;
      ++c;
    }
    if (g < 1024) cnt[g] = c < M ? c : M;
  }
  __syncthreads();
  for (int r = threadIdx.x; r < a.L.R; r += blockDim.x) {
    int32_t off = 0;
    for (int e = 0; e < el; ++e) {
      offsets[r * el + e] = off;
      off += cnt[r * el + e];
    }
  }
}

// Source: a warp per token; lanes over the hidden dim, k ascending per element.
__global__ void ll_combine_recv(LowLatencyArgs a) {
  LowLatencyHeader* h = ll_header(a, a.me);
  ll_wait_all(a, h->arrive_combine, h->seq_combine);
  const int el = a.L.experts_per_rank();
  const int32_t* pos = reinterpret_cast<const int32_t*>(ll_at(a, a.me, a.L.pos_off));
  const int32_t* offsets = reinterpret_cast<const int32_t*>(ll_at(a, a.me, a.L.offsets_off));
  const int lane = threadIdx.x % 32;
  const int warp = blockIdx.x * kWarps + threadIdx.x / 32;
  for (int t = warp; t < a.S; t += gridDim.x * kWarps) {
    char* dst = static_cast<char*>(a.out) + static_cast<size_t>(t) * a.L.row_bytes;
    for (int64_t x = lane; x < a.H; x += 32) {
      float acc = 0.0f;
      for (int k = 0; k < a.K; ++k) {
        const int i = t * a.K + k;
        const int32_t g = a.topk_idx[i];
        const int p = pos[i];
        if (g < 0 || p < 0) continue;
        const int64_t row = offsets[g] + p;
        const char* src = ll_at(a, a.me, a.L.cstage_off +
                                             (static_cast<size_t>(g / el) * a.L.rows_per_dest +
                                              row) * a.L.stride);
        float v;
        switch (a.kind) {
          case FloatKind::kF32: v = peer::load_cg_f32(reinterpret_cast<const float*>(src) + x); break;
          case FloatKind::kBF16:
            v = bf16_to_f32(*reinterpret_cast<const volatile uint16_t*>(src + 2 * x)); break;
          default: v = f16_to_f32(*reinterpret_cast<const volatile uint16_t*>(src + 2 * x)); break;
        }
        acc = ll_weighted_add(acc, a.topk_w[i], v);
      }
      ll_store(a.kind, dst, x, acc);
    }
  }
}

int Blocks(int64_t warps_of_work) {
  const int64_t b = (warps_of_work + kWarps - 1) / kWarps;
  return static_cast<int>(b < 1 ? 1 : (b > 1024 ? 1024 : b));
}

}  // namespace

cudaError_t LaunchLowLatencyPhase(int phase, const LowLatencyArgs& a, cudaStream_t stream) {
  const int64_t rows = static_cast<int64_t>(a.L.experts_per_rank()) * a.L.R * a.L.M;
  switch (phase) {
    case kLLDispatchPlan: ll_dispatch_plan<<<1, kThreads, 0, stream>>>(a); break;
    case kLLDispatchPush:
      ll_dispatch_push<<<Blocks(static_cast<int64_t>(a.S) * a.K), kThreads, 0, stream>>>(a);
      break;
    case kLLDispatchRecv: ll_dispatch_recv<<<Blocks(rows), kThreads, 0, stream>>>(a); break;
    case kLLCombinePlan: ll_combine_plan<<<1, 1, 0, stream>>>(a); break;
    case kLLCombinePush: ll_combine_push<<<Blocks(rows), kThreads, 0, stream>>>(a); break;
    case kLLCombineRecvPlan: ll_combine_recv_plan<<<1, kThreads, 0, stream>>>(a); break;
    case kLLCombineRecv: ll_combine_recv<<<Blocks(a.S), kThreads, 0, stream>>>(a); break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

cudaError_t ReadLowLatencyError(ErrorRecord* out, bool clear) {
  return ReadErrorSymbol(g_ll_error, out, clear);
}

}  // namespace jax_ep
