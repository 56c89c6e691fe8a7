// XLA FFI handlers of the CUDA backend (JEP_CUDA_TARGETS), registered for platform "CUDA"
// under the same target names as the CPU ones (see cuda_registrations.cc), plus the
// virtual-rank harness targets that run R ranks' kernels on one GPU.
#pragma once

#include <cuda_runtime_api.h>

#include "xla_ffi/common/ffi_table.h"

namespace jax_ep {
// Re-zeroes the headers of the harness's virtual ranks on a device (jax_ep.cuda.reset);
// synchronous, never inside an FFI call.
cudaError_t ResetHarnessBuffers(int ordinal);
// Destroys the harness's rank streams of a GPU (made again by its next call).
cudaError_t ReleaseHarnessStreams(int ordinal);

JEP_CUDA_TARGETS(JEP_FFI_DECLARE_TARGET)
}  // namespace jax_ep
