// The emulated module's calls: one FFI handler body of the CUDA backend (or of the
// internode backend), run on one virtual GPU's stream with buffers the driver allocated
// on that GPU. Each translation unit that includes a backend's handlers registers an
// invoker that knows its op names.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "kernels/emu/emu_cuda.h"
#include "xla/ffi/api/c_api.h"
#include "xla/ffi/api/ffi.h"

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

}  // namespace emu_driver
}  // namespace jax_ep
