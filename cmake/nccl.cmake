# NCCL GIN transport: the host side (kernels/internode/nccl_host.cc) and its
# bindings, built into the internode module _jax_ep_nvshmem against the headers of the
# nvidia-nccl-cu13 wheel (the `cuda` extra). Included by cmake/cuda.cmake after
# nvshmem.cmake. Only headers are used: libnccl.so.2 is resolved with dlsym at run time,
# so nothing here links it and the module loads where NCCL is absent.
# Sets JAX_EP_HAVE_NCCL and JAX_EP_NCCL_VERSION_CODE (the headers' NCCL_VERSION_CODE).
set(JAX_EP_NCCL "AUTO" CACHE STRING "Build the NCCL GIN transport's host side: AUTO, ON or OFF")
set_property(CACHE JAX_EP_NCCL PROPERTY STRINGS AUTO ON OFF)
set(JAX_EP_NCCL_ROOT "$ENV{JAX_EP_NCCL_ROOT}" CACHE PATH
    "NCCL install (include/, lib/); default: the nvidia.nccl Python package")
set(JAX_EP_HAVE_NCCL OFF)
set(JAX_EP_NCCL_VERSION_CODE 0)

function(_jax_ep_nccl_off reason)
  if(JAX_EP_NCCL STREQUAL "ON")
    message(FATAL_ERROR "jax_ep: -DJAX_EP_NCCL=ON but ${reason}")
  endif()
  message(STATUS "jax_ep: NCCL GIN transport OFF -- ${reason}")
endfunction()

if(JAX_EP_NCCL STREQUAL "OFF")
  message(STATUS "jax_ep: NCCL GIN transport OFF -- disabled with -DJAX_EP_NCCL=OFF")
  return()
endif()
if(NOT JAX_EP_HAVE_NVSHMEM)
  _jax_ep_nccl_off("the internode module _jax_ep_nvshmem is not built (NVSHMEM is OFF)")
  return()
endif()

set(_nccl_root "${JAX_EP_NCCL_ROOT}")
if(NOT _nccl_root)
  # nvidia.nccl is a namespace package in the wheel (no __init__.py, no __file__).
  execute_process(
    COMMAND "${Python_EXECUTABLE}" -c
            "import nvidia.nccl as m, os; print(os.path.dirname(m.__file__) if getattr(m, '__file__', None) else list(m.__path__)[0])"
    OUTPUT_VARIABLE _nccl_root OUTPUT_STRIP_TRAILING_WHITESPACE
    RESULT_VARIABLE _nccl_rc ERROR_QUIET)
  if(NOT _nccl_rc EQUAL 0)
    set(_nccl_root "")
  endif()
endif()
if(NOT _nccl_root)
  _jax_ep_nccl_off("the nvidia-nccl-cu13 package is not installed (pip install 'nvidia-nccl-cu13>=2.30' or '.[cuda]')")
  return()
endif()

set(_nccl_inc "${_nccl_root}/include")
foreach(_f "${_nccl_inc}/nccl.h" "${_nccl_inc}/nccl_device.h" "${_nccl_inc}/nccl_device/host.h")
  if(NOT EXISTS "${_f}")
    _jax_ep_nccl_off("${_f} is missing")
    return()
  endif()
endforeach()
file(STRINGS "${_nccl_inc}/nccl.h" _nccl_code_line REGEX "^#define NCCL_VERSION_CODE [0-9]+")
string(REGEX MATCH "[0-9]+$" _nccl_code "${_nccl_code_line}")
if(NOT _nccl_code OR _nccl_code LESS 23000)
  _jax_ep_nccl_off("${_nccl_inc}/nccl.h is NCCL_VERSION_CODE '${_nccl_code}'; 2.30 (23000) or newer needed (pip install -U 'nvidia-nccl-cu13>=2.30')")
  return()
endif()

# Compiled by nvcc (it defines the device global transport::g_nccl_gin) as relocatable
# device code with the internode kernels; the emulated build compiles it through its own
# wrapper (cmake/emu_internode.cmake), so this property does not reach it.
set_source_files_properties(kernels/internode/nccl_host.cc PROPERTIES LANGUAGE CUDA)
target_sources(jax_ep_internode PRIVATE kernels/internode/nccl_host.cc)
target_include_directories(jax_ep_internode SYSTEM PRIVATE "${_nccl_inc}")
target_compile_definitions(jax_ep_internode PRIVATE JAX_EP_WITH_NCCL=1)
target_link_libraries(jax_ep_internode PUBLIC ${CMAKE_DL_LIBS})

target_sources(_jax_ep_nvshmem PRIVATE
               "${CMAKE_CURRENT_SOURCE_DIR}/xla_ffi/internode/nccl_bindings.cc")
target_compile_definitions(_jax_ep_nvshmem PRIVATE JAX_EP_WITH_NCCL=1)
# dlopen("libnccl.so.2") searches the calling module's RUNPATH: the wheel's lib/ beside the
# installed package, and the one found here for builds run in place.
set_property(TARGET _jax_ep_nvshmem APPEND PROPERTY INSTALL_RPATH "$ORIGIN/../nvidia/nccl/lib")
if(JAX_EP_NCCL_ROOT)
  set_property(TARGET _jax_ep_nvshmem APPEND PROPERTY INSTALL_RPATH "${_nccl_root}/lib")
endif()
set_property(TARGET _jax_ep_nvshmem APPEND PROPERTY BUILD_RPATH "${_nccl_root}/lib")

set(JAX_EP_HAVE_NCCL ON)
set(JAX_EP_NCCL_VERSION_CODE ${_nccl_code})
message(STATUS "jax_ep: NCCL GIN transport ON (headers ${_nccl_root}, NCCL_VERSION_CODE ${_nccl_code}; libnccl.so.2 resolved at run time)")
