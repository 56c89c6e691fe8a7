// NCCL GIN backend of kernels/internode/transport.cuh: GPU-initiated RDMA through NCCL's
// device API (nccl_device/gin.h, NCCL >= 2.30) for peers on other nodes, loads and stores
// through the window's LSA mapping for peers on this node.
//
// The whole internode heap is one symmetric window (ncclCommWindowRegister,
// NCCL_WIN_COLL_SYMMETRIC), so a symmetric address is the window plus its offset from
// this GPU's base. Logical QP q of the striping plan is GIN context ctx_of_qp[q]: "each
// context has one QP per peer" (gin.h, the ncclGin constructor), so the plan's QP is the
// QP on the wire, as with NVSHMEM's QP handles.
//
// Signals are VA signals on the window's words. Every signal is STRONG: "visibility implies
// all preceding puts are settled" (gin.h, ncclGin_StrongVASignalAdd), which is the
// contract's in-order QP; a weak one "guarantees only the bundled put is settled" and
// would let a count signal overtake its rows. GIN has no SET: Sig's SET adds value - prev.
//
// Peers in this GPU's LSA team (this node, itself included) are not GIN's: a put is the
// warp's own copy through the window's peer mapping, each lane fencing its stores at
// system scope, and a signal an atomic add after a fence, so the same contract holds.
#pragma once

#include <cstddef>
#include <cstdint>

#if !defined(JAX_EP_EMU)
#include <nccl_device.h>  // the device API's inline definitions (nccl_device/impl/*__funcs.h)
#endif

#include "kernels/cuda/launch.cuh"
#include "kernels/internode/device_copy.cuh"
#include "kernels/internode/nccl_gin_state.h"
#include "kernels/internode/transport.cuh"

namespace jax_ep {
namespace transport {

template <Conn C>
struct NcclGin {
  static __device__ __forceinline__ const ncclDevComm& comm() {
    return C == Conn::kRail ? g_nccl_gin.rail : g_nccl_gin.full;
  }
  static __device__ __forceinline__ int my_pe() { return g_nccl_gin.full.rank; }
  static __device__ __forceinline__ int n_pes() { return g_nccl_gin.full.nRanks; }

  static __device__ __forceinline__ size_t off(const void* p) {
    return static_cast<size_t>(static_cast<const char*>(p) - g_nccl_gin.base);
  }
  // SET from a known previous value is an ADD of the difference (mod 2^64).
  static __device__ __forceinline__ uint64_t delta(const Sig& s) {
    return s.op == SignalOp::kAdd ? s.value : s.value - s.prev;
  }
  static __device__ __forceinline__ int ctx(int qp) { return g_nccl_gin.ctx_of_qp[qp]; }

  // This GPU's address of `sym` on `pe` when `pe` is in its LSA team, else nullptr.
  static __device__ __forceinline__ char* lsa(const void* sym, int pe) {
    return static_cast<char*>(peer_ptr(const_cast<void*>(sym), pe));
  }
  // The warp's copy to an LSA peer; the source may have been written by this kernel, so it
  // is read past L1.
  static __device__ __forceinline__ void lsa_put_warp(char* dst, const void* src,
                                                      size_t bytes) {
    devcopy::CopyLanded(dst, static_cast<const char*>(src), static_cast<int64_t>(bytes),
                        static_cast<int>(threadIdx.x & 31), 32);
    __threadfence_system();
    __syncwarp();
  }
  static __device__ __forceinline__ void lsa_signal(char* word, const Sig& s) {
    __threadfence_system();
    atomicAdd(reinterpret_cast<unsigned long long*>(word),
              static_cast<unsigned long long>(delta(s)));
  }

  static __device__ __forceinline__ void put_warp(void* dst, const void* src, size_t bytes,
                                                  int pe, int qp) {
    if (char* p = lsa(dst, pe)) return lsa_put_warp(p, src, bytes);
    ncclGin gin(comm(), ctx(qp));
    gin.put(ncclTeamWorld(comm()), pe, g_nccl_gin.win, off(dst), g_nccl_gin.win, off(src),
            bytes, ncclGin_None{}, ncclGin_None{}, ncclCoopWarp{});
  }

  static __device__ __forceinline__ void put_signal_warp(void* dst, const void* src,
                                                         size_t bytes, Sig s, int pe, int qp) {
    if (char* p = lsa(dst, pe)) {
      lsa_put_warp(p, src, bytes);
      if ((threadIdx.x & 31) == 0) lsa_signal(lsa(s.word, pe), s);
      __syncwarp();
      return;
    }
    ncclGin gin(comm(), ctx(qp));
    gin.put(ncclTeamWorld(comm()), pe, g_nccl_gin.win, off(dst), g_nccl_gin.win, off(src),
            bytes, ncclGin_StrongVASignalAdd{g_nccl_gin.win, off(s.word), delta(s)},
            ncclGin_None{}, ncclCoopWarp{});
  }

  static __device__ __forceinline__ void signal(Sig s, int pe, int qp) {
    if (char* w = lsa(s.word, pe)) return lsa_signal(w, s);
    ncclGin gin(comm(), ctx(qp));
    gin.signal(ncclTeamWorld(comm()), pe,
               ncclGin_StrongVASignalAdd{g_nccl_gin.win, off(s.word), delta(s)},
               ncclCoopThread{});
  }

  // readSignal is an acquire load of the local word (gin__funcs.h); on the emulated GPU it
  // is also a poll, where the emulated NIC delivers.
  static __device__ __forceinline__ uint64_t fetch(uint64_t* sig) {
    ncclGin gin(comm(), 0);
    return gin.readSignal(g_nccl_gin.win, off(sig));
  }

  // ncclGetPeerPointer is defined for the LSA team only (ranks lsaRank-relative on this
  // node): anything else must go by RDMA.
  static __device__ __forceinline__ void* peer_ptr(void* sym, int pe) {
    const ncclDevComm& c = g_nccl_gin.full;
    const int first = c.rank - c.lsaRank;
    if (pe < first || pe >= first + c.lsaSize) return nullptr;
    return ncclGetPeerPointer(g_nccl_gin.win, off(sym), pe);
  }

  // gin.h flush: "all source buffers from put's from any thread in this coop will be safe
  // to reuse"; the warp's puts may be on any context.
  static __device__ __forceinline__ void quiet_warp() {
    for (int c = 0; c < g_nccl_gin.num_contexts; ++c) {
      ncclGin gin(comm(), c);
      gin.flush(ncclCoopWarp{});
    }
  }

  // A strong signal settles every earlier put of its context to its peer: nothing to do.
  static __device__ __forceinline__ void fence_qp(int) {}
};

namespace via_nccl {
template <Conn C>
using TransportFor = NcclGin<C>;
}  // namespace via_nccl

}  // namespace transport
}  // namespace jax_ep
