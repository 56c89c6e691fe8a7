// Argument-checking helpers shared by the CPU, CUDA and internode FFI handlers, so every
// backend words its shape errors the same way.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <initializer_list>
#include <sstream>
#include <string>

#include "kernels/common/dtype_convert.h"
#include "kernels/common/settings.h"
#include "xla/ffi/api/ffi.h"

namespace jax_ep {

// The setting timeout_s (JAX_EP_TIMEOUT_S, default kDefaultTimeoutSeconds): how long any
// backend waits for a peer before failing.
inline double TimeoutSeconds() {
  const double s = settings().timeout_s;
  return s > 0 ? s : kDefaultTimeoutSeconds;
}

// The FloatKind of an FFI buffer's element type; false for anything but f32/bf16/f16.
inline bool FloatKindOf(xla::ffi::DataType t, FloatKind* k) {
  switch (t) {
    case xla::ffi::DataType::F32: *k = FloatKind::kF32; return true;
    case xla::ffi::DataType::BF16: *k = FloatKind::kBF16; return true;
    case xla::ffi::DataType::F16: *k = FloatKind::kF16; return true;
    default: return false;
  }
}

inline xla::ffi::Error Invalid(const std::string& msg) {
  return xla::ffi::Error(xla::ffi::ErrorCode::kInvalidArgument, "jax_ep: " + msg);
}

inline std::string Dims(xla::ffi::Span<const int64_t> d) {
  std::ostringstream s;
  s << "[";
  for (size_t i = 0; i < d.size(); ++i) s << (i ? ", " : "") << d[i];
  s << "]";
  return s.str();
}

inline bool HasShape(xla::ffi::Span<const int64_t> got, std::initializer_list<int64_t> want) {
  if (got.size() != want.size()) return false;
  size_t i = 0;
  for (int64_t w : want)
    if (got[i++] != w) return false;
  return true;
}

// "" if `got` is `want`, else a message naming `what`.
inline std::string ExpectShape(const char* what, xla::ffi::Span<const int64_t> got,
                               std::initializer_list<int64_t> want) {
  if (HasShape(got, want)) return {};
  std::ostringstream s;
  s << what << " has shape " << Dims(got) << ", expected [";
  size_t i = 0;
  for (int64_t w : want) s << (i++ ? ", " : "") << w;
  s << "]";
  return s.str();
}

}  // namespace jax_ep
