# The internode (NVSHMEM) kernels on the emulated GPU (included by cmake/emu.cmake): the
# direct, hierarchical and low-latency kernels and their host side compiled as C++ over
# the emulated NVSHMEM (kernels/emu/nvshmem_emu.h), the handlers' invokers, and the
# hierarchical mode a second time with small rings (ops internode_hier_small_*).
list(APPEND JAX_EP_EMU_KERNELS
     kernels/internode/nvshmem_host.cu
     kernels/internode/internode_kernels.cu
     kernels/internode/hierarchical_host.cu
     kernels/internode/hierarchical_kernels.cu
     kernels/internode/low_latency_host.cu
     kernels/internode/low_latency_kernels.cu
     xla_ffi/internode/emu_hier_small_rings.cc)
list(APPEND JAX_EP_EMU_SOURCES
     kernels/emu/nvshmem_emu.cc
     kernels/internode/nvshmem_select.cc
     xla_ffi/internode/emu_direct.cc
     xla_ffi/internode/emu_hier.cc
     xla_ffi/internode/emu_ll.cc)
# The NCCL GIN transport's host side over the emulated NCCL (kernels/emu/nccl_emu.h),
# through the kernels' wrapper (the real build compiles the same file as CUDA). AUTO: on
# once the emulated NCCL is in the tree.
set(JAX_EP_EMU_NCCL "AUTO" CACHE STRING
    "Emulated build of kernels/internode/nccl_host.cc: AUTO (if kernels/emu/nccl_emu.h exists), ON or OFF")
set_property(CACHE JAX_EP_EMU_NCCL PROPERTY STRINGS AUTO ON OFF)
if(JAX_EP_EMU_NCCL STREQUAL "ON" OR
   (JAX_EP_EMU_NCCL STREQUAL "AUTO" AND EXISTS "${CMAKE_CURRENT_SOURCE_DIR}/kernels/emu/nccl_emu.h"))
  list(APPEND JAX_EP_EMU_KERNELS kernels/internode/nccl_host.cc)
  if(NOT "kernels/emu/nccl_emu.cc" IN_LIST JAX_EP_EMU_SOURCES)
    list(APPEND JAX_EP_EMU_SOURCES kernels/emu/nccl_emu.cc)
  endif()
endif()
