// Python bindings of the memory layouts and launch settings the kernels use
// (xla_ffi/common/layout_bindings.cc). Called from the nanobind module in xla_ffi/module.cc.
#pragma once

#include <nanobind/nanobind.h>

namespace jax_ep {
void AddLayoutBindings(nanobind::module_& m);
}  // namespace jax_ep
