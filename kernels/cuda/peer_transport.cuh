// Device-side transport over peer pointers (NVLink peer access or CUDA IPC mappings):
// the few primitives the intranode kernels use to move data and signal. Keeping them
// here means another transport only has to provide the same calls.
//   peer_ptr(peers, r, off)   address of byte `off` of rank r's buffer
//   signal(flag, value)       release store at system scope (after the data it covers)
//   wait_geq(flag, v, ...)    acquire spin until *flag >= v, bounded by a timeout and
//                             abandoned early when a stop word becomes non-zero
//   fence_data()              orders this thread's remote data writes before a signal;
//                             at system scope: a peer GPU is outside a .gpu fence's scope
//   bulk_load / mbar_wait     bulk copies into shared memory; the wait is bounded by the
//                             kernels' timeout like wait_geq (false: the caller records it)
#pragma once

#include <cstdint>

#include "kernels/cuda/intranode_buffer.h"

namespace jax_ep {
namespace peer {

__device__ __forceinline__ char* peer_ptr(const PeerTable& t, int r, size_t off) {
  return t.base[r] + off;
}

__device__ __forceinline__ RankHeader* header(const PeerTable& t, int r) {
  return reinterpret_cast<RankHeader*>(t.base[r]);
}

__device__ __forceinline__ void fence_data() { __threadfence_system(); }

// ---- every inline PTX statement of the intranode kernels, one helper each ----
// The emulated GPU (kernels/emu/emu_ptx.h) defines the same helpers with the same meaning.
#if defined(JAX_EP_EMU)
#include "kernels/emu/emu_ptx.h"
#else
// Release store at system scope: the writes before it (fenced) are visible first.
__device__ __forceinline__ void signal(uint64_t* flag, uint64_t value) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(flag), "l"(value) : "memory");
}

__device__ __forceinline__ uint64_t load_acquire(const uint64_t* flag) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(flag) : "memory");
  return v;
}

__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// 16-byte load that bypasses L1 (data written by peers during this kernel's lifetime).
__device__ __forceinline__ uint4 load_cg16(const void* p) {
  uint4 v;
  asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}
// 16-byte load through the non-coherent path without allocating in L1: for XLA inputs,
// which nothing writes while the kernel runs, streamed once.
__device__ __forceinline__ uint4 load_nc16(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}
__device__ __forceinline__ uint32_t load_cg4(const void* p) {
  uint32_t v;
  asm volatile("ld.global.cg.u32 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}
// Lanes below this thread's lane in its warp.
__device__ __forceinline__ unsigned lanemask_lt() {
  unsigned m;
  asm("mov.u32 %0, %%lanemask_lt;" : "=r"(m));
  return m;
}
// Barrier `id` (1..15) of `threads` threads (whole warps) of the block: a role's warps
// meet without waiting for the block's other roles (__syncthreads is barrier 0, all).
__device__ __forceinline__ void sync_threads(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
// A plain store into memory a peer reads (its buffer through a peer pointer). Ordered
// before a later signal only by fence_data(); the emulated GPU buffers it until then.
template <typename T>
__device__ __forceinline__ void store(T* p, T v) {
  *p = v;
}
__device__ __forceinline__ void store16(void* p, uint4 v) { *static_cast<uint4*>(p) = v; }
// 16-byte store that does not allocate in L1 (PTX ISA, "st", .level::eviction_priority
// .L1::no_allocate, sm_70+): a copied row is never read back by this SM, so it should not
// evict lines that are. Same ordering as store16 (weak; fence_data before a signal).
__device__ __forceinline__ void store16_na(void* p, uint4 v) {
  asm volatile("st.global.L1::no_allocate.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x),
               "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}
template <typename T>
__device__ __forceinline__ void store_volatile(T* p, T v) {
  *reinterpret_cast<volatile T*>(p) = v;
}

// ---- bulk copies (Hopper's TMA, cp.async.bulk): one thread moves a whole 16-byte aligned
// range between global and shared memory, without the warp's loads and stores in flight.
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
// An mbarrier of one arrival per phase (the thread that issues the phase's loads).
__device__ __forceinline__ void mbar_init(uint64_t* mbar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(mbar)) : "memory");
}
// After mbar_init, before the bulk copies use the mbarriers or the shared memory a thread
// wrote (the copies run in the async proxy).
__device__ __forceinline__ void fence_bulk_shared() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
// After an acquire that makes peers' writes to global memory visible, before bulk loads
// read them.
__device__ __forceinline__ void fence_bulk_global() {
  asm volatile("fence.proxy.async.global;" ::: "memory");
}
// One arrival on `mbar` that also announces `bytes` of copies completing its current phase
// (the phase completes once its arrivals are in and that many bytes have landed).
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* mbar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(mbar)),
               "r"(bytes)
               : "memory");
}
// `n` bytes from global `src` into shared `smem`, counted against `mbar`'s current phase
// (complete_tx: no arrival of its own).
__device__ __forceinline__ void bulk_load_tx(void* smem, const void* src, uint32_t n, uint64_t* mbar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
          smem_addr(smem)),
      "l"(src), "r"(n), "r"(smem_addr(mbar))
      : "memory");
}
// Waits until the phase of `mbar` with this parity has completed (its loads landed).
// False after `timeout_ns` (0: no limit): a phase short of arrivals or bytes never
// completes, and the caller records the timeout as the other waits do.
__device__ __forceinline__ bool mbar_wait(uint64_t* mbar, uint32_t parity, int64_t timeout_ns) {
  uint64_t start = 0;
  for (;;) {
    uint32_t done;
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        " selp.u32 %0, 1, 0, p;\n}"
        : "=r"(done)
        : "r"(smem_addr(mbar)), "r"(parity)
        : "memory");
    if (done) return true;
    if (timeout_ns > 0) {
      const uint64_t now = global_timer_ns();
      if (start == 0) start = now;
      else if (now - start > static_cast<uint64_t>(timeout_ns)) return false;
    }
  }
}
// `n` bytes from shared `smem` to global `dst`, in this thread's open bulk group.
__device__ __forceinline__ void bulk_store(void* dst, const void* smem, uint32_t n) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst),
               "r"(smem_addr(smem)), "r"(n)
               : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
// Until at most the newest `keep` of this thread's groups still read their shared memory.
template <int keep>
__device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(keep) : "memory");
}
// Until every bulk store of this thread has landed in global memory.
__device__ __forceinline__ void bulk_wait_all() {
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
  asm volatile("fence.proxy.async.global;" ::: "memory");
}
#endif

// `n` bytes from global `src` into shared `smem` (16-byte aligned and sized); completes
// the current phase of `mbar` (initialized for one arrival) when they land.
__device__ __forceinline__ void bulk_load(void* smem, const void* src, uint32_t n, uint64_t* mbar) {
  mbar_arrive_expect_tx(mbar, n);
  bulk_load_tx(smem, src, n, mbar);
}

__device__ __forceinline__ int32_t load_volatile(const int32_t* p) {
  return *reinterpret_cast<const volatile int32_t*>(p);
}

// Spins until *flag >= value. Returns false on timeout, or at once when `stop` (if given)
// reads non-zero: a timeout already recorded on this GPU means a peer is gone, and
// waiting the full timeout again in every queued kernel would only delay the error.
// The caller records an error and carries on, so a missing peer never hangs the GPU.
__device__ __forceinline__ bool wait_geq(const uint64_t* flag, uint64_t value, int64_t timeout_ns,
                                         const int32_t* stop = nullptr) {
  if (load_acquire(flag) >= value) return true;
  const uint64_t start = global_timer_ns();
  while (load_acquire(flag) < value) {
    if (stop != nullptr && *reinterpret_cast<const volatile int32_t*>(stop) != 0) return false;
    if (timeout_ns > 0 && global_timer_ns() - start > static_cast<uint64_t>(timeout_ns))
      return false;
    __nanosleep(64);
  }
  return true;
}

__device__ __forceinline__ int32_t load_cg_s32(const int32_t* p) {
  return static_cast<int32_t>(load_cg4(p));
}
__device__ __forceinline__ float load_cg_f32(const float* p) {
  return __uint_as_float(load_cg4(p));
}

}  // namespace peer
}  // namespace jax_ep
