// The device-side transport the internode kernels are written against.
//
// A backend is a struct with the static __device__ members below; the kernels are
// templates over it, so a backend costs nothing at run time and a new one (for example
// the NCCL device API) is one new header that defines such a struct plus a host-side
// `Init`/`Finalize`, with no change to the kernels.
//
//   // Identity of this process in the world of PEs.
//   static int my_pe();
//   static int n_pes();
//   // Non-blocking put of `bytes` from local `src` (registered memory) to the symmetric
//   // address `dst` on `pe`, through logical QP `qp` (see kernels/common/striping_plan.h).
//   // Called by a whole warp with the same arguments.
//   static void put_warp(void* dst, const void* src, size_t bytes, int pe, int qp);
//   // The same, then `*sig op= value` on `pe`, on the same QP, visible only after the
//   // data: the receiver may read the data once it sees the signal.
//   static void put_signal_warp(void* dst, const void* src, size_t bytes, uint64_t* sig,
//                               uint64_t value, SignalOp op, int pe, int qp);
//   // A signal alone (one thread).
//   static void signal(uint64_t* sig, uint64_t value, SignalOp op, int pe, int qp);
//   // Current value of the local symmetric signal `*sig` (one thread; the kernels
//   // poll it against a deadline, so no wait is unbounded). An acquire: whatever the
//   // signal guards, read after it, is at least as new as the signal.
//   static uint64_t fetch(uint64_t* sig);
//   // A pointer through which this GPU can load/store `sym` on `pe` (NVLink / same
//   // GPU), or nullptr when `pe` is reachable only by RDMA.
//   static void* peer_ptr(void* sym, int pe);
//   // Complete every put this thread issued (source buffers may be reused after).
//   static void quiet();
//   // Deliver this PE's earlier operations on logical QP `qp` before its later ones.
//   static void fence_qp(int qp);
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/common/striping_plan.h"

namespace jax_ep {
namespace transport {

enum class SignalOp : int { kSet = 0, kAdd = 1 };

// Most logical QPs per peer a backend must provide (num_ports * qps_per_port); one
// signal word per (source, QP) is reserved for each (kernels/internode/wire_protocol.h).
using ::jax_ep::kMaxQps;  // kernels/common/striping_plan.h

}  // namespace transport
}  // namespace jax_ep
