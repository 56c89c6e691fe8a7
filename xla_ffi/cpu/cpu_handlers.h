// XLA FFI handlers of the CPU backend (platform "cpu").
#pragma once

#include "xla/ffi/api/ffi.h"

namespace jax_ep {
XLA_FFI_DECLARE_HANDLER_SYMBOL(LayoutCpuHandler);
XLA_FFI_DECLARE_HANDLER_SYMBOL(DispatchCpuHandler);
XLA_FFI_DECLARE_HANDLER_SYMBOL(CombineCpuHandler);
XLA_FFI_DECLARE_HANDLER_SYMBOL(GatherCpuHandler);
}  // namespace jax_ep
