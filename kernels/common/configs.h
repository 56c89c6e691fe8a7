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

// Ordered by max_ranks; the last row catches everything. Every grid fits the default SM
// budget of a 132-SM GPU (132 - kReservedSms) at kAssumedBlocksPerSm: a kernel whose blocks
// wait on peers must have all of them resident beside other work (an NCCL kernel, an MPS
// client), or the ranks wait for each other until the timeout.
inline constexpr IntranodePreset kIntranodePresets[] = {
    {"ep2", 2, 32, 64, 512},
    {"ep4", 4, 48, 96, 512},
    {"ep8", 8, 64, 112, 512},
    {"ep16", 16, 96, 116, 512},
    {"ep32", 32, 116, 116, 512},
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

// SMs left to other work when no budget is set (JAX_EP_NUM_SMS): the EP kernels use at
// most device SMs - kReservedSms.
inline constexpr int kReservedSms = 16;
// Blocks of one push or receive kernel resident per SM at the presets' threads per block:
// ptxas gives the dispatch push/finish kernels about 78/74 registers at 512 threads, one
// block per SM. tests/test_grid_budget.py checks it against `nvcc -Xptxas -v`.
inline constexpr int kAssumedBlocksPerSm = 1;

// SMs the EP kernels may use on a GPU with `device_sms` SMs: JAX_EP_NUM_SMS when set (as
// DeepEP's Buffer.set_num_sms; jax_ep.cuda.set_num_sms), else device_sms - kReservedSms;
// within [1, device_sms].
inline int EpSmBudget(int device_sms) {
  int n = device_sms - kReservedSms;
  const char* v = std::getenv("JAX_EP_NUM_SMS");
  if (v != nullptr && *v != '\0') n = std::atoi(v);
  if (n > device_sms) n = device_sms;
  return n < 1 ? 1 : n;
}

// `p` with its push and receive grids cut to what `sm_budget` SMs hold resident.
inline IntranodePreset FitPresetToSms(IntranodePreset p, int sm_budget) {
  const int cap = (sm_budget < 1 ? 1 : sm_budget) * kAssumedBlocksPerSm;
  if (p.push_blocks > cap) p.push_blocks = cap;
  if (p.recv_blocks > cap) p.recv_blocks = cap;
  return p;
}

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
