// What the internode handlers (direct, hierarchical, low-latency) share: their error
// wording and the shape check that returns from the handler.
#pragma once

#include <string>

#include "xla/ffi/api/ffi.h"
#include "xla_ffi/common/ffi_helpers.h"

namespace jax_ep {
namespace internode_ffi {

// A launch's error ("" on success) as the handler's result.
inline xla::ffi::Error FromString(const std::string& err) {
  if (err.empty()) return xla::ffi::Error::Success();
  return xla::ffi::Error(xla::ffi::ErrorCode::kInternal, err);
}

// The sticky error of an earlier call (read from mapped host memory, no sync), if any.
inline xla::ffi::Error Pending(const std::string& msg) {
  if (msg.empty()) return xla::ffi::Error::Success();
  return xla::ffi::Error(xla::ffi::ErrorCode::kFailedPrecondition, msg);
}

}  // namespace internode_ffi
}  // namespace jax_ep

// Returns an invalid-argument error from the handler unless `buf` has the shape given.
#define JEP_EXPECT_SHAPE(what, buf, ...)                                          \
  do {                                                                            \
    const std::string m_ = ExpectShape(what, (buf).dimensions(), {__VA_ARGS__});  \
    if (!m_.empty()) return Invalid(m_);                                          \
  } while (0)
