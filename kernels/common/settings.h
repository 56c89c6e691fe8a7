// The library's run-time settings as the C++ code reads them: one plain struct, filled
// from Python's jax_ep.Config through the bindings (xla_ffi/common/settings_bindings.cc,
// `set_settings`) when jax_ep is imported and on every jax_ep.config.update/override.
// Nothing under kernels/ reads the environment; jax_ep/config.py reads it once and its
// docstring tables every variable.
//
// Each extension module (_jax_ep_ext, _jax_ep_emu, _jax_ep_nvshmem) is its own shared
// object with its own copy of the struct; Python fills every one that is loaded.
// Defaults shared with Python live here and reach it through `settings_defaults()`.
#pragma once

#include <string>

namespace jax_ep {

// How long any backend waits for a peer before failing, in seconds (JAX_EP_TIMEOUT_S).
inline constexpr double kDefaultTimeoutSeconds = 300.0;
// The kernels' wait bound where a call passes none (timeout_ns <= 0).
inline constexpr long long DefaultTimeoutNs() {
  return static_cast<long long>(kDefaultTimeoutSeconds) * 1000000000ll;
}

// 0 (or "") in a field: not set, the kernels' own choice (configs.h).
struct Settings {
  double timeout_s = kDefaultTimeoutSeconds;  // JAX_EP_TIMEOUT_S
  int num_sms = 0;               // JAX_EP_NUM_SMS: SM budget of the EP kernels
  int ring_tokens = 0;           // JAX_EP_RING_TOKENS: intranode ring slots
  int bulk_piece_bytes = 0;      // JAX_EP_BULK_PIECE_BYTES: dispatch bulk-copy piece
  std::string cuda_preset;       // JAX_EP_CUDA_PRESET: intranode preset forced by name
  int hier_source_blocks = 0;    // JAX_EP_HIER_SOURCE_BLOCKS
  int hier_push_parts = 0;       // JAX_EP_HIER_PUSH_PARTS
  int hier_forward_columns = 0;  // JAX_EP_HIER_FORWARD_COLUMNS
  int hier_dispatch_blocks = 0;  // JAX_EP_HIER_DISPATCH_BLOCKS
  int hier_combine_blocks = 0;   // JAX_EP_HIER_COMBINE_BLOCKS
  // SMs per mode (configs.h kEpModes, the presets beside them): 0 = the mode's preset.
  int intranode_sms = 0;         // JAX_EP_INTRANODE_SMS
  int hierarchical_sms = 0;      // JAX_EP_HIERARCHICAL_SMS
  int direct_sms = 0;            // JAX_EP_DIRECT_SMS
  int low_latency_sms = 0;       // JAX_EP_LOW_LATENCY_SMS
  // CUDA_DEVICE_MAX_CONNECTIONS (the driver's default 8): hardware queues of this
  // process's streams, which the virtual-rank harness checks its ranks against.
  int hardware_queues = 8;
};

// This module's settings (written only by the bindings, between calls).
inline Settings& mutable_settings() {
  static Settings s;
  return s;
}
inline const Settings& settings() { return mutable_settings(); }

}  // namespace jax_ep
