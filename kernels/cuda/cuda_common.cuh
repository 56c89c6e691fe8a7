// Helpers shared by the CUDA kernels: the sticky error record, topk id sanitizing and
// warp-wide row copies.
#pragma once

#include <cstdint>

#include "kernels/common/dtype_convert.h"
#include "kernels/cuda/intranode_buffer.h"
#include "kernels/cuda/peer_transport.cuh"

namespace jax_ep {

constexpr unsigned kFullMask = 0xffffffffu;

// Records an error in `dev` (the translation unit's device record) and in the mapped
// host mirror if there is one. The first error wins.
__device__ __forceinline__ void record_error(ErrorRecord* dev, ErrorRecord* host, int32_t code,
                                             int32_t rank, int32_t a, int32_t b, int32_t c,
                                             int32_t d) {
  if (atomicCAS(&dev->code, 0, code) == 0) {
    dev->rank = rank;
    dev->a = a;
    dev->b = b;
    dev->c = c;
    dev->d = d;
    if (host != nullptr && *reinterpret_cast<volatile int32_t*>(&host->code) == 0) {
      volatile ErrorRecord* h = host;
      h->rank = rank;
      h->a = a;
      h->b = b;
      h->c = c;
      h->d = d;
      __threadfence_system();
      h->code = code;
    }
  }
}

// A topk id outside [-1, E) counts as an unused slot (-1); callers record the error.
__device__ __forceinline__ int32_t sanitized(int32_t e, int E) { return (e < -1 || e >= E) ? -1 : e; }

// Reads (and optionally clears) a translation unit's sticky device record `symbol`.
inline cudaError_t ReadErrorSymbol(const ErrorRecord& symbol, ErrorRecord* out, bool clear) {
  cudaError_t err = cudaMemcpyFromSymbol(out, symbol, sizeof(ErrorRecord));
  if (err == cudaSuccess && clear) {
    const ErrorRecord zero{};
    err = cudaMemcpyToSymbol(symbol, &zero, sizeof(ErrorRecord));
  }
  return err;
}

// ---- warp-wide copies ----
__device__ __forceinline__ bool aligned16(const void* a, const void* b, size_t n) {
  return ((reinterpret_cast<uintptr_t>(a) | reinterpret_cast<uintptr_t>(b) | n) & 15u) == 0;
}

// 16-byte load of a row source: kInput for XLA inputs (read-only while the kernel runs),
// else data a peer wrote into our buffer (bypasses L1, coherent at L2).
template <bool kInput>
__device__ __forceinline__ uint4 load_row16(const char* p) {
  if constexpr (kInput) return peer::load_nc16(p);
  else return peer::load_cg16(p);
}

// Vectors each lane keeps in flight in the row copies: one 16-byte load per lane leaves
// most of the memory latency exposed, so loads are issued in batches before any store.
constexpr int kCopyUnroll = 4;

// Copies one row of `n` bytes with the 32 lanes of a warp. kInput: `src` is an XLA input;
// otherwise a peer may have written it during this kernel (loads bypass L1).
template <bool kInput>
__device__ __forceinline__ void warp_copy_row(void* dst, const void* src, size_t n, int lane) {
  if (aligned16(dst, src, n)) {
    const size_t nv = n / 16;
    const char* s = static_cast<const char*>(src);
    uint4* d = static_cast<uint4*>(dst);
    size_t i = lane;
    for (; i + 32 * (kCopyUnroll - 1) < nv; i += 32 * kCopyUnroll) {
      uint4 v[kCopyUnroll];
#pragma unroll
      for (int u = 0; u < kCopyUnroll; ++u) v[u] = load_row16<kInput>(s + (i + 32 * u) * 16);
#pragma unroll
      for (int u = 0; u < kCopyUnroll; ++u) peer::store16(&d[i + 32 * u], v[u]);
    }
    for (; i < nv; i += 32) peer::store16(&d[i], load_row16<kInput>(s + i * 16));
  } else {
    const char* s = static_cast<const char*>(src);
    char* d = static_cast<char*>(dst);
    for (size_t i = lane; i < n; i += 32)
      peer::store(&d[i], static_cast<char>(*reinterpret_cast<const volatile char*>(s + i)));
  }
}

__device__ __forceinline__ void warp_zero_row(void* dst, size_t n, int lane) {
  if (((reinterpret_cast<uintptr_t>(dst) | n) & 15u) == 0) {
    uint4* d = static_cast<uint4*>(dst);
    const uint4 z = make_uint4(0, 0, 0, 0);
    for (size_t i = lane; i < n / 16; i += 32) peer::store16(&d[i], z);
  } else {
    char* d = static_cast<char*>(dst);
    for (size_t i = lane; i < n; i += 32) peer::store(&d[i], char{0});
  }
}

// Lanes below `lane` in the warp.
__device__ __forceinline__ unsigned lanemask_lt() { return peer::lanemask_lt(); }

}  // namespace jax_ep
