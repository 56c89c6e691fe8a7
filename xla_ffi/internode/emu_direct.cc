// The direct internode mode's FFI handlers on the emulated GPU: this translation unit
// includes the handler source itself, so an emulated call runs the handler's argument
// checks and argument construction and then the launch sequence (internode::Dispatch, ...)
// over the emulated NVSHMEM (kernels/emu/nvshmem_emu.h); ops: JEP_INTERNODE_TARGETS
// without "jax_ep_". Also the ops that start the emulated NVSHMEM world and read its
// transport log (tests/emu/internode_emu_util.py).
#include <cstring>
#include <vector>

#include "xla_ffi/internode/internode_handlers.cc"  // NOLINT(build/include): the handlers
#include "kernels/emu/nvshmem_emu.h"
#if defined(JAX_EP_WITH_NCCL)
#include "kernels/emu/nccl_emu.h"
#include "kernels/internode/nccl_host.h"
#endif
#include "kernels/internode/hierarchical_kernels.h"
#include "kernels/internode/low_latency_kernels.h"
#include "xla_ffi/emu/emu_call.h"

namespace jax_ep {
namespace emu_internode {
namespace {
namespace ffi = xla::ffi;
using emu_driver::CallArgs;

JEP_EMU_TARGETS_RUNNER(RunTargets, JEP_INTERNODE_TARGETS)

// Log record fields, in the columns of the "internode_log" op's s32[n, 9] output.
constexpr int kLogCols = 9;

// Every virtual GPU's internode state of an earlier world, whichever transport it ran on
// (a new world of either kind starts from nothing).
void FinalizeWorlds(int num_ranks) {
  for (int r = 0; r < num_ranks; ++r) {
    cudaSetDevice(r);
    ll_internode::Finalize();  // the low-latency area first (it lives in the heap)
    if (internode::Initialized()) internode::Finalize();
#if defined(JAX_EP_WITH_NCCL)
    nccl_host::Finish({r});  // also what a failed start left (nothing made: nothing to do)
#endif
  }
}

#if defined(JAX_EP_WITH_NCCL)
// The NCCL GIN world's ops (tests/emu/internode_emu_util.py, transport="nccl").
constexpr int kNcclLogCols = 11;
std::string InvokeNccl(const CallArgs& a, bool* known) {
  *known = true;
  if (a.op == "internode_nccl_world") {  // once, on any virtual GPU: a fresh NCCL world
    nccl_emu::WorldConfig w;
    w.num_ranks = static_cast<int>(a.attr("num_ranks"));
    w.gpus_per_node = static_cast<int>(a.attr("gpus_per_node"));
    w.seed = static_cast<uint64_t>(a.attr("seed"));
    w.max_delay = static_cast<int>(a.attr("max_delay"));
    if (a.attrs.count("settle_delay")) w.settle_delay = static_cast<int>(a.attr("settle_delay"));
    if (a.attrs.count("max_contexts")) w.max_contexts = static_cast<int>(a.attr("max_contexts"));
    nvshmem_emu::grow(w.num_ranks);  // the earlier worlds' state on every virtual GPU
    nccl_emu::grow(w.num_ranks);
    FinalizeWorlds(w.num_ranks);
    cudaSetDevice(a.ordinal);
    // The NVSHMEM world goes too: its undelivered operations (a failed call's) would
    // count as pending work for ever and keep the emulator from idling forward.
    nvshmem_emu::WorldConfig none;
    none.num_pes = w.num_ranks;
    nvshmem_emu::reset(none);
    nccl_emu::reset(w);
    return {};
  }
  if (a.op == "internode_nccl_uid") {  // u8[128]: a fresh ncclUniqueId
    std::string uid;
    const std::string e = nccl_host::UniqueId(&uid);
    if (!e.empty()) return e;
    std::memcpy(a.out.at(0)->data, uid.data(), uid.size());
    return {};
  }
  if (a.op == "internode_nccl_start") {  // one process: GPUs [ordinal, ordinal + local)
    const int local = static_cast<int>(a.attr("local"));
    std::vector<int> ordinals, ranks;
    for (int i = 0; i < local; ++i) {
      ordinals.push_back(a.ordinal + i);
      ranks.push_back(a.ordinal + i);
    }
    const std::string uid(static_cast<const char*>(a.in.at(0)->data), 128);
    std::vector<int64_t> ll;  // the low-latency area made at start, as the bootstrap asks
    if (a.attrs.count("ll_max_tokens"))
      ll = {a.attr("ll_max_tokens"), a.attr("ll_row_bytes"), a.attr("ll_topk"),
            a.attr("ll_num_experts")};
    const std::string e = internode::StartOverNccl(
        ordinals, ranks, static_cast<int>(a.attr("world")), uid,
        static_cast<size_t>(a.attr("heap_bytes")), static_cast<int>(a.attr("num_qps")),
        static_cast<int>(a.attr("gpus_per_node")), ll);
    cudaSetDevice(a.ordinal);
    return e;
  }
  if (a.op == "internode_nccl_ports") {  // s32[R, n]: the wire port of each rank's contexts
    const int32_t* p = static_cast<const int32_t*>(a.in.at(0)->data);
    const int64_t R = a.in.at(0)->dims[0], n = a.in.at(0)->dims[1];
    for (int64_t r = 0; r < R; ++r)
      nccl_emu::set_context_ports(static_cast<int>(r), std::vector<int>(p + r * n, p + r * n + n));
    return {};
  }
  if (a.op == "internode_nccl_log_size") {  // s32[2]: records, operations still pending
    int32_t* o = static_cast<int32_t*>(a.out.at(0)->data);
    o[0] = static_cast<int32_t>(nccl_emu::log().size());
    o[1] = static_cast<int32_t>(nccl_emu::pending());
    return {};
  }
  // s32[n, 11]: src dst ctx port devcomm block bytes kind call done sig_off
  if (a.op == "internode_nccl_log") {
    const auto& log = nccl_emu::log();
    int32_t* o = static_cast<int32_t*>(a.out.at(0)->data);
    const int64_t n = a.out.at(0)->dims[0];
    for (int64_t i = 0; i < n && i < static_cast<int64_t>(log.size()); ++i) {
      const nccl_emu::LogRecord& p = log[static_cast<size_t>(i)];
      const int64_t row[kNcclLogCols] = {p.src,   p.dst,   p.context, p.port, p.devcomm, p.block,
                                         p.bytes, p.kind,  p.call,    p.done, p.sig_off};
      for (int c = 0; c < kNcclLogCols; ++c) o[i * kNcclLogCols + c] = static_cast<int32_t>(row[c]);
    }
    nccl_emu::clear_log();
    return {};
  }
  *known = false;
  return {};
}
#endif

std::string Invoke(const CallArgs& a, bool* known) {
  *known = true;
  if (a.op == "internode_world") {  // once, on any virtual GPU: a fresh NVSHMEM world
    nvshmem_emu::WorldConfig w;
    w.num_pes = static_cast<int>(a.attr("num_pes"));
    w.gpus_per_node = static_cast<int>(a.attr("gpus_per_node"));
    w.num_ports = static_cast<int>(a.attr("num_ports"));
    w.qps_per_port = static_cast<int>(a.attr("qps_per_port"));
    w.seed = static_cast<uint64_t>(a.attr("seed"));
    w.max_delay = static_cast<int>(a.attr("max_delay"));
    w.qp_api = a.attr("qp_api") != 0;
    w.default_handles = a.attrs.count("default_handles") && a.attr("default_handles") != 0;
    nvshmem_emu::grow(w.num_pes);  // PEs a smaller world in between left out
#if defined(JAX_EP_WITH_NCCL)
    nccl_emu::grow(w.num_pes);
#endif
    FinalizeWorlds(w.num_pes);  // a previous world's heaps
    cudaSetDevice(a.ordinal);
#if defined(JAX_EP_WITH_NCCL)
    // An NCCL world's unsettled data would count as pending work for ever (it settles
    // only at NCCL polls) and keep the emulator from idling forward: that world goes.
    nccl_emu::WorldConfig none;
    none.num_ranks = w.num_pes;
    nccl_emu::reset(none);
#endif
    nvshmem_emu::reset(w);
    return {};
  }
  if (a.op == "internode_init") {  // on every virtual GPU: the bootstrap's Init
    std::string uid;
    std::string e = internode::UniqueId(&uid);
    if (e.empty())
      e = internode::Init(a.ordinal, static_cast<int>(a.attr("num_pes")), uid,
                          static_cast<size_t>(a.attr("heap_bytes")),
                          static_cast<int>(a.attr("num_qps")), a.attr("qp_api") != 0, false);
    return e;
  }
  if (a.op == "internode_error") {  // this rank's recorded error (both modes' wording)
    return hier::PendingError();
  }
  if (a.op == "internode_call_tag") {  // numbers the puts logged from now on
    nvshmem_emu::set_call(a.attr("call"));
#if defined(JAX_EP_WITH_NCCL)
    nccl_emu::set_call(a.attr("call"));
#endif
    return {};
  }
#if defined(JAX_EP_WITH_NCCL)
  if (a.op.rfind("internode_nccl_", 0) == 0) return InvokeNccl(a, known);
#endif
  if (a.op == "internode_log_size") {  // s32[2]: records, operations still queued
    int32_t* o = static_cast<int32_t*>(a.out.at(0)->data);
    o[0] = static_cast<int32_t>(nvshmem_emu::put_log().size());
    o[1] = static_cast<int32_t>(nvshmem_emu::pending());
    return {};
  }
  if (a.op == "internode_log") {  // s32[n, 9]: src dst qp port handle bytes sig_op call block
    const auto& log = nvshmem_emu::put_log();
    int32_t* o = static_cast<int32_t*>(a.out.at(0)->data);
    const int64_t n = a.out.at(0)->dims[0];
    for (int64_t i = 0; i < n && i < static_cast<int64_t>(log.size()); ++i) {
      const nvshmem_emu::PutRecord& p = log[static_cast<size_t>(i)];
      const int64_t row[kLogCols] = {p.src,   p.dst,    p.qp,   p.port, p.handle,
                                     p.bytes, p.sig_op, p.call, p.block};
      for (int c = 0; c < kLogCols; ++c) o[i * kLogCols + c] = static_cast<int32_t>(row[c]);
    }
    nvshmem_emu::clear_log();
    return {};
  }
  return RunTargets(a, a.op, known);  // internode_{dispatch,combine,gather}
}

emu_driver::RegisterInvoker g_register(Invoke);

}  // namespace
}  // namespace emu_internode
}  // namespace jax_ep
