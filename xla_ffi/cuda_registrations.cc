#include "xla_ffi/cuda_registrations.h"

namespace jax_ep {
// CUDA FFI handlers are registered here as they are added.
void AddCudaRegistrations(const RegisterFn& add) { (void)add; }
}  // namespace jax_ep
