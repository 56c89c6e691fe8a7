// The emulated GPU: what the CUDA sources of kernels/cuda and kernels/internode need to
// compile as plain C++ (g++/clang) and run on the CPU. Every CUDA thread is a fiber; one
// seeded scheduler on the calling host thread runs all blocks of all virtual GPUs
// (kernels/emu/emu_scheduler.cc and the other emu_*.cc). See kernels/emu/README.md and
// docs/emulator.md.
//
// Included through the replacement headers in kernels/emu/include (cuda_runtime_api.h,
// cuda_runtime.h, cuda_bf16.h, cuda_fp16.h), which the emulated build puts ahead of the
// system ones. JAX_EP_EMU is defined for every emulated translation unit.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <tuple>
#include <type_traits>
#include <utility>

#ifndef JAX_EP_EMU
#define JAX_EP_EMU 1
#endif

// ---------------------------------------------------------------------------------------
// Qualifiers. `__shared__` variables are thread_local function statics: the scheduler runs
// every fiber on one host thread and swaps that thread's TLS block of this module per
// block, so each block sees its own copy. Device globals (JEP_DEVICE_GLOBAL) sit in
// per-declaration sections that kernels/emu/emu.ld gathers into one range, swapped per
// virtual GPU, so each virtual GPU has its own copy of every one.
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __shared__ static thread_local __attribute__((aligned(16)))
#define JEP_EMU_STR2(x) #x
#define JEP_EMU_STR(x) JEP_EMU_STR2(x)
#define JEP_EMU_DEVICE_GLOBAL \
  __attribute__((section("jep_emu_dev" JEP_EMU_STR(__COUNTER__)), aligned(16)))
#define __constant__ JEP_EMU_DEVICE_GLOBAL

namespace emu {

// ---------------------------------------------------------------------------------------
// Vector types and dims.
struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  constexpr dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {}
};
using uint3 = dim3;

}  // namespace emu

using emu::dim3;
struct alignas(16) uint4 { unsigned x, y, z, w; };
struct alignas(16) int4 { int x, y, z, w; };
struct alignas(16) float4 { float x, y, z, w; };
struct alignas(8) uint2 { unsigned x, y; };
struct alignas(8) int2 { int x, y; };
struct alignas(8) float2 { float x, y; };
struct alignas(16) ulonglong2 { unsigned long long x, y; };
struct alignas(16) longlong2 { long long x, y; };
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return uint4{x, y, z, w}; }
inline int4 make_int4(int x, int y, int z, int w) { return int4{x, y, z, w}; }
inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }
inline uint2 make_uint2(unsigned x, unsigned y) { return uint2{x, y}; }
inline int2 make_int2(int x, int y) { return int2{x, y}; }
inline float2 make_float2(float x, float y) { return float2{x, y}; }

// ---------------------------------------------------------------------------------------
// Runtime API types (the subset the host launchers and xla_ffi/cuda use).
enum cudaError_t : int {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorMemoryAllocation = 2,
  cudaErrorInitializationError = 3,
  cudaErrorLaunchFailure = 4,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorInvalidDevice = 101,
  cudaErrorInvalidResourceHandle = 400,
  cudaErrorNotReady = 600,
  cudaErrorPeerAccessAlreadyEnabled = 704,
  cudaErrorPeerAccessNotEnabled = 705,
  cudaErrorLaunchOutOfResources = 701,
  cudaErrorCooperativeLaunchTooLarge = 720,
  cudaErrorNotSupported = 801,
  cudaErrorUnknown = 999,
};
using cudaError = cudaError_t;
enum cudaMemcpyKind : int {
  cudaMemcpyHostToHost = 0,
  cudaMemcpyHostToDevice = 1,
  cudaMemcpyDeviceToHost = 2,
  cudaMemcpyDeviceToDevice = 3,
  cudaMemcpyDefault = 4,
};
namespace emu {
struct Stream;
struct Event;
}  // namespace emu
using cudaStream_t = emu::Stream*;
using cudaEvent_t = emu::Event*;
struct cudaIpcMemHandle_t {
  char reserved[64];
};
constexpr unsigned cudaStreamDefault = 0, cudaStreamNonBlocking = 1;
constexpr unsigned cudaEventDefault = 0, cudaEventDisableTiming = 2;
constexpr unsigned cudaHostAllocDefault = 0, cudaHostAllocPortable = 1, cudaHostAllocMapped = 2;
constexpr unsigned cudaIpcMemLazyEnablePeerAccess = 1;
enum cudaLaunchAttributeID : int { cudaLaunchAttributeCooperative = 2 };
struct cudaLaunchAttributeValue {
  int cooperative;
};
struct cudaLaunchAttribute {
  cudaLaunchAttributeID id;
  cudaLaunchAttributeValue val;
};
struct cudaLaunchConfig_t {
  dim3 gridDim;
  dim3 blockDim;
  size_t dynamicSmemBytes = 0;
  cudaStream_t stream = nullptr;
  cudaLaunchAttribute* attrs = nullptr;
  unsigned numAttrs = 0;
};

cudaError_t cudaGetLastError();
cudaError_t cudaPeekAtLastError();
const char* cudaGetErrorString(cudaError_t e);
const char* cudaGetErrorName(cudaError_t e);
cudaError_t cudaGetDeviceCount(int* n);
cudaError_t cudaGetDevice(int* d);
cudaError_t cudaSetDevice(int d);
cudaError_t cudaDeviceSynchronize();
cudaError_t cudaDeviceCanAccessPeer(int* can, int d, int peer);
cudaError_t cudaDeviceEnablePeerAccess(int peer, unsigned flags);
cudaError_t cudaMalloc(void** p, size_t bytes);
template <typename T>
inline cudaError_t cudaMalloc(T** p, size_t bytes) {
  return cudaMalloc(reinterpret_cast<void**>(p), bytes);
}
cudaError_t cudaFree(void* p);
cudaError_t cudaHostAlloc(void** p, size_t bytes, unsigned flags);
cudaError_t cudaMallocHost(void** p, size_t bytes);
cudaError_t cudaFreeHost(void* p);
cudaError_t cudaHostGetDevicePointer(void** dev, void* host, unsigned flags);
cudaError_t cudaMemset(void* p, int v, size_t n);
cudaError_t cudaMemsetAsync(void* p, int v, size_t n, cudaStream_t s = nullptr);
cudaError_t cudaMemcpy(void* dst, const void* src, size_t n, cudaMemcpyKind kind);
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t n, cudaMemcpyKind kind,
                            cudaStream_t s = nullptr);
cudaError_t cudaStreamCreate(cudaStream_t* s);
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned flags);
cudaError_t cudaStreamDestroy(cudaStream_t s);
cudaError_t cudaStreamSynchronize(cudaStream_t s);
cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned flags = 0);
cudaError_t cudaEventCreate(cudaEvent_t* e);
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned flags);
cudaError_t cudaEventDestroy(cudaEvent_t e);
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s = nullptr);
cudaError_t cudaEventSynchronize(cudaEvent_t e);
cudaError_t cudaIpcGetMemHandle(cudaIpcMemHandle_t* h, void* p);
cudaError_t cudaIpcOpenMemHandle(void** p, cudaIpcMemHandle_t h, unsigned flags);
cudaError_t cudaIpcCloseMemHandle(void* p);

namespace emu {
// Host side of the symbol calls: the virtual GPU's copy of a device global.
cudaError_t symbol_copy(void* dst, const void* src, size_t n, bool to_symbol, const void* symbol);
void* symbol_address(const void* symbol);
}  // namespace emu

template <typename T>
inline cudaError_t cudaMemcpyFromSymbol(void* dst, const T& symbol, size_t n, size_t offset = 0,
                                        cudaMemcpyKind = cudaMemcpyDeviceToHost) {
  return emu::symbol_copy(dst, reinterpret_cast<const char*>(&symbol) + offset, n, false, &symbol);
}
template <typename T>
inline cudaError_t cudaMemcpyToSymbol(const T& symbol, const void* src, size_t n, size_t offset = 0,
                                      cudaMemcpyKind = cudaMemcpyHostToDevice) {
  return emu::symbol_copy(const_cast<char*>(reinterpret_cast<const char*>(&symbol)) + offset, src,
                          n, true, &symbol);
}
template <typename T>
inline cudaError_t cudaGetSymbolAddress(void** p, const T& symbol) {
  *p = emu::symbol_address(&symbol);
  return cudaSuccess;
}

// ---------------------------------------------------------------------------------------
// Device side: the current fiber's identity and the yield points.
namespace emu {

struct FiberCtx {
  dim3 tid, bid, bdim, gdim;
  int lane, warp;
};
// The running fiber's context (null on the host).
extern FiberCtx* g_ctx;

enum YieldKind : int {
  kYieldBarrier = 0, kYieldWarp, kYieldAtomic, kYieldFence, kYieldPoll, kYieldSleep,
  kYieldStore, kNumYieldKinds
};
enum FenceScope : int { kFenceBlock = 0, kFenceGpu = 1, kFenceSystem = 2 };
enum WarpOp : int { kWarpSync = 0, kWarpBallot, kWarpAny, kWarpAll, kWarpShfl, kWarpShflXor,
                    kWarpShflDown, kWarpShflUp };

void yield(int kind);
void syncthreads();
// bar.sync id, threads (id 1..15): a barrier of `threads` threads of the block.
void named_barrier(int id, int threads);
// Lanes of `mask` meet; returns this lane's result (the value is up to 8 bytes).
uint64_t warp_collective(int op, unsigned mask, uint64_t value, int arg, int width);
unsigned activemask();
void fence(int scope);
// What a fence does to this thread's buffered peer stores, without counting a fence.
void drain_own_stores();
void nanosleep_ns(unsigned ns);
uint64_t global_timer_ns();
long long clock_ticks();
char* dynamic_smem();
// Counted, yields; a poll that finds nothing new advances the virtual clock.
void note_poll();
// An acquire load (counted as one and as a poll).
void note_acquire();
// Per-thread chains of serial costs: each kernel reports its longest ("chain:*" counters).
enum Chain : int { kChainFenceSystem = 0, kChainFenceGpu, kChainRelease, kChainWr, kNumChains };
void note_chain(int which, uint32_t n = 1);
void note_copy(int width, size_t bytes);
// Counters of bytes moved by width and space (local: this GPU's or host memory; peer:
// another virtual GPU's): n accesses of `width` bytes at p by the running thread.
enum AccessDir : int { kAccessLoad = 0, kAccessStore = 1 };
void note_access(int dir, const void* p, int width, size_t n);
// This thread's share of a copy of `count` elements of `width` bytes that threads
// [tid, stride) split (element i goes to thread i % stride); null dst/src: not counted.
void note_copy_share(const void* dst, const void* src, int width, int64_t count, int tid,
                     int stride);
// Latency accounting ("rounds", kernels/emu/emu_counters.cc; docs/emulator.md, "Rounds and
// bytes in flight"): a round is one trip to memory that a thread waits for before it goes
// on. Spaces in order of distance: this GPU's memory, a peer's over NVLink, another node's
// over RDMA (the farthest space of what a wait covers is the one it costs).
enum LatSpace : int { kLatLocal = 0, kLatPeer = 1, kLatRdma = 2, kNumLatSpaces };
// An acquire poll of `flag` whose writer reaches this GPU over `space` (-1: from the flag's
// place: a peer's memory, or this GPU's memory that peers write, is kLatPeer; else local).
// Counted as an acquire load and a poll; repeated polls of one flag are one round.
void note_acquire_at(const void* flag, int space);
// The same for a relaxed poll (counted as a poll only).
void note_poll_at(const void* flag, int space);
// This thread issued a write that completes over `space` later (an RDMA put): the next
// wait for its completion (note_complete_writes, a fence) costs a round of that space.
void note_remote_write(int space);
// This thread waits until its earlier writes complete (nvshmem_quiet).
void note_complete_writes();
// Stores to memory other virtual GPUs read (peer buffers) that another virtual GPU owns:
// through a per-thread store buffer that drains at random later points, in order; fences
// and release stores drain it. Stores to the writer's own memory land at once.
void store_bytes(void* dst, const void* src, size_t n);
// What store_bytes does, not counted (the caller counts: devcopy's copies).
void buffered_store(void* dst, const void* src, size_t n);
// Whether the running thread's stores to dst are buffered: dst is peer memory
// (mark_peer_memory) that another virtual GPU owns.
bool remote_store(const void* dst);
void release_store64(uint64_t* p, uint64_t v);
// Bulk asynchronous copies (the TMA's cp.async.bulk, peer_transport.cuh bulk_*): a load
// into shared memory completes an mbarrier phase (mbar_wait waits for it); a store from
// shared memory belongs to its thread's open group (bulk_commit closes it, bulk_wait
// waits for all but the newest `keep`). Each copy lands, seeded, either at its issue or
// at its wait, the two ends of what a GPU may do: so shared memory read before its load's
// wait, rewritten before a store's wait, or stored before its load's wait shows.
// A load never waited for, a wait on a phase nothing completes (a hang on a GPU) and a
// store group still pending when its thread exits are faults. Counted apart from the
// threads' own accesses: "tma_bytes:load|store:local|peer", "block_max:tma_bytes".
// The hardware's rules, each a fault or a stale read (docs/emulator.md): 16-byte alignment
// and size of every copy; an mbarrier phase completes only with `count` arrivals and as
// many bytes copied as expect_tx announced (a wait short of them ends at its timeout with
// a fault naming the barrier); the async proxy sees generic writes only after a proxy
// fence (proxy_fence: fence.proxy.async.shared::cta or .global).
void mbar_init(uint64_t* mbar, uint32_t count = 1);
void mbar_arrive_expect_tx(uint64_t* mbar, uint32_t bytes);
// cp.async.bulk ... complete_tx::bytes: no arrival of its own.
void bulk_load_tx(void* smem, const void* src, size_t n, uint64_t* mbar);
// False when the phase has not completed within timeout_ns (0: no limit).
bool mbar_wait(uint64_t* mbar, uint32_t parity, int64_t timeout_ns);
enum ProxySpace : int { kProxyShared = 0, kProxyGlobal = 1 };
void proxy_fence(int space);
// A load through the non-coherent path (ld.global.nc, __ldg): of peer memory, it may
// return the block's first read of the granule for the rest of the block's life.
void load_nc(void* out, const void* p, size_t n);
void bulk_store(void* dst, const void* smem, size_t n);
void bulk_commit();
void bulk_wait(int keep);
// Host: a fault the emulator found in a kernel (an exited lane in a collective's mask...).
void fault(const char* what);

template <typename T>
inline uint64_t to_bits(T v) {
  static_assert(sizeof(T) <= 8, "warp collectives move up to 8 bytes");
  uint64_t b = 0;
  std::memcpy(&b, &v, sizeof(T));
  return b;
}
template <typename T>
inline T from_bits(uint64_t b) {
  T v;
  std::memcpy(&v, &b, sizeof(T));
  return v;
}

// A kernel launch: the argument tuple is copied once, as CUDA copies kernel parameters.
struct LaunchSpec {
  dim3 grid, block;
  size_t smem = 0;
  cudaStream_t stream = nullptr;
  const char* name = "";
  const void* entry = nullptr;  // the kernel function (names a cudaLaunchKernelEx launch)
  bool cooperative = false;
  std::function<void()> body;
};
cudaError_t enqueue_kernel(LaunchSpec spec);

template <typename... P>
struct Launcher {
  void (*kernel)(P...);
  dim3 grid, block;
  size_t smem;
  cudaStream_t stream;
  const char* name;
  bool cooperative = false;
  template <typename... A>
  void operator()(A&&... args) const {
    LaunchSpec s;
    s.grid = grid;
    s.block = block;
    s.smem = smem;
    s.stream = stream;
    s.name = name;
    s.entry = reinterpret_cast<const void*>(kernel);
    s.cooperative = cooperative;
    auto tup = std::make_shared<std::tuple<std::decay_t<P>...>>(std::forward<A>(args)...);
    auto* k = kernel;
    s.body = [k, tup]() { std::apply(k, *tup); };
    enqueue_kernel(std::move(s));
  }
};
template <typename... P>
inline Launcher<P...> make_launcher(void (*kernel)(P...), dim3 grid, dim3 block, size_t smem,
                                    cudaStream_t stream, const char* name) {
  return Launcher<P...>{kernel, grid, block, smem, stream, name};
}

// "name@bound": a kernel templated on its __launch_bounds__, launched at instance `bound`
// (launch.cuh JEP_LAUNCH_T). Its occupancy row is the instance's (`name@bound`, from
// scripts/gen_emu_occupancy.py), its counters are the name's. The string lives as long
// as the process.
const char* bound_name(const char* name, int bound);

}  // namespace emu

// Kernel-launch helper for the emulated build (kernels/cuda/launch.cuh maps it to <<<>>>).
#define JEP_EMU_LAUNCH(kernel, grid, block, smem, stream) \
  ::emu::make_launcher(kernel, dim3(grid), dim3(block), smem, stream, #kernel)

namespace emu {
// cudaLaunchKernelEx with the kernel's name, so its co-residency comes from the occupancy
// table (a cooperative grid is checked against its ptxas limit, not the fallback).
template <typename... P, typename... A>
inline cudaError_t launch_kernel_ex(const cudaLaunchConfig_t* cfg, const char* name,
                                    void (*kernel)(P...), A&&... args) {
  auto l = make_launcher(kernel, cfg->gridDim, cfg->blockDim, cfg->dynamicSmemBytes,
                         cfg->stream, name);
  for (unsigned i = 0; i < cfg->numAttrs; ++i)
    if (cfg->attrs[i].id == cudaLaunchAttributeCooperative && cfg->attrs[i].val.cooperative)
      l.cooperative = true;
  l(std::forward<A>(args)...);
  return cudaGetLastError();
}
}  // namespace emu

template <typename... P, typename... A>
inline cudaError_t cudaLaunchKernelEx(const cudaLaunchConfig_t* cfg, void (*kernel)(P...),
                                      A&&... args) {
  return emu::launch_kernel_ex(cfg, "cudaLaunchKernelEx", kernel, std::forward<A>(args)...);
}

// Built-in variables.
#define threadIdx (::emu::g_ctx->tid)
#define blockIdx (::emu::g_ctx->bid)
#define blockDim (::emu::g_ctx->bdim)
#define gridDim (::emu::g_ctx->gdim)
constexpr int warpSize = 32;

// Dynamic shared memory: `JEP_DYNAMIC_SMEM(int32_t, s)` (kernels/cuda/launch.cuh).
#define JEP_EMU_DYNAMIC_SMEM(T, name) T* const name = reinterpret_cast<T*>(::emu::dynamic_smem())

// ---------------------------------------------------------------------------------------
// Device builtins.
inline void __syncthreads() { emu::syncthreads(); }
inline void __syncwarp(unsigned mask = 0xffffffffu) {
  emu::warp_collective(emu::kWarpSync, mask, 0, 0, 32);
}
inline unsigned __ballot_sync(unsigned mask, int pred) {
  return static_cast<unsigned>(emu::warp_collective(emu::kWarpBallot, mask, pred != 0, 0, 32));
}
inline int __any_sync(unsigned mask, int pred) {
  return static_cast<int>(emu::warp_collective(emu::kWarpAny, mask, pred != 0, 0, 32));
}
inline int __all_sync(unsigned mask, int pred) {
  return static_cast<int>(emu::warp_collective(emu::kWarpAll, mask, pred != 0, 0, 32));
}
inline unsigned __activemask() { return emu::activemask(); }
template <typename T>
inline T __shfl_sync(unsigned mask, T v, int src, int width = 32) {
  return emu::from_bits<T>(emu::warp_collective(emu::kWarpShfl, mask, emu::to_bits(v), src, width));
}
template <typename T>
inline T __shfl_xor_sync(unsigned mask, T v, int lm, int width = 32) {
  return emu::from_bits<T>(emu::warp_collective(emu::kWarpShflXor, mask, emu::to_bits(v), lm, width));
}
template <typename T>
inline T __shfl_down_sync(unsigned mask, T v, unsigned d, int width = 32) {
  return emu::from_bits<T>(
      emu::warp_collective(emu::kWarpShflDown, mask, emu::to_bits(v), static_cast<int>(d), width));
}
template <typename T>
inline T __shfl_up_sync(unsigned mask, T v, unsigned d, int width = 32) {
  return emu::from_bits<T>(
      emu::warp_collective(emu::kWarpShflUp, mask, emu::to_bits(v), static_cast<int>(d), width));
}
inline void __threadfence_block() { emu::fence(emu::kFenceBlock); }
inline void __threadfence() { emu::fence(emu::kFenceGpu); }
inline void __threadfence_system() { emu::fence(emu::kFenceSystem); }
inline void __nanosleep(unsigned ns) { emu::nanosleep_ns(ns); }
inline long long clock64() { return emu::clock_ticks(); }

inline int __popc(unsigned v) { return __builtin_popcount(v); }
inline int __popcll(unsigned long long v) { return __builtin_popcountll(v); }
inline int __ffs(int v) { return __builtin_ffs(v); }
inline int __ffs(unsigned v) { return __builtin_ffs(static_cast<int>(v)); }
inline int __ffsll(long long v) { return __builtin_ffsll(v); }
inline int __clz(int v) { return v == 0 ? 32 : __builtin_clz(static_cast<unsigned>(v)); }
inline int __clzll(long long v) { return v == 0 ? 64 : __builtin_clzll(static_cast<unsigned long long>(v)); }
inline unsigned __brev(unsigned v) {
  unsigned r = 0;
  for (int i = 0; i < 32; ++i) r |= ((v >> i) & 1u) << (31 - i);
  return r;
}
inline float __int_as_float(int v) { return emu::from_bits<float>(static_cast<uint32_t>(v)); }
inline int __float_as_int(float f) { return static_cast<int>(static_cast<uint32_t>(emu::to_bits(f))); }
inline float __uint_as_float(unsigned v) { return emu::from_bits<float>(v); }
inline unsigned __float_as_uint(float f) { return static_cast<unsigned>(emu::to_bits(f)); }
inline double __longlong_as_double(long long v) { return emu::from_bits<double>(static_cast<uint64_t>(v)); }
inline long long __double_as_longlong(double d) { return static_cast<long long>(emu::to_bits(d)); }
template <typename T>
inline T __ldg(const T* p) {
  T v;
  emu::load_nc(&v, p, sizeof(T));
  return v;
}
template <typename T>
inline T __ldcg(const T* p) {
  emu::note_poll();
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

// Integer min/max as CUDA's device library provides them.
#define JEP_EMU_MINMAX(T)                                  \
  inline T min(T a, T b) { return b < a ? b : a; }         \
  inline T max(T a, T b) { return a < b ? b : a; }
JEP_EMU_MINMAX(int)
JEP_EMU_MINMAX(unsigned)
JEP_EMU_MINMAX(long)
JEP_EMU_MINMAX(unsigned long)
JEP_EMU_MINMAX(long long)
JEP_EMU_MINMAX(unsigned long long)
JEP_EMU_MINMAX(float)
JEP_EMU_MINMAX(double)
#undef JEP_EMU_MINMAX

// Atomics: one atomic step of the scheduler (no other fiber runs in between): the thread
// yields, then reads, updates with `f(old)` and returns the old value.
namespace emu {
template <typename T, typename F>
inline T atomic_update(T* p, F f) {
  yield(kYieldAtomic);
  const T old = *p;
  *p = f(old);
  return old;
}
}  // namespace emu
template <typename T, typename U>
inline T atomicAdd(T* p, U v) {
  return emu::atomic_update(p, [&](T o) { return static_cast<T>(o + static_cast<T>(v)); });
}
template <typename T, typename U>
inline T atomicSub(T* p, U v) {
  return emu::atomic_update(p, [&](T o) { return static_cast<T>(o - static_cast<T>(v)); });
}
template <typename T, typename U>
inline T atomicExch(T* p, U v) {
  return emu::atomic_update(p, [&](T) { return static_cast<T>(v); });
}
template <typename T, typename U, typename V>
inline T atomicCAS(T* p, U cmp, V v) {
  return emu::atomic_update(p, [&](T o) { return o == static_cast<T>(cmp) ? static_cast<T>(v) : o; });
}

// System-scope atomics of the internode kernels (their error record lives in mapped host
// memory): one scheduler step, as every emulated atomic.
template <typename T, typename U, typename V>
inline T atomicCAS_system(T* p, U cmp, V v) {
  return atomicCAS(p, cmp, v);
}
template <typename T, typename U>
inline T atomicOr(T* p, U v) {
  return emu::atomic_update(p, [&](T o) { return static_cast<T>(o | static_cast<T>(v)); });
}
template <typename T, typename U>
inline T atomicAnd(T* p, U v) {
  return emu::atomic_update(p, [&](T o) { return static_cast<T>(o & static_cast<T>(v)); });
}
template <typename T, typename U>
inline T atomicMax(T* p, U v) {
  return emu::atomic_update(p, [&](T o) { return o < static_cast<T>(v) ? static_cast<T>(v) : o; });
}
template <typename T, typename U>
inline T atomicMin(T* p, U v) {
  return emu::atomic_update(p, [&](T o) { return static_cast<T>(v) < o ? static_cast<T>(v) : o; });
}

// 16-bit float types (storage and the bit casts the kernels use).
struct __half {
  unsigned short x;
};
struct __nv_bfloat16 {
  unsigned short x;
};
inline __half __ushort_as_half(unsigned short v) { return __half{v}; }
inline unsigned short __half_as_ushort(__half h) { return h.x; }
inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short v) { return __nv_bfloat16{v}; }
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 h) { return h.x; }
