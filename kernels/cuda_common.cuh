// Helpers shared by the CUDA kernels: the sticky error record, element conversions that
// match kernels/dtype_convert.h bit for bit, and warp-wide row copies.
#pragma once

#include <cstdint>

#include "kernels/dtype_convert.h"
#include "kernels/intranode_buffer.h"
#include "kernels/peer_transport.cuh"

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

// ---- element conversions: the host/device definitions of kernels/dtype_convert.h ----
__device__ __forceinline__ float bf16_bits_to_f32(uint32_t h) {
  return bf16_to_f32(static_cast<uint16_t>(h));
}
__device__ __forceinline__ uint32_t f32_to_bf16_bits(float f) { return f32_to_bf16(f); }
__device__ __forceinline__ float f16_bits_to_f32(uint32_t h) {
  return f16_to_f32(static_cast<uint16_t>(h));
}
__device__ __forceinline__ uint32_t f32_to_f16_bits(float f) { return f32_to_f16(f); }

// ---- warp-wide copies ----
__device__ __forceinline__ bool aligned16(const void* a, const void* b, size_t n) {
  return ((reinterpret_cast<uintptr_t>(a) | reinterpret_cast<uintptr_t>(b) | n) & 15u) == 0;
}

// Copies one row of `n` bytes with the 32 lanes of a warp. `src` may have been written
// by a peer during this kernel (loads bypass L1).
__device__ __forceinline__ void warp_copy_row(void* dst, const void* src, size_t n, int lane) {
  if (aligned16(dst, src, n)) {
    const size_t nv = n / 16;
    const char* s = static_cast<const char*>(src);
    uint4* d = static_cast<uint4*>(dst);
    for (size_t i = lane; i < nv; i += 32) d[i] = peer::load_cg16(s + i * 16);
  } else {
    const char* s = static_cast<const char*>(src);
    char* d = static_cast<char*>(dst);
    for (size_t i = lane; i < n; i += 32) d[i] = *reinterpret_cast<const volatile char*>(s + i);
  }
}

__device__ __forceinline__ void warp_zero_row(void* dst, size_t n, int lane) {
  if (((reinterpret_cast<uintptr_t>(dst) | n) & 15u) == 0) {
    uint4* d = static_cast<uint4*>(dst);
    const uint4 z = make_uint4(0, 0, 0, 0);
    for (size_t i = lane; i < n / 16; i += 32) d[i] = z;
  } else {
    char* d = static_cast<char*>(dst);
    for (size_t i = lane; i < n; i += 32) d[i] = 0;
  }
}

// Lanes below `lane` in the warp.
__device__ __forceinline__ unsigned lanemask_lt() {
  unsigned m;
  asm("mov.u32 %0, %%lanemask_lt;" : "=r"(m));
  return m;
}

}  // namespace jax_ep
