// The internode (NVSHMEM) low-latency mode's entry points for the nanobind module:
// the wire protocol's bindings (every build: the simulator and the heap sizing use
// them) and, in NVSHMEM builds, the FFI registrations and the area's start.
#pragma once

#include "xla_ffi/cuda/cuda_registrations.h"

namespace nanobind {
class module_;
}  // namespace nanobind

namespace jax_ep {
// ll_protocol, ll_config_hash, ll_expert_qp, ll_area_layout; with NVSHMEM
// also ll_internode_init / ll_internode_info (xla_ffi/internode/low_latency_bindings.cc).
void AddLowLatencyWireBindings(nanobind::module_& m);
#ifdef JAX_EP_WITH_NVSHMEM
// jax_ep_internode_ll_{dispatch,combine}_{send,recv} (low_latency_handlers.cc).
void AddInternodeLowLatencyRegistrations(const RegisterFn& add);
#endif
}  // namespace jax_ep
