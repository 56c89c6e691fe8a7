// Python bindings of the layouts and launch settings the kernels size their memory with,
// so that Python (jax_ep.cuda, jax_ep.nvshmem_bootstrap, jax_ep.network.hier_layout and
// the model in jax_ep.network.modes) calls the kernels' own functions instead of copies:
// the direct internode mode's rows (kernels/internode/internode_layout.h), the
// hierarchical mode's rings (kernels/internode/hierarchical_layout.h), the intranode
// buffer and launch presets (kernels/cuda/intranode_buffer.h, kernels/common/configs.h)
// and the intranode low-latency area (kernels/cuda/low_latency_layout.h). Host code of
// every build, CPU-only ones included.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <cstdint>
#include <stdexcept>

#include "kernels/common/configs.h"
#include "kernels/cuda/intranode_buffer.h"
#include "kernels/internode/hierarchical_layout.h"
#include "kernels/internode/internode_layout.h"
#include "xla_ffi/common/layout_bindings.h"
#include "xla_ffi/common/layout_dicts.h"

namespace nb = nanobind;

namespace jax_ep {
namespace {

nb::dict HierLayoutDict(int64_t num_ranks, int64_t gpus_per_node, int64_t num_qps,
                        int64_t hidden, int64_t topk, int64_t x_bytes, int64_t y_bytes) {
  // hier::layout divides by it (the kernels check it before they get there).
  if (gpus_per_node < 1) throw std::invalid_argument("hier_layout: gpus_per_node must be >= 1");
  const hier::Layout L =
      hier::layout(num_ranks, gpus_per_node, num_qps, hidden, topk, x_bytes, y_bytes);
  nb::dict d;
  d["sig_data"] = L.sig_data;
  d["sig_credit"] = L.sig_credit;
  d["sig_counts"] = L.sig_counts;
  d["nvl_head"] = L.nvl_head;
  d["nvl_tail"] = L.nvl_tail;
  d["counts"] = L.counts;
  d["rdma_send"] = L.rdma_send;
  d["rdma_recv"] = L.rdma_recv;
  d["nvl_recv"] = L.nvl_recv;
  d["row_stride"] = L.row_stride;
  d["rdma_bytes"] = L.rdma_bytes;
  d["nvl_bytes"] = L.nvl_bytes;
  d["total"] = L.total;
  return d;
}

nb::dict IntranodeConstants() {
  nb::dict d;
  d["max_ranks"] = kMaxRanks;
  d["max_channels"] = kMaxChannels;
  d["max_split_send_ranks"] = kMaxSplitSendRanks;
  d["header_bytes"] = kHeaderBytes;
  d["area_align"] = kAreaAlign;
  d["ring_tokens"] = kRingTokens;
  d["max_ring_tokens"] = kMaxRingTokens;
  d["reserved_sms"] = kReservedSms;
  d["blocks_per_sm"] = kAssumedBlocksPerSm;
  d["channel_threads"] = kChannelThreads;
  d["max_channel_threads"] = kMaxChannelThreads;
  d["plan_threads"] = kPlanThreads;
  d["presets"] = IntranodePresetList();
  return d;
}

// The presets as a launch runs them on a GPU of `device_sms` SMs: cut to the SM budget
// (EpSmBudget, which reads JAX_EP_NUM_SMS) by FitPresetToSms.
nb::list FittedPresets(int device_sms) {
  nb::list l;
  for (const IntranodePreset& p : kIntranodePresets)
    l.append(PresetDict(FitPresetToSms(p, EpSmBudget(device_sms))));
  return l;
}

// A channel block's threads and the dispatch channel kernel's dynamic shared memory at
// `num_ranks` ranks (the largest bulk-copy piece: JAX_EP_BULK_PIECE_BYTES only lowers it).
nb::dict ChannelBlock(int num_ranks) {
  if (num_ranks < 1 || num_ranks > kMaxRanks)
    throw std::invalid_argument("jax_ep: num_ranks must be in [1, 32]");
  nb::dict d;
  d["role_threads"] = ChannelRoleThreads(num_ranks);
  d["dispatch_threads"] = DispatchRoleThreads(num_ranks);
  d["bulk_piece_bytes"] = DispatchBulkPieceBytes(num_ranks);
  d["dispatch_smem_bytes"] =
      DispatchChannelSmemBytes(num_ranks, DispatchBulkPieceBytes(num_ranks));
  return d;
}

}  // namespace

void AddLayoutBindings(nb::module_& m) {
  // --- internode, direct mode: one row of each direction (internode_layout.h)
  m.def("internode_dispatch_row_stride", [](int64_t hidden_bytes, int64_t topk) {
    return dispatch_row_stride(hidden_bytes, topk);
  });
  m.def("internode_combine_row_stride",
        [](int64_t hidden_bytes) { return combine_row_stride(hidden_bytes); });
  m.def("internode_wire_chunk_bytes",
        [](int64_t chunk_bytes) { return wire_chunk_bytes(chunk_bytes); });

  // --- internode, hierarchical mode (hierarchical_layout.h)
  m.def("hier_layout_constants", []() {
    nb::dict d;
    d["rdma_chunk_rows"] = hier::kRdmaChunkRows;
    d["rdma_ring_chunks"] = hier::kRdmaRingChunks;
    d["nvl_ring_rows"] = hier::kNvlRingRows;
    d["max_gpus_per_node"] = hier::kMaxGpusPerNode;
    d["meta_words"] = hier::kMetaWords;
    return d;
  });
  m.def("hier_meta_offset", [](int64_t hidden_bytes) { return hier::meta_offset(hidden_bytes); });
  m.def("hier_dispatch_row_stride", [](int64_t hidden_bytes, int64_t topk) {
    return hier::dispatch_row_stride(hidden_bytes, topk);
  });
  m.def("hier_combine_row_stride",
        [](int64_t hidden_bytes) { return hier::combine_row_stride(hidden_bytes); });
  m.def("hier_layout", &HierLayoutDict, nb::arg("num_ranks"), nb::arg("gpus_per_node"),
        nb::arg("num_qps"), nb::arg("hidden"), nb::arg("topk"), nb::arg("x_bytes"),
        nb::arg("y_bytes"));
  m.def("hier_state_bytes",
        [](int64_t num_ranks, int64_t gpus_per_node, int64_t num_qps, int64_t hidden,
           int64_t topk, int64_t x_bytes, int64_t y_bytes) {
          if (gpus_per_node < 1)
            throw std::invalid_argument("hier_state_bytes: gpus_per_node must be >= 1");
          return hier::state_bytes(num_ranks, gpus_per_node, num_qps, hidden, topk, x_bytes,
                                   y_bytes);
        });

  // --- intranode (intranode_buffer.h, configs.h, low_latency_layout.h)
  m.def("intranode_constants", &IntranodeConstants);
  m.def("intranode_channels", [](int num_ranks) { return SetupChannels(num_ranks); });
  m.def("intranode_dispatch_channels", [](int num_ranks) {
    return DispatchChannels(num_ranks, SetupChannels(num_ranks));
  });
  m.def("intranode_ring_tokens", []() { return IntranodeRingTokens(); });
  m.def("intranode_area_bytes", &IntranodeAreaDict, nb::arg("num_ranks"), nb::arg("row_bytes"),
        nb::arg("topk"));
  m.def("intranode_ll_layout", &LowLatencyLayoutDict, nb::arg("num_ranks"),
        nb::arg("max_tokens"), nb::arg("row_bytes"), nb::arg("topk"), nb::arg("num_experts"));
  m.def("intranode_fitted_presets", &FittedPresets, nb::arg("device_sms"));
  m.def("intranode_channel_block", &ChannelBlock, nb::arg("num_ranks"));
}

}  // namespace jax_ep
