// XLA FFI handlers of the low-latency mode on CPU (platform "cpu"): the send and receive
// halves of dispatch and combine.
#pragma once

#include "xla/ffi/api/ffi.h"

namespace jax_ep {
XLA_FFI_DECLARE_HANDLER_SYMBOL(LowLatencyDispatchSendCpuHandler);
XLA_FFI_DECLARE_HANDLER_SYMBOL(LowLatencyDispatchRecvCpuHandler);
XLA_FFI_DECLARE_HANDLER_SYMBOL(LowLatencyDispatchSendFp8CpuHandler);
XLA_FFI_DECLARE_HANDLER_SYMBOL(LowLatencyDispatchRecvFp8CpuHandler);
XLA_FFI_DECLARE_HANDLER_SYMBOL(LowLatencyCombineSendCpuHandler);
XLA_FFI_DECLARE_HANDLER_SYMBOL(LowLatencyCombineRecvCpuHandler);
}  // namespace jax_ep
