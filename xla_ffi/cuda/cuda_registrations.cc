#include "xla_ffi/cuda/cuda_registrations.h"

#include "xla_ffi/cuda/cuda_handlers.h"
#include "xla_ffi/cuda/low_latency_handlers.h"

namespace jax_ep {
// CUDA handlers under the same target names as the CPU ones (the Python layer is
// shared), plus the virtual-rank harness targets used by tests and benchmarks.
// Python registers each with the traits of its row in xla_ffi/common/op_tables.h
// (JEP_CUDA_TARGETS).
void AddCudaRegistrations(const RegisterFn& add) {
  JEP_CUDA_TARGETS(JEP_FFI_ADD_TARGET)
  // Low-latency mode, virtual-rank harness (xla_ffi/cuda/low_latency_handlers.cc).
  AddLowLatencyCudaRegistrations(add);
}
}  // namespace jax_ep
