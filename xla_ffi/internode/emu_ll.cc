// The internode low-latency mode's FFI handlers on the emulated GPU (see emu_direct.cc):
// ops internode_ll_init (the area's start, per virtual GPU) and the targets of
// JEP_INTERNODE_LL_TARGETS without "jax_ep_", run through the handlers' own bodies.
#include "xla_ffi/internode/low_latency_handlers.cc"  // NOLINT(build/include): the handlers
#include "xla_ffi/emu/emu_call.h"

namespace jax_ep {
namespace emu_internode_ll {
namespace {
namespace ffi = xla::ffi;
using emu_driver::CallArgs;

JEP_EMU_TARGETS_RUNNER(RunTargets, JEP_INTERNODE_LL_TARGETS)

std::string Invoke(const CallArgs& a, bool* known) {
  *known = true;
  const auto at = [&](const char* k) { return a.attr(k); };
  if (a.op == "internode_ll_init")
    return ll_internode::Init(static_cast<int>(at("num_ranks")), static_cast<int>(at("max_tokens")),
                              at("row_bytes"), static_cast<int>(at("topk")),
                              static_cast<int>(at("num_experts")));
  // this rank's recorded error in whichever mode's wording recorded it (the low-latency
  // decoder hands other modes' records on to theirs)
  if (a.op == "internode_ll_error") return ll_internode::PendingError();
  return RunTargets(a, a.op, known);  // internode_ll_{dispatch,combine}_{send,recv}{,_fp8}
}

emu_driver::RegisterInvoker g_register(Invoke);

}  // namespace
}  // namespace emu_internode_ll
}  // namespace jax_ep
