// Tuned launch presets of the CUDA kernels: how many thread blocks (SMs) the intranode
// channel kernels (dispatch, combine, gather) use, threads per block, and the chunk sizes
// of the layout and planning kernels.
// One small table instead of numbers spread through the kernels. Host-only header.
//
// The numbers are first estimates for one H100/H200 class GPU (132 SMs) and have not
// yet been measured on hardware; scripts/gpu_check.sh prints the timings to retune them.
// The setting cuda_preset (JAX_EP_CUDA_PRESET=<name>) forces a row by name. Settings come
// from settings.h (filled from jax_ep.Config); this header reads no environment.
#pragma once

#include <cstring>
#include <string>

#include "kernels/common/settings.h"

namespace jax_ep {

struct IntranodePreset {
  const char* name;
  int max_ranks;     // row applies to num_ranks <= max_ranks (first match wins)
  int num_sms;       // blocks of the dispatch/combine/gather channel kernels: num_sms / 2
                     // channels of two blocks each for combine and gather, a channel per
                     // block for dispatch up to 16 ranks; DeepEP's Buffer.num_sms
};

// Ordered by max_ranks; the last row catches everything. Every grid fits the default SM
// budget of a 132-SM GPU (132 - kReservedSms) at kAssumedBlocksPerSm: a kernel whose blocks
// wait on peers must have all of them resident beside other work (an NCCL kernel, an MPS
// client), or the ranks wait for each other until the timeout. 24 blocks at 8 ranks is
// DeepEP's 20-24 SMs for intranode normal mode.
inline constexpr IntranodePreset kIntranodePresets[] = {
    {"ep2", 2, 16},
    {"ep4", 4, 20},
    {"ep8", 8, 24},
    {"ep16", 16, 24},
    {"ep32", 32, 32},
};
inline constexpr int kNumIntranodePresets =
    static_cast<int>(sizeof(kIntranodePresets) / sizeof(kIntranodePresets[0]));

// Channels of the dispatch/combine kernels at most (the ring counters in the buffer
// header are sized for it; kernels/cuda/intranode_buffer.h kMaxChannels).
inline constexpr int kMaxIntranodeChannels = 16;
// Ring slots per (channel, peer) by default, and the most JAX_EP_RING_TOKENS may ask for.
inline constexpr int kRingTokens = 128;
inline constexpr int kMaxRingTokens = 4096;
// Receiving threads of a channel block at least (32 x ranks when more: a warp per source
// ring; intranode_buffer.h ChannelRecvWarps), and threads of a block at most (the
// kernels are compiled for it, which bounds their registers).
inline constexpr int kChannelThreads = 256;
inline constexpr int kMaxChannelThreads = 1024;
// Bulk copies (the TMA) of the dispatch channel kernel, which moves the received rows from
// the rings into recv_x, a rank's own rows from x, and zeros into the rows past the
// received ones: a block's shared memory holds two staging pieces per source rank (one
// loads while the previous one stores) in kBulkStagingBytes, pieces of at most
// kBulkPieceBytes, and kBulkZeroBytes of zeros the empty rows are stored from.
// Under 48 KiB in all at any rank count (intranode_buffer.h DispatchChannelSmemBytes).
inline constexpr int kBulkStagingBytes = 32768;
inline constexpr int kBulkPieceBytes = 2048;
inline constexpr int kBulkZeroBytes = 2048;

// Bytes of one bulk-copy piece at `num_ranks` ranks (a multiple of 16): two per rank in
// kBulkStagingBytes, at most kBulkPieceBytes.
inline constexpr int DispatchBulkPieceBytes(int num_ranks) {
  return (kBulkStagingBytes / (2 * num_ranks)) / 16 * 16 < kBulkPieceBytes
             ? (kBulkStagingBytes / (2 * num_ranks)) / 16 * 16
             : kBulkPieceBytes;
}

// Blocks of the hierarchical combine's source role, which sums every token's node partials
// (each block a slice of the hidden columns, so the reads spread over SMs as DeepEP's
// combine spreads its reduction); at most one block per 16-byte vector of a row.
// The setting hier_source_blocks (JAX_EP_HIER_SOURCE_BLOCKS) overrides it (a rank-local
// choice: peers need not agree).
inline constexpr int kHierSourceBlocks = 16;
inline constexpr int kMaxHierSourceBlocks = 64;

inline int HierSourceBlocks(long long row_vectors) {
  const int forced = settings().hier_source_blocks;
  long long n = forced > 0 ? forced
                : (row_vectors < kHierSourceBlocks ? row_vectors : kHierSourceBlocks);
  if (n < 1) n = 1;
  return static_cast<int>(n > kMaxHierSourceBlocks ? kMaxHierSourceBlocks : n);
}

// Hierarchical dispatch: its roles are spread over parts, one warp each, and the warps over
// the mode's blocks, consecutive warps of a role on consecutive blocks (DeepEP's
// channels: every SM holds a slice of every role). A sender to a remote node runs as
// parts that each own a set of QPs (the largest divisor of the QP count at most
// kHierSendParts: the chunks of one QP stay in order), a forwarder (local or rail) as
// parts that each own a set of the node's receivers (at most kHierForwardParts).
// Its blocks: the hierarchical mode's SMs (InternodeModeSms below);
// JAX_EP_HIER_DISPATCH_BLOCKS overrides the block count (rank-local: the wire is the same).
inline constexpr int kHierSendParts = 4;
inline constexpr int kHierForwardParts = 8;
inline constexpr int kMaxHierParts = 32;

inline int HierSendParts(int num_qps) {
  int p = num_qps < kHierSendParts ? num_qps : kHierSendParts;
  while (p > 1 && num_qps % p != 0) --p;
  return p < 1 ? 1 : p;
}
inline int HierForwardParts(int gpus_per_node) {
  const int p = gpus_per_node < kHierForwardParts ? gpus_per_node : kHierForwardParts;
  return p < 1 ? 1 : (p > kMaxHierParts ? kMaxHierParts : p);
}
// The hierarchical combine's forwarder to a remote node runs as parts, a warp each
// summing a slice of the columns (at most one per 16-byte vector of a row, at most
// kHierCombineForwardParts); its parts and the pushers (a warp each) spread the same way
// over role blocks beside the source blocks: the mode's SMs split by HierCombineFit
// (JAX_EP_HIER_COMBINE_BLOCKS overrides the role blocks).
inline constexpr int kHierCombineForwardParts = 8;

inline int HierCombineForwardParts(long long row_vectors) {
  long long n = row_vectors < kHierCombineForwardParts ? row_vectors : kHierCombineForwardParts;
  if (n < 1) n = 1;
  return static_cast<int>(n > kMaxHierParts ? kMaxHierParts : n);
}

// A combine pusher (one (source, receiver) pair's rows) runs as parts on consecutive
// blocks, a warp each copying a slice of every row's 16-byte vectors (part 0 releases a
// batch once every part has written it): the pair's rows spread over blocks, so no block
// holds a whole pair's, however the routing loads one pair. Parts per pusher: up to
// kHierPushParts, as long as the pushers keep to about kHierPushWarps warps in all and to
// the role blocks' warps beside the forwarders' (HierCombineFit; never more parts than a
// row has vectors). JAX_EP_HIER_PUSH_PARTS overrides it (up to
// kHierPushParts; rank-local: the wire is the same).
inline constexpr int kHierPushParts = 4;
inline constexpr int kHierPushWarps = 64;

// Parts per role: `forced` when set (> 0), else as many as keep `roles` roles to about
// `warps` warps; at most `most` (and kMaxHierParts), at most a row's 16-byte vectors, at
// least one.
inline int PartsPerRole(int forced, int most, int warps, int roles, long long row_vectors) {
  long long n = forced > 0 ? forced : (roles > 0 ? warps / roles : 1);
  if (n > most) n = most;
  if (n > row_vectors) n = row_vectors;
  if (n < 1) n = 1;
  return static_cast<int>(n > kMaxHierParts ? kMaxHierParts : n);
}

// Each dispatch forwarder part (one set of a node's receivers) can run as column parts on
// consecutive blocks, a warp each copying a slice of every row's 16-byte vectors (column
// part 0 also the row's words, and it releases a ring's tail once every column part has
// marked its rows written), so one (source, receiver) pair's rows spread over blocks.
// One column part by default: counted at 2 x 8 with 4 (docs/performance.md), the model
// read the dispatch slower at the preset's 24 blocks (the busiest block became one where
// receivers and column parts stack, and each column part reads every row's words).
// JAX_EP_HIER_FORWARD_COLUMNS asks for up to kHierForwardColumns (rank-local: the wire
// is the same), for a GPU run to decide.
inline constexpr int kHierForwardColumns = 4;

inline int HierForwardColumns(int forwarders, long long row_vectors) {
  return PartsPerRole(settings().hier_forward_columns, kHierForwardColumns, forwarders,
                      forwarders, row_vectors);
}

// Blocks for `warps` role warps: `preset`, or `forced` when set (> 0); at least enough for
// `per_block` warps a block, at most one block a warp.
inline int HierRoleBlocks(int forced, int preset, int warps, int per_block) {
  long long n = forced > 0 ? forced : preset;
  const int least = (warps + per_block - 1) / per_block;
  if (n < least) n = least;
  if (n > warps) n = warps;
  return static_cast<int>(n < 1 ? 1 : n);
}
// The same, naming the setting by its environment variable (the hierarchical launchers:
// JAX_EP_HIER_DISPATCH_BLOCKS, JAX_EP_HIER_COMBINE_BLOCKS); the value is the setting's,
// never the environment's.
inline int HierRoleBlocks(const char* setting, int preset, int warps, int per_block) {
  const Settings& s = settings();
  const int forced = std::strcmp(setting, "JAX_EP_HIER_DISPATCH_BLOCKS") == 0 ? s.hier_dispatch_blocks
                     : std::strcmp(setting, "JAX_EP_HIER_COMBINE_BLOCKS") == 0 ? s.hier_combine_blocks
                     : 0;
  return HierRoleBlocks(forced, preset, warps, per_block);
}

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

// SMs left to other work when no budget is set (num_sms, JAX_EP_NUM_SMS): the EP kernels use at
// most device SMs - kReservedSms.
inline constexpr int kReservedSms = 16;
// Blocks of one channel kernel resident per SM at its threads per block (ChannelRoleThreads):
// one. tests/test_grid_budget.py checks it against `nvcc -Xptxas -v`.
inline constexpr int kAssumedBlocksPerSm = 1;

// SMs the EP kernels may use on a GPU with `device_sms` SMs: the setting num_sms when set
// (JAX_EP_NUM_SMS; as DeepEP's Buffer.set_num_sms; jax_ep.cuda.set_num_sms), else
// device_sms - kReservedSms; within [1, device_sms].
inline int EpSmBudget(int device_sms) {
  int n = device_sms - kReservedSms;
  if (settings().num_sms > 0) n = settings().num_sms;
  if (n > device_sms) n = device_sms;
  return n < 1 ? 1 : n;
}

// ---- SM budget per mode (DeepEP V2's SM count per mode) ----------------------------------
// SMs each mode's kernels use: their grids (one block per SM, as the channel kernels:
// kAssumedBlocksPerSm) are cut to it. A setting per mode (JAX_EP_<MODE>_SMS, jax_ep.config
// `<mode>_sms`) overrides the preset; the whole budget EpSmBudget (num_sms) still caps it.
// Rank-local: the wire and the buffers are the same whatever a rank's budget.
enum EpMode : int { kModeIntranode = 0, kModeHierarchical = 1, kModeDirect = 2, kModeLowLatency = 3 };
inline constexpr int kNumEpModes = 4;
// A mode's setting at most (more than any GPU's SMs; the whole budget cuts it anyway).
inline constexpr int kMaxModeSms = 1024;

struct EpModeInfo {
  const char* mode;     // as jax_ep names it
  const char* setting;  // jax_ep.config's field
  const char* env;      // its environment variable
};
inline constexpr EpModeInfo kEpModes[kNumEpModes] = {
    {"intranode", "intranode_sms", "JAX_EP_INTRANODE_SMS"},
    {"hierarchical", "hierarchical_sms", "JAX_EP_HIERARCHICAL_SMS"},
    {"direct", "direct_sms", "JAX_EP_DIRECT_SMS"},
    {"low_latency", "low_latency_sms", "JAX_EP_LOW_LATENCY_SMS"},
};

// The internode modes' SMs by EP size (first row with num_ranks <= max_ranks). DeepEP V2
// reaches 90/81 GB/s at EP 8x2 with 12 SMs (SM90 + CX7), so 12 there: two NIC ports are
// fed by a few RDMA CTAs and the NVLink copies of the rest. Larger groups hold more role
// warps (the hierarchical kernels need a warp per remote node's sender part and receivers
// per node), so the rows grow. First estimates, not measured (scripts/gpu_check.sh).
// The low-latency mode takes the whole EP budget (EpSmBudget: 116 on a 132-SM GPU), as
// DeepEP's low-latency kernels spread a decode step's few tokens over most SMs: its cost
// is latency, and the latency-aware model puts a step of 128 tokens at EP 16 at 132 us /
// 551 us on 12 SMs (each thread walking ten times the items) against 106 us / 191 us on
// the whole budget (docs/performance.md, "Latency-aware model"). A setting caps it.
// Intranode's SMs are its launch preset's num_sms (kIntranodePresets: 24 at 8 and 16 ranks).
struct InternodeSmPreset {
  int max_ranks;
  int hierarchical, direct, low_latency;
};
inline constexpr InternodeSmPreset kInternodeSmPresets[] = {
    {16, 12, 12, kMaxModeSms},
    {32, 16, 12, kMaxModeSms},
    {64, 24, 16, kMaxModeSms},
    {1 << 20, 32, 24, kMaxModeSms},
};
inline constexpr int kNumInternodeSmPresets =
    static_cast<int>(sizeof(kInternodeSmPresets) / sizeof(kInternodeSmPresets[0]));

// The mode's setting (> 0 when set), 0 when unset.
inline int ModeSmSetting(int mode) {
  const Settings& s = settings();
  switch (mode) {
    case kModeIntranode: return s.intranode_sms;
    case kModeHierarchical: return s.hierarchical_sms;
    case kModeDirect: return s.direct_sms;
    case kModeLowLatency: return s.low_latency_sms;
  }
  return 0;
}

// The preset's SMs of an internode mode at `num_ranks` ranks.
inline int InternodeSmPresetFor(int mode, int num_ranks) {
  for (const auto& p : kInternodeSmPresets)
    if (num_ranks <= p.max_ranks)
      return mode == kModeHierarchical ? p.hierarchical
             : mode == kModeDirect     ? p.direct
                                       : p.low_latency;
  return 1;
}

// SMs the internode `mode` uses at `num_ranks` ranks on a GPU of `device_sms` SMs: the
// setting when set, else the preset; within the whole budget (EpSmBudget) and >= 1.
inline int InternodeModeSms(int mode, int num_ranks, int device_sms) {
  const int forced = ModeSmSetting(mode);
  int n = forced > 0 ? forced : InternodeSmPresetFor(mode, num_ranks);
  const int cap = EpSmBudget(device_sms);
  if (n > cap) n = cap;
  return n < 1 ? 1 : n;
}

// The text of an error about a mode's budget: names the setting and its variable.
inline std::string ModeSmError(int mode, int sms, int least, const char* what) {
  const EpModeInfo& m = kEpModes[mode];
  return std::string("jax_ep: ") + m.setting + " (" + m.env + ") = " + std::to_string(sms) +
         " SMs is below the " + std::to_string(least) + " the " + m.mode + " mode's " + what +
         " needs";
}

// Direct mode's SendKernel: `rdma` CTAs post the RDMA streams (CTA b the QPs q = b mod
// rdma, so each CTA keeps whole QPs and their chunks in order) and `nvl` CTAs copy the
// NVLink streams. With NVLink peers, about half the budget posts (each CTA at most
// ceil(num_qps / (budget / 2)) QPs, as few CTAs as that allows) and the rest copies: the
// NIC needs few CTAs to be fed (a post is a few work requests), the copies need many
// loads in flight. Without NVLink peers every CTA posts (and with no NVLink CTA, the RDMA
// CTAs copy to NVLink peers after their posts).
struct DirectSplit {
  int rdma, nvl;
};
inline DirectSplit DirectSendSplit(int sms, int num_qps, bool nvlink_peers) {
  DirectSplit d;
  if (sms < 1) sms = 1;
  if (num_qps < 1) num_qps = 1;
  if (!nvlink_peers) {
    d.rdma = num_qps < sms ? num_qps : sms;
    d.nvl = 0;
    return d;
  }
  const int half = sms / 2 < 1 ? 1 : sms / 2;
  const int per = (num_qps + half - 1) / half;  // QPs per RDMA CTA
  d.rdma = (num_qps + per - 1) / per;
  d.nvl = sms - d.rdma;  // 0 only at one SM: the RDMA CTA copies after its posts
  return d;
}

// Hierarchical combine: `sms` blocks split into source blocks (a slice of the columns each)
// and role blocks (forwarder parts and pushers, a warp each): the source gets half (at most
// its own preset, HierSourceBlocks; JAX_EP_HIER_SOURCE_BLOCKS wins), the roles the rest, and
// the forwarder and pusher parts shrink to fit the role blocks' warps (never below one part
// each). `roles` ends at least what holds every role warp: callers compare with the budget.
struct HierCombineSplit {
  int nsrc, roles, cp, pp;
};
inline HierCombineSplit HierCombineFit(int sms, int remote_nodes, int pushers,
                                       long long row_units, long long row_vectors,
                                       int warps_per_block) {
  const Settings& s = settings();
  HierCombineSplit c;
  const int src = HierSourceBlocks(row_units);
  const int half = sms / 2 < 1 ? 1 : sms / 2;
  c.nsrc = s.hier_source_blocks > 0 ? src : (src < half ? src : half);
  c.cp = HierCombineForwardParts(row_units);
  int roles, left;
  if (s.hier_combine_blocks > 0) {
    // role blocks asked for: the parts as without a budget (about kHierPushWarps pusher
    // warps), packed into at least the blocks asked
    roles = s.hier_combine_blocks;
    left = kHierPushWarps;
  } else {
    roles = sms - c.nsrc < 1 ? 1 : sms - c.nsrc;
    const int avail = roles * warps_per_block;
    if (remote_nodes > 0 && remote_nodes * c.cp + pushers > avail) {
      const int cp = (avail - pushers) / remote_nodes;
      c.cp = cp < 1 ? 1 : cp;
    }
    left = avail - remote_nodes * c.cp;
    if (left > kHierPushWarps) left = kHierPushWarps;
  }
  c.pp = PartsPerRole(s.hier_push_parts, kHierPushParts, left < pushers ? pushers : left,
                      pushers, row_vectors);
  const int warps = remote_nodes * c.cp + pushers * c.pp;
  const int least = (warps + warps_per_block - 1) / warps_per_block;
  c.roles = roles < least ? least : roles;
  if (c.roles > warps) c.roles = warps < 1 ? 1 : warps;  // at most one block a warp
  return c;
}

// `p` with its grids cut to what `sm_budget` SMs hold resident. The channel kernels keep
// an even block count of at least 2 (two blocks per combine or gather channel).
inline IntranodePreset FitPresetToSms(IntranodePreset p, int sm_budget) {
  const int cap = (sm_budget < 1 ? 1 : sm_budget) * kAssumedBlocksPerSm;
  if (p.num_sms > cap) p.num_sms = cap;
  p.num_sms = p.num_sms < 2 ? 2 : p.num_sms & ~1;
  if (p.num_sms > 2 * kMaxIntranodeChannels) p.num_sms = 2 * kMaxIntranodeChannels;
  return p;
}

// Ring slots (tokens) of one (channel, peer) ring of the dispatch and combine channel
// kernels: the setting ring_tokens when set (JAX_EP_RING_TOKENS; tests use a few, to wrap
// every ring), else kRingTokens. The staging memory of a rank is channels x peers x ring slots x row,
// whatever the tokens per call.
inline int IntranodeRingTokens() {
  int n = settings().ring_tokens > 0 ? settings().ring_tokens : kRingTokens;
  if (n < 1) n = 1;
  return n > kMaxRingTokens ? kMaxRingTokens : n;
}

// The bulk-copy piece of the dispatch channel kernel: the setting bulk_piece_bytes when set
// (JAX_EP_BULK_PIECE_BYTES; tests use a few vectors, so a row moves in several pieces), a multiple of 16 within
// [16, DispatchBulkPieceBytes], else DispatchBulkPieceBytes.
inline int IntranodeBulkPieceBytes(int num_ranks) {
  const int most = DispatchBulkPieceBytes(num_ranks < 1 ? 1 : num_ranks);
  if (settings().bulk_piece_bytes <= 0) return most;
  const int n = settings().bulk_piece_bytes / 16 * 16;
  return n < 16 ? 16 : (n > most ? most : n);
}

inline const IntranodePreset& SelectIntranodePreset(int num_ranks) {
  const std::string& forced = settings().cuda_preset;
  if (!forced.empty()) {
    for (const auto& p : kIntranodePresets)
      if (forced == p.name) return p;
  }
  for (const auto& p : kIntranodePresets)
    if (num_ranks <= p.max_ranks) return p;
  return kIntranodePresets[kNumIntranodePresets - 1];
}

// The intranode preset a launch runs with at `num_ranks` ranks on a GPU of `device_sms`
// SMs: its blocks cut to the whole budget (EpSmBudget) and to the intranode mode's setting
// (intranode_sms, JAX_EP_INTRANODE_SMS) when set. The setting only lowers the preset's
// blocks: the group's buffers are sized for the preset's channels (SetupChannels).
inline IntranodePreset IntranodeLaunchPreset(int num_ranks, int device_sms) {
  int budget = EpSmBudget(device_sms);
  const int forced = ModeSmSetting(kModeIntranode);
  if (forced > 0 && forced < budget) budget = forced;
  return FitPresetToSms(SelectIntranodePreset(num_ranks), budget);
}

// SMs `mode` (EpMode) uses at `num_ranks` ranks on a GPU of `device_sms` SMs.
inline int ModeSms(int mode, int num_ranks, int device_sms) {
  if (mode == kModeIntranode) return IntranodeLaunchPreset(num_ranks, device_sms).num_sms;
  return InternodeModeSms(mode, num_ranks, device_sms);
}

}  // namespace jax_ep
