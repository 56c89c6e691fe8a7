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
# The NCCL GIN transport's host side over the emulated NCCL (kernels/emu/nccl_emu.h),
# through the kernels' wrapper (the real build compiles the same file as CUDA). AUTO: on
# once the emulated NCCL is in the tree.
set(JAX_EP_EMU_NCCL "AUTO" CACHE STRING
    "Emulated build of kernels/internode/nccl_host.cc: AUTO (if kernels/emu/nccl_emu.h exists), ON or OFF")
set_property(CACHE JAX_EP_EMU_NCCL PROPERTY STRINGS AUTO ON OFF)
if(JAX_EP_EMU_NCCL STREQUAL "ON" OR
   (JAX_EP_EMU_NCCL STREQUAL "AUTO" AND EXISTS "${CMAKE_CURRENT_SOURCE_DIR}/kernels/emu/nccl_emu.h"))
  # ... and every internode kernel a second time, over NCCL GIN (transport_select.cuh)
  list(APPEND JAX_EP_EMU_KERNELS kernels/internode/nccl_host.cc
       kernels/internode/internode_kernels_nccl.cu
       kernels/internode/hierarchical_kernels_nccl.cu
       kernels/internode/low_latency_kernels_nccl.cu)
  set(JAX_EP_EMU_WITH_NCCL ON)
endif()
