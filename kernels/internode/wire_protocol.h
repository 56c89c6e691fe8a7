// The internode wire protocol: which signal word each put signals, what a receiver
// waits for, the per-call header every rank exchanges, and the device error record.
//
// Pure functions and constants, shared by the CUDA kernels (internode_kernels.cu), the
// FFI handlers, and, through `internode_protocol()` in the bindings, by the host
// simulator in tests/sim/internode_sim.py and `python -m jax_ep.plan --check-wire`, so
// the simulated schedule and the compiled one cannot drift.
//
// One call (dispatch, combine or gather) on rank r, for every peer p != r:
//   1. header: r puts its Header into hdr[r] on p with a put-with-signal (SET 1) on
//      QP kControlQp, word (kSigHeader, r, kControlQp); dispatch also puts its count
//      row into counts[r] on p, signalling word (kSigCounts, r, kControlQp).
//   2. r waits (bounded) for every peer's header word; a peer whose seq, config hash or
//      error bit differ makes every rank skip the data phase and record an error. The
//      decision is the same on every rank: each sees all R headers.
//   3. data: the stream r sends p is cut into chunks; chunk j goes on logical QP
//      qp_for(p, j % NQ, j) (kernels/common/striping_plan.h, NQ = ports * QPs per
//      port channels, one per QP), each chunk a put-with-signal (ADD 1) on that QP into
//      word (data kind, r, qp) on p; then one closing signal (ADD 1) per QP on that word.
//      A word is written from one QP only.
//   4. p waits (bounded) until word (kind, r, q) == chunks_on_qp(...) + 1 for every q.
//   5. p resets the words of this call's half; the half is next used two calls later.
#pragma once

#include <cstdint>

#include "kernels/common/striping_plan.h"

#if defined(__CUDACC__)
#define JEP_WIRE_HD __host__ __device__ __forceinline__
#else
#define JEP_WIRE_HD inline
#endif

namespace jax_ep {
namespace wire {

// Signal words reserved per source, one per logical QP (num_ports * qps_per_port <= it).
using ::jax_ep::kMaxQps;  // kernels/common/striping_plan.h
// Header and count row travel on this logical QP.
constexpr int kControlQp = 0;

enum SigKind : int {
  kSigHeader = 0,
  kSigCounts = 1,
  kSigDispatch = 2,  // dispatch rows and gather rows (dispatch's wire pattern)
  kSigCombine = 3,
  kNumSigKinds = 4,
};

enum Op : int { kOpDispatch = 0, kOpCombine = 1, kOpGather = 2 };

// Index of a signal word within a half's signal region: [kind][source][qp].
JEP_WIRE_HD int64_t sig_word(int kind, int num_ranks, int source, int qp) {
  return (static_cast<int64_t>(kind) * num_ranks + source) * kMaxQps + qp;
}
JEP_WIRE_HD int64_t sig_words(int num_ranks) {
  return static_cast<int64_t>(kNumSigKinds) * num_ranks * kMaxQps;
}

// The call's configuration as exchanged in the header (and hashed).
enum CfgField : int {
  kCfgOp = 0, kCfgRanks, kCfgTokens, kCfgHidden, kCfgTopk, kCfgCapacity, kCfgDtype,
  kCfgNumQps,
  kCfgCallSite,  // the custom call's call_site: a rank in another call site is a mismatch
  kNumCfgFields
};

struct Header {
  uint64_t seq;                   // calls this PE made before this one
  uint32_t hash;                  // config_hash(cfg)
  int32_t error;                  // nonzero: this rank found an error (bad ids) already
  int32_t cfg[kNumCfgFields];
  int32_t pad[16 - 4 - kNumCfgFields];
};
static_assert(sizeof(Header) == 64, "the header is one 64-byte put");
constexpr int kHeaderBytes = 64;

// FNV-1a over the config fields.
JEP_WIRE_HD uint32_t config_hash(const int32_t* cfg) {
  uint32_t h = 2166136261u;
  for (int i = 0; i < kNumCfgFields; ++i) {
    uint32_t v = static_cast<uint32_t>(cfg[i]);
    for (int b = 0; b < 4; ++b) {
      h ^= (v >> (8 * b)) & 0xffu;
      h *= 16777619u;
    }
  }
  return h;
}

// The channel whose chunks the plan puts on logical QP `qp` for `peer` (channels ==
// QPs, so this is a bijection), -1 if `qp` is out of range.
JEP_WIRE_HD int32_t channel_of_qp(int32_t peer, int32_t qp, int32_t num_ports,
                                  int32_t qps_per_port) {
  const int32_t nq = num_ports * qps_per_port;
  for (int32_t c = 0; c < nq; ++c)
    if (qp_for(peer, c, c, num_ports, qps_per_port).qp == qp) return c;
  return -1;
}

// Chunks j < n_chunks with j % num_qps == channel (the chunks that channel sends).
JEP_WIRE_HD int64_t chunks_on_channel(int64_t n_chunks, int32_t channel, int32_t num_qps) {
  if (channel < 0 || channel >= n_chunks) return 0;
  return (n_chunks - 1 - channel) / num_qps + 1;
}

// Value word (kind, source, qp) holds on the receiver once every chunk of the source's
// stream on that QP and the closing signal have landed.
JEP_WIRE_HD uint64_t expected_signal(int64_t n_chunks, int32_t receiver, int32_t qp,
                                     int32_t num_ports, int32_t qps_per_port) {
  const int32_t c = channel_of_qp(receiver, qp, num_ports, qps_per_port);
  return static_cast<uint64_t>(chunks_on_channel(n_chunks, c, num_ports * qps_per_port)) + 1;
}

// Device error record (sticky: the first error wins).
enum ErrCode : int32_t {
  kErrNone = 0,
  kErrTimeout = 1,      // waited past JAX_EP_TIMEOUT_S for (peer, kind, qp)
  kErrMismatch = 2,     // a peer's header differs (seq or config)
  kErrPeerFailed = 3,   // a peer reported an error in its header
  kErrBadId = 4,        // this rank's topk_idx has ids outside [-1, E)
  kErrExtraSignal = 5,  // a word holds more than expected (a peer sent more)
};

struct ErrorRecord {
  int32_t code;
  int32_t rank;      // this PE
  int32_t op;        // Op
  int32_t peer;
  int32_t kind;      // SigKind waited for
  int32_t qp;
  uint64_t expected;
  uint64_t seen;
  uint64_t my_seq;
  uint64_t peer_seq;
  int32_t mine[kNumCfgFields];
  int32_t theirs[kNumCfgFields];
};

}  // namespace wire
}  // namespace jax_ep
