// The direct internode mode's FFI handlers on the emulated GPU: this translation unit
// includes the handler source itself, so an emulated call runs the handler's argument
// checks and argument construction and then the launch sequence (internode::Dispatch, ...)
// over the emulated NVSHMEM (kernels/emu/nvshmem_emu.h); ops: JEP_INTERNODE_TARGETS
// without "jax_ep_". Also the ops that start the emulated NVSHMEM world and read its
// transport log (tests/emu/internode_emu_util.py).
#include "xla_ffi/internode/internode_handlers.cc"  // NOLINT(build/include): the handlers
#include "kernels/emu/nvshmem_emu.h"
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
    for (int r = 0; r < w.num_pes; ++r) {  // a previous world's heaps
      cudaSetDevice(r);
      ll_internode::Finalize();  // the low-latency area first (it lives in the heap)
      if (internode::Initialized()) internode::Finalize();
    }
    cudaSetDevice(a.ordinal);
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
    return {};
  }
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
