// Hook through which the CUDA handlers are added to registrations()["CUDA"].
#pragma once

#include <functional>

namespace jax_ep {
using RegisterFn = std::function<void(const char* name, void* handler)>;
void AddCudaRegistrations(const RegisterFn& add);
// Internode (NVSHMEM) handlers; defined only when built with NVSHMEM.
void AddInternodeRegistrations(const RegisterFn& add);
// The hierarchical mode's handlers (xla_ffi/internode/hierarchical_handlers.cc), added by
// AddInternodeRegistrations.
void AddHierarchicalRegistrations(const RegisterFn& add);
// Adds the cuda_* host functions (buffer setup, error check, presets) to the nanobind
// module whose PyObject* is `module` (xla_ffi/cuda/cuda_harness.cc).
void DefineCudaBindings(void* module);
}  // namespace jax_ep
