// Host side of the internode low-latency mode: the symmetric area's start-up and release
// (on the runtime the direct mode starts, kernels/internode/nvshmem_host.cu), the checks
// and geometry of a call, its grid sizes (cut to the SM budget), the per-call host code of
// the four halves (no host synchronisation, no allocation: they queue the launchers of
// kernels/internode/low_latency_kernels.cu, declared in kernels/internode/api.cuh), and
// the decoding of this mode's records in the sticky error record.
#include <cstring>
#include <string>

#include "kernels/common/settings.h"
#include "kernels/common/configs.h"
#include "kernels/common/fp8_quant.h"
#include "kernels/common/low_latency_math.h"
#include "kernels/internode/api.cuh"
#include "kernels/internode/hierarchical_kernels.h"
#include "kernels/internode/internode_kernels.h"
#include "kernels/internode/low_latency_kernels.h"
#include "kernels/internode/low_latency_wire.h"
#include "kernels/internode/transport_nvshmem.cuh"
#include "kernels/internode/wire_protocol.h"

namespace jax_ep {
namespace ll_internode {

// Epochs started per op on this PE (kernels/internode/api.cuh); Init zeroes them.
JEP_DEVICE_GLOBAL unsigned long long g_ll_epoch[llwire::kNumOps];

std::string CudaErr(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return {};
  return std::string("jax_ep internode low-latency: ") + what + ": " + cudaGetErrorString(e);
}

namespace {

using llwire::Area;

constexpr int kD = llwire::kOpDispatch;
constexpr int kC = llwire::kOpCombine;

struct State {
  Limits lim;
  char* area = nullptr;
  Area A{};
};
// One per process on a GPU; one per virtual GPU on the emulated GPU (see internode::Rt).
#if defined(JAX_EP_EMU)
State g_ll_of[64];
State& Ll() { return g_ll_of[emu::current_device() & 63]; }
#else
State g_ll;
State& Ll() { return g_ll; }
#endif

// ---- grids ---------------------------------------------------------------------------

int SmCount() { return DeviceSms(); }

// Blocks of `kernel` (kThreads threads) one SM holds, from its registers and shared
// memory; the emulated GPU assumes configs.h's kAssumedBlocksPerSm.
int BlocksPerSm(const void* kernel, int* cache) {
#if defined(JAX_EP_EMU)
  (void)kernel;
  (void)cache;
  return kAssumedBlocksPerSm;
#else
  if (*cache > 0) return *cache;
  int per = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per, kernel, kThreads, 0) != cudaSuccess ||
      per < 1) {
    cudaGetLastError();
    per = 1;
  }
  *cache = per;
  return per;
#endif
}

std::string MakeG(const CallDims& d, int op, G* g) {
  internode::SharedRuntime rt;
  std::string e = internode::SharedState(&rt);
  if (!e.empty()) return e;
  if (!Ll().lim.initialized)
    return "jax_ep internode low-latency: the low-latency area is not allocated; pass "
           "low_latency=dict(max_tokens_per_rank=..., hidden=..., topk=..., num_experts=...) "
           "to jax_ep.nvshmem_bootstrap.initialize";
  const Limits& l = Ll().lim;
  if (d.fp8 != 0 && (op != kD || d.H % kFp8Block != 0))
    return "jax_ep internode low-latency: fp8 is a dispatch of rows whose hidden size is a "
           "multiple of 128";
  const int64_t row_bytes =
      d.fp8 != 0 ? static_cast<int64_t>(ll_fp8_msg_bytes(d.H)) : d.H * d.elem_bytes;
  if (d.R != rt.world || d.rank != rt.rank)
    return "jax_ep internode low-latency: the EP group must be all " + std::to_string(rt.world) +
           " NVSHMEM PEs; got " + std::to_string(d.R) + " ranks";
  if (d.R != l.R || d.E != l.E || d.M > l.M || row_bytes > l.row_bytes ||
      static_cast<int64_t>(d.S) * d.K > static_cast<int64_t>(l.M) * l.K ||
      d.S > static_cast<int64_t>(l.M) * l.K || d.rows_per_dest > Ll().A.rpd)
    return "jax_ep internode low-latency: the call (R=" + std::to_string(d.R) + ", E=" +
           std::to_string(d.E) + ", M=" + std::to_string(d.M) + ", row bytes " +
           std::to_string(row_bytes) + ", staged slots " +
           std::to_string(static_cast<int64_t>(d.S) * d.K) + ", rows per source " +
           std::to_string(d.rows_per_dest) + ") does not fit the area started for (R=" +
           std::to_string(l.R) + ", E=" + std::to_string(l.E) + ", M=" + std::to_string(l.M) +
           ", row bytes " + std::to_string(l.row_bytes) + ", K=" + std::to_string(l.K) +
           "); start it with the largest limits the program uses";
  const int nq = d.num_ports * d.qps_per_port;
  if (nq != rt.num_qps)
    return "jax_ep internode low-latency: the call asks for " + std::to_string(nq) +
           " QPs per peer but NVSHMEM was started with " + std::to_string(rt.num_qps);
  g->R = d.R;
  g->rank = d.rank;
  g->E = d.E;
  g->el = d.E / d.R;
  g->M = d.M;
  g->S = d.S;
  g->K = d.K;
  g->P = d.num_ports;
  g->Q = d.qps_per_port;
  g->nq = nq;
  g->H = d.H;
  g->row_bytes = row_bytes;
  g->x_row_bytes = d.H * d.elem_bytes;
  g->fp8 = d.fp8;
  g->rpd = d.rows_per_dest;
  g->ds_put = llwire::dispatch_stride(row_bytes);
  g->meta_off = llwire::dispatch_meta_offset(row_bytes);
  g->cs_put = llwire::combine_stride(row_bytes);
  g->timeout_ns = d.timeout_ns > 0 ? d.timeout_ns : DefaultTimeoutNs();
  g->op = op;
  int32_t* c = g->cfg;
  c[llwire::kCfgOp] = op;
  c[llwire::kCfgRanks] = d.R;
  c[llwire::kCfgExperts] = d.E;
  c[llwire::kCfgMaxTokens] = d.M;
  c[llwire::kCfgStageRows] = op == kD ? d.S : 0;
  c[llwire::kCfgTopk] = op == kD ? d.K : 0;
  c[llwire::kCfgHidden] = static_cast<int32_t>(d.H);
  c[llwire::kCfgDtype] = d.dtype_code | (d.fp8 << 16);  // an FP8 send never meets a plain one
  c[llwire::kCfgRowsPerDest] = static_cast<int32_t>(d.rows_per_dest);
  c[llwire::kCfgNumQps] = nq;
  c[llwire::kCfgCallSite] = static_cast<int32_t>(d.call_site);
  g->hash = llwire::config_hash(c);
  g->err = static_cast<wire::ErrorRecord*>(rt.err);
  g->area = Ll().area;
  g->A = Ll().A;
  g->elem = d.elem;
  return {};
}

}  // namespace

// Blocks for `warps` warps of work at `num_ranks` ranks, at most the low-latency mode's SMs
// (configs.h InternodeModeSms: JAX_EP_LOW_LATENCY_SMS or the preset, within the whole
// budget JAX_EP_NUM_SMS), one block per SM (kAssumedBlocksPerSm) and never more than one
// SM holds (its occupancy): the grid-stride loops cover the rest, and the ranks never wait
// on blocks that beside other work could not start.
int GridBlocks(const void* kernel, int* cache, int64_t warps, int num_ranks) {
  const int per = BlocksPerSm(kernel, cache);
  const int64_t cap = static_cast<int64_t>(InternodeModeSms(kModeLowLatency, num_ranks, SmCount())) *
                      (per < kAssumedBlocksPerSm ? per : kAssumedBlocksPerSm);
  int64_t b = (warps + kWarps - 1) / kWarps;
  if (b > cap) b = cap;
  return static_cast<int>(b < 1 ? 1 : b);
}

std::string Init(int num_ranks, int max_tokens, int64_t row_bytes, int topk, int num_experts) {
  internode::SharedRuntime rt;
  std::string e = internode::SharedState(&rt);
  if (!e.empty()) return e;
  if (Ll().lim.initialized) return "jax_ep internode low-latency: the area is already allocated";
  if (num_ranks != rt.world)
    return "jax_ep internode low-latency: num_ranks must be the transport's world (" +
           std::to_string(rt.world) + ")";
  if (max_tokens < 1 || row_bytes < 1 || topk < 1 || num_experts < 1 ||
      num_experts % num_ranks != 0)
    return "jax_ep internode low-latency: bad limits (max_tokens, row bytes, topk >= 1; "
           "num_experts a positive multiple of the ranks)";
  const Area A = llwire::area_layout(num_ranks, max_tokens, row_bytes, topk, num_experts);
  char* p = nullptr;
  e = internode::SymmetricArea(static_cast<size_t>(A.total), &p);
  if (!e.empty()) return e;
  e = CudaErr(cudaMemset(p, 0, static_cast<size_t>(A.total)), "clear area");
  const unsigned long long zero[llwire::kNumOps] = {0, 0};
  if (e.empty())
    e = CudaErr(cudaMemcpyToSymbol(g_ll_epoch, zero, sizeof(zero)), "epochs");
  if (e.empty()) e = CudaErr(cudaDeviceSynchronize(), "area");
  if (!e.empty()) return e;
  internode::TransportBarrier();
  Ll().area = p;
  Ll().A = A;
  Ll().lim.initialized = true;
  Ll().lim.R = num_ranks;
  Ll().lim.M = max_tokens;
  Ll().lim.K = topk;
  Ll().lim.E = num_experts;
  Ll().lim.row_bytes = row_bytes;
  Ll().lim.area_bytes = A.total;
  return {};
}

Limits GetLimits() { return Ll().lim; }

std::string Finalize() {
  if (!Ll().lim.initialized) return {};
  const std::string e = CudaErr(cudaDeviceSynchronize(), "finalize");
  internode::SymmetricAreaFree(Ll().area);
  Ll() = State{};
  return e;
}

std::string DispatchSend(cudaStream_t stream, const CallDims& d, const void* x,
                         const int32_t* topk_idx, int32_t* token) {
  G g;
  std::string e = MakeG(d, kD, &g);
  if (!e.empty()) return e;
  return LaunchDispatchSend(stream, g, x, topk_idx, token);
}

std::string DispatchRecv(cudaStream_t stream, const CallDims& d, const int32_t* token,
                         const DispatchRecvOut& out) {
  G g;
  std::string e = MakeG(d, kD, &g);
  if (!e.empty()) return e;
  return LaunchDispatchRecv(stream, g, token, out);
}

std::string CombineSend(cudaStream_t stream, const CallDims& d, const void* y,
                        const int32_t* first_row, const int32_t* row_count, int32_t* token) {
  G g;
  std::string e = MakeG(d, kC, &g);
  if (!e.empty()) return e;
  return LaunchCombineSend(stream, g, y, first_row, row_count, token);
}

std::string CombineRecv(cudaStream_t stream, const CallDims& d, const int32_t* token,
                        const int32_t* topk_idx, const float* topk_weights, void* out) {
  G g;
  std::string e = MakeG(d, kC, &g);
  if (!e.empty()) return e;
  return LaunchCombineRecv(stream, g, token, topk_idx, topk_weights, out);
}

std::string PendingError() {
  internode::SharedRuntime rt;
  if (!internode::SharedState(&rt).empty() || rt.err == nullptr) return {};
  const volatile wire::ErrorRecord* r = static_cast<const wire::ErrorRecord*>(rt.err);
  const int code = r->code;
  const int op = r->op - llwire::kErrOpBase;
  if (code == wire::kErrNone || code < 0 || op < 0 || op >= llwire::kNumOps)
    return hier::PendingError();  // another mode's error: its own wording
  const int peer = r->peer, kind = r->kind, qp = r->qp, rank = r->rank;
  const unsigned long long expected = r->expected, seen = r->seen;
  const std::string name = op == kD ? "dispatch" : "combine";
  std::string m = "jax_ep internode low-latency " + name + ": ";
  switch (code) {
    case wire::kErrTimeout:
      m += "timed out (JAX_EP_TIMEOUT_S) waiting for rank " + std::to_string(peer) + ": " +
           (kind == llwire::kKindHeader  ? std::string("its header")
            : kind == llwire::kKindData  ? "the count of its rows for local expert " +
                                               std::to_string(qp)
                                         : std::string("its credit (it has not finished the "
                                                       "call two epochs back)")) +
           ", word holds " + std::to_string(seen) + " of " + std::to_string(expected) +
           "; that rank skipped the call, failed earlier, is slower than the timeout, or "
           "more than two calls of this op are in flight";
      break;
    case wire::kErrMismatch:
      if (kind == llwire::kKindRows)
        m += "rank " + std::to_string(peer) + " returns " + std::to_string(seen) +
             " rows of its local expert " + std::to_string(qp) + " but this rank's routing "
             "expects " + std::to_string(expected) + "; pass the dispatch's topk_idx and handle";
      else if (kind == llwire::kKindCounts)
        m += "rank " + std::to_string(peer) + " sent a header whose counts (" +
             std::to_string(seen) + " rows) do not fit the blocks";
      else
        m += "rank " + std::to_string(peer) + " is in another call: this rank epoch " +
             std::to_string(static_cast<unsigned long long>(r->my_seq)) + " config hash " +
             std::to_string(expected) + ", rank " + std::to_string(peer) + " epoch " +
             std::to_string(static_cast<unsigned long long>(r->peer_seq)) + " config hash " +
             std::to_string(seen) +
             "; every rank must make the same low-latency calls with the same shapes";
      break;
    case wire::kErrPeerFailed:
      m += "rank " + std::to_string(peer) +
           " reported an error in this call (bad or repeated ids, or a bad handle there)";
      break;
    case wire::kErrBadId:
      if (op == kD)
        m += "topk_idx[" + std::to_string(peer) + ", " + std::to_string(qp) + "] = " +
             std::to_string(static_cast<long long>(seen)) + " is outside [-1, " +
             std::to_string(expected) + ") or repeats an expert of that token";
      else
        m += "the handle's row counts do not fit the blocks (local expert " +
             std::to_string(peer) + ", source " + std::to_string(qp) + ")";
      break;
    case wire::kErrExtraSignal:
      m += "rank " + std::to_string(peer) + " signalled " + std::to_string(seen) +
           " rows for local expert " + std::to_string(qp) + ", its header says " +
           std::to_string(expected);
      break;
    default:
      m += "error code " + std::to_string(code);
  }
  return m + " [rank " + std::to_string(rank) +
         "]. The internode transport stays failed for the life of this process; restart the "
         "job.";
}

}  // namespace ll_internode
}  // namespace jax_ep
