# Decides whether the CUDA backend is built and defines the `jax_ep_cuda` target.
# Sets JAX_EP_HAVE_CUDA, JAX_EP_CUDA_ARCH_NAMES, JAX_EP_HAVE_NVSHMEM, JAX_EP_HAVE_NCCL,
# JAX_EP_NCCL_VERSION_CODE, JAX_EP_CUDA_REASON.
set(JAX_EP_HAVE_CUDA OFF)
set(JAX_EP_HAVE_NVSHMEM OFF)
set(JAX_EP_HAVE_NCCL OFF)
set(JAX_EP_NCCL_VERSION_CODE 0)
set(JAX_EP_CUDA_REASON "")

if(JAX_EP_CUDA STREQUAL "OFF")
  set(JAX_EP_CUDA_REASON "disabled with -DJAX_EP_CUDA=OFF")
  return()
endif()

include(CheckLanguage)
check_language(CUDA)
if(NOT CMAKE_CUDA_COMPILER)
  if(JAX_EP_CUDA STREQUAL "ON")
    message(FATAL_ERROR "jax_ep: -DJAX_EP_CUDA=ON but no CUDA compiler (nvcc) was found")
  endif()
  set(JAX_EP_CUDA_REASON "nvcc not found")
  return()
endif()

enable_language(CUDA)
find_package(CUDAToolkit REQUIRED)
set(JAX_EP_HAVE_CUDA ON)
# sm_90 for every kernel; sm_90a where Hopper-only instructions are used.
set(CMAKE_CUDA_ARCHITECTURES OFF)
set(JAX_EP_CUDA_ARCH_NAMES "sm_90" "sm_90a")
set(JAX_EP_CUDA_GENCODE
    "-gencode=arch=compute_90,code=sm_90"
    "-gencode=arch=compute_90a,code=sm_90a")

add_library(jax_ep_cuda STATIC
  kernels/cuda/toolchain_check.cu
  kernels/cuda/layout_kernels.cu
  kernels/cuda/intranode_kernels.cu
  kernels/cuda/low_latency_kernels.cu
  xla_ffi/cuda/cuda_state.cc
  xla_ffi/cuda/cuda_handlers.cc
  xla_ffi/cuda/cuda_harness.cc
  xla_ffi/cuda/cuda_registrations.cc
  xla_ffi/cuda/low_latency_handlers.cc)
target_include_directories(jax_ep_cuda PUBLIC "${CMAKE_CURRENT_SOURCE_DIR}")
target_include_directories(jax_ep_cuda SYSTEM PUBLIC "${XLA_FFI_INCLUDE_DIR}")
target_compile_options(jax_ep_cuda PRIVATE
  $<$<COMPILE_LANGUAGE:CUDA>:${JAX_EP_CUDA_GENCODE} -Werror=all-warnings -Xcompiler=-Wall,-Wextra,-Werror,-Wno-unused-parameter>
  $<$<COMPILE_LANGUAGE:CXX>:${JAX_EP_WARNINGS}>)
# Static runtime: the extension still imports on machines without a GPU driver.
target_link_libraries(jax_ep_cuda PUBLIC CUDA::cudart_static)
# xla_ffi/cuda/cuda_harness.cc defines nanobind functions (added to the module by module.cc).
if(TARGET nanobind-static)
  target_link_libraries(jax_ep_cuda PRIVATE nanobind-static)
endif()
set_target_properties(jax_ep_cuda PROPERTIES CUDA_STANDARD 17 CUDA_STANDARD_REQUIRED ON)
include("${CMAKE_CURRENT_LIST_DIR}/nvshmem.cmake" OPTIONAL)
# The NCCL GIN transport's host side, into the internode module nvshmem.cmake defines.
include("${CMAKE_CURRENT_LIST_DIR}/nccl.cmake" OPTIONAL)
