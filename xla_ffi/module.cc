// The nanobind module `jax_ep._jax_ep_ext`: registrations() maps FFI target names to
// handler capsules, per platform; ffi_signatures() describes every target of the tables in
// xla_ffi/common/op_tables.h (built here or not); build_info() says what was compiled in.
#include <nanobind/nanobind.h>

#include <cctype>
#include <string>

#include "xla_ffi/cpu/cpu_handlers.h"
#include "xla_ffi/cpu/low_latency_handlers.h"
#include "xla_ffi/common/ffi_table.h"
#include "xla_ffi/common/layout_bindings.h"
#include "xla_ffi/common/transport_bindings.h"
#include "xla_ffi/internode/low_latency_handlers.h"
#ifdef JAX_EP_WITH_CUDA
#include "xla_ffi/cuda/cuda_registrations.h"
#endif

namespace nb = nanobind;

namespace {
std::string Lower(const char* s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

// A target's signature for Python: operand, result and attribute names in the handler's
// order, their types (lower case: any, s32, f32, pred; i64, i64s), the variadic operand
// (or None), the traits.
template <typename Sig>
nb::dict Describe(const char* trait) {
  nb::list operands, operand_types, results, result_types, attrs;
  nb::object variadic = nb::none();
  Sig::Describe([&](const char* kind, const char* name, const char* type) {
    const std::string k = kind;
    if (k == "ARG") {
      operands.append(nb::str(name));
      operand_types.append(nb::str(Lower(type).c_str()));
    } else if (k == "REST") {
      variadic = nb::str(name);
    } else if (k == "RET") {
      results.append(nb::str(name));
      result_types.append(nb::str(Lower(type).c_str()));
    } else {  // ATTR, OPT_ATTR: (name, type, required)
      attrs.append(nb::make_tuple(nb::str(name), nb::str(Lower(type).c_str()), k == "ATTR"));
    }
  });
  nb::dict d;
  d["signature"] = nb::str(Sig::kName);
  d["operands"] = nb::tuple(operands);
  d["operand_types"] = nb::tuple(operand_types);
  d["variadic"] = variadic;
  d["results"] = nb::tuple(results);
  d["result_types"] = nb::tuple(result_types);
  d["attrs"] = nb::tuple(attrs);
  nb::list traits;
  if (*trait) traits.append(nb::str(trait));
  d["traits"] = nb::tuple(traits);
  return d;
}

#define JEP_DESCRIBE_TARGET(target, Sig, Symbol, Impl, CTX, TRAITS) \
  d[target] = Describe<jax_ep::sig::Sig>(JEP_FFI_TRAIT_NAME_##TRAITS);

nb::dict CpuSignatures() {
  nb::dict d;
  JEP_CPU_TARGETS(JEP_DESCRIBE_TARGET)
  JEP_CPU_LL_TARGETS(JEP_DESCRIBE_TARGET)
  return d;
}

nb::dict CudaSignatures() {
  nb::dict d;
  JEP_CUDA_TARGETS(JEP_DESCRIBE_TARGET)
  JEP_CUDA_LL_TARGETS(JEP_DESCRIBE_TARGET)
  JEP_INTERNODE_TARGETS(JEP_DESCRIBE_TARGET)
  JEP_INTERNODE_HIER_TARGETS(JEP_DESCRIBE_TARGET)
  JEP_INTERNODE_LL_TARGETS(JEP_DESCRIBE_TARGET)
  return d;
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
    const auto add = [&](const char* name, void* fn) { cpu[name] = nb::capsule(fn); };
    JEP_CPU_TARGETS(JEP_FFI_ADD_TARGET)
    JEP_CPU_LL_TARGETS(JEP_FFI_ADD_TARGET)
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
  m.def(
      "ffi_signatures",
      []() {
        nb::dict out;
        out["cpu"] = CpuSignatures();
        out["CUDA"] = CudaSignatures();
        return out;
      },
      "Per platform ('cpu', 'CUDA'), per FFI target of xla_ffi/common/op_tables.h (built "
      "here or not): {'signature', 'operands', 'operand_types', 'variadic', 'results', "
      "'result_types', 'attrs': ((name, type, required), ...), 'traits'}.");
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
    // Built with NCCL's headers (the NCCL GIN transport's host side, in _jax_ep_nvshmem),
    // and their NCCL_VERSION_CODE; libnccl itself is found at run time.
#ifdef JAX_EP_WITH_NCCL
    d["nccl"] = true;
    d["nccl_version"] = JAX_EP_NCCL_VERSION_CODE;
#else
    d["nccl"] = false;
    d["nccl_version"] = 0;
#endif
    return d;
  });
}
