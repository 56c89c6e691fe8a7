// The nanobind module `jax_ep._jax_ep_nvshmem`: everything that needs NVSHMEM's host
// library (libnvshmem_host.so.3): the bootstrap's runtime calls, the internode
// low-latency area and the internode FFI handlers. It is a module of its own so that
// `_jax_ep_ext` has no NEEDED libnvshmem_host and `import jax_ep` works where NVSHMEM is
// not installed; jax_ep/_src/ext.py loads it when the internode backend is first used.
#include <nanobind/nanobind.h>

#include "xla_ffi/common/layout_bindings.h"
#include "xla_ffi/common/transport_bindings.h"
#include "xla_ffi/cuda/cuda_registrations.h"
#include "xla_ffi/internode/low_latency_handlers.h"

namespace nb = nanobind;

NB_MODULE(_jax_ep_nvshmem, m) {
  jax_ep::AddNvshmemBindings(m);
#ifdef JAX_EP_WITH_NCCL
  jax_ep::AddNcclBindings(m);  // the NCCL GIN transport's runtime (libnccl by dlopen)
#endif
  jax_ep::AddSettingsBindings(m);  // this module's own copy of the settings
  // The wire helpers again, with the low-latency area's start and stop (NVSHMEM only).
  jax_ep::AddLowLatencyWireBindings(m);
  m.def("registrations", []() {
    nb::dict cuda;
    const jax_ep::RegisterFn add = [&](const char* name, void* fn) {
      cuda[name] = nb::capsule(fn);
    };
    jax_ep::AddInternodeRegistrations(add);
    jax_ep::AddInternodeLowLatencyRegistrations(add);
    nb::dict out;
    out["CUDA"] = cuda;
    return out;
  });
}
