// Internode dispatch and combine: direct RDMA from every rank to every rank over the
// transport interface (kernels/transport.cuh), NVSHMEM backend. See docs/internode.md.
//
// One call (dispatch or combine) uses one half of the symmetric heap, chosen by the
// parity of a per-PE call counter, so a peer already in the next call never writes into
// memory this PE still reads (kernels/internode_layout.h). Every call makes every rank
// signal every other rank at least once, so no rank can run more than one call ahead.
//
// Dispatch:  slots   -- per destination d, number this rank's tokens for d in token order
//            pack    -- pack (x row, ids, weights, token index) into stage, grouped by d
//            counts  -- all-gather the count rows (put + signal to every peer)
//            prefix  -- row offsets from the count matrix
//            send    -- CTA q = logical QP q; the bytes for each peer are cut into chunks
//                       and chunk j goes out on the QP/port of kernels/striping_plan.h,
//                       each with a signal on the same QP; straight into the receiver's
//                       recv rows (contract order: source rank, then token)
//            unpack  -- wait for every source's chunks, write the outputs
//            finish  -- reset this call's signals, advance the call counter
// Combine:   the same wire pattern backwards (recv rows -> the sources' back rows), then
//            each source sums the rows of a token in ascending rank order in float32.
// Gather:    combine's transpose: dispatch's wire pattern for rows of g, driven by the
//            handle (counts, send_slot) with no count exchange; out[i] = g_src[index].
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdlib>
#include <cstring>
#include <string>

#include "kernels/common/dtype_convert.h"
#include "kernels/internode/internode_kernels.h"
#include "kernels/internode/internode_layout.h"
#include "kernels/common/layout_math.h"
#include "kernels/common/striping_plan.h"
#include "kernels/internode/transport_nvshmem.cuh"

namespace jax_ep {
namespace transport {
__device__ int g_nvshmem_num_qp_handles = 0;
__device__ int g_nvshmem_qp_handles[kMaxQps];
}  // namespace transport

namespace internode {
namespace {

using Transport = transport::Nvshmem;
using transport::SignalOp;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxRanks = 1024;

__device__ unsigned long long g_call_counter = 0;

struct RuntimeState {
  bool initialized = false;
  int rank = 0;
  int world = 0;
  size_t heap_bytes = 0;
  size_t half_bytes = 0;  // bytes per parity half
  char* heap = nullptr;
  int64_t* scratch = nullptr;  // [3R + 1] device prefixes
  int* error_flag = nullptr;   // device
};
RuntimeState g_rt;

// Pointers into one half of the heap for one call's dims.
struct Half {
  uint64_t* sig_counts;  // [R]
  uint64_t* sig_disp;    // [R]
  uint64_t* sig_comb;    // [R]
  int32_t* counts;       // [R][R]
  char* recv;            // [C] dispatch rows
  char* back;            // [T*min(K,R)] combine rows
  char* stage;           // [T*min(K,R)] dispatch rows
  char* cstage;          // [C] combine rows
};

struct Geometry {
  int R, rank, T, H, K, C, E, el;
  int64_t xrow;    // H * x bytes
  int64_t yrow;    // H * y bytes
  int64_t ds, cs;  // row strides on the wire
  int P, Q, num_qps;
  int64_t chunk;
};

__host__ __device__ inline Half HalfAt(char* half_base, const HeapLayout& L, int R) {
  Half h;
  h.sig_counts = reinterpret_cast<uint64_t*>(half_base + L.sigs);
  h.sig_disp = h.sig_counts + R;
  h.sig_comb = h.sig_disp + R;
  h.counts = reinterpret_cast<int32_t*>(half_base + L.counts);
  h.recv = half_base + L.recv;
  h.back = half_base + L.back;
  h.stage = half_base + L.stage;
  h.cstage = half_base + L.cstage;
  return h;
}

// Copies n bytes with the widest access both pointers allow; threads [tid, stride).
__device__ __forceinline__ void CopyBytes(char* dst, const char* src, int64_t n, int tid,
                                          int stride) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src);
  if ((a % 16) == 0 && (n % 16) == 0) {
    for (int64_t i = tid; i < n / 16; i += stride)
      reinterpret_cast<int4*>(dst)[i] = reinterpret_cast<const int4*>(src)[i];
  } else if ((a % 4) == 0 && (n % 4) == 0) {
    for (int64_t i = tid; i < n / 4; i += stride)
      reinterpret_cast<int32_t*>(dst)[i] = reinterpret_cast<const int32_t*>(src)[i];
  } else {
    for (int64_t i = tid; i < n; i += stride) dst[i] = src[i];
  }
}

__device__ __forceinline__ void ZeroBytes(char* dst, int64_t n, int tid, int stride) {
  for (int64_t i = tid; i < n; i += stride) dst[i] = 0;
}

__device__ __forceinline__ int Parity() { return static_cast<int>(g_call_counter & 1ull); }

__device__ __forceinline__ Half CurrentHalf(char* heap, int64_t half_bytes,
                                            const HeapLayout& L, int R) {
  return HalfAt(heap + Parity() * half_bytes, L, R);
}

// ---- dispatch ----------------------------------------------------------------------

// Block d numbers, in token order, the tokens this rank sends rank d.
__global__ void SlotsKernel(Geometry g, const int32_t* topk_idx, int32_t* send_slot,
                            char* heap, int64_t half_bytes, HeapLayout L, int* error_flag) {
  const int d = blockIdx.x;
  const Half h = CurrentHalf(heap, half_bytes, L, g.R);
  __shared__ int warp_total[kWarps];
  __shared__ int running;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (threadIdx.x == 0) running = 0;
  __syncthreads();
  for (int base = 0; base < g.T; base += kThreads) {
    const int t = base + threadIdx.x;
    bool hit = false;
    if (t < g.T) {
      const int32_t* row = topk_idx + static_cast<int64_t>(t) * g.K;
      hit = token_in_rank(row, g.K, g.el, d);
      if (d == 0) {
        for (int k = 0; k < g.K; ++k)
          if (row[k] < -1 || row[k] >= g.E) atomicExch(error_flag, 1);
      }
    }
    const unsigned mask = __ballot_sync(0xffffffffu, hit);
    if (lane == 0) warp_total[warp] = __popc(mask);
    __syncthreads();
    int off = running;
    for (int w = 0; w < warp; ++w) off += warp_total[w];
    if (t < g.T) {
      send_slot[static_cast<int64_t>(t) * g.R + d] =
          hit ? off + __popc(mask & ((1u << lane) - 1u)) : -1;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      int s = 0;
      for (int w = 0; w < kWarps; ++w) s += warp_total[w];
      running += s;
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) h.counts[g.rank * g.R + d] = running;
}

// One block per token: pack its row once per destination into stage.
__global__ void PackKernel(Geometry g, const char* x, const int32_t* topk_idx,
                           const float* topk_weights, const int32_t* send_slot, char* heap,
                           int64_t half_bytes, HeapLayout L) {
  const Half h = CurrentHalf(heap, half_bytes, L, g.R);
  __shared__ int64_t row_base[kMaxRanks];
  if (threadIdx.x == 0) {
    int64_t acc = 0;
    for (int d = 0; d < g.R; ++d) {
      row_base[d] = acc;
      acc += h.counts[g.rank * g.R + d];
    }
  }
  __syncthreads();
  const int t = blockIdx.x;
  const char* xrow = x + static_cast<int64_t>(t) * g.xrow;
  for (int d = 0; d < g.R; ++d) {
    const int j = send_slot[static_cast<int64_t>(t) * g.R + d];
    if (j < 0) continue;
    char* dst = h.stage + (row_base[d] + j) * g.ds;
    CopyBytes(dst, xrow, g.xrow, threadIdx.x, blockDim.x);
    int32_t* meta = reinterpret_cast<int32_t*>(dst + g.xrow);
    for (int k = threadIdx.x; k < g.K; k += blockDim.x) {
      meta[k] = topk_idx[static_cast<int64_t>(t) * g.K + k];
      reinterpret_cast<float*>(meta + g.K)[k] = topk_weights[static_cast<int64_t>(t) * g.K + k];
    }
    if (threadIdx.x == 0) meta[2 * g.K] = t;
  }
}

// All-gather of the count rows: one warp per peer, then wait for every peer's row.
template <class T>
__global__ void CountsKernel(Geometry g, char* heap, int64_t half_bytes, HeapLayout L) {
  const Half h = CurrentHalf(heap, half_bytes, L, g.R);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  int32_t* mine = h.counts + static_cast<int64_t>(g.rank) * g.R;
  for (int i = 1 + warp; i < g.R; i += kWarps) {
    const int peer = (g.rank + i) % g.R;
    T::put_signal_warp(mine, mine, sizeof(int32_t) * g.R, h.sig_counts + g.rank, 1,
                       SignalOp::kSet, peer, 0);
  }
  if (lane == 0) T::quiet();
  for (int s = threadIdx.x; s < g.R; s += blockDim.x) {
    if (s == g.rank) continue;
    T::wait_ge(h.sig_counts + s, 1);
    h.sig_counts[s] = 0;  // next written in the call after next
  }
}

// scratch: [0, R) col_base[d] = rows of sources < rank at d; [R, 2R) row_base[d] = rows
// this rank sends ranks < d; [2R, 3R+1) recv_base[s] = rows of sources < s at this rank.
__global__ void PrefixKernel(Geometry g, const int32_t* counts_ext, char* heap,
                             int64_t half_bytes, HeapLayout L, int64_t* scratch) {
  const int R = g.R;
  const int32_t* counts =
      counts_ext != nullptr ? counts_ext : CurrentHalf(heap, half_bytes, L, R).counts;
  for (int d = threadIdx.x; d < R; d += blockDim.x) scratch[d] = recv_base(counts, R, g.rank, d);
  if (threadIdx.x == 0) {
    int64_t acc = 0;
    for (int d = 0; d < R; ++d) {
      scratch[R + d] = acc;
      acc += counts[g.rank * R + d];
    }
    acc = 0;
    for (int s = 0; s <= R; ++s) {
      scratch[2 * R + s] = acc;
      if (s < R) acc += counts[s * R + g.rank];
    }
  }
}

__device__ __forceinline__ int64_t Kept(int64_t base, int64_t n, int capacity) {
  const int64_t room = capacity - base;
  return room <= 0 ? 0 : (n < room ? n : room);
}

// The three wire patterns: dispatch (packed rows to the receivers' recv rows), combine
// (recv rows back to the sources' back rows) and gather (the sources' rows, by the
// dispatch handle, to the receivers' cstage rows: dispatch's pattern with y-sized rows).
enum class Wire : int { kDispatch = 0, kCombine = 1, kGather = 2 };

// What this rank sends `peer` in a call: source and destination byte offsets within a
// half and the byte count.
struct Span {
  int64_t src, dst, bytes;
};

__device__ __forceinline__ Span StreamTo(const Geometry& g, const int32_t* counts,
                                         const int64_t* scratch, int peer, Wire wire,
                                         const HeapLayout& L) {
  const int R = g.R;
  Span s;
  if (wire != Wire::kCombine) {
    const int64_t n = counts[g.rank * R + peer];
    const int64_t base = scratch[peer];  // rows of sources < rank at peer
    const int64_t kept = Kept(base, n, g.C);
    if (wire == Wire::kDispatch) {
      s.bytes = kept * g.ds;
      s.src = L.stage + scratch[R + peer] * g.ds;
      s.dst = L.recv + base * g.ds;
    } else {
      s.bytes = kept * g.cs;
      s.src = L.back + scratch[R + peer] * g.cs;
      s.dst = L.cstage + base * g.cs;
    }
  } else {
    // rows `peer` sent this rank: recv rows [recv_base[peer], +kept), back to peer's
    // back rows at its send offset for this rank.
    const int64_t n = counts[peer * R + g.rank];
    const int64_t base = scratch[2 * R + peer];
    const int64_t kept = Kept(base, n, g.C);
    int64_t peer_row_base = 0;
    for (int d = 0; d < g.rank; ++d) peer_row_base += counts[peer * R + d];
    s.bytes = kept * g.cs;
    s.src = L.cstage + base * g.cs;
    s.dst = L.back + peer_row_base * g.cs;
  }
  return s;
}

// Chunks a source sends this rank in a call (+1 closing signal is added by callers).
__device__ __forceinline__ int64_t ChunksFrom(const Geometry& g, const int32_t* counts,
                                              int source, Wire wire) {
  const int R = g.R;
  int64_t base, n, stride;
  if (wire != Wire::kCombine) {
    base = recv_base(counts, R, source, g.rank);
    n = counts[source * R + g.rank];
    stride = wire == Wire::kDispatch ? g.ds : g.cs;
  } else {
    base = recv_base(counts, R, g.rank, source);
    n = counts[g.rank * R + source];
    stride = g.cs;
  }
  return num_chunks(Kept(base, n, g.C) * stride, g.chunk);
}

// Every block: waits until each source other than this rank has signalled on `sig` all
// its chunks of this call plus the closing signal.
template <class T>
__device__ __forceinline__ void WaitSources(const Geometry& g, const int32_t* counts,
                                            uint64_t* sig, Wire wire) {
  for (int s = threadIdx.x; s < g.R; s += blockDim.x) {
    if (s == g.rank) continue;
    T::wait_ge(sig + s, static_cast<uint64_t>(ChunksFrom(g, counts, s, wire) + 1));
  }
  __syncthreads();
}

// Source rank of received row i: the last s with recv_base[s] <= i (scratch[2R, 3R]).
__device__ __forceinline__ int SourceOfRow(const Geometry& g, const int64_t* scratch,
                                           int64_t i) {
  int s = 0;
  while (s + 1 < g.R && scratch[2 * g.R + s + 1] <= i) ++s;
  return s;
}

// CTA q sends, to every peer, the chunks the striping plan puts on logical QP q.
template <class T>
__global__ void SendKernel(Geometry g, const int32_t* counts_ext, const int64_t* scratch,
                           char* heap, int64_t half_bytes, HeapLayout L, Wire wire) {
  char* half = heap + Parity() * half_bytes;
  const Half h = HalfAt(half, L, g.R);
  const int32_t* counts = counts_ext != nullptr ? counts_ext : h.counts;
  uint64_t* sig = wire == Wire::kCombine ? h.sig_comb : h.sig_disp;
  const int q = blockIdx.x;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int i = 1; i < g.R; ++i) {
    const int peer = (g.rank + i) % g.R;
    const Span s = StreamTo(g, counts, scratch, peer, wire, L);
    // The channel whose chunks go on QP q for this peer (a bijection when
    // channels == QPs, see striping_plan.h).
    int channel = -1;
    for (int c = 0; c < g.num_qps; ++c) {
      if (qp_for(peer, c, c, g.P, g.Q).qp == q) {
        channel = c;
        break;
      }
    }
    const int64_t n = num_chunks(s.bytes, g.chunk);
    if (channel >= 0) {
      int k = 0;
      for (int64_t j = channel; j < n; j += g.num_qps, ++k) {
        if (k % kWarps != warp) continue;
        const QpPort qp = qp_for(peer, channel, j, g.P, g.Q);
        const int64_t off = chunk_offset(j, g.chunk);
        T::put_signal_warp(half + s.dst + off, half + s.src + off,
                           static_cast<size_t>(chunk_size(s.bytes, j, g.chunk)),
                           sig + g.rank, 1, SignalOp::kAdd, peer, qp.qp);
      }
    }
    // One closing signal per peer, so a peer with nothing to receive still hears from us.
    if (q == 0 && warp == 0 && lane == 0)
      T::signal(sig + g.rank, 1, SignalOp::kAdd, peer, 0);
  }
  __syncwarp();
  if (lane == 0) T::quiet();
}

// Waits (every block) for every source's chunks, then writes the dispatch outputs.
template <class T>
__global__ void UnpackKernel(Geometry g, const int64_t* scratch, char* heap,
                             int64_t half_bytes, HeapLayout L, DispatchOut out) {
  const Half h = CurrentHalf(heap, half_bytes, L, g.R);
  WaitSources<T>(g, h.counts, h.sig_disp, Wire::kDispatch);
  const int64_t total = scratch[3 * g.R];
  const int64_t num_recv = kept_rows(total, g.C);
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    *out.num_recv = static_cast<int32_t>(num_recv);
    *out.num_dropped = static_cast<int32_t>(total - num_recv);
  }
  for (int64_t i = threadIdx.x + static_cast<int64_t>(blockIdx.x) * blockDim.x;
       i < static_cast<int64_t>(g.R) * g.R; i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    out.counts[i] = h.counts[i];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int64_t i = blockIdx.x * kWarps + warp; i < g.C; i += gridDim.x * kWarps) {
    char* xo = static_cast<char*>(out.recv_x) + i * g.xrow;
    int32_t* io = out.recv_topk_idx + i * g.K;
    float* wo = out.recv_topk_weights + i * g.K;
    if (i >= num_recv) {
      ZeroBytes(xo, g.xrow, lane, 32);
      for (int k = lane; k < g.K; k += 32) {
        io[k] = -1;
        wo[k] = 0.f;
      }
      if (lane == 0) out.src_rank[i] = out.src_index[i] = -1;
      continue;
    }
    const int s = SourceOfRow(g, scratch, i);
    const char* row = s == g.rank
                          ? h.stage + (scratch[g.R + g.rank] + (i - scratch[2 * g.R + s])) * g.ds
                          : h.recv + i * g.ds;
    CopyBytes(xo, row, g.xrow, lane, 32);
    const int32_t* ids = reinterpret_cast<const int32_t*>(row + g.xrow);
    const float* ws = reinterpret_cast<const float*>(ids + g.K);
    for (int k = lane; k < g.K; k += 32) {
      const int32_t local = local_expert_id(ids[k], g.el, g.rank);
      io[k] = local;
      wo[k] = local < 0 ? 0.f : ws[k];
      if (local >= 0) atomicAdd(out.recv_per_expert + local, 1);
    }
    if (lane == 0) {
      out.src_rank[i] = s;
      out.src_index[i] = ids[2 * g.K];
    }
  }
}

// Resets the signals of this call's half and advances the call counter.
__global__ void FinishKernel(int R, char* heap, int64_t half_bytes, HeapLayout L,
                             bool combine) {
  const Half h = CurrentHalf(heap, half_bytes, L, R);
  uint64_t* sig = combine ? h.sig_comb : h.sig_disp;
  for (int s = threadIdx.x; s < R; s += blockDim.x) sig[s] = 0;
  __syncthreads();
  if (threadIdx.x == 0) ++g_call_counter;
}

// ---- combine -----------------------------------------------------------------------

__global__ void CombineStageKernel(Geometry g, const char* y, const int64_t* scratch,
                                   char* heap, int64_t half_bytes, HeapLayout L) {
  const Half h = CurrentHalf(heap, half_bytes, L, g.R);
  const int64_t rows = kept_rows(scratch[3 * g.R], g.C);
  for (int64_t i = blockIdx.x; i < rows; i += gridDim.x)
    CopyBytes(h.cstage + i * g.cs, y + i * g.yrow, g.yrow, threadIdx.x, blockDim.x);
}

template <typename E>
__device__ __forceinline__ float ToF(E v) { return static_cast<float>(v); }
template <typename E>
__device__ __forceinline__ E FromF(float v) { return static_cast<E>(v); }
template <>
__device__ __forceinline__ float ToF(__nv_bfloat16 v) {
  return bf16_to_f32(__bfloat16_as_ushort(v));
}
template <>
__device__ __forceinline__ __nv_bfloat16 FromF(float v) {
  return __ushort_as_bfloat16(f32_to_bf16(v));
}
template <>
__device__ __forceinline__ float ToF(__half v) { return f16_to_f32(__half_as_ushort(v)); }
template <>
__device__ __forceinline__ __half FromF(float v) { return __ushort_as_half(f32_to_f16(v)); }

// One block per token: wait for every rank's rows, then sum in ascending rank order.
template <class T, typename E>
__global__ void ReduceKernel(Geometry g, const E* y, const int32_t* counts,
                             const int32_t* send_slot, const int64_t* scratch, char* heap,
                             int64_t half_bytes, HeapLayout L, E* out) {
  const Half h = CurrentHalf(heap, half_bytes, L, g.R);
  WaitSources<T>(g, counts, h.sig_comb, Wire::kCombine);
  const int t = blockIdx.x;
  for (int x = threadIdx.x; x < g.H; x += blockDim.x) {
    float acc = 0.f;
    for (int d = 0; d < g.R; ++d) {
      const int j = send_slot[static_cast<int64_t>(t) * g.R + d];
      if (j < 0) continue;
      const int64_t base = scratch[d];  // rows of sources < rank at d
      if (base + j >= g.C) continue;   // dropped at d
      const E* row = d == g.rank
                         ? y + (base + j) * g.H
                         : reinterpret_cast<const E*>(h.back + (scratch[g.R + d] + j) * g.cs);
      acc += ToF(row[x]);
    }
    out[static_cast<int64_t>(t) * g.H + x] = FromF<E>(acc);
  }
}

// ---- gather (combine's transpose) ----------------------------------------------------
// out[i] = g_{src_rank[i]}[src_index[i]]: every source sends, by the dispatch handle
// (counts, send_slot), its g rows to the rows they occupy on each receiver.

// One block per token: pack g[t] once per destination into the back rows, in send order.
__global__ void GatherPackKernel(Geometry g, const char* src, const int32_t* send_slot,
                                 const int64_t* scratch, char* heap, int64_t half_bytes,
                                 HeapLayout L) {
  const Half h = CurrentHalf(heap, half_bytes, L, g.R);
  const int t = blockIdx.x;
  const char* row = src + static_cast<int64_t>(t) * g.yrow;
  for (int d = 0; d < g.R; ++d) {
    const int j = send_slot[static_cast<int64_t>(t) * g.R + d];
    if (j < 0 || scratch[d] + j >= g.C) continue;  // not sent there, or dropped there
    CopyBytes(h.back + (scratch[g.R + d] + j) * g.cs, row, g.yrow, threadIdx.x, blockDim.x);
  }
}

// Waits (every block) for every source's chunks, then writes out[C, H] (zero rows past
// the rows kept).
template <class T>
__global__ void GatherUnpackKernel(Geometry g, const int32_t* counts, const int64_t* scratch,
                                   char* heap, int64_t half_bytes, HeapLayout L, char* out) {
  const Half h = CurrentHalf(heap, half_bytes, L, g.R);
  WaitSources<T>(g, counts, h.sig_disp, Wire::kGather);
  const int64_t num_recv = kept_rows(scratch[3 * g.R], g.C);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int64_t i = blockIdx.x * kWarps + warp; i < g.C; i += gridDim.x * kWarps) {
    char* o = out + i * g.yrow;
    if (i >= num_recv) {
      ZeroBytes(o, g.yrow, lane, 32);
      continue;
    }
    const int s = SourceOfRow(g, scratch, i);
    const char* row =
        s == g.rank ? h.back + (scratch[g.R + g.rank] + (i - scratch[2 * g.R + s])) * g.cs
                    : h.cstage + i * g.cs;
    CopyBytes(o, row, g.yrow, lane, 32);
  }
}

std::string CudaErr(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return {};
  return std::string("jax_ep internode: ") + what + ": " + cudaGetErrorString(e);
}

std::string MakeGeometry(const Dims& d, int x_bytes, int y_bytes, Geometry* g, HeapLayout* L) {
  if (!g_rt.initialized)
    return "jax_ep internode: NVSHMEM is not initialised; call "
           "jax_ep.nvshmem_bootstrap.initialize(...) before jit";
  if (d.num_ranks != g_rt.world || d.rank != g_rt.rank)
    return "jax_ep internode: the EP group must be all NVSHMEM PEs (" +
           std::to_string(g_rt.world) + " processes, one GPU each); got " +
           std::to_string(d.num_ranks) + " ranks";
  if (d.num_ranks > kMaxRanks) return "jax_ep internode: more than 1024 ranks";
  const int qps = d.num_ports * d.qps_per_port;
  if (d.num_ports < 1 || d.qps_per_port < 1 || qps > transport::kMaxQps || d.chunk_bytes < 1)
    return "jax_ep internode: bad transport config (ports, QPs per port, chunk bytes)";
  g->R = d.num_ranks;
  g->rank = d.rank;
  g->T = d.tokens;
  g->H = d.hidden;
  g->K = d.topk;
  g->C = d.capacity;
  g->E = d.num_experts;
  g->el = d.experts_per_rank;
  g->xrow = static_cast<int64_t>(d.hidden) * x_bytes;
  g->yrow = static_cast<int64_t>(d.hidden) * y_bytes;
  g->ds = dispatch_row_stride(g->xrow, d.topk);
  g->cs = combine_row_stride(g->yrow);
  g->P = d.num_ports;
  g->Q = d.qps_per_port;
  g->num_qps = qps;
  // Chunks are whole 16-byte units so every put stays aligned.
  g->chunk = round_up(d.chunk_bytes, 16);
  *L = heap_layout(d.num_ranks, d.tokens, d.capacity, d.hidden, d.topk, x_bytes, y_bytes);
  if (static_cast<size_t>(L->total) > g_rt.half_bytes)
    return "jax_ep internode: the NVSHMEM heap is too small for this call (needs " +
           std::to_string(2 * L->total) + " bytes plus slack, has " +
           std::to_string(g_rt.heap_bytes) +
           "); initialise with the largest tokens/capacity/hidden/topk the program uses";
  return {};
}

std::string CheckErrorFlag(cudaStream_t stream) {
  int flag = 0;
  std::string e = CudaErr(cudaMemcpyAsync(&flag, g_rt.error_flag, sizeof(int),
                                          cudaMemcpyDeviceToHost, stream), "read error flag");
  if (e.empty()) e = CudaErr(cudaStreamSynchronize(stream), "dispatch");
  if (!e.empty()) return e;
  if (flag) {
    cudaMemsetAsync(g_rt.error_flag, 0, sizeof(int), stream);
    return "jax_ep internode: topk_idx has values outside [-1, num_experts)";
  }
  return {};
}

// Start of a handle-driven call (combine, gather): geometry and layout for rows of
// `elem` (they travel through the back and cstage regions; dispatch's regions, sized by
// x, are unused), then the row prefixes from the handle's counts.
std::string BeginHandleCall(cudaStream_t stream, const Dims& d, FloatKind elem,
                            const int32_t* counts, Geometry* g, HeapLayout* L) {
  std::string e = MakeGeometry(d, 0, FloatKindBytes(elem), g, L);
  if (!e.empty()) return e;
  PrefixKernel<<<1, kThreads, 0, stream>>>(*g, counts, g_rt.heap,
                                           static_cast<int64_t>(g_rt.half_bytes), *L,
                                           g_rt.scratch);
  return {};
}

}  // namespace


int Version() {
  return NVSHMEM_VENDOR_MAJOR_VERSION * 10000 + NVSHMEM_VENDOR_MINOR_VERSION * 100 +
         NVSHMEM_VENDOR_PATCH_VERSION;
}

bool Initialized() { return g_rt.initialized; }
size_t HeapBytes() { return g_rt.heap_bytes; }

std::string UniqueId(std::string* out) {
  nvshmemx_uniqueid_t id = NVSHMEMX_UNIQUEID_INITIALIZER;
  if (nvshmemx_get_uniqueid(&id) != 0) return "jax_ep internode: nvshmemx_get_uniqueid failed";
  out->assign(reinterpret_cast<const char*>(&id), sizeof(id));
  return {};
}

std::string Init(int rank, int world, const std::string& unique_id, size_t heap_bytes,
                 int num_qps) {
  if (g_rt.initialized) return "jax_ep internode: NVSHMEM is already initialised";
  nvshmemx_uniqueid_t id = NVSHMEMX_UNIQUEID_INITIALIZER;
  if (unique_id.size() != sizeof(id))
    return "jax_ep internode: unique id has " + std::to_string(unique_id.size()) +
           " bytes, expected " + std::to_string(sizeof(id));
  if (heap_bytes <= static_cast<size_t>(kHeapSlackBytes))
    return "jax_ep internode: heap_bytes is smaller than the reserved slack";
  std::memcpy(&id, unique_id.data(), sizeof(id));
  std::string e = CudaErr(cudaFree(nullptr), "CUDA context");
  if (!e.empty()) return e;
  nvshmemx_init_attr_t attr = NVSHMEMX_INIT_ATTR_INITIALIZER;
  if (nvshmemx_set_attr_uniqueid_args(rank, world, &id, &attr) != 0)
    return "jax_ep internode: nvshmemx_set_attr_uniqueid_args failed";
  if (nvshmemx_init_attr(NVSHMEMX_INIT_WITH_UNIQUEID, &attr) != 0)
    return "jax_ep internode: nvshmemx_init_attr failed";
  if (nvshmem_my_pe() != rank || nvshmem_n_pes() != world)
    return "jax_ep internode: NVSHMEM PE " + std::to_string(nvshmem_my_pe()) + "/" +
           std::to_string(nvshmem_n_pes()) + " does not match process " +
           std::to_string(rank) + "/" + std::to_string(world);
  const size_t usable = heap_bytes - kHeapSlackBytes;
  g_rt.half_bytes = (usable / 2) / kHeapAlign * kHeapAlign;
  g_rt.heap = static_cast<char*>(nvshmem_malloc(2 * g_rt.half_bytes));
  if (g_rt.heap == nullptr) return "jax_ep internode: nvshmem_malloc of the heap failed";
  e = CudaErr(cudaMemset(g_rt.heap, 0, 2 * g_rt.half_bytes), "clear heap");
  if (e.empty())
    e = CudaErr(cudaMalloc(&g_rt.scratch, sizeof(int64_t) * (3 * world + 1)), "scratch");
  if (e.empty()) e = CudaErr(cudaMalloc(&g_rt.error_flag, sizeof(int)), "error flag");
  if (e.empty()) e = CudaErr(cudaMemset(g_rt.error_flag, 0, sizeof(int)), "error flag");
  if (!e.empty()) return e;
  int handles = 0;
#if JAX_EP_NVSHMEM_QP_API
  // Explicit QP handles are opt-in (JAX_EP_NVSHMEM_QP_API=1): the default relies on
  // NVSHMEM_IBGDA_RC_MAP_BY=cta, which every IBGDA version honours.
  const char* want = std::getenv("JAX_EP_NVSHMEM_QP_API");
  if (want != nullptr && std::strcmp(want, "1") == 0 && num_qps <= transport::kMaxQps) {
    nvshmemx_qp_handle_t* arr = nullptr;
    if (nvshmemx_qp_create(num_qps, &arr) == 0 && arr != nullptr) {
      int host[transport::kMaxQps];
      for (int i = 0; i < num_qps; ++i) host[i] = arr[i];
      e = CudaErr(cudaMemcpyToSymbol(transport::g_nvshmem_qp_handles, host,
                                     sizeof(int) * num_qps), "QP handles");
      if (!e.empty()) return e;
      handles = num_qps;
    }
  }
#endif
  e = CudaErr(cudaMemcpyToSymbol(transport::g_nvshmem_num_qp_handles, &handles, sizeof(int)),
              "QP handles");
  if (!e.empty()) return e;
  const unsigned long long zero = 0;
  e = CudaErr(cudaMemcpyToSymbol(g_call_counter, &zero, sizeof(zero)), "call counter");
  if (!e.empty()) return e;
  e = CudaErr(cudaDeviceSynchronize(), "init");
  if (!e.empty()) return e;
  nvshmem_barrier_all();
  g_rt.initialized = true;
  g_rt.rank = rank;
  g_rt.world = world;
  g_rt.heap_bytes = heap_bytes;
  return {};
}

std::string Finalize() {
  if (!g_rt.initialized) return {};
  cudaDeviceSynchronize();
  nvshmem_barrier_all();
  nvshmem_free(g_rt.heap);
  cudaFree(g_rt.scratch);
  cudaFree(g_rt.error_flag);
  nvshmem_finalize();
  g_rt = RuntimeState{};
  return {};
}

std::string Dispatch(cudaStream_t stream, const Dims& d, FloatKind elem, const void* x,
                     const int32_t* topk_idx, const float* topk_weights,
                     const DispatchOut& out) {
  Geometry g;
  HeapLayout L;
  // Each call lays out its own half; combine's regions (sized by y) are unused here.
  std::string e = MakeGeometry(d, FloatKindBytes(elem), 0, &g, &L);
  if (!e.empty()) return e;
  char* heap = g_rt.heap;
  const int64_t hb = static_cast<int64_t>(g_rt.half_bytes);
  e = CudaErr(cudaMemsetAsync(out.recv_per_expert, 0, sizeof(int32_t) * d.experts_per_rank,
                              stream), "clear expert counts");
  if (!e.empty()) return e;
  SlotsKernel<<<g.R, kThreads, 0, stream>>>(g, topk_idx, out.send_slot, heap, hb, L,
                                            g_rt.error_flag);
  if (g.T > 0)
    PackKernel<<<g.T, 128, 0, stream>>>(g, static_cast<const char*>(x), topk_idx,
                                        topk_weights, out.send_slot, heap, hb, L);
  CountsKernel<Transport><<<1, kThreads, 0, stream>>>(g, heap, hb, L);
  PrefixKernel<<<1, kThreads, 0, stream>>>(g, nullptr, heap, hb, L, g_rt.scratch);
  SendKernel<Transport><<<g.num_qps, kThreads, 0, stream>>>(g, nullptr, g_rt.scratch, heap,
                                                             hb, L, Wire::kDispatch);
  const int blocks = static_cast<int>((g.C + kWarps - 1) / kWarps);
  UnpackKernel<Transport><<<blocks < 1024 ? blocks : 1024, kThreads, 0, stream>>>(
      g, g_rt.scratch, heap, hb, L, out);
  FinishKernel<<<1, kThreads, 0, stream>>>(g.R, heap, hb, L, false);
  e = CudaErr(cudaGetLastError(), "dispatch launch");
  if (!e.empty()) return e;
  return CheckErrorFlag(stream);
}

std::string Combine(cudaStream_t stream, const Dims& d, FloatKind elem, const void* y,
                    const int32_t* counts, const int32_t* send_slot, void* out) {
  Geometry g;
  HeapLayout L;
  const std::string e = BeginHandleCall(stream, d, elem, counts, &g, &L);
  if (!e.empty()) return e;
  char* heap = g_rt.heap;
  const int64_t hb = static_cast<int64_t>(g_rt.half_bytes);
  CombineStageKernel<<<g.C < 1024 ? g.C : 1024, kThreads, 0, stream>>>(
      g, static_cast<const char*>(y), g_rt.scratch, heap, hb, L);
  SendKernel<Transport><<<g.num_qps, kThreads, 0, stream>>>(g, counts, g_rt.scratch, heap,
                                                             hb, L, Wire::kCombine);
  if (g.T > 0) {
    switch (elem) {
      case FloatKind::kF32:
        ReduceKernel<Transport, float><<<g.T, kThreads, 0, stream>>>(
            g, static_cast<const float*>(y), counts, send_slot, g_rt.scratch, heap, hb, L,
            static_cast<float*>(out));
        break;
      case FloatKind::kBF16:
        ReduceKernel<Transport, __nv_bfloat16><<<g.T, kThreads, 0, stream>>>(
            g, static_cast<const __nv_bfloat16*>(y), counts, send_slot, g_rt.scratch, heap,
            hb, L, static_cast<__nv_bfloat16*>(out));
        break;
      case FloatKind::kF16:
        ReduceKernel<Transport, __half><<<g.T, kThreads, 0, stream>>>(
            g, static_cast<const __half*>(y), counts, send_slot, g_rt.scratch, heap, hb, L,
            static_cast<__half*>(out));
        break;
    }
  }
  FinishKernel<<<1, kThreads, 0, stream>>>(g.R, heap, hb, L, true);
  return CudaErr(cudaGetLastError(), "combine launch");
}

std::string Gather(cudaStream_t stream, const Dims& d, FloatKind elem, const void* src,
                   const int32_t* counts, const int32_t* send_slot, void* out) {
  Geometry g;
  HeapLayout L;
  const std::string e = BeginHandleCall(stream, d, elem, counts, &g, &L);
  if (!e.empty()) return e;
  char* heap = g_rt.heap;
  const int64_t hb = static_cast<int64_t>(g_rt.half_bytes);
  if (g.T > 0)
    GatherPackKernel<<<g.T, 128, 0, stream>>>(g, static_cast<const char*>(src), send_slot,
                                              g_rt.scratch, heap, hb, L);
  SendKernel<Transport><<<g.num_qps, kThreads, 0, stream>>>(g, counts, g_rt.scratch, heap,
                                                             hb, L, Wire::kGather);
  const int blocks = static_cast<int>((g.C + kWarps - 1) / kWarps);
  GatherUnpackKernel<Transport><<<blocks < 1024 ? blocks : 1024, kThreads, 0, stream>>>(
      g, counts, g_rt.scratch, heap, hb, L, static_cast<char*>(out));
  FinishKernel<<<1, kThreads, 0, stream>>>(g.R, heap, hb, L, false);
  return CudaErr(cudaGetLastError(), "gather launch");
}

namespace {
// One warp puts 4 KiB from the first half of a scratch area to its second half on this
// PE through the transport, with a signal; thread 0 waits for the signal.
__global__ void SelfPutKernel(char* area, uint64_t* sig, int* ok) {
  const int me = Transport::my_pe();
  constexpr int kBytes = 4096;
  for (int i = threadIdx.x; i < kBytes; i += blockDim.x) area[i] = static_cast<char>(i * 7 + 3);
  __syncwarp();
  Transport::put_signal_warp(area + kBytes, area, kBytes, sig, 1, SignalOp::kSet, me, 0);
  if (threadIdx.x == 0) {
    Transport::quiet();
    Transport::wait_ge(sig, 1);
    int good = 1;
    for (int i = 0; i < kBytes; ++i) good &= area[kBytes + i] == static_cast<char>(i * 7 + 3);
    *ok = good;
  }
}
}  // namespace

std::string SelfPutCheck(bool* ok) {
  *ok = false;
  if (!g_rt.initialized) return "jax_ep internode: NVSHMEM is not initialised";
  if (g_rt.half_bytes < 8192 + 256) return "jax_ep internode: heap too small for the check";
  std::string e = CudaErr(cudaDeviceSynchronize(), "self put");
  // Uses the half the next call would use, then clears it again.
  unsigned long long counter = 0;
  if (e.empty()) e = CudaErr(cudaMemcpyFromSymbol(&counter, g_call_counter, sizeof(counter)),
                             "call counter");
  if (!e.empty()) return e;
  char* area = g_rt.heap + (counter & 1ull) * g_rt.half_bytes;
  uint64_t* sig = reinterpret_cast<uint64_t*>(area + 8192);
  int* dok = g_rt.error_flag;  // reused as the result cell, reset below
  SelfPutKernel<<<1, 32>>>(area, sig, dok);
  int host = 0;
  e = CudaErr(cudaMemcpy(&host, dok, sizeof(int), cudaMemcpyDeviceToHost), "self put");
  if (e.empty()) e = CudaErr(cudaMemset(area, 0, 8192 + 256), "self put cleanup");
  if (e.empty()) e = CudaErr(cudaMemset(dok, 0, sizeof(int)), "self put cleanup");
  if (!e.empty()) return e;
  *ok = host == 1;
  return {};
}

}  // namespace internode
}  // namespace jax_ep
