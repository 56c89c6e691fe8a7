// The internode low-latency mode's FFI handlers on the emulated GPU (see emu_direct.cc):
// ops internode_ll_init (the area's start, per virtual GPU) and
// internode_ll_{dispatch,combine}_{send,recv}, run through the handlers' own bodies.
#include "xla_ffi/internode/low_latency_handlers.cc"  // NOLINT(build/include): the handlers
#include "xla_ffi/emu/emu_call.h"

namespace jax_ep {
namespace emu_internode_ll {
namespace {
namespace ffi = xla::ffi;
using emu_driver::CallArgs;
using emu_driver::ErrorText;
using ffi::DataType;

std::string Invoke(const CallArgs& a, bool* known) {
  *known = true;
  const auto at = [&](const char* k) { return a.attr(k); };
  if (a.op == "internode_ll_init")
    return ll_internode::Init(static_cast<int>(at("num_ranks")), static_cast<int>(at("max_tokens")),
                              at("row_bytes"), static_cast<int>(at("topk")),
                              static_cast<int>(at("num_experts")));
  if (a.op == "internode_ll_dispatch_send")
    return ErrorText(DispatchSendImpl(a.stream, a.any_in(0), a.in_as<DataType::S32>(1),
                                      a.out_as<DataType::S32>(0), at("num_experts"),
                                      at("num_ranks"), at("rank"), at("max_tokens"),
                                      at("num_ports"), at("qps_per_port"), at("call_site")));
  if (a.op == "internode_ll_dispatch_recv")
    return ErrorText(DispatchRecvImpl(
        a.stream, a.in_as<DataType::S32>(0), a.any_out(0), a.out_as<DataType::S32>(1),
        a.out_as<DataType::S32>(2), a.out_as<DataType::S32>(3), a.out_as<DataType::S32>(4),
        a.out_as<DataType::S32>(5), at("num_experts"), at("num_ranks"), at("rank"),
        at("max_tokens"), at("num_ports"), at("qps_per_port"), at("call_site")));
  if (a.op == "internode_ll_dispatch_send_fp8")
    return ErrorText(DispatchSendFp8Impl(a.stream, a.any_in(0), a.in_as<DataType::S32>(1),
                                         a.out_as<DataType::S32>(0), at("num_experts"),
                                         at("num_ranks"), at("rank"), at("max_tokens"),
                                         at("num_ports"), at("qps_per_port"), at("call_site"),
                                         at("round_scale")));
  if (a.op == "internode_ll_dispatch_recv_fp8")
    return ErrorText(DispatchRecvFp8Impl(
        a.stream, a.in_as<DataType::S32>(0), a.any_out(0), a.out_as<DataType::F32>(1),
        a.out_as<DataType::S32>(2), a.out_as<DataType::S32>(3), a.out_as<DataType::S32>(4),
        a.out_as<DataType::S32>(5), a.out_as<DataType::S32>(6), at("num_experts"),
        at("num_ranks"), at("rank"), at("max_tokens"), at("num_ports"), at("qps_per_port"),
        at("call_site")));
  if (a.op == "internode_ll_combine_send")
    return ErrorText(CombineSendImpl(a.stream, a.any_in(0), a.in_as<DataType::S32>(1),
                                     a.in_as<DataType::S32>(2), a.out_as<DataType::S32>(0),
                                     at("num_experts"), at("num_ranks"), at("rank"),
                                     at("max_tokens"), at("rows_per_dest"), at("num_ports"),
                                     at("qps_per_port"), at("call_site")));
  if (a.op == "internode_ll_combine_recv")
    return ErrorText(CombineRecvImpl(a.stream, a.in_as<DataType::S32>(0),
                                     a.in_as<DataType::S32>(1), a.in_as<DataType::F32>(2),
                                     a.any_out(0), at("num_experts"), at("num_ranks"),
                                     at("rank"), at("max_tokens"), at("num_ports"),
                                     at("qps_per_port"), at("call_site")));
  // this rank's recorded error in whichever mode's wording recorded it (the low-latency
  // decoder hands other modes' records on to theirs)
  if (a.op == "internode_ll_error") return ll_internode::PendingError();
  *known = false;
  return {};
}

emu_driver::RegisterInvoker g_register(Invoke);

}  // namespace
}  // namespace emu_internode_ll
}  // namespace jax_ep
