// The hierarchical mode (kernels and handlers) once more for the emulated GPU, with rings
// small enough that a few tokens fill and wrap them: 2-row chunks, 2 chunks per RDMA ring,
// 3-row NVLink rings. Its own names (namespace hier_small_rings, handler symbols, ops
// internode_hier_small_*), so it links beside the shipped build.
#define JAX_EP_HIER_CHUNK_ROWS 2
#define JAX_EP_HIER_RING_CHUNKS 2
#define JAX_EP_HIER_NVL_ROWS 3
#define hier hier_small_rings
#define emu_internode_hier emu_internode_hier_small_rings
#define AddHierarchicalRegistrations AddHierarchicalRegistrationsSmallRings
#define InternodeHierDispatchHandler InternodeHierSmallRingsDispatchHandler
#define InternodeHierCombineHandler InternodeHierSmallRingsCombineHandler
#define InternodeHierGatherHandler InternodeHierSmallRingsGatherHandler
#define JEP_EMU_HIER_OP(name) "internode_hier_small_" name
#include "kernels/internode/hierarchical_kernels.cu"  // NOLINT(build/include)
#if defined(JAX_EP_WITH_NCCL)
#define JEP_TRANSPORT_NCCL 1
#include "kernels/internode/hierarchical_kernels.cu"  // NOLINT(build/include): over NCCL GIN
#undef JEP_TRANSPORT_NCCL
#endif
#define JEP_DISPATCH_HIER_ONLY 1
#include "kernels/internode/transport_dispatch.cu"    // NOLINT(build/include)
#include "kernels/internode/hierarchical_host.cu"     // NOLINT(build/include)
#include "xla_ffi/internode/emu_hier.cc"               // NOLINT(build/include)
