# The emulated GPU (kernels/emu): the CUDA kernels and the CUDA backend's handlers compiled
# with the host compiler into a separate module, _jax_ep_emu, that runs them on the CPU
# over virtual GPUs. The real CUDA build is untouched. See docs/emulator.md.
#
# Other kernel sets add themselves with (e.g. from cmake/emu_internode.cmake, included
# below when present):
#   list(APPEND JAX_EP_EMU_KERNELS kernels/internode/foo.cu)       # .cu compiled as C++
#   list(APPEND JAX_EP_EMU_SOURCES xla_ffi/emu/emu_foo.cc)         # host/driver sources
option(JAX_EP_EMU "Build the emulated-GPU module _jax_ep_emu (kernel sources run on the CPU)" ON)
set(JAX_EP_EMU_SANITIZE "" CACHE STRING
    "Sanitizers for the emulated module only, e.g. address,undefined (make test-emu-asan)")

if(JAX_EP_EMU)
  set(JAX_EP_EMU_KERNELS
      kernels/cuda/layout_kernels.cu
      kernels/cuda/intranode_kernels.cu
      kernels/cuda/low_latency_kernels.cu)
  set(JAX_EP_EMU_SOURCES
      kernels/emu/emu_runtime.cc
      xla_ffi/cuda/cuda_state.cc
      xla_ffi/emu/emu_module.cc
      xla_ffi/emu/emu_setup.cc
      xla_ffi/emu/emu_intranode.cc
      xla_ffi/emu/emu_low_latency.cc)
  include("${CMAKE_CURRENT_LIST_DIR}/emu_internode.cmake" OPTIONAL)

  # A .cu file is compiled as C++ through a wrapper, so the same file keeps its CUDA
  # language in the real build; the wrapper includes the runtime first, as nvcc does.
  set(_emu_wrapped "")
  foreach(_cu IN LISTS JAX_EP_EMU_KERNELS)
    string(MAKE_C_IDENTIFIER "${_cu}" _id)
    set(_w "${CMAKE_CURRENT_BINARY_DIR}/emu_wrap/${_id}.cc")
    file(CONFIGURE OUTPUT "${_w}" CONTENT "#include \"kernels/emu/emu_cuda.h\"\n#include \"${_cu}\"\n")
    set_source_files_properties("${_w}" PROPERTIES OBJECT_DEPENDS "${CMAKE_CURRENT_SOURCE_DIR}/${_cu}")
    list(APPEND _emu_wrapped "${_w}")
  endforeach()

  nanobind_add_module(_jax_ep_emu NB_STATIC ${JAX_EP_EMU_SOURCES} ${_emu_wrapped})
  # The replacement CUDA headers come before anything else on the include path.
  target_include_directories(_jax_ep_emu BEFORE PRIVATE
                             "${CMAKE_CURRENT_SOURCE_DIR}/kernels/emu/include"
                             "${CMAKE_CURRENT_SOURCE_DIR}")
  target_include_directories(_jax_ep_emu SYSTEM PRIVATE "${XLA_FFI_INCLUDE_DIR}")
  target_compile_definitions(_jax_ep_emu PRIVATE JAX_EP_EMU=1)
  # Kernel code type-puns rows through uint4 as CUDA allows; float sums round per add like
  # the GPU's (no contraction), so results stay bit-exact with the reference.
  target_compile_options(_jax_ep_emu PRIVATE -fno-strict-aliasing -ffp-contract=off
                         -Wno-unknown-pragmas -Wno-unused-parameter -Wno-subobject-linkage)
  target_link_options(_jax_ep_emu PRIVATE
                      "-Wl,-T,${CMAKE_CURRENT_SOURCE_DIR}/kernels/emu/emu.ld")
  target_link_libraries(_jax_ep_emu PRIVATE Threads::Threads)
  if(JAX_EP_EMU_SANITIZE)
    target_compile_options(_jax_ep_emu PRIVATE -fsanitize=${JAX_EP_EMU_SANITIZE}
                           -fno-omit-frame-pointer -fno-sanitize-recover=all)
    target_link_options(_jax_ep_emu PRIVATE -fsanitize=${JAX_EP_EMU_SANITIZE})
  endif()
  install(TARGETS _jax_ep_emu LIBRARY DESTINATION jax_ep)
endif()
