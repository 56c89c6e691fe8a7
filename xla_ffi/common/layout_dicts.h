// The intranode presets, buffer sizes and low-latency area layout as Python objects: one
// builder for the CPU extension's intranode_* functions (xla_ffi/common/layout_bindings.cc)
// and the CUDA module's cuda_presets / cuda_area_bytes / cuda_ll_layout
// (xla_ffi/cuda/cuda_harness.cc, also in the emulated GPU's module), so their keys cannot
// differ. Inline: each module compiles its own copy.
#pragma once

#include <nanobind/nanobind.h>

#include <cstdint>
#include <stdexcept>

#include "kernels/cuda/intranode_buffer.h"
#include "kernels/cuda/low_latency_layout.h"

namespace jax_ep {

// One intranode launch preset (kernels/common/configs.h): name, max_ranks, num_sms.
inline nanobind::dict PresetDict(const IntranodePreset& p) {
  nanobind::dict d;
  d["name"] = p.name;
  d["max_ranks"] = p.max_ranks;
  d["num_sms"] = p.num_sms;
  return d;
}

// The intranode launch presets compiled in.
inline nanobind::list IntranodePresetList() {
  nanobind::list l;
  for (const IntranodePreset& p : kIntranodePresets) l.append(PresetDict(p));
  return l;
}

// Bytes of each op kind's area of one rank's intranode buffer and the settings that size
// them: dispatch, combine and gather stage rows in channels x ranks rings, whatever the
// tokens per call or the capacity.
inline nanobind::dict IntranodeAreaDict(int num_ranks, uint64_t row_bytes, int topk) {
  if (num_ranks < 1 || num_ranks > kMaxRanks)
    throw std::invalid_argument("jax_ep: num_ranks must be in [1, 32]");
  nanobind::dict d;
  d["dispatch"] = SetupDispatchBytes(num_ranks, row_bytes, topk);
  d["combine"] = SetupCombineBytes(num_ranks, row_bytes);
  d["gather"] = SetupGatherBytes(num_ranks, row_bytes);
  d["header"] = kHeaderBytes;
  d["channels"] = SetupChannels(num_ranks);
  d["dispatch_channels"] = DispatchChannels(num_ranks, SetupChannels(num_ranks));
  d["ring_tokens"] = IntranodeRingTokens();
  return d;
}

// The low-latency area's layout (kernels/cuda/low_latency_layout.h) for these shapes.
inline nanobind::dict LowLatencyLayoutDict(int num_ranks, int max_tokens, uint64_t row_bytes,
                                           int topk, int num_experts) {
  if (num_ranks < 1 || num_ranks > kMaxRanks || max_tokens < 1 || topk < 1 ||
      num_experts % num_ranks != 0 || num_experts < num_ranks)
    throw std::invalid_argument("jax_ep: low-latency layout: bad shapes");
  const LowLatencyLayout l =
      LowLatencyLayout::Make(num_ranks, max_tokens, row_bytes, topk, num_experts);
  nanobind::dict d;
  d["header"] = kLowLatencyHeaderBytes;
  d["stride"] = l.stride;
  d["rows_per_dest"] = l.rows_per_dest;
  d["slots"] = l.slots_off;
  d["slot_tok"] = l.tok_off;
  d["counts"] = l.counts_off;
  d["pos"] = l.pos_off;
  d["pos_combine"] = l.pos_c_off;
  d["offsets"] = l.offsets_off;
  d["cstage"] = l.cstage_off;
  d["bytes"] = l.bytes;
  d["slots_half"] = l.slots_half;
  d["tok_half"] = l.tok_half;
  d["counts_half"] = l.counts_half;
  d["cstage_half"] = l.cstage_half;
  return d;
}

}  // namespace jax_ep
