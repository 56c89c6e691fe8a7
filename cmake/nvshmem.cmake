# NVSHMEM (internode transport), from the nvidia-nvshmem-cu13 wheel (the `cuda` extra).
# Included by cmake/cuda.cmake once the CUDA backend is on. The wheel has no CMake
# config, so its headers and libraries are declared here as imported targets.
# Sets JAX_EP_HAVE_NVSHMEM and builds the internode library into its own module,
# _jax_ep_nvshmem (the only one that needs libnvshmem_host.so.3).
set(JAX_EP_NVSHMEM "AUTO" CACHE STRING "Build the NVSHMEM internode backend: AUTO, ON or OFF")
set_property(CACHE JAX_EP_NVSHMEM PROPERTY STRINGS AUTO ON OFF)
set(JAX_EP_NVSHMEM_ROOT "$ENV{JAX_EP_NVSHMEM_ROOT}" CACHE PATH
    "NVSHMEM install (include/, lib/); default: the nvidia.nvshmem Python package")
set(JAX_EP_HAVE_NVSHMEM OFF)

function(_jax_ep_nvshmem_off reason)
  if(JAX_EP_NVSHMEM STREQUAL "ON")
    message(FATAL_ERROR "jax_ep: -DJAX_EP_NVSHMEM=ON but ${reason}")
  endif()
  message(STATUS "jax_ep: NVSHMEM internode backend OFF -- ${reason}")
endfunction()

if(JAX_EP_NVSHMEM STREQUAL "OFF")
  message(STATUS "jax_ep: NVSHMEM internode backend OFF -- disabled with -DJAX_EP_NVSHMEM=OFF")
  return()
endif()

set(_nvshmem_root "${JAX_EP_NVSHMEM_ROOT}")
if(NOT _nvshmem_root)
  execute_process(
    COMMAND "${Python_EXECUTABLE}" -c
            "import nvidia.nvshmem as m, os; print(os.path.dirname(m.__file__) if getattr(m, '__file__', None) else list(m.__path__)[0])"
    OUTPUT_VARIABLE _nvshmem_root OUTPUT_STRIP_TRAILING_WHITESPACE
    RESULT_VARIABLE _nvshmem_rc ERROR_QUIET)
  if(NOT _nvshmem_rc EQUAL 0)
    set(_nvshmem_root "")
  endif()
endif()
if(NOT _nvshmem_root)
  _jax_ep_nvshmem_off("the nvidia-nvshmem-cu13 package is not installed (pip install '.[cuda]')")
  return()
endif()

set(_nvshmem_inc "${_nvshmem_root}/include")
set(_nvshmem_lib "${_nvshmem_root}/lib")
foreach(_f "${_nvshmem_inc}/nvshmem.h" "${_nvshmem_lib}/libnvshmem_host.so.3"
           "${_nvshmem_lib}/libnvshmem_device.a")
  if(NOT EXISTS "${_f}")
    _jax_ep_nvshmem_off("${_f} is missing")
    return()
  endif()
endforeach()

# Host library: the wheel ships only the versioned name.
add_library(jax_ep_nvshmem_host SHARED IMPORTED)
set_target_properties(jax_ep_nvshmem_host PROPERTIES
  IMPORTED_LOCATION "${_nvshmem_lib}/libnvshmem_host.so.3"
  IMPORTED_SONAME "libnvshmem_host.so.3"
  INTERFACE_INCLUDE_DIRECTORIES "${_nvshmem_inc}")
# Device library: relocatable device code, resolved by the device link below.
add_library(jax_ep_nvshmem_device STATIC IMPORTED)
set_target_properties(jax_ep_nvshmem_device PROPERTIES
  IMPORTED_LOCATION "${_nvshmem_lib}/libnvshmem_device.a"
  INTERFACE_INCLUDE_DIRECTORIES "${_nvshmem_inc}")

# The internode kernels (relocatable device code), their host side (kernels/internode/
# *_host.cu: NVSHMEM start-up, call checks, error text) and their FFI handlers. The device
# link (against libnvshmem_device.a) happens when this static library is built, so the
# extension links it like any host library.
add_library(jax_ep_internode STATIC kernels/internode/nvshmem_host.cu
            kernels/internode/transport_dispatch.cu
            kernels/internode/internode_kernels.cu
            kernels/internode/hierarchical_host.cu
            kernels/internode/hierarchical_kernels.cu
            xla_ffi/internode/internode_handlers.cc
            xla_ffi/internode/hierarchical_handlers.cc)
set_target_properties(jax_ep_internode PROPERTIES
  CUDA_SEPARABLE_COMPILATION ON
  CUDA_RESOLVE_DEVICE_SYMBOLS ON
  POSITION_INDEPENDENT_CODE ON)
target_include_directories(jax_ep_internode PUBLIC "${CMAKE_CURRENT_SOURCE_DIR}")
target_include_directories(jax_ep_internode SYSTEM PUBLIC "${XLA_FFI_INCLUDE_DIR}")
target_include_directories(jax_ep_internode SYSTEM PRIVATE "${_nvshmem_inc}")
# sm_90 only: the NVSHMEM device library is built for it; no Hopper-only instructions here.
target_compile_options(jax_ep_internode PRIVATE
  $<$<COMPILE_LANGUAGE:CUDA>:-gencode=arch=compute_90,code=sm_90 -Werror=all-warnings -Xcompiler=-Wall,-Wextra,-Werror,-Wno-unused-parameter>
  $<$<COMPILE_LANGUAGE:CXX>:${JAX_EP_WARNINGS}>)
target_link_options(jax_ep_internode PRIVATE
  $<DEVICE_LINK:-arch=sm_90>)
target_link_libraries(jax_ep_internode PUBLIC
  jax_ep_nvshmem_device jax_ep_nvshmem_host CUDA::cudart_static ${CMAKE_DL_LIBS})

set(JAX_EP_HAVE_NVSHMEM ON)
# Everything that needs libnvshmem_host.so.3 goes into a second module, _jax_ep_nvshmem,
# which jax_ep/_src/ext.py loads when the internode backend is first used: _jax_ep_ext keeps
# no NEEDED libnvshmem_host, so `import jax_ep` works where NVSHMEM is not installed.
nanobind_add_module(_jax_ep_nvshmem NB_STATIC
                    "${CMAKE_CURRENT_SOURCE_DIR}/xla_ffi/internode/nvshmem_module.cc"
                    "${CMAKE_CURRENT_SOURCE_DIR}/xla_ffi/internode/nvshmem_bindings.cc"
                    "${CMAKE_CURRENT_SOURCE_DIR}/xla_ffi/common/settings_bindings.cc"
                    "${CMAKE_CURRENT_SOURCE_DIR}/xla_ffi/internode/low_latency_bindings.cc")
target_include_directories(_jax_ep_nvshmem PRIVATE "${CMAKE_CURRENT_SOURCE_DIR}")
target_include_directories(_jax_ep_nvshmem SYSTEM PRIVATE "${XLA_FFI_INCLUDE_DIR}")
target_compile_options(_jax_ep_nvshmem PRIVATE ${JAX_EP_WARNINGS})
target_compile_definitions(_jax_ep_nvshmem PRIVATE JAX_EP_WITH_CUDA JAX_EP_WITH_NVSHMEM)
target_link_libraries(_jax_ep_nvshmem PRIVATE jax_ep_internode)
# RUNPATH relative to the installed package: site-packages/jax_ep/ -> site-packages/
# nvidia/nvshmem/lib, where the nvidia-nvshmem-cu13 wheel puts libnvshmem_host.so.3. An
# NVSHMEM given by JAX_EP_NVSHMEM_ROOT (not the wheel) is found where it was at build time.
set_property(TARGET _jax_ep_nvshmem PROPERTY INSTALL_RPATH "$ORIGIN/../nvidia/nvshmem/lib")
if(JAX_EP_NVSHMEM_ROOT)
  set_property(TARGET _jax_ep_nvshmem APPEND PROPERTY INSTALL_RPATH "${_nvshmem_lib}")
endif()
set_property(TARGET _jax_ep_nvshmem APPEND PROPERTY BUILD_RPATH "${_nvshmem_lib}")
# The static NVSHMEM device library (and the internode library around it) must not
# export its symbols from the module: jaxlib's Mosaic GPU links the same library,
# and two default-visibility copies in one process would interpose on each other.
target_link_options(_jax_ep_nvshmem PRIVATE
  "LINKER:--exclude-libs,libnvshmem_device.a:libjax_ep_internode.a")
install(TARGETS _jax_ep_nvshmem LIBRARY DESTINATION jax_ep)
message(STATUS "jax_ep: NVSHMEM internode backend ON (${_nvshmem_root}), module _jax_ep_nvshmem")
