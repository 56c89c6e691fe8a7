// NVSHMEM backend of kernels/internode/transport.cuh: GPU-initiated RDMA (IBGDA) for
// peers on other nodes, NVLink loads/stores where nvshmem_ptr gives a pointer.
//
// Logical QP q of the striping plan is carried by explicit QP handle
// `g_nvshmem_qp_handles[q]` (NVSHMEM 3.8's QP API): the put and its signal are issued
// on that handle, so the plan's QP is the QP on the wire. The host creates the handles
// once at init through `nvshmemx_qp_create`, resolved with dlsym so that an older
// NVSHMEM host library (or none) still loads the extension. Without handles
// (g_nvshmem_num_qp_handles == 0) the calls fall back to NVSHMEM's own QP choice; the
// bootstrap then runs with one port and says so (see docs/internode.md).
#pragma once

#if defined(JAX_EP_EMU)
#include "kernels/emu/nvshmem_emu.h"  // the emulated GPU's NVSHMEM (same API subset)
#else
#include <nvshmem.h>
#include <nvshmemx.h>
#endif

#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/peer_transport.cuh"
#include "kernels/internode/transport.cuh"

#if (NVSHMEM_VENDOR_MAJOR_VERSION * 100 + NVSHMEM_VENDOR_MINOR_VERSION) >= 308
#define JAX_EP_NVSHMEM_QP_API 1
#else
#define JAX_EP_NVSHMEM_QP_API 0
#endif

namespace jax_ep {
namespace transport {

// Set by the host at init (kernels/internode/nvshmem_host.cu): 0 = default QP selection.
// Defined there with JEP_DEVICE_GLOBAL (the emulated GPU keeps one copy per virtual GPU).
JEP_DEVICE_EXTERN int g_nvshmem_num_qp_handles;
JEP_DEVICE_EXTERN int g_nvshmem_qp_handles[kMaxQps];

struct Nvshmem {
  static __device__ __forceinline__ int my_pe() { return nvshmem_my_pe(); }
  static __device__ __forceinline__ int n_pes() { return nvshmem_n_pes(); }

  static __device__ __forceinline__ int sig_op(SignalOp op) {
    return op == SignalOp::kAdd ? NVSHMEM_SIGNAL_ADD : NVSHMEM_SIGNAL_SET;
  }

  static __device__ __forceinline__ void put_warp(void* dst, const void* src, size_t bytes,
                                                  int pe, int qp) {
#if JAX_EP_NVSHMEM_QP_API
    if (qp < g_nvshmem_num_qp_handles) {
      nvshmemx_qp_uint8_put_nbi_warp(static_cast<uint8_t*>(dst),
                                     static_cast<const uint8_t*>(src), bytes, pe,
                                     g_nvshmem_qp_handles[qp]);
      return;
    }
#endif
    nvshmemx_putmem_nbi_warp(dst, src, bytes, pe);
  }

  static __device__ __forceinline__ void put_signal_warp(void* dst, const void* src,
                                                         size_t bytes, Sig s, int pe, int qp) {
#if JAX_EP_NVSHMEM_QP_API
    if (qp < g_nvshmem_num_qp_handles) {
      nvshmemx_qp_uint8_put_signal_nbi_warp(static_cast<uint8_t*>(dst),
                                            static_cast<const uint8_t*>(src), bytes, s.word,
                                            s.value, sig_op(s.op), pe, g_nvshmem_qp_handles[qp]);
      return;
    }
#endif
    nvshmemx_putmem_signal_nbi_warp(dst, src, bytes, s.word, s.value, sig_op(s.op), pe);
  }

  static __device__ __forceinline__ void signal(Sig s, int pe, int qp) {
#if JAX_EP_NVSHMEM_QP_API
    if (qp < g_nvshmem_num_qp_handles) {
      nvshmemx_qp_signal_op(s.word, s.value, sig_op(s.op), pe, g_nvshmem_qp_handles[qp]);
      return;
    }
#endif
    nvshmemx_signal_op(s.word, s.value, sig_op(s.op), pe);
  }

  // Current value of a local symmetric signal word (the kernels poll with a deadline).
  // An acquire at system scope: the header or rows the word guards, read after it, are
  // never older than the signal (nvshmem_signal_fetch alone is a volatile load, which
  // orders nothing after it).
  static __device__ __forceinline__ uint64_t fetch(uint64_t* sig) {
#if defined(JAX_EP_EMU)
    return nvshmem_emu::load_acquire(sig);  // a poll: the emulated NIC delivers meanwhile
#else
    return peer::load_acquire(sig);
#endif
  }

  static __device__ __forceinline__ void* peer_ptr(void* sym, int pe) {
    return nvshmem_ptr(sym, pe);
  }

  // nvshmem_quiet completes every put of the PE; one lane's call covers the warp's.
  static __device__ __forceinline__ void quiet_warp() {
    if ((threadIdx.x & 31) == 0) nvshmem_quiet();
    __syncwarp();
  }

  // Orders this PE's earlier puts on logical QP `qp` before its later operations there (a
  // count signal after the rows it counts). A QP handle's operations are delivered in
  // order, so only NVSHMEM's own QP choice (no handles), which may spread them over
  // several QPs, needs nvshmem_fence.
  static __device__ __forceinline__ void fence_qp(int qp) {
#if JAX_EP_NVSHMEM_QP_API
    if (qp < g_nvshmem_num_qp_handles) return;
#endif
    (void)qp;
    nvshmem_fence();
  }
};

namespace via_nvshmem {
template <Conn>
using TransportFor = Nvshmem;  // NVSHMEM reaches every PE: one backend for both
}  // namespace via_nvshmem

}  // namespace transport
}  // namespace jax_ep
