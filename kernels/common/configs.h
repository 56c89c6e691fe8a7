// Tuned launch presets of the CUDA kernels: how many thread blocks (SMs) each phase of
// the intranode dispatch/combine uses, threads per block, and the chunk sizes of the
// layout and planning kernels.
// One small table instead of numbers spread through the kernels. Host-only header.
//
// The numbers are first estimates for one H100/H200 class GPU (132 SMs) and have not
// yet been measured on hardware; scripts/gpu_check.sh prints the timings to retune them.
// JAX_EP_CUDA_PRESET=<name> forces a row by name.
#pragma once

#include <cstdlib>
#include <cstring>

namespace jax_ep {

struct IntranodePreset {
  const char* name;
  int max_ranks;     // row applies to num_ranks <= max_ranks (first match wins)
  int push_blocks;   // blocks of the push kernels (dispatch send, combine/gather push)
  int recv_blocks;   // blocks of the kernels that copy staged rows into XLA outputs
  int threads;       // threads per block of both (a warp moves one row at a time)
};

// Ordered by max_ranks; the last row catches everything.
inline constexpr IntranodePreset kIntranodePresets[] = {
    {"ep2", 2, 32, 64, 512},
    {"ep4", 4, 48, 96, 512},
    {"ep8", 8, 64, 128, 512},
    {"ep16", 16, 96, 132, 512},
    {"ep32", 32, 132, 132, 512},
};
inline constexpr int kNumIntranodePresets =
    static_cast<int>(sizeof(kIntranodePresets) / sizeof(kIntranodePresets[0]));

// Layout kernel: tokens handled per block and threads per block.
struct LayoutPreset {
  int tokens_per_block;
  int threads;
  int max_smem_experts;  // experts counted in shared memory; more fall back to global atomics
};
inline constexpr LayoutPreset kLayoutPreset = {256, 256, 8192};

// Single-block planning kernels: tokens (or rows) scanned per step = threads.
inline constexpr int kPlanThreads = 1024;
// Largest E_local whose received-row histogram is kept in shared memory.
inline constexpr int kMaxSmemLocalExperts = 8192;

inline const IntranodePreset& SelectIntranodePreset(int num_ranks) {
  const char* forced = std::getenv("JAX_EP_CUDA_PRESET");
  if (forced != nullptr && *forced != '\0') {
    for (const auto& p : kIntranodePresets)
      if (std::strcmp(p.name, forced) == 0) return p;
  }
  for (const auto& p : kIntranodePresets)
    if (num_ranks <= p.max_ranks) return p;
  return kIntranodePresets[kNumIntranodePresets - 1];
}

}  // namespace jax_ep
