// The hierarchical internode mode's FFI handlers on the emulated GPU (see emu_direct.cc):
// ops internode_hier_{dispatch,combine,gather}. Compiled a second time with small rings
// (emu_hier_small_rings.cc), ops internode_hier_small_*.
#ifndef JEP_EMU_HIER_OP
#define JEP_EMU_HIER_OP(name) "internode_hier_" name
#endif
#include "xla_ffi/internode/hierarchical_handlers.cc"  // NOLINT(build/include): the handlers
#include "xla_ffi/emu/emu_call.h"

namespace jax_ep {
namespace emu_internode_hier {
namespace {
namespace ffi = xla::ffi;
using emu_driver::CallArgs;
using emu_driver::ErrorText;
using ffi::DataType;

std::string Invoke(const CallArgs& a, bool* known) {
  *known = true;
  const auto at = [&](const char* k) { return a.attr(k); };
  if (a.op == JEP_EMU_HIER_OP("dispatch"))
    return ErrorText(DispatchImpl(
        a.stream, a.any_in(0), a.in_as<DataType::S32>(1), a.in_as<DataType::F32>(2),
        a.any_out(0), a.out_as<DataType::S32>(1), a.out_as<DataType::F32>(2),
        a.out_as<DataType::S32>(3), a.out_as<DataType::S32>(4), a.out_as<DataType::S32>(5),
        a.out_as<DataType::S32>(6), a.out_as<DataType::S32>(7), a.out_as<DataType::S32>(8),
        a.out_as<DataType::S32>(9), at("num_experts"), at("num_ranks"), at("rank"),
        at("capacity"), at("num_ports"), at("qps_per_port"), at("chunk_bytes"),
        at("call_site"), at("gpus_per_node")));
  if (a.op == JEP_EMU_HIER_OP("combine"))
    return ErrorText(CombineImpl(a.stream, a.any_in(0), a.in_as<DataType::S32>(1),
                                 a.in_as<DataType::S32>(2), a.in_as<DataType::S32>(3),
                                 a.any_out(0), at("num_ranks"), at("rank"), at("capacity"),
                                 at("topk"), at("num_ports"), at("qps_per_port"),
                                 at("chunk_bytes"), at("call_site"), at("gpus_per_node")));
  if (a.op == JEP_EMU_HIER_OP("gather"))
    return ErrorText(GatherImpl(a.stream, a.any_in(0), a.in_as<DataType::S32>(1),
                                a.in_as<DataType::S32>(2), a.any_out(0), at("num_ranks"),
                                at("rank"), at("capacity"), at("topk"), at("num_ports"),
                                at("qps_per_port"), at("chunk_bytes"), at("call_site"),
                                at("gpus_per_node")));
  *known = false;
  return {};
}

emu_driver::RegisterInvoker g_register(Invoke);

}  // namespace
}  // namespace emu_internode_hier
}  // namespace jax_ep
