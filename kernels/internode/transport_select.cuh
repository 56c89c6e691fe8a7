// The transport a kernel file is built for. Each internode kernel file is compiled once per
// backend: as itself for NVSHMEM, and included by its *_nccl.cu twin with
// JEP_TRANSPORT_NCCL defined for NCCL GIN. The kernels name only
// transport::JEP_TR_NS::TransportFor<conn>, and their launchers live in namespace
// JEP_TR_NS (via_nvshmem / via_nccl), which the host side picks per GPU
// (kernels/internode/transport_dispatch.cu). No include guard: a translation unit may
// build a kernel file over both backends (xla_ffi/internode/emu_hier_small_rings.cc).
#include "kernels/internode/transport.cuh"

#undef JEP_TR_NS
#if defined(JEP_TRANSPORT_NCCL)
#include "kernels/internode/transport_nccl_gin.cuh"
#define JEP_TR_NS via_nccl
#else
#include "kernels/internode/transport_nvshmem.cuh"
#define JEP_TR_NS via_nvshmem
#endif
