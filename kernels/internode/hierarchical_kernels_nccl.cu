// The hierarchical kernels built over NCCL GIN (kernels/internode/transport_select.cuh): the same
// source as hierarchical_kernels.cu, its launchers in namespace via_nccl.
#define JEP_TRANSPORT_NCCL 1
#include "kernels/internode/hierarchical_kernels.cu"  // NOLINT(build/include)
