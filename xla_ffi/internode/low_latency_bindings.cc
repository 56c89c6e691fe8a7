// Python bindings of the internode low-latency mode: its wire protocol
// (kernels/internode/low_latency_wire.h; every build, for the host simulator and the heap
// sizing) and, with NVSHMEM, the start of its symmetric area.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/internode/low_latency_wire.h"
#include "xla_ffi/internode/low_latency_handlers.h"
#ifdef JAX_EP_WITH_NVSHMEM
#include "kernels/internode/low_latency_kernels.h"
#endif

namespace nb = nanobind;

namespace jax_ep {

void AddLowLatencyWireBindings(nb::module_& m) {
  m.def("ll_protocol", []() {
    nb::dict d;
    d["max_qps"] = llwire::kMaxQps;
    d["control_qp"] = llwire::kControlQp;
    d["num_bufs"] = llwire::kNumBufs;
    d["ops"] = nb::make_tuple(int(llwire::kOpDispatch), int(llwire::kOpCombine));
    d["err_op_base"] = llwire::kErrOpBase;
    d["kinds"] = nb::make_tuple(int(llwire::kKindHeader), int(llwire::kKindData),
                                int(llwire::kKindCredit), int(llwire::kKindRows),
                                int(llwire::kKindCounts));
    d["num_cfg_fields"] = int(llwire::kNumCfgFields);
    d["header_fixed_bytes"] = static_cast<int>(sizeof(llwire::Header));
    return d;
  });
  m.def("ll_config_hash", [](std::vector<int32_t> cfg) {
    if (cfg.size() != llwire::kNumCfgFields)
      throw std::invalid_argument("ll_config_hash: expected " +
                                  std::to_string(llwire::kNumCfgFields) + " fields");
    return llwire::config_hash(cfg.data());
  });
  m.def("ll_expert_qp", [](int reader, int e, int num_ports, int qps_per_port) {
    return llwire::expert_qp(reader, e, num_ports, qps_per_port);
  });
  m.def("ll_widen_epoch", [](uint64_t latest, uint32_t low) {
    return llwire::widen_epoch(latest, low);
  });
  m.def("ll_area_layout", [](int64_t R, int64_t M, int64_t row_bytes, int64_t K, int64_t E) {
    const llwire::Area a = llwire::area_layout(R, M, row_bytes, K, E);
    nb::dict d;
    d["dsig"] = a.dsig;
    d["hsig"] = a.hsig;
    d["credit"] = a.credit;
    d["hdr"] = a.hdr;
    d["hstage"] = a.hstage;
    d["bad"] = a.bad;
    d["pos"] = a.pos;
    d["counts"] = a.counts;
    d["offsets"] = a.offsets;
    d["done"] = a.done;
    d["dstage"] = a.dstage;
    d["drecv"] = a.drecv;
    d["cstage"] = a.cstage;
    d["crecv"] = a.crecv;
    d["total"] = a.total;
    d["dispatch_stride"] = a.ds;
    d["combine_stride"] = a.cs;
    d["header_stride"] = a.hs;
    d["rows_per_dest"] = a.rpd;
    d["stage_rows"] = a.stage_rows;
    return d;
  });
#ifdef JAX_EP_WITH_NVSHMEM
  // Collective (every PE, after nvshmem_init): allocates the low-latency area.
  m.def("ll_internode_init", [](int num_ranks, int max_tokens, int64_t row_bytes, int topk,
                                int num_experts) {
    std::string e;
    {
      nb::gil_scoped_release unlocked;  // collective: the bootstrap's watchdog may report it
      e = ll_internode::Init(num_ranks, max_tokens, row_bytes, topk, num_experts);
    }
    if (!e.empty()) throw std::runtime_error(e);
  });
  // Collective: frees the area; jax_ep.nvshmem_bootstrap.finalize calls it first.
  m.def("ll_internode_finalize", []() {
    const std::string e = ll_internode::Finalize();
    if (!e.empty()) throw std::runtime_error(e);
  });
  m.def("ll_internode_info", []() {
    nb::dict d;
    const ll_internode::Limits l = ll_internode::GetLimits();
    d["initialized"] = l.initialized;
    d["num_ranks"] = l.R;
    d["max_tokens"] = l.M;
    d["row_bytes"] = l.row_bytes;
    d["topk"] = l.K;
    d["num_experts"] = l.E;
    d["area_bytes"] = l.area_bytes;
    return d;
  });
#endif
}

}  // namespace jax_ep
