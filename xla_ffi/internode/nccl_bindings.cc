// The NCCL GIN transport's host runtime for Python (kernels/internode/nccl_host.h): built
// into _jax_ep_nvshmem when the NCCL headers are found (cmake/nccl.cmake). Loading the
// module never loads NCCL; the first call here does (dlopen of libnccl.so.2).
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/internode/internode_kernels.h"
#include "kernels/internode/nccl_host.h"
#include "xla_ffi/common/transport_bindings.h"

namespace nb = nanobind;

namespace jax_ep {

void AddNcclBindings(nb::module_& m) {
  m.def("nccl_available", []() {
    std::string why;
    const bool ok = nccl_host::Available(&why);
    return std::make_tuple(ok, why);
  }, "(ok, why): libnccl.so.2 found and new enough; why names what to install.");
  m.def("nccl_version", []() { return nccl_host::VersionString(); },
        "The loaded libnccl's version ('2.32.6'), or '' when unavailable.");
  m.def("nccl_header_version", []() { return nccl_host::HeaderVersion(); },
        "NCCL_VERSION_CODE of the headers this module was compiled with.");
  m.def("nccl_unique_id", []() {
    std::string id;
    ThrowIfError(nccl_host::UniqueId(&id));
    return nb::bytes(id.data(), id.size());
  });
  // Collective and unbounded: the GIL is released while NCCL waits for the peers.
  m.def("nccl_start", [](const std::vector<int>& ordinals, const std::vector<int>& ranks,
                         int world, nb::bytes uid, size_t heap_bytes, int num_contexts,
                         int gpus_per_node, const std::vector<int64_t>& low_latency) {
    const std::string id(uid.c_str(), uid.size());
    std::string err;
    {
      nb::gil_scoped_release unlocked;
      // the communicators, then each GPU's internode runtime on its window
      err = internode::StartOverNccl(ordinals, ranks, world, id, heap_bytes, num_contexts,
                                     gpus_per_node, low_latency);
    }
    ThrowIfError(err);
  }, nb::arg("ordinals"), nb::arg("ranks"), nb::arg("world"), nb::arg("uid"),
     nb::arg("heap_bytes"), nb::arg("num_contexts"), nb::arg("gpus_per_node"),
     nb::arg("low_latency") = std::vector<int64_t>{},
     "Starts NCCL on these GPUs and the internode runtime on each; low_latency: "
     "[max_tokens, row_bytes, topk, num_experts] to hold the low-latency area too.");
  m.def("nccl_finish", [](const std::vector<int>& ordinals) {
    std::string err;
    {
      nb::gil_scoped_release unlocked;
      err = internode::FinishOverNccl(ordinals);
    }
    ThrowIfError(err);
  }, nb::arg("ordinals"));
  m.def("nccl_started", []() { return nccl_host::Started(); },
        "Started() on the current CUDA device.");
  m.def("nccl_rank", []() { return nccl_host::Rank(); }, "The current device's world rank.");
  m.def("nccl_world", []() { return nccl_host::World(); }, "The NCCL world's size.");
  m.def("nccl_info", []() {
    nb::dict d;
    d["started"] = nccl_host::Started();
    d["rank"] = nccl_host::Rank();
    d["world"] = nccl_host::World();
    d["heap_bytes"] = nccl_host::HeapBytes();
    d["num_contexts"] = nccl_host::NumContexts();
    d["version"] = nccl_host::VersionString();
    d["header_version"] = nccl_host::HeaderVersion();
    return d;
  }, "The current CUDA device's NCCL GIN transport state.");
}

}  // namespace jax_ep
