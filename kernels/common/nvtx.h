// NVTX ranges for the host side of the CUDA launchers, so Nsight Systems shows each EP
// call (and its phases) on the CPU timeline, under the domain "jax_ep", next to XLA's own
// ranges for the custom call. Host-only header.
//
//   #include "kernels/common/nvtx.h"
//   JEP_NVTX_RANGE("jax_ep.dispatch");           // until the end of the enclosing scope
//   JEP_NVTX_RANGE("jax_ep.dispatch/notify");    // nested phases nest on the timeline
//
// Compiled in when the NVTX v3 headers (header-only, shipped with the CUDA toolkit as
// <nvtx3/nvToolsExt.h>) are on the include path, compiled out otherwise or with
// -DJAX_EP_NO_NVTX. Compiled in, a range costs two calls through NVTX's function table;
// with no profiler attached they return at once (NVTX loads a tool only when one is
// injected, e.g. by `nsys profile`). JEP_NVTX_ENABLED says which way it was built.
// The name must be a string that outlives the range (a literal).
#pragma once

#if !defined(JAX_EP_NO_NVTX) && defined(__has_include)
#if __has_include(<nvtx3/nvToolsExt.h>)
#include <nvtx3/nvToolsExt.h>
#define JEP_NVTX_ENABLED 1
#endif
#endif

#ifndef JEP_NVTX_ENABLED
#define JEP_NVTX_ENABLED 0
#endif

#define JEP_NVTX_CONCAT_INNER(a, b) a##b
#define JEP_NVTX_CONCAT(a, b) JEP_NVTX_CONCAT_INNER(a, b)

#if JEP_NVTX_ENABLED

namespace jax_ep {

// One NVTX domain for the library, created on first use (thread-safe static init).
inline nvtxDomainHandle_t NvtxDomain() {
  static const nvtxDomainHandle_t domain = nvtxDomainCreateA("jax_ep");
  return domain;
}

// Pushes a range on construction and pops it on destruction (also on early returns and
// error paths, so ranges stay balanced).
class NvtxRange {
 public:
  explicit NvtxRange(const char* name) {
    nvtxEventAttributes_t attr = {};
    attr.version = NVTX_VERSION;
    attr.size = NVTX_EVENT_ATTRIB_STRUCT_SIZE;
    attr.messageType = NVTX_MESSAGE_TYPE_ASCII;
    attr.message.ascii = name;
    nvtxDomainRangePushEx(NvtxDomain(), &attr);
  }
  ~NvtxRange() { nvtxDomainRangePop(NvtxDomain()); }
  NvtxRange(const NvtxRange&) = delete;
  NvtxRange& operator=(const NvtxRange&) = delete;
};

}  // namespace jax_ep

#define JEP_NVTX_RANGE(name) \
  ::jax_ep::NvtxRange JEP_NVTX_CONCAT(jep_nvtx_range_, __LINE__)(name)

#else

// Compiled out: evaluates nothing (the name is not even read).
#define JEP_NVTX_RANGE(name) static_cast<void>(0)

#endif
