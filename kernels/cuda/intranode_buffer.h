// Layout of one rank's intranode communication buffer, shared by the CUDA kernels and
// the host code that allocates buffers and launches kernels.
//
// Every rank of an EP group owns one buffer on its GPU; peers write into it through
// peer pointers (NVLink peer access within a process, CUDA IPC across processes). A
// buffer is a fixed header followed by three areas, one per op kind, so that a fast
// rank already in the next op never writes where a slow peer still reads:
//   [RankHeader | pad to kHeaderBytes][dispatch area][combine area][gather area]
// All ranks of a group run the same program and settings, so they compute the same
// offsets. docs/intranode.md describes the design.
//
// Dispatch and combine run as channels (DeepEP's design): a small notify kernel, then
// one channel kernel of 2 x channels blocks. Channel ch of a rank owns a contiguous range
// of its tokens. Combine and gather: both blocks of a channel send (to the even and to
// the odd ranks, ChannelSendSplit), the odd block receives from all. Dispatch (up to
// kMaxSplitSendRanks ranks): every block is a channel of its own (DispatchChannels), which
// sends its tokens to every rank and receives that channel from every source, so each
// SM carries the same share of the NVLink stores and of the received rows. The dispatch
// area of receiver d holds one ring of `ring_tokens` slots per (dispatch channel ch,
// source s); the combine area of token owner s one ring per (channel ch, data owner r). A rank's own rows skip its ring (ch, me) in
// every op (its kernels write or read them in place), so that ring stays unused. Ring
// counters are cumulative over calls (never reset but by reset()):
//   tail  written by the sender into the receiver's header (release, after a fence of
//         the rows it covers): rows written so far;
//   head  written by the receiver into the sender's header (release): rows consumed so
//         far; the sender writes slot (k mod ring_tokens) only once head > k - ring.
// Epochs n = 1, 2, ... per op kind are kept in lockstep by every rank:
//   dispatch: notify on s waits credit[r] >= n-1 from every receiver r (r finished epoch
//             n-1), writes its row counts and call site into r's header and arrive = n;
//             then waits for every peer's counts (arrive >= n), turns its positions into
//             rows on each receiver (send_row) and the received totals. Channel senders
//             push (row, token, local ids, weights) through the rings and end each ring
//             with d_end[ch][s] = n after its last tail; receivers copy each slot into
//             its row of the XLA outputs. The last block to finish writes credit = n.
//   combine:  notify on s tells each r, per channel, the range of r's rows its tokens
//             use (req_lo, req_n: contiguous, since dispatch ordered them by token) and
//             request = n; r's channel senders push those rows of y into the rings on s;
//             s's receivers sum each token's rows over ranks in ascending order. A request
//             is posted only after the previous epoch's rows were consumed, so it is
//             also the credit for the request slots.
//   gather:   (combine's transpose, also cached dispatch) one channel kernel, no notify:
//             the handle already holds the layout. Receiver q's channel ch block works out,
//             per source s, the contiguous range of its rows whose token lies in s's channel
//             ch, posts the count (g_req_n, g_req_site, then g_req_epoch = n) into s's
//             header, then streams the rows' token ids into the request ring (ch, q) on s
//             (head counts the ids posted). s's channel ch sender answers with its call site
//             (g_arr_site, g_arr_epoch = n on q), reads each id and writes that row of g
//             into the data ring (ch, s) on q (tail). q posts id k only once it has read
//             row k - ring_tokens, so a posted id is also the credit for its data slot and
//             the slot of id k - ring_tokens.
//
// Call sites: every request and every data signal is preceded by the sender's call-site
// id (site_req / site_arr), which the receiver compares with its own after its wait, so
// two different EP calls that meet by mistake (XLA running them at once, or ranks whose
// programs differ) are reported instead of mixing their data. A rank that has recorded
// a protocol error (timeout, call-site mismatch, rank mismatch, failed peer) keeps
// signalling and draining its rings, so no peer is left behind, but moves no data and
// sends kSiteFailed in place of its site: its peers record kErrPeerFailed and skip their
// work as well. The failed state is the first protocol error, kept apart from the
// first-error record, so one that follows a recorded bad id or foreign handle counts too.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/common/configs.h"
#include "kernels/common/dtype_convert.h"

#if defined(__CUDACC__)
#define JEP_HDX __host__ __device__ __forceinline__
#else
#define JEP_HDX inline
#endif

namespace jax_ep {

constexpr int kMaxRanks = 32;  // ranks of one intranode group (a 32-bit mask per token)
constexpr int kMaxChannels = 16;  // channels of the combine/gather kernels at most
// Warps of the channel blocks of all three ops (docs/intranode.md, "Kernels per call").
// Both blocks of channel ch send, block 2ch to the even ranks and block 2ch + 1 to the odd
// ones, so the peer stores (an SM's slowest accesses) spread over every block; block 2ch + 1
// also receives, with the warps after its senders'. With more than kMaxSplitSendRanks ranks
// both roles' warps do not fit one block, and block 2ch sends to every rank.
constexpr int kMaxSplitSendRanks = 16;
JEP_HDX bool ChannelSendSplit(int num_ranks) { return num_ranks <= kMaxSplitSendRanks; }
// Sending warps of a block (warp i sends to rank 2i + (block & 1) when split, else to i).
JEP_HDX int ChannelSendWarps(int num_ranks) {
  return ChannelSendSplit(num_ranks) ? (num_ranks + 1) / 2 : num_ranks;
}
// Receiving warps: one per source (its ring), at least kChannelThreads / 32 (the combine
// receiver sums one token per warp).
JEP_HDX int ChannelRecvWarps(int num_ranks) {
  return num_ranks > kChannelThreads / 32 ? num_ranks : kChannelThreads / 32;
}
// The first receiving warp of a combine or gather block 2ch + 1 (dispatch:
// DispatchRecvWarp0).
JEP_HDX int ChannelRecvWarp0(int num_ranks) {
  return ChannelSendSplit(num_ranks) ? ChannelSendWarps(num_ranks) : 0;
}
JEP_HDX int ChannelRoleThreads(int num_ranks) {
  return 32 * (ChannelRecvWarp0(num_ranks) + ChannelRecvWarps(num_ranks));
}
// Dispatch's channels. With the split, two blocks that each sent to half the ranks left
// 4 peers on one SM and 3 on the other at 8 ranks (7 peers), and the receives likewise:
// the busiest SM carried 8/7 of the average's NVLink stores. A block per channel, sending
// to every rank and receiving from every source, gives every SM the same share; it costs
// twice the rings (one set per block), each of `ring_tokens` slots. Above
// kMaxSplitSendRanks, block 2ch sends channel ch to every rank and 2ch + 1 receives it.
constexpr int kMaxDispatchChannels = 2 * kMaxChannels;
JEP_HDX int DispatchChannels(int num_ranks, int channels) {
  return ChannelSendSplit(num_ranks) ? 2 * channels : channels;
}
JEP_HDX int DispatchBlocks(int num_ranks, int dispatch_channels) {
  return ChannelSendSplit(num_ranks) ? dispatch_channels : 2 * dispatch_channels;
}
// A dispatch block's warps: a sending warp per rank (warp d to rank d; its own rows skip
// the rings), then a receiving warp per source (ChannelRecvWarps); above
// kMaxSplitSendRanks the receiving block's warps start at 0.
JEP_HDX int DispatchRecvWarp0(int num_ranks) {
  return ChannelSendSplit(num_ranks) ? num_ranks : 0;
}
JEP_HDX int DispatchRoleThreads(int num_ranks) {
  return 32 * (DispatchRecvWarp0(num_ranks) + ChannelRecvWarps(num_ranks));
}

enum OpKind : int { kOpDispatch = 0, kOpCombine = 1, kOpGather = 2, kNumOpKinds = 3 };
// Last-block counters, one per kernel that ends with a signal.
enum DoneCounter : int { kDoneDispatchChannel = 0, kDoneGatherChannel = 1, kNumDoneCounters = 2 };

constexpr size_t kHeaderBytes = 128 * 1024;
constexpr size_t kAreaAlign = 256;

// Ring counters of one op kind's channels (see the top), for up to N channels.
template <int N>
struct RingCountersOf {
  static constexpr int kChannels = N;
  uint64_t tail[N][kMaxRanks];  // by sender p: rows written into ring (ch, p) here
  uint64_t head[N][kMaxRanks];  // by receiver p: rows of my ring (ch) on p consumed
  uint64_t sent[N][kMaxRanks];  // own: rows I wrote into ring (ch, me) on p
  uint64_t read[N][kMaxRanks];  // own: rows I consumed from ring (ch, p)
};
using RingCounters = RingCountersOf<kMaxChannels>;
using DispatchRingCounters = RingCountersOf<kMaxDispatchChannels>;

struct alignas(128) RankHeader {
  int32_t rank;       // identity written at setup (-1 in the virtual-rank harness)
  int32_t group;
  int32_t num_ranks;
  int32_t magic;
  uint64_t seq[kNumOpKinds];               // own epoch per op kind
  uint32_t done[kNumDoneCounters];         // last-block counters
  uint64_t arrive[kNumOpKinds][kMaxRanks];   // written by peer p: epoch n's data is here
  uint64_t request[kNumOpKinds][kMaxRanks];  // written by peer p: epoch n's request posted
  uint64_t credit[kMaxRanks];              // dispatch: receiver p finished epoch n
  int32_t counts[kMaxRanks][kMaxRanks];    // dispatch: row s = tokens s sends each rank
  int64_t site_req[kNumOpKinds][kMaxRanks];  // written by peer p before request[k][p]
  int64_t site_arr[kNumOpKinds][kMaxRanks];  // written by peer p before arrive[k][p]
  DispatchRingCounters d_ring;             // dispatch channels
  RingCounters c_ring;                     // combine channels
  RingCounters g_ring;                     // gather channels; head is the ids posted (see the top)
  uint64_t d_end[kMaxDispatchChannels][kMaxRanks];  // dispatch: by source p, ring (ch, p) ended epoch n
  int32_t c_req_lo[kMaxChannels][kMaxRanks]; // combine: first of my rows peer p's channel wants
  int32_t c_req_n[kMaxChannels][kMaxRanks];
  int32_t c_own_lo[kMaxChannels][kMaxRanks]; // combine scratch: my channel's request to rank r
  int32_t c_own_n[kMaxChannels][kMaxRanks];
  uint64_t g_req_epoch[kMaxChannels][kMaxRanks];  // gather: by receiver p, its count of epoch n
  uint64_t g_arr_epoch[kMaxChannels][kMaxRanks];  // gather: by sender p, its call site of epoch n
  int64_t g_req_site[kMaxChannels][kMaxRanks];    // gather: written by receiver p before its count
  int64_t g_arr_site[kMaxChannels][kMaxRanks];    // gather: written by sender p before any row
  int32_t g_req_n[kMaxChannels][kMaxRanks];       // gather: rows receiver p wants from my channel
  // dispatch: written by peer p before arrive[kOpDispatch][p]: the epoch n when p's
  // topk_idx of epoch n held ids outside [-1, E) (else 0). The value check's verdict
  // travels in the exchange itself, so every rank learns it with no collective of XLA's.
  int64_t bad_ids[kMaxRanks];
};
static_assert(sizeof(RankHeader) <= kHeaderBytes, "header too large");
constexpr int32_t kHeaderMagic = 0x4a455031;  // "JEP1"
// Bytes at the start of a header that setup writes (rank, group, num_ranks, magic) and
// jax_ep.cuda.reset() keeps; everything after them is protocol state reset re-zeroes.
constexpr size_t kHeaderIdentityBytes = 4 * sizeof(int32_t);
// Sent in place of a call-site id by a rank that has a protocol error recorded.
constexpr int64_t kSiteFailed = -1;

// Device-side error record, sticky (the first error wins). Codes:
enum ErrorCode : int32_t {
  kErrNone = 0,
  kErrBadTopkId = 1,    // a = token, b = slot, c = value, d = num_experts
  kErrTimeout = 2,      // a = peer rank, b = op kind, c = epoch
  kErrBadHandle = 3,    // a = row or token, b = rank field, c = value, d = op kind
  kErrRankMismatch = 4, // a = rank given, b = rank in setup, c = group given, d = group
  kErrCallSite = 5,     // a = peer rank, b = op kind, c = peer's call site, d = mine
  kErrPeerFailed = 6,   // a = peer rank, b = op kind: the peer had an error and skipped
  kErrPeerBadId = 7,    // a = peer rank, b = op kind: the peer's ids were outside [-1, E)
                        // (recorded there, treated as unused; the data moved)
};
// Errors after which the protocol keeps running but no data moves (see the top);
// bad ids and foreign handles are repaired (treated as unused) and only reported.
JEP_HDX bool IsProtocolError(int32_t code) {
  return code == kErrTimeout || code == kErrRankMismatch || code == kErrCallSite ||
         code == kErrPeerFailed;
}
struct ErrorRecord {
  int32_t code;
  int32_t rank;  // rank that saw it (virtual rank in the harness)
  int32_t a, b, c, d;
  int32_t pad[2];
};

JEP_HDX size_t AlignUp(size_t v, size_t a) { return (v + a - 1) / a * a; }
JEP_HDX size_t RowStride(size_t row_bytes) { return AlignUp(row_bytes, 16); }

// The dispatch channel kernel's dynamic shared memory with bulk-copy pieces of `piece`
// bytes (configs.h IntranodeBulkPieceBytes): kBulkZeroBytes of zeros, then per rank r two
// mbarriers (at kBulkZeroBytes + 16 r) and two pieces (at DispatchBulkStagingOff(R) +
// 2 r piece).
JEP_HDX size_t DispatchBulkStagingOff(int num_ranks) {
  return static_cast<size_t>(kBulkZeroBytes) + 16 * static_cast<size_t>(num_ranks);
}
JEP_HDX size_t DispatchChannelSmemBytes(int num_ranks, int piece) {
  return DispatchBulkStagingOff(num_ranks) + 2 * static_cast<size_t>(num_ranks) * piece;
}

// One dispatch ring slot: the row, then [row on the receiver, source token, K local ids,
// K weights] as 32-bit words.
JEP_HDX size_t DispatchMetaWords(int K) { return 2 + 2 * static_cast<size_t>(K); }
// One dispatch ring (channel, source) on a receiver: ring_tokens rows, then their words.
struct DispatchRing {
  size_t meta_off, bytes;
  JEP_HDX static DispatchRing Make(int ring_tokens, size_t row_bytes, int K) {
    DispatchRing r;
    const size_t n = static_cast<size_t>(ring_tokens);
    r.meta_off = AlignUp(n * RowStride(row_bytes), kAreaAlign);
    r.bytes = r.meta_off + AlignUp(n * DispatchMetaWords(K) * 4, kAreaAlign);
    return r;
  }
};
// Dispatch area: dispatch channels (DispatchChannels) x R rings, ring (ch, s) at
// (ch * R + s) * ring bytes. The same for any tokens per call or capacity.
JEP_HDX size_t DispatchAreaBytes(int R, int channels, int ring_tokens, size_t row_bytes, int K) {
  return static_cast<size_t>(channels) * R * DispatchRing::Make(ring_tokens, row_bytes, K).bytes;
}
// Combine ring (channel, data owner r) on a token owner: ring_tokens rows of y.
JEP_HDX size_t CombineRingBytes(int ring_tokens, size_t row_bytes) {
  return AlignUp(static_cast<size_t>(ring_tokens) * RowStride(row_bytes), kAreaAlign);
}
JEP_HDX size_t CombineAreaBytes(int R, int channels, int ring_tokens, size_t row_bytes) {
  return static_cast<size_t>(channels) * R * CombineRingBytes(ring_tokens, row_bytes);
}
// One gather ring pair (channel ch, peer p) on a rank: the data ring (ring_tokens rows of
// g from source p), then the request ring (ring_tokens token ids from receiver p).
struct GatherRing {
  size_t req_off, bytes;
  JEP_HDX static GatherRing Make(int ring_tokens, size_t row_bytes) {
    GatherRing r;
    const size_t n = static_cast<size_t>(ring_tokens);
    r.req_off = AlignUp(n * RowStride(row_bytes), kAreaAlign);
    r.bytes = r.req_off + AlignUp(n * 4, kAreaAlign);
    return r;
  }
};
// Gather area: channels x R ring pairs, pair (ch, p) at (ch * R + p) * pair bytes. The same
// for any tokens per call or capacity.
JEP_HDX size_t GatherAreaBytes(int R, int channels, int ring_tokens, size_t row_bytes) {
  return static_cast<size_t>(channels) * R * GatherRing::Make(ring_tokens, row_bytes).bytes;
}

// Channels a group set up for `num_ranks` ranks runs with (its preset's num_sms / 2, not
// cut to an SM budget: the setup sizes the areas for it, a launch may use fewer).
inline int SetupChannels(int num_ranks) {
  return FitPresetToSms(SelectIntranodePreset(num_ranks), 1 << 20).num_sms / 2;
}
// Staging bytes of the dispatch and combine areas for a group of `num_ranks` ranks and
// rows of `row_bytes` (top-`topk`; gather's the same): set by the channels and ring slots, not by the
// tokens per call or the capacity.
inline size_t SetupDispatchBytes(int num_ranks, size_t row_bytes, int topk) {
  return DispatchAreaBytes(num_ranks, DispatchChannels(num_ranks, SetupChannels(num_ranks)),
                           IntranodeRingTokens(), row_bytes, topk);
}
inline size_t SetupCombineBytes(int num_ranks, size_t row_bytes) {
  return CombineAreaBytes(num_ranks, SetupChannels(num_ranks), IntranodeRingTokens(), row_bytes);
}
inline size_t SetupGatherBytes(int num_ranks, size_t row_bytes) {
  return GatherAreaBytes(num_ranks, SetupChannels(num_ranks), IntranodeRingTokens(), row_bytes);
}

// Where the three areas start in every buffer of a group (sizes fixed at setup).
struct AreaConfig {
  size_t bytes[kNumOpKinds];
  size_t offset(int kind) const {
    size_t o = kHeaderBytes;
    for (int k = 0; k < kind; ++k) o += AlignUp(bytes[k], kAreaAlign);
    return o;
  }
  size_t total() const { return offset(kNumOpKinds); }
};

// Base pointers of every rank's buffer as seen from the launching device.
struct PeerTable {
  char* base[kMaxRanks];
};

// What every intranode kernel is given (by value).
struct CommonArgs {
  PeerTable peers;
  size_t area_off;      // offset of this op kind's area in every buffer
  int me;               // this rank's index in the group
  int num_ranks;        // R
  int expect_group;     // group id from setup, checked against `group_in` on device
  const int32_t* rank_in;   // device scalars from XLA (null in the harness)
  const int32_t* group_in;
  ErrorRecord* host_err;    // mapped host mirror (may be null)
  int64_t timeout_ns;
  int64_t call_site;        // the call's id (same on every rank of a correct program)
  int channels;             // channels (combine, gather: the channel kernel has twice the
                            // blocks; dispatch: DispatchChannels, DispatchBlocks of them)
  int ring_tokens;          // slots of each (channel, peer) ring
};

struct DispatchArgs {
  CommonArgs c;
  int T, K, C, E, experts_per_rank;
  size_t row_bytes;
  const void* x;
  const int32_t* topk_idx;
  const float* topk_w;
  void* recv_x;
  int32_t* recv_idx;
  float* recv_w;
  int32_t* num_recv;
  int32_t* num_dropped;
  int32_t* recv_per_expert;
  int32_t* src_rank;
  int32_t* src_index;
  int32_t* send_row;
  int32_t bulk_piece;  // bytes of a bulk-copy piece (set by LaunchDispatchPhase)
};

struct CombineArgs {
  CommonArgs c;
  int T, C, H;
  FloatKind kind;
  size_t row_bytes;
  const void* y;
  const int32_t* send_row;
  void* out;
};

struct GatherArgs {
  CommonArgs c;
  int T, C;
  size_t row_bytes;
  const void* g;
  const int32_t* src_rank;
  const int32_t* src_index;
  void* out;
};

}  // namespace jax_ep
