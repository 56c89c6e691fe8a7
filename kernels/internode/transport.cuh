// The device-side transport the internode kernels are written against.
//
// A backend is a struct with the static __device__ members below; the kernels are built
// over it (kernels/internode/transport_select.cuh: each kernel file is compiled once per
// backend), so a backend costs nothing at run time and a new one is one header that
// defines such a struct plus its host side, with no change to the kernels. Backends:
// transport_nvshmem.cuh (NVSHMEM, IBGDA) and transport_nccl_gin.cuh (NCCL's GPU-initiated
// networking).
//
//   // Identity of this GPU in the world of ranks.
//   static int my_pe();
//   static int n_pes();
//   // Non-blocking put of `bytes` from local `src` (registered memory) to the symmetric
//   // address `dst` on `pe`, through logical QP `qp` (see kernels/common/striping_plan.h).
//   // Called by a whole warp with the same arguments.
//   static void put_warp(void* dst, const void* src, size_t bytes, int pe, int qp);
//   // The same, then signal `s` on `pe`, on the same QP, visible only after the data of
//   // this put and of every earlier put of this GPU on that QP to `pe`: the receiver may
//   // read them all once it sees the signal.
//   static void put_signal_warp(void* dst, const void* src, size_t bytes, Sig s, int pe,
//                               int qp);
//   // A signal alone (one thread), ordered after this GPU's earlier puts on `qp` to `pe`
//   // as above.
//   static void signal(Sig s, int pe, int qp);
//   // Current value of the local symmetric signal `*sig` (one thread; the kernels
//   // poll it against a deadline, so no wait is unbounded). An acquire: whatever the
//   // signal guards, read after it, is at least as new as the signal.
//   static uint64_t fetch(uint64_t* sig);
//   // A pointer through which this GPU can load/store `sym` on `pe` (NVLink / same
//   // GPU), or nullptr when `pe` is reachable only by RDMA.
//   static void* peer_ptr(void* sym, int pe);
//   // Called by every lane of a warp after the warp's puts: they are complete (their
//   // source buffers may be reused).
//   static void quiet_warp();
//   // Deliver this GPU's earlier operations on logical QP `qp` before its later ones.
//   static void fence_qp(int qp);
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/common/striping_plan.h"

namespace jax_ep {
namespace transport {

enum class SignalOp : int { kSet = 0, kAdd = 1 };

// What a signal does to its word on the receiver: ADD `value`, or SET it to `value` from
// `prev`, the value the word holds when the signal lands. The protocol always knows
// `prev` (zero after the reader's reset, or the writer's own previous value of a word only
// it writes): NCCL's GIN has no SET (nccl_device/gin.h: "Support deferred:
// ncclGin_SignalSet"), so that backend adds value - prev; NVSHMEM sets.
struct Sig {
  uint64_t* word;
  SignalOp op;
  uint64_t value;
  uint64_t prev;
};
__host__ __device__ inline Sig Add(uint64_t* word, uint64_t value) {
  return Sig{word, SignalOp::kAdd, value, 0};
}
__host__ __device__ inline Sig Set(uint64_t* word, uint64_t value, uint64_t prev) {
  return Sig{word, SignalOp::kSet, value, prev};
}

// Which ranks a backend must reach by RDMA for a mode: every rank (direct, low latency),
// or the same local GPU of every other node (hierarchical: NCCL's rail connections).
enum class Conn : int { kFull = 0, kRail = 1 };

// Most logical QPs per peer a backend must provide (num_ports * qps_per_port); one
// signal word per (source, QP) is reserved for each (kernels/internode/wire_protocol.h).
using ::jax_ep::kMaxQps;  // kernels/common/striping_plan.h

}  // namespace transport
}  // namespace jax_ep
