// Python bindings of the run-time settings (kernels/common/settings.h): jax_ep.config
// calls set_settings(dict) on every loaded extension module (each has its own copy of
// the struct) when jax_ep is imported and on every config.update/override; the defaults
// that C++ and Python share come from here (settings_defaults).
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <stdexcept>
#include <string>

#include "kernels/common/configs.h"
#include "kernels/common/settings.h"
#include "xla_ffi/common/layout_bindings.h"

namespace nb = nanobind;

namespace jax_ep {
namespace {

int IntOrUnset(const std::string& key, nb::handle v) {
  if (v.is_none()) return 0;
  const long long n = nb::cast<long long>(v);
  if (n < 0 || n > (1LL << 30))
    throw std::invalid_argument("set_settings: " + key + " out of range: " + std::to_string(n));
  return static_cast<int>(n);
}

// A mode's SMs (configs.h kEpModes): None (the preset) or an int in [1, kMaxModeSms],
// the error naming the setting and its variable.
int ParseModeSms(const std::string& key, nb::handle v) {
  if (v.is_none()) return 0;
  const long long n = nb::cast<long long>(v);
  if (n < 1 || n > kMaxModeSms) {
    const char* env = "";
    for (const EpModeInfo& m : kEpModes)
      if (key == m.setting) env = m.env;
    throw std::invalid_argument("set_settings: " + key + " (" + env + ") must be in [1, " +
                                std::to_string(kMaxModeSms) + "], got " + std::to_string(n));
  }
  return static_cast<int>(n);
}

void SetSettings(nb::dict d) {
  Settings s = settings();  // keys left out keep their values
  for (auto [k, v] : d) {
    const std::string key = nb::cast<std::string>(k);
    if (key == "timeout_s") {
      const double t = v.is_none() ? kDefaultTimeoutSeconds : nb::cast<double>(v);
      if (!(t > 0)) throw std::invalid_argument("set_settings: timeout_s must be > 0");
      s.timeout_s = t;
    } else if (key == "num_sms") {
      s.num_sms = IntOrUnset(key, v);
    } else if (key == "ring_tokens") {
      s.ring_tokens = IntOrUnset(key, v);
    } else if (key == "bulk_piece_bytes") {
      s.bulk_piece_bytes = IntOrUnset(key, v);
    } else if (key == "cuda_preset") {
      s.cuda_preset = v.is_none() ? std::string() : nb::cast<std::string>(v);
    } else if (key == "hier_source_blocks") {
      s.hier_source_blocks = IntOrUnset(key, v);
    } else if (key == "hier_push_parts") {
      s.hier_push_parts = IntOrUnset(key, v);
    } else if (key == "hier_forward_columns") {
      s.hier_forward_columns = IntOrUnset(key, v);
    } else if (key == "hier_dispatch_blocks") {
      s.hier_dispatch_blocks = IntOrUnset(key, v);
    } else if (key == "hier_combine_blocks") {
      s.hier_combine_blocks = IntOrUnset(key, v);
    } else if (key == "intranode_sms") {
      s.intranode_sms = ParseModeSms(key, v);
    } else if (key == "hierarchical_sms") {
      s.hierarchical_sms = ParseModeSms(key, v);
    } else if (key == "direct_sms") {
      s.direct_sms = ParseModeSms(key, v);
    } else if (key == "low_latency_sms") {
      s.low_latency_sms = ParseModeSms(key, v);
    } else if (key == "hardware_queues") {
      const long long n = v.is_none() ? 8 : nb::cast<long long>(v);
      if (n < 1 || n > 32)
        throw std::invalid_argument("set_settings: hardware_queues (CUDA_DEVICE_MAX_CONNECTIONS) "
                                    "must be in [1, 32], got " + std::to_string(n));
      s.hardware_queues = static_cast<int>(n);
    } else {
      throw std::invalid_argument("set_settings: unknown setting " + key);
    }
  }
  mutable_settings() = s;
}

nb::object IntOrNone(int v) { return v > 0 ? nb::object(nb::int_(v)) : nb::none(); }

nb::dict GetSettings() {
  const Settings& s = settings();
  nb::dict d;
  d["timeout_s"] = s.timeout_s;
  d["num_sms"] = IntOrNone(s.num_sms);
  d["ring_tokens"] = IntOrNone(s.ring_tokens);
  d["bulk_piece_bytes"] = IntOrNone(s.bulk_piece_bytes);
  d["cuda_preset"] = s.cuda_preset.empty() ? nb::object(nb::none())
                                           : nb::object(nb::str(s.cuda_preset.c_str()));
  d["hier_source_blocks"] = IntOrNone(s.hier_source_blocks);
  d["hier_push_parts"] = IntOrNone(s.hier_push_parts);
  d["hier_forward_columns"] = IntOrNone(s.hier_forward_columns);
  d["hier_dispatch_blocks"] = IntOrNone(s.hier_dispatch_blocks);
  d["hier_combine_blocks"] = IntOrNone(s.hier_combine_blocks);
  d["intranode_sms"] = IntOrNone(s.intranode_sms);
  d["hierarchical_sms"] = IntOrNone(s.hierarchical_sms);
  d["direct_sms"] = IntOrNone(s.direct_sms);
  d["low_latency_sms"] = IntOrNone(s.low_latency_sms);
  d["hardware_queues"] = s.hardware_queues;
  return d;
}

nb::dict Defaults() {
  nb::dict d;
  d["timeout_s"] = kDefaultTimeoutSeconds;
  d["ring_tokens"] = kRingTokens;
  d["max_ring_tokens"] = kMaxRingTokens;
  d["reserved_sms"] = kReservedSms;
  nb::list presets;
  for (const auto& p : kIntranodePresets) presets.append(nb::str(p.name));
  d["cuda_presets"] = presets;
  // the SM budget per mode: its settings, and the presets (configs.h)
  nb::list modes;
  for (const EpModeInfo& m : kEpModes) {
    nb::dict md;
    md["mode"] = m.mode;
    md["setting"] = m.setting;
    md["env"] = m.env;
    modes.append(md);
  }
  d["sm_modes"] = modes;
  d["max_mode_sms"] = kMaxModeSms;
  nb::list rows;
  for (const InternodeSmPreset& p : kInternodeSmPresets) {
    nb::dict r;
    r["max_ranks"] = p.max_ranks;
    r["hierarchical"] = p.hierarchical;
    r["direct"] = p.direct;
    r["low_latency"] = p.low_latency;
    rows.append(r);
  }
  d["internode_sm_presets"] = rows;
  nb::list intra;
  for (const IntranodePreset& p : kIntranodePresets) {
    nb::dict r;
    r["name"] = p.name;
    r["max_ranks"] = p.max_ranks;
    r["intranode"] = p.num_sms;
    intra.append(r);
  }
  d["intranode_sm_presets"] = intra;
  return d;
}

// SMs each mode uses at `num_ranks` ranks on a GPU of `device_sms` SMs with the settings in
// force (configs.h: ModeSms), and the direct mode's send split (DirectSendSplit) for
// `num_qps` QPs: what the launchers compute.
nb::dict ModeSmsNow(int num_ranks, int device_sms, int num_qps, bool nvlink_peers) {
  nb::dict d;
  for (int m = 0; m < kNumEpModes; ++m) d[kEpModes[m].mode] = ModeSms(m, num_ranks, device_sms);
  const DirectSplit sp = DirectSendSplit(ModeSms(kModeDirect, num_ranks, device_sms), num_qps,
                                         nvlink_peers);
  d["direct_rdma_ctas"] = sp.rdma;
  d["direct_nvlink_ctas"] = sp.nvl;
  return d;
}

}  // namespace

void AddSettingsBindings(nb::module_& m) {
  m.def("set_settings", &SetSettings, nb::arg("settings"),
        "Sets this module's run-time settings (kernels/common/settings.h) from a dict; "
        "None: not set. jax_ep.config calls it; use jax_ep.config.update/override.");
  m.def("settings", &GetSettings, "This module's run-time settings as C++ reads them.");
  m.def("settings_defaults", &Defaults,
        "Defaults C++ and Python share: timeout_s, ring_tokens, max_ring_tokens, "
        "reserved_sms, cuda_presets (the intranode preset names), sm_modes, max_mode_sms, "
        "internode_sm_presets, intranode_sm_presets (the SM budget per mode).");
  m.def("mode_sms", &ModeSmsNow, nb::arg("num_ranks"), nb::arg("device_sms") = 132,
        nb::arg("num_qps") = 1, nb::arg("nvlink_peers") = true,
        "SMs each mode's kernels use (configs.h ModeSms) with this module's settings, and "
        "the direct mode's RDMA and NVLink CTAs (DirectSendSplit).");
}

}  // namespace jax_ep
