// The nanobind module `jax_ep._jax_ep_ext`: registrations() maps FFI target names to
// handler capsules, per platform, and build_info() says what was compiled in.
#include <nanobind/nanobind.h>

#include "xla_ffi/cpu/cpu_handlers.h"
#include "xla_ffi/cpu/low_latency_handlers.h"
#include "xla_ffi/common/layout_bindings.h"
#include "xla_ffi/common/transport_bindings.h"
#include "xla_ffi/internode/low_latency_handlers.h"
#ifdef JAX_EP_WITH_CUDA
#include "xla_ffi/cuda/cuda_registrations.h"
#endif

namespace nb = nanobind;

namespace {
template <typename T>
nb::capsule Capsule(T* fn) {
  static_assert(std::is_invocable_r_v<XLA_FFI_Error*, T, XLA_FFI_CallFrame*>,
                "handler must be an XLA FFI handler");
  return nb::capsule(reinterpret_cast<void*>(fn));
}
}  // namespace

NB_MODULE(_jax_ep_ext, m) {
  jax_ep::AddTransportBindings(m);
  jax_ep::AddLayoutBindings(m);
  jax_ep::AddSettingsBindings(m);
  jax_ep::AddLowLatencyWireBindings(m);
#ifdef JAX_EP_WITH_CUDA
  jax_ep::DefineCudaBindings(m.ptr());
#endif
  m.def("registrations", []() {
    nb::dict cpu;
    cpu["jax_ep_layout"] = Capsule(jax_ep::LayoutCpuHandler);
    cpu["jax_ep_dispatch"] = Capsule(jax_ep::DispatchCpuHandler);
    cpu["jax_ep_combine"] = Capsule(jax_ep::CombineCpuHandler);
    cpu["jax_ep_gather"] = Capsule(jax_ep::GatherCpuHandler);
    // Low-latency mode (jax_ep.low_latency).
    cpu["jax_ep_ll_dispatch_send"] = Capsule(jax_ep::LowLatencyDispatchSendCpuHandler);
    cpu["jax_ep_ll_dispatch_recv"] = Capsule(jax_ep::LowLatencyDispatchRecvCpuHandler);
    cpu["jax_ep_ll_dispatch_send_fp8"] = Capsule(jax_ep::LowLatencyDispatchSendFp8CpuHandler);
    cpu["jax_ep_ll_dispatch_recv_fp8"] = Capsule(jax_ep::LowLatencyDispatchRecvFp8CpuHandler);
    cpu["jax_ep_ll_combine_send"] = Capsule(jax_ep::LowLatencyCombineSendCpuHandler);
    cpu["jax_ep_ll_combine_recv"] = Capsule(jax_ep::LowLatencyCombineRecvCpuHandler);
    nb::dict out;
    out["cpu"] = cpu;
#ifdef JAX_EP_WITH_CUDA
    nb::dict cuda;
    jax_ep::AddCudaRegistrations(
        [&](const char* name, void* fn) { cuda[name] = nb::capsule(fn); });
#ifdef JAX_EP_WITH_NVSHMEM
    jax_ep::AddInternodeRegistrations(
        [&](const char* name, void* fn) { cuda[name] = nb::capsule(fn); });
    jax_ep::AddInternodeLowLatencyRegistrations(
        [&](const char* name, void* fn) { cuda[name] = nb::capsule(fn); });
#endif
    out["CUDA"] = cuda;
#endif
    return out;
  });
  m.def("build_info", []() {
    nb::dict d;
    d["cpu"] = true;
#ifdef JAX_EP_WITH_CUDA
    d["cuda"] = true;
    d["cuda_archs"] = nb::str(JAX_EP_CUDA_ARCHS);
#else
    d["cuda"] = false;
    d["cuda_archs"] = nb::str("");
#endif
#ifdef JAX_EP_WITH_NVSHMEM
    d["nvshmem"] = true;
#else
    d["nvshmem"] = false;
#endif
    return d;
  });
}
