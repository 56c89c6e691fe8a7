# The internode (NVSHMEM) kernels on the emulated GPU (included by cmake/emu.cmake): the
# direct, hierarchical and low-latency kernels and their host side compiled as C++ over
# the emulated NVSHMEM (kernels/emu/nvshmem_emu.h), the handlers' invokers, and the
# hierarchical mode a second time with small rings (ops internode_hier_small_*); the
# emulated NCCL (kernels/emu/nccl_emu.h) and its GIN probes (xla_ffi/internode/emu_gin_probe.cc).
list(APPEND JAX_EP_EMU_KERNELS
     kernels/internode/nvshmem_host.cu
     kernels/internode/transport_dispatch.cu
     kernels/internode/internode_kernels.cu
     kernels/internode/hierarchical_host.cu
     kernels/internode/hierarchical_kernels.cu
     kernels/internode/low_latency_host.cu
     kernels/internode/low_latency_kernels.cu
     xla_ffi/internode/emu_hier_small_rings.cc)
list(APPEND JAX_EP_EMU_SOURCES
     kernels/emu/nvshmem_emu.cc
     kernels/emu/nccl_emu.cc
     kernels/internode/nvshmem_select.cc
     kernels/internode/nccl_select.cc
     xla_ffi/internode/emu_direct.cc
     xla_ffi/internode/emu_hier.cc
     xla_ffi/internode/emu_ll.cc
     xla_ffi/internode/emu_gin_probe.cc)
