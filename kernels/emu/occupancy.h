// The occupancy rule of the emulated GPU: how many blocks of a kernel one SM of an sm_90
// GPU (H100/H200) holds at a launch configuration, from the kernel's registers and static
// shared memory as `ptxas -v` reports them (kernels/emu/occupancy_table.inc, made by
// scripts/gen_emu_occupancy.py). The emulator's default co-residency limit is this times
// the SM count (docs/emulator.md, "Co-residency").
#pragma once

#include <cstddef>

namespace emu {

struct Sm90 {
  static constexpr int kSms = 132;                  // H100 SXM / H200
  static constexpr int kRegistersPerSm = 65536;
  static constexpr int kRegisterUnit = 256;         // per warp, allocated in these units
  static constexpr int kThreadsPerSm = 2048;
  static constexpr int kBlocksPerSm = 32;
  static constexpr size_t kSharedPerSm = 228 * 1024;
  static constexpr size_t kSharedPerBlock = 227 * 1024;  // the most one block may use
  static constexpr size_t kSharedReservedPerBlock = 1024;  // the runtime's own, per block
};

// Blocks of `threads` threads resident on one SM when each thread uses `registers` and
// the block `smem` bytes of shared memory (static + dynamic); 0: the launch cannot run.
constexpr int BlocksPerSm(int registers, size_t smem, int threads) {
  if (threads <= 0 || threads > 1024 || smem > Sm90::kSharedPerBlock) return 0;
  const int warps = (threads + 31) / 32;
  const int per_warp = (registers * 32 + Sm90::kRegisterUnit - 1) / Sm90::kRegisterUnit *
                       Sm90::kRegisterUnit;
  const int by_regs = per_warp == 0 ? Sm90::kBlocksPerSm
                                    : Sm90::kRegistersPerSm / (per_warp * warps);
  const int by_threads = Sm90::kThreadsPerSm / (warps * 32);
  const int by_smem =
      static_cast<int>(Sm90::kSharedPerSm / (smem + Sm90::kSharedReservedPerBlock));
  int n = Sm90::kBlocksPerSm;
  if (by_regs < n) n = by_regs;
  if (by_threads < n) n = by_threads;
  if (by_smem < n) n = by_smem;
  return n;
}

static_assert(BlocksPerSm(78, 32, 512) == 1, "2560 registers per warp x 16 warps");
static_assert(BlocksPerSm(32, 0, 512) == 4, "the thread limit");
static_assert(BlocksPerSm(64, 120000, 256) == 1, "the shared-memory limit");
static_assert(BlocksPerSm(255, 0, 1024) == 0, "too many registers for one block");
static_assert(BlocksPerSm(16, 0, 32) == 32, "the block limit");

}  // namespace emu
