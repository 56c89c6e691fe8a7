// The low_latency kernels built over NCCL GIN (kernels/internode/transport_select.cuh): the same
// source as low_latency_kernels.cu, its launchers in namespace via_nccl.
#define JEP_TRANSPORT_NCCL 1
#include "kernels/internode/low_latency_kernels.cu"  // NOLINT(build/include)
