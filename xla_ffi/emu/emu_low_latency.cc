// The CUDA backend's low-latency handlers (real-rank send and receive halves), compiled
// for the emulated GPU by including the handler source itself.
#include "xla_ffi/cuda/low_latency_handlers.cc"  // NOLINT(build/include)
#include "xla_ffi/emu/emu_call.h"

namespace jax_ep {
namespace emu_driver {
namespace {
namespace ffi = xla::ffi;
using ffi::DataType;

std::string Invoke(const CallArgs& a, bool* known) {
  *known = true;
  if (a.op == "ll_dispatch_send")
    return ErrorText(RankDispatchSendImpl(
        a.stream, a.ordinal, a.any_in(0), a.in_as<DataType::S32>(1), a.any_out(0),
        a.out_as<DataType::S32>(1), a.out_as<DataType::S32>(2), a.attr("num_experts"),
        a.attr("num_ranks"), a.attr("max_tokens"), a.attr("call_site")));
  if (a.op == "ll_dispatch_recv")
    return ErrorText(RankDispatchRecvImpl(
        a.stream, a.ordinal, a.any_in(0), a.in_as<DataType::S32>(1), a.in_as<DataType::S32>(2),
        a.in_as<DataType::S32>(3), a.in_as<DataType::S32>(4), a.any_out(0),
        a.out_as<DataType::S32>(1), a.out_as<DataType::S32>(2), a.out_as<DataType::S32>(3),
        a.out_as<DataType::S32>(4), a.out_as<DataType::S32>(5), a.attr("num_experts"),
        a.attr("num_ranks"), a.attr("max_tokens"), a.attr("call_site")));
  if (a.op == "ll_dispatch_send_fp8")
    return ErrorText(RankDispatchSendFp8Impl(
        a.stream, a.ordinal, a.any_in(0), a.in_as<DataType::S32>(1), a.any_out(0),
        a.out_as<DataType::S32>(1), a.out_as<DataType::S32>(2), a.attr("num_experts"),
        a.attr("num_ranks"), a.attr("max_tokens"), a.attr("call_site"), a.attr("round_scale")));
  if (a.op == "ll_dispatch_recv_fp8")
    return ErrorText(RankDispatchRecvFp8Impl(
        a.stream, a.ordinal, a.any_in(0), a.in_as<DataType::S32>(1), a.in_as<DataType::S32>(2),
        a.in_as<DataType::S32>(3), a.in_as<DataType::S32>(4), a.any_out(0),
        a.out_as<DataType::F32>(1), a.out_as<DataType::S32>(2), a.out_as<DataType::S32>(3),
        a.out_as<DataType::S32>(4), a.out_as<DataType::S32>(5), a.out_as<DataType::S32>(6),
        a.attr("num_experts"), a.attr("num_ranks"), a.attr("max_tokens"), a.attr("call_site")));
  if (a.op == "ll_combine_send")
    return ErrorText(RankCombineSendImpl(
        a.stream, a.ordinal, a.any_in(0), a.in_as<DataType::S32>(1), a.in_as<DataType::S32>(2),
        a.any_out(0), a.out_as<DataType::S32>(1), a.attr("num_ranks"), a.attr("max_tokens"),
        a.attr("rows_per_dest"), a.attr("call_site")));
  if (a.op == "ll_combine_recv")
    return ErrorText(RankCombineRecvImpl(
        a.stream, a.ordinal, a.any_in(0), a.in_as<DataType::S32>(1), a.in_as<DataType::S32>(2),
        a.in_as<DataType::F32>(3), a.in_as<DataType::S32>(4), a.in_as<DataType::S32>(5),
        a.any_out(0), a.attr("num_experts"), a.attr("num_ranks"), a.attr("max_tokens"),
        a.attr("call_site")));
  *known = false;
  return {};
}

RegisterInvoker g_register(Invoke);

}  // namespace
}  // namespace emu_driver
}  // namespace jax_ep
