// Hook through which the CUDA handlers are added to registrations()["CUDA"].
#pragma once

#include <functional>

namespace jax_ep {
using RegisterFn = std::function<void(const char* name, void* handler)>;
void AddCudaRegistrations(const RegisterFn& add);
// Internode (NVSHMEM) handlers; defined only when built with NVSHMEM.
void AddInternodeRegistrations(const RegisterFn& add);
}  // namespace jax_ep
