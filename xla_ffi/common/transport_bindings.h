// Python bindings of the transport: the striping plan (always) and the NVSHMEM runtime
// (builds with NVSHMEM). Called from the nanobind module in xla_ffi/module.cc.
#pragma once

#include <nanobind/nanobind.h>

namespace jax_ep {
void AddTransportBindings(nanobind::module_& m);
#ifdef JAX_EP_WITH_NVSHMEM
void AddNvshmemBindings(nanobind::module_& m);  // xla_ffi/internode/nvshmem_bindings.cc
#endif
}  // namespace jax_ep
