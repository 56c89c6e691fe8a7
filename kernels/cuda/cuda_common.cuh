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

// ---- bulk (TMA) row copies, issued by one thread ----
// Two staging pieces in shared memory with an mbarrier each; `phase` bit b is the parity
// the next wait on mbar[b] waits for. One thread (a warp's lane 0) owns it.
struct BulkStage {
  char* buf[2];
  uint64_t* mbar[2];
  uint32_t bytes;  // a piece (a multiple of 16)
  uint32_t phase;
  int64_t timeout_ns;  // each mbarrier wait's bound (the kernels' timeout)
  bool failed;         // a wait timed out: the stage's barriers are out of step, copy no more
};

// Copies `n` bytes (16-byte aligned and sized) from global `src` to global `dst` through
// the stage, piece by piece: piece p + 1 loads while piece p stores. The stores are left
// in flight; bulk_wait_all() before the kernel ends (or before anything reads dst).
// False when a piece's load did not land within the stage's timeout (the caller records
// it); the stage then copies nothing more.
__device__ __forceinline__ bool bulk_copy_row(BulkStage& st, char* dst, const char* src, size_t n) {
  if (st.failed) return false;
  const uint32_t np = static_cast<uint32_t>((n + st.bytes - 1) / st.bytes);
  auto len = [&](uint32_t p) {
    const size_t left = n - static_cast<size_t>(p) * st.bytes;
    return static_cast<uint32_t>(left < st.bytes ? left : st.bytes);
  };
  // The previous row's last stores have read the pieces.
  peer::bulk_wait_read<0>();
  peer::bulk_load(st.buf[0], src, len(0), st.mbar[0]);
  for (uint32_t p = 0; p < np; ++p) {
    const uint32_t b = p & 1u;
    if (p + 1 < np) {
      peer::bulk_wait_read<0>();  // piece p - 1's store has read buf[b ^ 1]
      peer::bulk_load(st.buf[b ^ 1u], src + static_cast<size_t>(p + 1) * st.bytes, len(p + 1),
                      st.mbar[b ^ 1u]);
    }
    if (!peer::mbar_wait(st.mbar[b], (st.phase >> b) & 1u, st.timeout_ns)) {
      st.failed = true;
      return false;
    }
    st.phase ^= 1u << b;
    peer::bulk_store(dst + static_cast<size_t>(p) * st.bytes, st.buf[b], len(p));
    peer::bulk_commit();
  }
  return true;
}

// Stores `n` zero bytes (16-byte aligned and sized) at `dst` from `zeros` (`zbytes` of
// zeros in shared memory, never rewritten while stores read them).
__device__ __forceinline__ void bulk_zero_row(const char* zeros, uint32_t zbytes, char* dst, size_t n) {
  for (size_t off = 0; off < n; off += zbytes)
    peer::bulk_store(dst + off, zeros, static_cast<uint32_t>(n - off < zbytes ? n - off : zbytes));
  peer::bulk_commit();
}

// Lanes below `lane` in the warp.
__device__ __forceinline__ unsigned lanemask_lt() { return peer::lanemask_lt(); }

}  // namespace jax_ep
