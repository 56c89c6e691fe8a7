// The CUDA backend's intranode and layout handlers, compiled for the emulated GPU: this
// translation unit includes the handler source itself, so the emulator runs the same
// argument checks, argument construction and launch sequences (LaunchPhases) as a GPU.
#include "xla_ffi/cuda/cuda_handlers.cc"  // NOLINT(build/include): the handlers themselves
#include "xla_ffi/emu/emu_call.h"

namespace jax_ep {
namespace emu_driver {
namespace {
namespace ffi = xla::ffi;
using ffi::DataType;

std::string Invoke(const CallArgs& a, bool* known) {
  *known = true;
  if (a.op == "layout")
    return ErrorText(LayoutImpl(a.stream, a.ordinal, a.in_as<DataType::S32>(0),
                                a.out_as<DataType::S32>(0), a.out_as<DataType::S32>(1),
                                a.out_as<DataType::PRED>(2), a.attr("num_experts"),
                                a.attr("num_ranks")));
  if (a.op == "dispatch")
    return ErrorText(DispatchImpl(
        a.stream, a.ordinal, a.any_in(0), a.in_as<DataType::S32>(1), a.in_as<DataType::F32>(2),
        a.in_as<DataType::S32>(3), a.in_as<DataType::S32>(4), a.any_out(0),
        a.out_as<DataType::S32>(1), a.out_as<DataType::F32>(2), a.out_as<DataType::S32>(3),
        a.out_as<DataType::S32>(4), a.out_as<DataType::S32>(5), a.out_as<DataType::S32>(6),
        a.out_as<DataType::S32>(7), a.out_as<DataType::S32>(8), a.attr("num_experts"),
        a.attr("num_ranks"), a.attr("capacity"), a.attr("call_site")));
  if (a.op == "combine")
    return ErrorText(CombineImpl(a.stream, a.ordinal, a.any_in(0), a.in_as<DataType::S32>(1),
                                 a.in_as<DataType::S32>(2), a.in_as<DataType::S32>(3),
                                 a.any_out(0), a.attr("num_ranks"), a.attr("call_site")));
  if (a.op == "gather")
    return ErrorText(GatherImpl(a.stream, a.ordinal, a.any_in(0), a.in_as<DataType::S32>(1),
                                a.in_as<DataType::S32>(2), a.in_as<DataType::S32>(3),
                                a.in_as<DataType::S32>(4), a.any_out(0), a.attr("num_ranks"),
                                a.attr("call_site")));
  *known = false;
  return {};
}

RegisterInvoker g_register(Invoke);

}  // namespace
}  // namespace emu_driver
}  // namespace jax_ep
