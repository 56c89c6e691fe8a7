// Byte copies inside the internode kernels: a row may start at any byte of the heap or of
// an XLA buffer (odd H in 16-bit dtypes, FP8 rows), so each copy takes the widest access
// both pointers and the length allow. Threads [tid, stride) share the work.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

// The emulated GPU counts each thread's share of a copy by width (kernels/emu/emu_cuda.h,
// note_copy_share); on a GPU this is nothing.
#if defined(JAX_EP_EMU)
#define JEP_COUNT_COPY(dst, src, width, count, tid, stride) \
  ::emu::note_copy_share(dst, src, width, count, tid, stride)
#else
#define JEP_COUNT_COPY(dst, src, width, count, tid, stride) ((void)0)
#endif

namespace jax_ep {
namespace devcopy {

// Whether stores to dst reach memory another GPU reads over NVLink (a peer's ring through
// nvshmem_ptr). On the emulated GPU such stores are weak: they sit in the writing thread's
// store buffer until its fence or release (kernels/emu/emu_cuda.h, buffered_store); on a
// GPU every store is a plain store and this is never asked.
__device__ __forceinline__ bool RemoteDst(const void* dst) {
#if defined(JAX_EP_EMU)
  return ::emu::remote_store(dst);
#else
  (void)dst;
  return false;
#endif
}

// One store of a copy or of a row's word: `remote` from RemoteDst(p).
template <class V>
__device__ __forceinline__ void StoreTo(V* p, const V& v, bool remote) {
#if defined(JAX_EP_EMU)
  if (remote) {
    ::emu::buffered_store(p, &v, sizeof(V));
    return;
  }
#else
  (void)remote;
#endif
  *p = v;
}

// A single word of a row (ids, weights, metadata) that may land in a peer's ring.
template <class V>
__device__ __forceinline__ void StoreWord(V* p, V v) {
  StoreTo(p, v, RemoteDst(p));
}

__device__ __forceinline__ void CopyBytes(char* dst, const char* src, int64_t n, int tid,
                                          int stride) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src);
  const bool rm = RemoteDst(dst);
  if ((a % 16) == 0 && (n % 16) == 0) {
    JEP_COUNT_COPY(dst, src, 16, n / 16, tid, stride);
    for (int64_t i = tid; i < n / 16; i += stride)
      StoreTo(reinterpret_cast<int4*>(dst) + i, reinterpret_cast<const int4*>(src)[i], rm);
  } else if ((a % 4) == 0 && (n % 4) == 0) {
    JEP_COUNT_COPY(dst, src, 4, n / 4, tid, stride);
    for (int64_t i = tid; i < n / 4; i += stride)
      StoreTo(reinterpret_cast<int32_t*>(dst) + i, reinterpret_cast<const int32_t*>(src)[i], rm);
  } else if ((a % 2) == 0 && (n % 2) == 0) {
    JEP_COUNT_COPY(dst, src, 2, n / 2, tid, stride);
    for (int64_t i = tid; i < n / 2; i += stride)
      StoreTo(reinterpret_cast<uint16_t*>(dst) + i, reinterpret_cast<const uint16_t*>(src)[i],
              rm);
  } else {
    JEP_COUNT_COPY(dst, src, 1, n, tid, stride);
    for (int64_t i = tid; i < n; i += stride) StoreTo(dst + i, src[i], rm);
  }
}

__device__ __forceinline__ void ZeroBytes(char* dst, int64_t n, int tid, int stride) {
  JEP_COUNT_COPY(dst, nullptr, 1, n, tid, stride);
  const bool rm = RemoteDst(dst);
  for (int64_t i = tid; i < n; i += stride) StoreTo(dst + i, char{0}, rm);
}

// A failed call's float outputs: every byte 0xff is a NaN in float32, bfloat16 and
// float16 alike (all exponent bits set, mantissa nonzero), so one fill serves each dtype
// and a loss computed from them shows the failure at once.
__device__ __forceinline__ void NanBytes(char* dst, int64_t n, int tid, int stride) {
  JEP_COUNT_COPY(dst, nullptr, 1, n, tid, stride);
  const bool rm = RemoteDst(dst);
  for (int64_t i = tid; i < n; i += stride) StoreTo(dst + i, static_cast<char>(0xff), rm);
}

// Loads of memory a peer or the NIC wrote (landed rows, headers): global-level (.cg)
// loads, never an L1 line that may predate the put. The signal poll before them is an
// acquire (kernels/internode/transport_nvshmem.cuh).
template <class V>
__device__ __forceinline__ V LoadLanded(const V* p) {
#if defined(__CUDA_ARCH__)
  return __ldcg(p);
#else
  return *reinterpret_cast<const volatile V*>(p);
#endif
}

__device__ __forceinline__ int4 LoadLandedInt4(const int4* p) {
#if defined(__CUDA_ARCH__)
  return __ldcg(p);
#else
  const volatile int* q = reinterpret_cast<const volatile int*>(p);
  int4 v;
  v.x = q[0];
  v.y = q[1];
  v.z = q[2];
  v.w = q[3];
  return v;
#endif
}

// One element of a landed row (see LoadLanded), any of the three dtypes.
template <typename E>
__device__ __forceinline__ E LoadLandedElem(const E* p) {
  static_assert(sizeof(E) == 4 || sizeof(E) == 2, "float32, bfloat16 or float16");
  if constexpr (sizeof(E) == 4) {
    const uint32_t b = LoadLanded(reinterpret_cast<const uint32_t*>(p));
    E v;
    __builtin_memcpy(&v, &b, 4);
    return v;
  } else {
    const uint16_t b = LoadLanded(reinterpret_cast<const uint16_t*>(p));
    E v;
    __builtin_memcpy(&v, &b, 2);
    return v;
  }
}

// CopyBytes for a source that landed by a put (see LoadLanded).
__device__ __forceinline__ void CopyLanded(char* dst, const char* src, int64_t n, int tid,
                                           int stride) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src);
  const bool rm = RemoteDst(dst);
  if ((a % 16) == 0 && (n % 16) == 0) {
    JEP_COUNT_COPY(dst, src, 16, n / 16, tid, stride);
    for (int64_t i = tid; i < n / 16; i += stride)
      StoreTo(reinterpret_cast<int4*>(dst) + i,
              LoadLandedInt4(reinterpret_cast<const int4*>(src) + i), rm);
  } else if ((a % 4) == 0 && (n % 4) == 0) {
    JEP_COUNT_COPY(dst, src, 4, n / 4, tid, stride);
    for (int64_t i = tid; i < n / 4; i += stride)
      StoreTo(reinterpret_cast<int32_t*>(dst) + i,
              LoadLanded(reinterpret_cast<const int32_t*>(src) + i), rm);
  } else if ((a % 2) == 0 && (n % 2) == 0) {
    JEP_COUNT_COPY(dst, src, 2, n / 2, tid, stride);
    for (int64_t i = tid; i < n / 2; i += stride)
      StoreTo(reinterpret_cast<uint16_t*>(dst) + i,
              LoadLanded(reinterpret_cast<const uint16_t*>(src) + i), rm);
  } else {
    JEP_COUNT_COPY(dst, src, 1, n, tid, stride);
    for (int64_t i = tid; i < n; i += stride)
      StoreTo(dst + i,
              static_cast<char>(LoadLanded(reinterpret_cast<const unsigned char*>(src) + i)),
              rm);
  }
}

}  // namespace devcopy
}  // namespace jax_ep
