// NVSHMEM runtime for jax_ep.nvshmem_bootstrap (builds with NVSHMEM only).
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <stdexcept>
#include <string>

#include "kernels/internode/internode_kernels.h"
#include "xla_ffi/common/transport_bindings.h"

namespace nb = nanobind;

namespace jax_ep {
namespace {
void Check(const std::string& err) {
  if (!err.empty()) throw std::runtime_error(err);
}
}  // namespace

void AddNvshmemBindings(nb::module_& m) {
  m.def("nvshmem_unique_id", []() {
    std::string id;
    Check(internode::UniqueId(&id));
    return nb::bytes(id.data(), id.size());
  });
  m.def("nvshmem_init", [](int rank, int world, nb::bytes uid, size_t heap_bytes, int num_qps) {
    Check(internode::Init(rank, world, std::string(uid.c_str(), uid.size()), heap_bytes,
                          num_qps));
  });
  m.def("nvshmem_finalize", []() { Check(internode::Finalize()); });
  m.def("nvshmem_info", []() {
    nb::dict d;
    d["initialized"] = internode::Initialized();
    d["heap_bytes"] = internode::HeapBytes();
    d["version"] = internode::Version();
    return d;
  });
  m.def("nvshmem_self_put_check", []() {
    bool ok = false;
    Check(internode::SelfPutCheck(&ok));
    return ok;
  });
}

}  // namespace jax_ep
