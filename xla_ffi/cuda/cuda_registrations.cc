#include "xla_ffi/cuda/cuda_registrations.h"

#include "xla_ffi/cuda/cuda_handlers.h"
#include "xla_ffi/cuda/low_latency_handlers.h"

namespace jax_ep {
// CUDA handlers under the same target names as the CPU ones (the Python layer is
// shared), plus the virtual-rank harness targets used by tests and benchmarks.
// jax_ep.cuda.register_ffi_targets() registers the four collectives with the
// COMMAND_BUFFER_COMPATIBLE trait (their handlers never synchronize with the host).
void AddCudaRegistrations(const RegisterFn& add) {
  add("jax_ep_layout", reinterpret_cast<void*>(LayoutCudaHandler));
  add("jax_ep_dispatch", reinterpret_cast<void*>(DispatchCudaHandler));
  add("jax_ep_combine", reinterpret_cast<void*>(CombineCudaHandler));
  add("jax_ep_gather", reinterpret_cast<void*>(GatherCudaHandler));
  add("jax_ep_harness_dispatch", reinterpret_cast<void*>(HarnessDispatchHandler));
  add("jax_ep_harness_combine", reinterpret_cast<void*>(HarnessCombineHandler));
  add("jax_ep_harness_gather", reinterpret_cast<void*>(HarnessGatherHandler));
  // Low-latency mode, virtual-rank harness (xla_ffi/cuda/low_latency_handlers.cc).
  AddLowLatencyCudaRegistrations(add);
}
}  // namespace jax_ep
