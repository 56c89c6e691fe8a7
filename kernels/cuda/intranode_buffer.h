// Layout of one rank's intranode communication buffer, shared by the CUDA kernels and
// the host code that allocates buffers and launches kernels.
//
// Every rank of an EP group owns one buffer on its GPU; peers write into it through
// peer pointers (NVLink peer access within a process, CUDA IPC across processes). A
// buffer is a fixed header followed by three areas, one per op kind, so that a fast
// rank already in the next op never writes where a slow peer still reads:
//   [RankHeader | pad to kHeaderBytes][dispatch area][combine area][gather area]
// The areas are carved per call from the call's static shapes; all ranks of a group
// run the same program, so they compute the same offsets.
//
// Protocol (per op kind, epochs n = 1, 2, ... kept in lockstep by every rank of the
// group, since all of them run the same sequence of EP ops):
//   dispatch: source s waits credit[r] >= n-1 from receiver r, pushes its rows into
//             r's dispatch region s, writes its count vector into r's header and then
//             arrive[dispatch][s] = n on r. r waits for every arrive, copies rows into
//             the XLA outputs in (source, token) order and writes credit[r] = n on s.
//   combine:  source s asks each r for rows [lo, lo + n) (its rows there are
//             contiguous) via request[combine][s] on r; r pushes those rows of y into
//             s's combine region r and sets arrive[combine][r] = n on s; s sums them.
//   gather:   rank q sends each source s the list of tokens it needs (request[gather]);
//             s pushes those rows of g into q's gather region s and sets
//             arrive[gather][s] = n on q; q copies them into place.
// A request is posted only after the previous epoch's data was consumed, so requests
// double as credits for combine and gather.
//
// Call sites: every request and every data signal is preceded by the sender's call-site
// id (site_req / site_arr), which the receiver compares with its own after its wait, so
// two different EP calls that meet by mistake (XLA running them at once, or ranks whose
// programs differ) are reported instead of mixing their data. A rank that has recorded
// a protocol error (timeout, call-site mismatch, rank mismatch, failed peer) keeps
// signalling, so no peer is left behind, but moves no data and sends kSiteFailed in
// place of its site: its peers record kErrPeerFailed and skip their work as well. The
// failed state is the first protocol error, kept apart from the first-error record, so
// one that follows a recorded bad id or foreign handle counts too.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/common/dtype_convert.h"

#if defined(__CUDACC__)
#define JEP_HDX __host__ __device__ __forceinline__
#else
#define JEP_HDX inline
#endif

namespace jax_ep {

constexpr int kMaxRanks = 32;  // ranks of one intranode group (a 32-bit mask per token)
enum OpKind : int { kOpDispatch = 0, kOpCombine = 1, kOpGather = 2, kNumOpKinds = 3 };
// Last-block counters, one per kernel that ends with a signal.
enum DoneCounter : int { kDoneDispatchSend = 0, kDoneDispatchRecv = 1, kDoneCombinePush = 2,
                         kDoneGatherPush = 3, kNumDoneCounters = 4 };

constexpr size_t kHeaderBytes = 64 * 1024;
constexpr size_t kAreaAlign = 256;

struct alignas(128) RankHeader {
  int32_t rank;       // identity written at setup (-1 in the virtual-rank harness)
  int32_t group;
  int32_t num_ranks;
  int32_t magic;
  uint64_t seq[kNumOpKinds];               // own epoch per op kind
  uint32_t done[kNumDoneCounters];         // last-block counters
  uint64_t arrive[kNumOpKinds][kMaxRanks];   // written by peer p: epoch n's data is here
  uint64_t request[kNumOpKinds][kMaxRanks];  // written by peer p: epoch n's request posted
  uint64_t credit[kMaxRanks];              // dispatch: receiver p finished reading epoch n
  int32_t counts[kMaxRanks][kMaxRanks];    // dispatch: row s = tokens s sends each rank
  int32_t my_counts[kMaxRanks];            // dispatch scratch: my tokens per receiver
  int32_t req_lo[kMaxRanks];               // combine: first row peer p wants from me
  int32_t req_n[kNumOpKinds][kMaxRanks];   // rows peer p wants from me
  int32_t own_lo[kMaxRanks];               // combine scratch: my request to rank r
  int32_t own_n[kMaxRanks];
  int64_t site_req[kNumOpKinds][kMaxRanks];  // written by peer p before request[k][p]
  int64_t site_arr[kNumOpKinds][kMaxRanks];  // written by peer p before arrive[k][p]
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

// Dispatch area: one region per source s of rows_cap = min(T, C) rows:
// x rows, local topk ids [rows_cap, K], weights [rows_cap, K], source token [rows_cap].
struct DispatchRegion {
  size_t x_off, idx_off, w_off, tok_off, bytes;
  JEP_HDX static DispatchRegion Make(int rows_cap, size_t row_bytes, int K) {
    DispatchRegion r;
    const size_t rc = static_cast<size_t>(rows_cap);
    r.x_off = 0;
    r.idx_off = AlignUp(rc * RowStride(row_bytes), kAreaAlign);
    r.w_off = r.idx_off + AlignUp(rc * K * 4, kAreaAlign);
    r.tok_off = r.w_off + AlignUp(rc * K * 4, kAreaAlign);
    r.bytes = r.tok_off + AlignUp(rc * 4, kAreaAlign);
    return r;
  }
};

JEP_HDX int RowsCap(int64_t T, int64_t C) { return static_cast<int>(T < C ? T : C); }

JEP_HDX size_t DispatchAreaBytes(int R, int64_t T, int64_t C, size_t row_bytes, int K) {
  return R * DispatchRegion::Make(RowsCap(T, C), row_bytes, K).bytes;
}
// Combine area: one region per data owner r of min(T, C) rows of y.
JEP_HDX size_t CombineRegionBytes(int64_t T, int64_t C, size_t row_bytes) {
  return AlignUp(static_cast<size_t>(RowsCap(T, C)) * RowStride(row_bytes), kAreaAlign);
}
JEP_HDX size_t CombineAreaBytes(int R, int64_t T, int64_t C, size_t row_bytes) {
  return R * CombineRegionBytes(T, C, row_bytes);
}
// Gather area: data regions [R][min(T, C)] rows, request lists [R][min(T, C)] token
// ids (written by requesters), slot per output row [C].
struct GatherLayout {
  size_t region_bytes, data_off, req_off, req_stride, slot_off, bytes;
  JEP_HDX static GatherLayout Make(int R, int64_t T, int64_t C, size_t row_bytes) {
    GatherLayout g;
    const size_t cap = static_cast<size_t>(RowsCap(T, C));
    g.region_bytes = AlignUp(cap * RowStride(row_bytes), kAreaAlign);
    g.data_off = 0;
    g.req_off = R * g.region_bytes;
    g.req_stride = AlignUp(cap * 4, kAreaAlign);
    g.slot_off = g.req_off + R * g.req_stride;
    g.bytes = g.slot_off + AlignUp(static_cast<size_t>(C) * 4, kAreaAlign);
    return g;
  }
};

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
