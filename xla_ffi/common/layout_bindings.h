// Python bindings of the memory layouts and launch settings the kernels use
// (xla_ffi/common/layout_bindings.cc). Called from the nanobind module in xla_ffi/module.cc.
#pragma once

#include <nanobind/nanobind.h>

namespace jax_ep {
void AddLayoutBindings(nanobind::module_& m);
// The run-time settings (xla_ffi/common/settings_bindings.cc): set_settings, settings,
// settings_defaults. Every extension module adds them (each has its own settings).
void AddSettingsBindings(nanobind::module_& m);
}  // namespace jax_ep
