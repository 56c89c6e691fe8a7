// The emulated module's calls: one FFI handler body of the CUDA backend (or of the
// internode backend), run on one virtual GPU's stream with buffers the driver allocated
// on that GPU. Each translation unit that includes a backend's handlers registers an
// invoker that knows its op names: the targets of the handler file's table
// (xla_ffi/common/op_tables.h) without the "jax_ep_" prefix, each run by JEP_EMU_RUN_TARGET
// with its operands, results and attributes decoded as the table says.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/emu/emu_cuda.h"
#include "xla/ffi/api/c_api.h"
#include "xla/ffi/api/ffi.h"
#include "xla_ffi/common/ffi_table.h"

namespace jax_ep {
namespace emu_driver {

struct CallArgs {
  std::string op;
  int ordinal = 0;
  cudaStream_t stream = nullptr;
  std::vector<XLA_FFI_Buffer*> in;
  std::vector<XLA_FFI_Buffer*> out;
  std::map<std::string, int64_t> attrs;
  std::map<std::string, std::vector<int64_t>> array_attrs;

  int64_t attr(const std::string& k) const;
  xla::ffi::Span<const int64_t> array_attr(const std::string& k) const;
  xla::ffi::AnyBuffer any_in(size_t i) const { return xla::ffi::AnyBuffer(in.at(i)); }
  template <xla::ffi::DataType T>
  xla::ffi::Buffer<T> in_as(size_t i) const { return xla::ffi::Buffer<T>(in.at(i)); }
  xla::ffi::Result<xla::ffi::AnyBuffer> any_out(size_t i) const {
    return xla::ffi::AnyBuffer(out.at(i));
  }
  template <xla::ffi::DataType T>
  xla::ffi::ResultBuffer<T> out_as(size_t i) const { return xla::ffi::Buffer<T>(out.at(i)); }
};

// Runs `a.op` if this invoker knows it: *known = true and the handler's error message
// ("" on success).
using Invoker = std::function<std::string(const CallArgs& a, bool* known)>;
// Registers an invoker at static-initialisation time (one per backend translation unit).
struct RegisterInvoker {
  explicit RegisterInvoker(Invoker f);
};
std::vector<Invoker>& Invokers();

inline std::string ErrorText(const xla::ffi::Error& e) { return e.success() ? std::string() : e.message(); }

// The emulator's op name of a target: the name without "jax_ep_".
inline std::string OpName(const char* target) {
  const std::string t = target;
  return t.rfind("jax_ep_", 0) == 0 ? t.substr(7) : t;
}

// A call's buffers and attributes as a signature's Decode reads them (jax_ep::sig).
struct CallSource {
  const CallArgs& a;
  template <typename T>
  T Arg(size_t i, const char*) const { return T(a.in.at(i)); }
  template <typename T>
  xla::ffi::Result<T> Ret(size_t i, const char*) const { return T(a.out.at(i)); }
  template <typename T>
  T Attr(const char* name) const {
    if constexpr (std::is_same_v<T, int64_t>) return a.attr(name);
    else return a.array_attr(name);
  }
};

// "name, name, ..." of a signature's entries of one kind (ARG or RET).
template <typename Sig>
std::string EntryNames(const char* kind) {
  std::string s;
  Sig::Describe([&](const char* k, const char* name, const char*) {
    if (std::string(k) == kind) s += (s.empty() ? "" : ", ") + std::string(name);
  });
  return s;
}

// Runs a handler function with the call's buffers and attributes decoded by its signature,
// after the context values `ctx`; the handler's error message ("" on success).
template <typename Sig, typename F, typename... Ctx>
std::string RunSignature(const CallArgs& a, F impl, Ctx... ctx) {
  if (a.in.size() != Sig::In::count || a.out.size() != Sig::Out::count)
    throw std::invalid_argument(
        "jax_ep emu: op " + a.op + " takes " + std::to_string(Sig::In::count) + " operands (" +
        EntryNames<Sig>("ARG") + ") and " + std::to_string(Sig::Out::count) + " results (" +
        EntryNames<Sig>("RET") + "), got " + std::to_string(a.in.size()) + " and " +
        std::to_string(a.out.size()));
  auto args = std::tuple_cat(std::make_tuple(ctx...), Sig::Decode(CallSource{a}));
  return ErrorText(std::apply(
      [&](auto&... xs) { return ffi_table::CallUnpacked(impl, xs...); }, args));
}

// A target row's context values in the emulator.
#define JEP_EMU_CTX_CUDA , a.stream, a.ordinal
#define JEP_EMU_CTX_STREAM , a.stream

// With `a` (the CallArgs) and `op` (the op name to match) in scope: runs the row's handler
// function if `op` names its target.
#define JEP_EMU_RUN_TARGET(target, Sig, Symbol, Impl, CTX, TRAITS)                  \
  if (op == ::jax_ep::emu_driver::OpName(target))                                   \
    return ::jax_ep::emu_driver::RunSignature<::jax_ep::sig::Sig>(a, Impl JEP_EMU_CTX_##CTX);

// Defines `std::string Name(const CallArgs& a, const std::string& op, bool* known)`, which
// runs the target of TARGETS (a target table) that `op` names (*known: whether one does).
#define JEP_EMU_TARGETS_RUNNER(Name, TARGETS)                                       \
  std::string Name(const ::jax_ep::emu_driver::CallArgs& a, const std::string& op,  \
                   bool* known) {                                                   \
    *known = true;                                                                  \
    TARGETS(JEP_EMU_RUN_TARGET)                                                     \
    *known = false;                                                                 \
    return {};                                                                      \
  }

// Registers an invoker of the targets of TARGETS under their op names (OpName).
#define JEP_EMU_REGISTER_TARGETS(TARGETS)                                           \
  namespace {                                                                       \
  JEP_EMU_TARGETS_RUNNER(RunTargets, TARGETS)                                       \
  ::jax_ep::emu_driver::RegisterInvoker g_register_targets(                         \
      [](const ::jax_ep::emu_driver::CallArgs& a, bool* known) {                    \
        return RunTargets(a, a.op, known);                                          \
      });                                                                           \
  }

}  // namespace emu_driver
}  // namespace jax_ep
