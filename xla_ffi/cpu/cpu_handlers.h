// XLA FFI handlers of the CPU backend (platform "cpu"): JEP_CPU_TARGETS.
#pragma once

#include "xla_ffi/common/ffi_table.h"

namespace jax_ep {
JEP_CPU_TARGETS(JEP_FFI_DECLARE_TARGET)
}  // namespace jax_ep
