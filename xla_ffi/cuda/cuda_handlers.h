// XLA FFI handlers of the CUDA backend, registered for platform "CUDA" under the same
// target names as the CPU ones (see cuda_registrations.cc), plus the virtual-rank
// harness targets that run R ranks' kernels on one GPU.
#pragma once

#include <cuda_runtime_api.h>

#include "xla/ffi/api/ffi.h"

namespace jax_ep {
// Re-zeroes the headers of the harness's virtual ranks on a device (jax_ep.cuda.reset);
// synchronous, never inside an FFI call.
cudaError_t ResetHarnessBuffers(int ordinal);

XLA_FFI_DECLARE_HANDLER_SYMBOL(LayoutCudaHandler);
XLA_FFI_DECLARE_HANDLER_SYMBOL(DispatchCudaHandler);
XLA_FFI_DECLARE_HANDLER_SYMBOL(CombineCudaHandler);
XLA_FFI_DECLARE_HANDLER_SYMBOL(GatherCudaHandler);
XLA_FFI_DECLARE_HANDLER_SYMBOL(HarnessDispatchHandler);
XLA_FFI_DECLARE_HANDLER_SYMBOL(HarnessCombineHandler);
XLA_FFI_DECLARE_HANDLER_SYMBOL(HarnessGatherHandler);
}  // namespace jax_ep
