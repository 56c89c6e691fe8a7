// The hierarchical internode mode's FFI handlers on the emulated GPU (see emu_direct.cc):
// ops internode_hier_{dispatch,combine,gather} (JEP_INTERNODE_HIER_TARGETS). Compiled a
// second time with small rings (emu_hier_small_rings.cc), ops internode_hier_small_*.
#ifndef JEP_EMU_HIER_OP
#define JEP_EMU_HIER_OP(name) "internode_hier_" name
#endif
#include "xla_ffi/internode/hierarchical_handlers.cc"  // NOLINT(build/include): the handlers
#include "xla_ffi/emu/emu_call.h"

namespace jax_ep {
namespace emu_internode_hier {
namespace {
using emu_driver::CallArgs;

JEP_EMU_TARGETS_RUNNER(RunTargets, JEP_INTERNODE_HIER_TARGETS)

std::string Invoke(const CallArgs& a, bool* known) {
  // JEP_EMU_HIER_OP(x) runs the target jax_ep_internode_hier_x of this build
  const std::string prefix = JEP_EMU_HIER_OP("");
  *known = a.op.rfind(prefix, 0) == 0;
  if (!*known) return {};
  return RunTargets(a, "internode_hier_" + a.op.substr(prefix.size()), known);
}

emu_driver::RegisterInvoker g_register(Invoke);

}  // namespace
}  // namespace emu_internode_hier
}  // namespace jax_ep
