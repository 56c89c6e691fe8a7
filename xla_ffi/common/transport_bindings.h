// Python bindings of the transport: the striping plan (always), the NVSHMEM runtime
// (builds with NVSHMEM) and the NCCL GIN transport's runtime (builds with NCCL's
// headers). Called from the nanobind modules in xla_ffi/.
#pragma once

#include <nanobind/nanobind.h>

#include <stdexcept>
#include <string>

namespace jax_ep {
// A native call's error text as a Python RuntimeError ("" is success).
inline void ThrowIfError(const std::string& err) {
  if (!err.empty()) throw std::runtime_error(err);
}

void AddTransportBindings(nanobind::module_& m);
#ifdef JAX_EP_WITH_NVSHMEM
void AddNvshmemBindings(nanobind::module_& m);  // xla_ffi/internode/nvshmem_bindings.cc
#endif
#ifdef JAX_EP_WITH_NCCL
void AddNcclBindings(nanobind::module_& m);  // xla_ffi/internode/nccl_bindings.cc
#endif
}  // namespace jax_ep
