// The LAG TX affinity and RoCE UDP source port the DevX shim (lag_shim.cc) gives the k-th
// RC QP it sees: one definition, also used by the emulated NVSHMEM (kernels/emu) to put a
// bonded device's QPs on the member their affinity names.
#pragma once

#include <cstdint>

namespace jax_ep {
namespace lag_rule {

// 1-based bond member of the k-th RC QP, groups of `group` QPs in turn (NVSHMEM creates
// one QP slot's QPs to the other PEs one after another); 0 = no affinity (members 0).
inline int Affinity(int k, int group, int members) {
  return members > 0 && group > 0 ? (k / group) % members + 1 : 0;
}

// UDP source port of the k-th RC QP, from `sport_base` within RoCE's dynamic range
// [0xC000, 0xFFFF]; 0 = leave NVSHMEM's (one fixed port for every QP).
inline uint32_t SourcePort(int k, uint32_t sport_base) {
  return sport_base != 0 ? 0xC000u + (sport_base - 0xC000u + static_cast<uint32_t>(k)) % 0x4000u
                         : 0u;
}

}  // namespace lag_rule
}  // namespace jax_ep
