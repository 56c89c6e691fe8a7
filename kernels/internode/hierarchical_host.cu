// Host side of the hierarchical internode mode: the checks and geometry of a call (on the
// runtime and heap halves the direct mode starts, kernels/internode/nvshmem_host.cu), the
// per-call host code of dispatch, combine and gather (no host synchronisation: they queue
// the launchers of kernels/internode/hierarchical_kernels.cu, declared in
// kernels/internode/api.cuh), and the decoding of this mode's wait kinds in the sticky
// error record. xla_ffi/internode/emu_hier_small_rings.cc compiles it a second time, with
// the kernels, for the emulated GPU's small rings.
#include <cuda_runtime.h>

#include <string>

#include "kernels/common/settings.h"
#include "kernels/common/dtype_convert.h"
#include "kernels/common/layout_math.h"
#include "kernels/common/striping_plan.h"
#include "kernels/internode/api.cuh"
#include "kernels/internode/hierarchical_kernels.h"
#include "kernels/internode/hierarchical_layout.h"
#include "kernels/internode/internode_kernels.h"
#include "kernels/internode/low_latency_wire.h"
#include "kernels/internode/wire_protocol.h"

namespace jax_ep {
namespace hier {

std::string CudaErr(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return {};
  return std::string("jax_ep internode (hierarchical): ") + what + ": " +
         cudaGetErrorString(e);
}

namespace {

std::string MakeGeo(const HierDims& hd, int op, FloatKind elem, Geo* g,
                    internode::SharedRuntime* rt) {
  const internode::Dims& d = hd.base;
  std::string e = internode::SharedState(rt);
  if (!e.empty()) return e;
  if (d.num_ranks != rt->world || d.rank != rt->rank)
    return "jax_ep internode (hierarchical): the EP group must be all NVSHMEM PEs (" +
           std::to_string(rt->world) + "); got " + std::to_string(d.num_ranks) + " ranks";
  const int G = hd.gpus_per_node;
  if (G < 1 || G > kMaxGpusPerNode || d.num_ranks % G != 0)
    return "jax_ep internode (hierarchical): gpus_per_node must divide num_ranks (" +
           std::to_string(d.num_ranks) + ") and be in [1, " +
           std::to_string(kMaxGpusPerNode) + "], got " + std::to_string(G);
  if (d.num_ranks > kMaxRanks || d.num_ranks / G > kMaxNodes)
    return "jax_ep internode (hierarchical): at most 1024 ranks and 256 nodes";
  const int qps = d.num_ports * d.qps_per_port;
  if (d.num_ports < 1 || d.qps_per_port < 1 || qps > kMaxQps)
    return "jax_ep internode (hierarchical): bad transport config (ports, QPs per port)";
  if (qps != rt->num_qps)
    return "jax_ep internode (hierarchical): the call asks for " + std::to_string(qps) +
           " QPs per peer but NVSHMEM was started with " + std::to_string(rt->num_qps);
  const int eb = FloatKindBytes(elem);
  g->R = d.num_ranks;
  g->rank = d.rank;
  g->G = G;
  g->N = d.num_ranks / G;
  g->node = d.rank / G;
  g->local = d.rank % G;
  g->T = d.tokens;
  g->H = d.hidden;
  g->K = d.topk;
  g->C = d.capacity;
  g->E = d.num_experts;
  g->el = d.experts_per_rank > 0 ? d.experts_per_rank : 1;
  g->prow = static_cast<int64_t>(d.hidden) * eb;
  g->dmeta = meta_offset(g->prow) + 8 * static_cast<int64_t>(d.topk);
  g->cmeta = meta_offset(g->prow);
  g->P = d.num_ports;
  g->Qpp = d.qps_per_port;
  g->nq = qps;
  g->timeout_ns = d.timeout_ns > 0 ? d.timeout_ns : DefaultTimeoutNs();
  g->cfg[wire::kCfgOp] = op;
  g->cfg[wire::kCfgRanks] = d.num_ranks;
  g->cfg[wire::kCfgTokens] = d.tokens;
  g->cfg[wire::kCfgHidden] = d.hidden;
  g->cfg[wire::kCfgTopk] = d.topk;
  g->cfg[wire::kCfgCapacity] = d.capacity;
  g->cfg[wire::kCfgDtype] = static_cast<int32_t>(elem);
  g->cfg[wire::kCfgNumQps] = qps;
  g->cfg[wire::kCfgCallSite] = static_cast<int32_t>(d.call_site);
  // The node size is part of the configuration: a rank with another G is another call.
  g->hash = wire::config_hash(g->cfg) ^ (static_cast<uint32_t>(G) * 2654435761u);
  g->err = static_cast<wire::ErrorRecord*>(rt->err);
  g->bad = rt->bad;
  g->counter = rt->call_counter;
  g->heap = rt->heap;
  g->half_bytes = static_cast<int64_t>(rt->half_bytes);
  // Rows of either direction in one stride (a half serves either call).
  g->L = layout(d.num_ranks, G, qps, d.hidden, d.topk, eb, eb);
  g->stride = g->L.row_stride;
  g->rdma_ring_bytes = round_up(rdma_ring_rows() * g->stride, kAlign);
  g->nvl_ring_bytes = round_up(static_cast<int64_t>(kNvlRingRows) * g->stride, kAlign);
  if (g->L.total > g->half_bytes)
    return "jax_ep internode (hierarchical): the NVSHMEM heap is too small (a half needs " +
           std::to_string(g->L.total) + " bytes for the hierarchical rings, has " +
           std::to_string(g->half_bytes) +
           "); size it with jax_ep.nvshmem_bootstrap.heap_bytes_for(..., gpus_per_node=G)";
  // At the end of each half, so the direct mode's regions (at its start) never overlap
  // it when the heap is sized for both.
  g->region = (g->half_bytes - g->L.total) / kAlign * kAlign;
  return {};
}

}  // namespace

std::string Dispatch(cudaStream_t stream, const HierDims& d, FloatKind elem, const void* x,
                     const int32_t* topk_idx, const float* topk_weights,
                     const internode::DispatchOut& out) {
  Geo g;
  internode::SharedRuntime rt;
  std::string e = MakeGeo(d, wire::kOpDispatch, elem, &g, &rt);
  if (!e.empty()) return e;
  Outs o{static_cast<char*>(out.recv_x), out.recv_topk_idx, out.recv_topk_weights,
         out.recv_per_expert, out.src_rank, out.src_index};
  return RunDispatchPattern(stream, g, static_cast<const char*>(x), topk_idx, topk_weights,
                            nullptr, out.send_slot, o, false, out.num_recv, out.num_dropped,
                            out.counts, rt);
}

std::string Gather(cudaStream_t stream, const HierDims& d, FloatKind elem, const void* src,
                   const int32_t* counts, const int32_t* send_slot, void* out) {
  Geo g;
  internode::SharedRuntime rt;
  std::string e = MakeGeo(d, wire::kOpGather, elem, &g, &rt);
  if (!e.empty()) return e;
  (void)counts;  // the exchange recounts the rows from send_slot (same numbers)
  Outs o{static_cast<char*>(out), nullptr, nullptr, nullptr, nullptr, nullptr};
  return RunDispatchPattern(stream, g, static_cast<const char*>(src), nullptr, nullptr,
                            send_slot, nullptr, o, true, nullptr, nullptr, nullptr, rt);
}

std::string Combine(cudaStream_t stream, const HierDims& d, FloatKind elem, const void* y,
                    const int32_t* counts, const int32_t* send_slot, const int32_t* src_index,
                    void* out) {
  Geo g;
  internode::SharedRuntime rt;
  std::string e = MakeGeo(d, wire::kOpCombine, elem, &g, &rt);
  if (!e.empty()) return e;
  e = CudaErr(cudaMemsetAsync(rt.bad, 0, sizeof(int32_t) * 4, stream), "clear");
  if (!e.empty()) return e;
  return LaunchCombine(stream, g, elem, y, counts, send_slot, src_index, out);
}

std::string PendingError() {
  internode::SharedRuntime rt;
  if (!internode::SharedState(&rt).empty() || rt.err == nullptr) return {};
  const volatile wire::ErrorRecord* r = static_cast<const wire::ErrorRecord*>(rt.err);
  const int code = r->code;
  const int kind = r->kind;
  // The exchange's mismatch carries hashes, not the peer's configuration fields.
  const bool hier_mismatch = code == wire::kErrMismatch && kind == wire::kSigCounts;
  // a low-latency record (op past llwire::kErrOpBase): the direct decoder names it
  if (code == wire::kErrNone || code < 0 || r->op >= llwire::kErrOpBase ||
      (kind < kKindCredit && !hier_mismatch))
    return internode::PendingError();
  const int peer = r->peer, qp = r->qp, rank = r->rank;
  const unsigned long long expected = r->expected, seen = r->seen;
  std::string m = "jax_ep internode (hierarchical): ";
  switch (hier_mismatch ? -1 : kind) {
    case -1:
      m += "rank " + std::to_string(peer) + " is in another call: this rank seq " +
           std::to_string(static_cast<unsigned long long>(r->my_seq)) + " config hash " +
           std::to_string(expected) + ", rank " + std::to_string(peer) + " seq " +
           std::to_string(static_cast<unsigned long long>(r->peer_seq)) + " config hash " +
           std::to_string(seen) +
           " (the hash covers op, R, T, H, K, C, dtype, QPs, call site and GPUs per node); "
           "every rank must make the same EP calls with the same shapes in the same order";
      break;
    case kKindCredit:
      m += "timed out (JAX_EP_TIMEOUT_S) waiting for a ring credit from rank " +
           std::to_string(peer) + " (credit word holds " + std::to_string(seen) + " of " +
           std::to_string(expected) + " chunks freed)";
      break;
    case kKindNvl:
      m += "timed out (JAX_EP_TIMEOUT_S) on an NVLink ring shared with rank " +
           std::to_string(peer) + " (ring " + std::to_string(qp) +
           "); that rank skipped the call, failed earlier, or is slower than the timeout";
      break;
    case kKindSource:
      m += "timed out (JAX_EP_TIMEOUT_S) waiting for block " + std::to_string(qp) +
           " of this rank's combine to sum its columns (it stopped on an earlier wait)";
      break;
    case kKindPart:
      m += "timed out (JAX_EP_TIMEOUT_S) waiting for part " + std::to_string(qp) +
           " of one of this rank's dispatch rail forwarders or combine forwarders (it stopped on an "
           "earlier wait)";
      break;
    case kKindRow:
      m += "a row from rank " + std::to_string(peer) + " arrived out of order (expected " +
           std::to_string(expected) + ", got " + std::to_string(static_cast<long long>(seen)) +
           "); the ranks disagree on the dispatch handle";
      break;
    default:
      m += "rank " + std::to_string(peer) +
           " is on this node but has no NVSHMEM peer pointer (no NVLink / P2P path); the "
           "hierarchical mode needs one between the GPUs of a node";
  }
  return m + " [rank " + std::to_string(rank) +
         "]. The internode transport stays failed for the life of this process; restart the "
         "job.";
}

}  // namespace hier
}  // namespace jax_ep
