// The copy engine: how every mode moves a row (or any 16-byte aligned range) between
// global memories with the SM's own loads and stores, and how a group of threads then
// publishes what it stored to a peer. One implementation for the intranode channels, the
// low-latency mode and the internode kernels.
//
// API (stable; callers name every template argument that changes meaning):
//   CopySrc::kReadOnly / kPeerWritten      what may write the source while the kernel
//                                          runs; it picks the load instruction, so it has
//                                          no default
//   CopyGroup                              threads [0, threads) of whole warps that share
//                                          a copy; warp_group() (the calling warp),
//                                          warps_group(first_warp, nwarps, barrier)
//   group_copy<kSrc, kUnroll>(g, dst, src, n)  every thread of g calls it with the same
//                                          arguments; n bytes, any alignment (16-byte
//                                          aligned pointers and size take the vector path)
//   group_zero(g, dst, n)                  zeros, same rules
//   group_release(g, flag, value)          after a chunk of copies into a peer's memory:
//                                          each thread fences its own stores once, the
//                                          group meets, one thread release-stores value
//   engine_load16<kSrc>(p), engine_store16(p, v)   the single accesses, for callers that
//                                          compute between load and store (combine's sums)
//
// Why loads and stores, not the TMA (cp.async.bulk), as the engine every mode shares:
// - a store through a peer pointer (NVLink) is where the bytes cross; the SM's own
//   16-byte stores reach a peer's memory from registers, the TMA would first stage each
//   piece in shared memory (a load, an mbarrier wait, a store) and needs shared memory
//   the internode kernels' cooperative launches do not have to spare;
// - the combine sums rows in registers in float32: it needs the data in registers anyway;
// - rows of any size and alignment (FP8 rows of 72 bytes, odd H in 16-bit dtypes) take
//   the same call; the TMA takes 16-byte multiples only;
// - the emulated GPU's weak-visibility model covers the threads' stores into peer memory
//   (docs/emulator.md), so a missing fence before a release shows as stale rows.
// What the TMA is kept for: the dispatch receiver's local ring-to-output copies
// (cuda_common.cuh bulk_copy_row), where no register work is done and the bytes stay on
// this GPU.
//
// Bytes in flight. A lane keeps kUnroll 16-byte loads outstanding before its first store
// (Little's law: a warp with one load per lane in flight moves 512 B per memory round
// trip, ~0.5 GB/s at a microsecond of NVLink latency; 8 per lane give 4 KiB per warp), and
// several warps of a role share one copy (CopyGroup), each taking every threads-th vector.
// A copy runs in pieces of kUnroll x threads vectors: all loads of a piece, then its
// stores. The last piece of a size that is a multiple of 16 bytes but not of the piece
// is the same code with its loads and stores predicated, so it too keeps its loads in
// flight together.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/cuda/peer_transport.cuh"

namespace jax_ep {

// What may write a copy's source while the kernel runs.
enum class CopySrc : int {
  // Nothing (XLA inputs, buffers this kernel only reads): the non-coherent path without
  // L1 allocation, `ld.global.nc.L1::no_allocate.v4` (PTX ISA, "ld.global.nc"; CUDA C++
  // Programming Guide, "Read-Only Data Cache Load Function": only for data that does
  // not change during the kernel; a row is streamed once, so it should not take L1).
  kReadOnly = 0,
  // A peer GPU or the NIC (rings, landed puts): `ld.global.cg.v4`, cached at L2 only,
  // the point of coherence for other GPUs' stores (PTX ISA, "ld", .cg "cache at global
  // level"). An `.nc` load here may return a line fetched before the peer's store, for
  // the rest of the kernel (the emulated GPU snapshots such lines per block).
  kPeerWritten = 1,
};

// 16-byte loads each lane keeps in flight before its first store, by default. Callers
// whose register budget is tight (1024-thread blocks: 64 registers) pass a smaller one.
constexpr int kCopyEngineUnroll = 8;

// Threads [0, threads) of whole warps that share one copy. Every thread of the group
// makes the same group_* call with the same arguments.
struct CopyGroup {
  int tid;      // this thread's index in the group
  int threads;  // a multiple of 32
  int barrier;  // named barrier (1..15) the group meets at when it spans several warps

  __device__ __forceinline__ void sync() const {
    if (threads <= 32) __syncwarp();
    else peer::sync_threads(barrier, threads);
  }
};

// The calling warp alone.
__device__ __forceinline__ CopyGroup warp_group() {
  return CopyGroup{static_cast<int>(threadIdx.x & 31), 32, 0};
}

// Warps [first_warp, first_warp + nwarps) of the block, meeting at named barrier
// `barrier` (ids are the caller's to keep apart; barrier 0 is __syncthreads).
__device__ __forceinline__ CopyGroup warps_group(int first_warp, int nwarps, int barrier) {
  return CopyGroup{static_cast<int>(threadIdx.x) - 32 * first_warp, 32 * nwarps, barrier};
}

template <CopySrc kSrc>
__device__ __forceinline__ uint4 engine_load16(const void* p) {
  if constexpr (kSrc == CopySrc::kReadOnly) return peer::load_nc16(p);
  else return peer::load_cg16(p);
}

// A 16-byte store without L1 allocation (PTX ISA, "st", .L1::no_allocate): the SM never
// reads a copied row back. Into a peer's memory it is a weak store: group_release (or a
// fence_data) orders it before a signal.
__device__ __forceinline__ void engine_store16(void* p, uint4 v) { peer::store16_na(p, v); }

namespace engine_detail {

template <CopySrc kSrc, typename T>
__device__ __forceinline__ T load_narrow(const T* p) {
  // Narrow accesses only for unaligned rows; a peer-written source is read through a
  // volatile load (not cached in L1 across reads), a read-only one plainly.
  if constexpr (kSrc == CopySrc::kPeerWritten) return *reinterpret_cast<const volatile T*>(p);
  else return *p;
}

template <CopySrc kSrc, typename T>
__device__ __forceinline__ void copy_narrow(const CopyGroup& g, char* d, const char* s, size_t n) {
  const size_t m = n / sizeof(T);
  for (size_t i = g.tid; i < m; i += g.threads)
    peer::store(reinterpret_cast<T*>(d) + i, load_narrow<kSrc>(reinterpret_cast<const T*>(s) + i));
}

}  // namespace engine_detail

// Copies n bytes from src to dst with every thread of g. The stores are weak: a peer
// sees them in order with a later signal only after group_release (or fence_data).
template <CopySrc kSrc, int kUnroll>
__device__ __forceinline__ void group_copy(const CopyGroup& g, void* dst, const void* src, size_t n) {
  static_assert(kUnroll >= 1 && kUnroll <= 16, "vectors per lane in flight");
  char* d = static_cast<char*>(dst);
  const char* s = static_cast<const char*>(src);
  const uintptr_t a = reinterpret_cast<uintptr_t>(d) | reinterpret_cast<uintptr_t>(s);
  if (((a | n) & 15u) == 0) {
    // 32-bit vector indices (a row is far below 64 GiB) keep the index math of kUnroll
    // predicated accesses in few registers. `first` is this thread's first vector of a
    // piece (kUnroll x threads vectors); the piece's last, partial one included.
    const uint32_t nv = static_cast<uint32_t>(n / 16), stride = static_cast<uint32_t>(g.threads);
    const uint4* sv = reinterpret_cast<const uint4*>(s);
    uint4* dv = reinterpret_cast<uint4*>(d);
    for (uint32_t first = static_cast<uint32_t>(g.tid); first < nv; first += kUnroll * stride) {
      uint4 v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
        if (first + u * stride < nv) v[u] = engine_load16<kSrc>(sv + first + u * stride);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
        if (first + u * stride < nv) engine_store16(dv + first + u * stride, v[u]);
    }
  } else if (((a | n) & 7u) == 0) {
    engine_detail::copy_narrow<kSrc, uint64_t>(g, d, s, n);
  } else if (((a | n) & 3u) == 0) {
    engine_detail::copy_narrow<kSrc, uint32_t>(g, d, s, n);
  } else if (((a | n) & 1u) == 0) {
    engine_detail::copy_narrow<kSrc, uint16_t>(g, d, s, n);
  } else {
    engine_detail::copy_narrow<kSrc, unsigned char>(g, d, s, n);
  }
}

// Stores n zero bytes at dst with every thread of g (weak stores, as group_copy's).
__device__ __forceinline__ void group_zero(const CopyGroup& g, void* dst, size_t n) {
  char* d = static_cast<char*>(dst);
  if (((reinterpret_cast<uintptr_t>(d) | n) & 15u) == 0) {
    const uint4 z = make_uint4(0, 0, 0, 0);
    for (size_t i = g.tid; i < n / 16; i += g.threads) engine_store16(d + i * 16, z);
  } else {
    for (size_t i = g.tid; i < n; i += g.threads) peer::store(d + i, char{0});
  }
}

// Publishes a chunk of copies into a peer's memory: each thread's stores are fenced at
// system scope (a peer GPU is outside a .gpu fence's scope: PTX ISA, Memory Consistency
// Model, "Scope"), once per chunk, not per row; the group meets, so every thread's fence
// precedes the release; thread 0 release-stores `value` to `flag` (st.release.sys), which
// the reader's acquire pairs with. Every thread fences rather than thread 0 alone after the
// barrier: that relies on cumulativity through bar.sync, which the emulated GPU does not
// model (docs/emulator.md, "What only hardware shows"), and costs one fence per warp.
__device__ __forceinline__ void group_release(const CopyGroup& g, uint64_t* flag, uint64_t value) {
  peer::fence_data();
  g.sync();
  if (g.tid == 0) peer::signal(flag, value);
  g.sync();
}

}  // namespace jax_ep
