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
      kernels/emu/emu_fibers.cc
      kernels/emu/emu_scheduler.cc
      kernels/emu/emu_memory.cc
      kernels/emu/emu_tma.cc
      kernels/emu/emu_counters.cc
      kernels/emu/emu_cuda_api.cc
      xla_ffi/cuda/cuda_state.cc
      xla_ffi/emu/emu_module.cc
      xla_ffi/common/settings_bindings.cc
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

  # Co-residency: registers and static shared memory per kernel, from `nvcc -Xptxas -v` on
  # the kernel files present at build time (one fragment per file, so an edit re-measures
  # only its file) when nvcc exists; else the checked-in kernels/emu/occupancy_table.inc.
  # -DJAX_EP_EMU_OCCUPANCY=table always takes the checked-in one (faster scratch builds).
  set(JAX_EP_EMU_OCCUPANCY "auto" CACHE STRING
      "Occupancy table of the emulated GPU: auto (nvcc when found), nvcc, or table")
  find_program(JAX_EP_EMU_NVCC nvcc HINTS /usr/local/cuda/bin)
  set(_occ_table "${CMAKE_CURRENT_SOURCE_DIR}/kernels/emu/occupancy_table.inc")
  if(JAX_EP_EMU_NVCC AND NOT JAX_EP_EMU_OCCUPANCY STREQUAL "table")
    set(_occ_gen "${CMAKE_CURRENT_SOURCE_DIR}/scripts/gen_emu_occupancy.py")
    file(GLOB _occ_cu RELATIVE "${CMAKE_CURRENT_SOURCE_DIR}" CONFIGURE_DEPENDS
         kernels/cuda/*.cu kernels/internode/*.cu)
    file(GLOB _occ_headers CONFIGURE_DEPENDS kernels/common/*.h kernels/cuda/*.cuh
         kernels/cuda/*.h kernels/internode/*.cuh kernels/internode/*.h)
    set(_occ_frags "")
    foreach(_cu IN LISTS _occ_cu)
      string(MAKE_C_IDENTIFIER "${_cu}" _id)
      set(_frag "${CMAKE_CURRENT_BINARY_DIR}/emu_occupancy/${_id}.txt")
      add_custom_command(OUTPUT "${_frag}"
        COMMAND "${Python_EXECUTABLE}" "${_occ_gen}" --nvcc "${JAX_EP_EMU_NVCC}"
                --source "${_cu}" --out "${_frag}"
        DEPENDS "${CMAKE_CURRENT_SOURCE_DIR}/${_cu}" ${_occ_headers} "${_occ_gen}"
        COMMENT "ptxas usage of ${_cu} (emulated GPU occupancy)" VERBATIM)
      list(APPEND _occ_frags "${_frag}")
    endforeach()
    set(_occ_table "${CMAKE_CURRENT_BINARY_DIR}/emu_occupancy/occupancy_table.inc")
    add_custom_command(OUTPUT "${_occ_table}"
      COMMAND "${Python_EXECUTABLE}" "${_occ_gen}" --nvcc "${JAX_EP_EMU_NVCC}"
              --merge ${_occ_frags} --out "${_occ_table}"
      DEPENDS ${_occ_frags} "${_occ_gen}" VERBATIM)
    target_sources(_jax_ep_emu PRIVATE "${_occ_table}")
  elseif(JAX_EP_EMU_OCCUPANCY STREQUAL "nvcc")
    message(FATAL_ERROR "jax_ep: -DJAX_EP_EMU_OCCUPANCY=nvcc but nvcc was not found")
  endif()
  target_compile_definitions(_jax_ep_emu PRIVATE JEP_EMU_OCCUPANCY_TABLE="${_occ_table}")
  set_source_files_properties("${CMAKE_CURRENT_SOURCE_DIR}/kernels/emu/emu_scheduler.cc"
                              PROPERTIES OBJECT_DEPENDS "${_occ_table}")
  # The replacement CUDA headers come before anything else on the include path.
  target_include_directories(_jax_ep_emu BEFORE PRIVATE
                             "${CMAKE_CURRENT_SOURCE_DIR}/kernels/emu/include"
                             "${CMAKE_CURRENT_SOURCE_DIR}")
  target_include_directories(_jax_ep_emu SYSTEM PRIVATE "${XLA_FFI_INCLUDE_DIR}")
  target_compile_definitions(_jax_ep_emu PRIVATE JAX_EP_EMU=1)
  if(JAX_EP_EMU_WITH_NCCL)  # cmake/emu_internode.cmake: the NCCL GIN transport too
    target_compile_definitions(_jax_ep_emu PRIVATE JAX_EP_WITH_NCCL=1)
  endif()
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
