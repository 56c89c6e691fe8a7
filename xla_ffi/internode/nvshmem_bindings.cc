// NVSHMEM runtime for jax_ep.nvshmem_bootstrap (builds with NVSHMEM only).
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <stdexcept>
#include <string>

#include "kernels/internode/internode_kernels.h"
#include "xla_ffi/common/transport_bindings.h"

namespace nb = nanobind;

namespace jax_ep {

void AddNvshmemBindings(nb::module_& m) {
  m.def("nvshmem_unique_id", []() {
    std::string id;
    ThrowIfError(internode::UniqueId(&id));
    return nb::bytes(id.data(), id.size());
  });
  // Collective and unbounded: the GIL is released while NVSHMEM waits for the peers, so
  // the bootstrap's watchdog thread can report a stuck start.
  m.def("nvshmem_init", [](int rank, int world, nb::bytes uid, size_t heap_bytes, int num_qps,
                           bool use_qp_api, bool adopt) {
    const std::string id(uid.c_str(), uid.size());
    std::string err;
    {
      nb::gil_scoped_release unlocked;
      err = internode::Init(rank, world, id, heap_bytes, num_qps, use_qp_api, adopt);
    }
    ThrowIfError(err);
  });
  m.def("nvshmem_finalize", []() {
    std::string err;
    {
      nb::gil_scoped_release unlocked;
      err = internode::Finalize();
    }
    ThrowIfError(err);
  });
  m.def("nvshmem_qp_api_available", []() { return internode::QpApiAvailable(); });
  m.def("nvshmem_init_status", []() { return internode::InitStatus(); });
  m.def("internode_error", []() { return internode::PendingError(); });
  m.def("nvshmem_info", []() {
    nb::dict d;
    const internode::TransportInfo t = internode::TransportState();
    d["initialized"] = internode::Initialized();
    d["adopted"] = t.adopted;
    d["heap_bytes"] = internode::HeapBytes();
    d["version"] = internode::Version();
    d["runtime_version"] = internode::RuntimeVersion();
    d["qp_api_available"] = internode::QpApiAvailable();
    d["qp_path"] = t.qp_path;
    d["num_qps"] = t.num_qps;
    d["qp_handles"] = t.handles;
    return d;
  });
  m.def("nvshmem_set_qp_order", [](const std::vector<int>& order) {
    ThrowIfError(internode::SetQpOrder(order));
  });
  m.def("nvshmem_self_put_check", []() {
    bool ok = false;
    ThrowIfError(internode::SelfPutCheck(&ok));
    return ok;
  });
}

}  // namespace jax_ep
