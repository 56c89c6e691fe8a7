// XLA FFI handlers of the low-latency mode on CPU (platform "cpu"): the send and receive
// halves of dispatch and combine, JEP_CPU_LL_TARGETS.
#pragma once

#include "xla_ffi/common/ffi_table.h"

namespace jax_ep {
JEP_CPU_LL_TARGETS(JEP_FFI_DECLARE_TARGET)
}  // namespace jax_ep
