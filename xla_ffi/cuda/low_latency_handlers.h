// CUDA handlers of the low-latency mode: the virtual-rank harness (every rank's buffers
// on one GPU, inputs and outputs stacked over a leading rank axis), targets
// jax_ep_ll_harness_{dispatch,combine}_{send,recv}.
#pragma once

#include "xla_ffi/cuda/cuda_registrations.h"

namespace jax_ep {
void AddLowLatencyCudaRegistrations(const RegisterFn& add);
}  // namespace jax_ep
