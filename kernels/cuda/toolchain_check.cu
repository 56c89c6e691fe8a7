// Proves the CUDA toolchain builds device code for the configured architectures.
// The real kernels live beside it (layout, intranode, internode).
#include "kernels/common/layout_math.h"

namespace jax_ep {
__global__ void toolchain_check_kernel(const int32_t* idx, int n, int el, int32_t* owner) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) owner[i] = owner_rank(idx[i], el);
}
}  // namespace jax_ep
