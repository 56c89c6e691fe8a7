// CUDA handlers of the low-latency mode: real ranks under the CPU's target names
// (jax_ep_ll_{dispatch,combine}_{send,recv}, over the low-latency area jax_ep.cuda.setup
// allocates) and the virtual-rank harness (every rank's buffers on one GPU, inputs and
// outputs stacked over a leading rank axis), targets jax_ep_ll_harness_*.
#pragma once

#include "xla_ffi/cuda/cuda_registrations.h"

namespace jax_ep {
void AddLowLatencyCudaRegistrations(const RegisterFn& add);
}  // namespace jax_ep
