// Byte copies inside the internode kernels, on the copy engine (kernels/cuda/copy_engine.cuh):
// a row may start at any byte of the heap or of an XLA buffer (odd H in 16-bit dtypes, FP8
// rows), so each copy takes the widest access both pointers and the length allow. Threads
// [tid, stride) share the work.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/copy_engine.cuh"

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

// 16-byte loads each lane keeps in flight in the internode copies: 4 (2 KiB per warp in
// flight), half the engine's default, because the hierarchical DispatchMain, whose roles
// inline every copy, already holds ~208 registers of its 255 (256 threads a block): at 8,
// ptxas spills it (255 registers, 16 B spill stores, 32 B spill loads); at 4 it does not
// (tests/test_ptxas_spills.py).
constexpr int kCopyUnroll = 4;
static_assert(kCopyUnroll <= kCopyEngineUnroll, "never more in flight than the engine's default");

// The emulated GPU counts the engine's 16-byte loads and every store (through the peer::
// helpers) but not the engine's narrow loads (plain loads, for rows the 16-byte path cannot
// take): they are counted here, at the width the engine's group_copy takes for the same
// pointers and length (its 8/4/2/1 rule), so a copy's loads and stores add up to the row.
__device__ __forceinline__ void CountNarrowLoads(const char* dst, const char* src, int64_t n,
                                                 int tid, int stride) {
#if defined(JAX_EP_EMU)
  const uintptr_t a = reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) |
                      static_cast<uintptr_t>(n);
  if ((a & 15u) == 0) return;
  const int w = (a & 7u) == 0 ? 8 : (a & 3u) == 0 ? 4 : (a & 1u) == 0 ? 2 : 1;
  JEP_COUNT_COPY(nullptr, src, w, n / w, tid, stride);
#else
  (void)dst;
  (void)src;
  (void)n;
  (void)tid;
  (void)stride;
#endif
}

// Copies n bytes with threads [tid, stride) through the copy engine
// (kernels/cuda/copy_engine.cuh, the one implementation every mode shares): unrolled 16-byte
// loads where both pointers and n allow, else the widest narrower access. `src` must not
// change while the kernel runs (an XLA input, rows this rank packed in an earlier kernel):
// it is read through the non-coherent path. Stores into a peer's ring are weak until the
// writer's fence (the emulated GPU buffers them, as the engine's stores).
__device__ __forceinline__ void CopyBytes(char* dst, const char* src, int64_t n, int tid,
                                          int stride) {
  CountNarrowLoads(dst, src, n, tid, stride);
  group_copy<CopySrc::kReadOnly, kCopyUnroll>(CopyGroup{tid, stride, 0}, dst, src,
                                              static_cast<size_t>(n));
}

__device__ __forceinline__ void ZeroBytes(char* dst, int64_t n, int tid, int stride) {
  group_zero(CopyGroup{tid, stride, 0}, dst, static_cast<size_t>(n));
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

// CopyBytes for a source a peer or the NIC wrote while the kernel may run (a landed put,
// a peer's ring row; see LoadLanded): the engine's global-level (.cg) loads.
__device__ __forceinline__ void CopyLanded(char* dst, const char* src, int64_t n, int tid,
                                           int stride) {
  CountNarrowLoads(dst, src, n, tid, stride);
  group_copy<CopySrc::kPeerWritten, kCopyUnroll>(CopyGroup{tid, stride, 0}, dst, src,
                                                 static_cast<size_t>(n));
}

}  // namespace devcopy
}  // namespace jax_ep
