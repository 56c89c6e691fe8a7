// Byte copies inside the internode kernels: a row may start at any byte of the heap or of
// an XLA buffer (odd H in 16-bit dtypes, FP8 rows), so each copy takes the widest access
// both pointers and the length allow. Threads [tid, stride) share the work.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace jax_ep {
namespace devcopy {

__device__ __forceinline__ void CopyBytes(char* dst, const char* src, int64_t n, int tid,
                                          int stride) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src);
  if ((a % 16) == 0 && (n % 16) == 0) {
    for (int64_t i = tid; i < n / 16; i += stride)
      reinterpret_cast<int4*>(dst)[i] = reinterpret_cast<const int4*>(src)[i];
  } else if ((a % 4) == 0 && (n % 4) == 0) {
    for (int64_t i = tid; i < n / 4; i += stride)
      reinterpret_cast<int32_t*>(dst)[i] = reinterpret_cast<const int32_t*>(src)[i];
  } else if ((a % 2) == 0 && (n % 2) == 0) {
    for (int64_t i = tid; i < n / 2; i += stride)
      reinterpret_cast<uint16_t*>(dst)[i] = reinterpret_cast<const uint16_t*>(src)[i];
  } else {
    for (int64_t i = tid; i < n; i += stride) dst[i] = src[i];
  }
}

__device__ __forceinline__ void ZeroBytes(char* dst, int64_t n, int tid, int stride) {
  for (int64_t i = tid; i < n; i += stride) dst[i] = 0;
}

}  // namespace devcopy
}  // namespace jax_ep
