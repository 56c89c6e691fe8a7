// The striping plan of kernels/common/striping_plan.h for jax_ep.network.transport, so Python and the
// kernels use one function; and the heap layout of kernels/internode/internode_layout.h.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <stdexcept>
#include <vector>

#include "kernels/internode/internode_layout.h"
#include "kernels/internode/nccl_select.h"
#include "kernels/internode/nvshmem_select.h"
#include "xla_ffi/internode/lag_rule.h"
#include "kernels/common/striping_plan.h"
#include "kernels/internode/wire_protocol.h"
#include "xla_ffi/common/transport_bindings.h"

namespace nb = nanobind;

namespace jax_ep {
namespace {
using In = nb::ndarray<const int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using Out = nb::ndarray<int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

void QpForArray(In peer, In channel, In chunk, int num_ports, int qps_per_port, Out qp,
                Out port) {
  const size_t n = peer.shape(0);
  if (channel.shape(0) != n || chunk.shape(0) != n || qp.shape(0) != n || port.shape(0) != n)
    throw std::invalid_argument("striping_qp_for_array: arrays differ in length");
  for (size_t i = 0; i < n; ++i) {
    const QpPort r = qp_for(static_cast<int32_t>(peer(i)), static_cast<int32_t>(channel(i)),
                            chunk(i), num_ports, qps_per_port);
    qp(i) = r.qp;
    port(i) = r.port;
  }
}
using Out2 = nb::ndarray<int64_t, nb::ndim<2>, nb::c_contig, nb::device::cpu>;

// The plan of one dispatch: bytes_per_peer[P] cut into chunks (num_chunks, chunk_size),
// chunk j sent by channel channel_for_chunk(j) on qp_for(peer, channel, j); adds each
// chunk's bytes to its port, QP and channel. Outputs are zeroed first.
void Stripe(In bytes_per_peer, int64_t chunk_bytes, int num_ports, int qps_per_port,
            int num_channels, Out chunks, Out2 port_bytes, Out2 qp_bytes, Out2 channel_bytes) {
  const size_t peers = bytes_per_peer.shape(0);
  if (chunks.shape(0) != peers || port_bytes.shape(0) != peers || qp_bytes.shape(0) != peers ||
      channel_bytes.shape(0) != peers || port_bytes.shape(1) != static_cast<size_t>(num_ports) ||
      qp_bytes.shape(1) != static_cast<size_t>(num_ports) * qps_per_port ||
      channel_bytes.shape(1) != static_cast<size_t>(num_channels))
    throw std::invalid_argument("striping_stripe: output shapes do not match the plan");
  for (size_t p = 0; p < peers; ++p) {
    for (int i = 0; i < num_ports; ++i) port_bytes(p, i) = 0;
    for (size_t i = 0; i < qp_bytes.shape(1); ++i) qp_bytes(p, i) = 0;
    for (int i = 0; i < num_channels; ++i) channel_bytes(p, i) = 0;
    const int64_t bytes = bytes_per_peer(p);
    const int64_t n = num_chunks(bytes, chunk_bytes);
    chunks(p) = n;
    for (int64_t j = 0; j < n; ++j) {
      const int64_t size = chunk_size(bytes, j, chunk_bytes);
      const int32_t ch = channel_for_chunk(j, num_channels);
      const QpPort r = qp_for(static_cast<int32_t>(p), ch, j, num_ports, qps_per_port);
      port_bytes(p, r.port) += size;
      qp_bytes(p, r.qp) += size;
      channel_bytes(p, ch) += size;
    }
  }
}

// (name, pci_path, numa, [(port, active, rdma_link), ...]) per device.
using DeviceTuple =
    std::tuple<std::string, std::string, int, std::vector<std::tuple<int, bool, bool>>>;

// A node from the bindings' device tuples (both selection models read the same one).
nvshmem_select::NodeDesc NodeOf(const std::vector<DeviceTuple>& devices,
                                const std::vector<std::string>& gpu_paths,
                                const std::vector<int>& gpu_numa) {
  nvshmem_select::NodeDesc node;
  for (const DeviceTuple& t : devices) {
    nvshmem_select::DeviceDesc d;
    d.name = std::get<0>(t);
    d.pci_path = std::get<1>(t);
    d.numa = std::get<2>(t);
    for (const auto& p : std::get<3>(t))
      d.ports.push_back({std::get<0>(p), std::get<1>(p), std::get<2>(p)});
    node.devices.push_back(d);
  }
  node.gpu_paths = gpu_paths;
  node.gpu_numa = gpu_numa;
  return node;
}

nb::dict NvshmemSelect(const std::vector<DeviceTuple>& devices,
                       const std::vector<std::string>& gpu_paths,
                       const std::vector<int>& gpu_numa,
                       const std::map<std::string, std::string>& env, int pe_node,
                       int num_qps, bool qp_api) {
  namespace ns = nvshmem_select;
  const ns::NodeDesc node = NodeOf(devices, gpu_paths, gpu_numa);
  ns::EnvDesc e = ns::EnvFrom(env);
  e.qp_api = qp_api;
  const ns::Selection s = ns::Select(node, e, pe_node, num_qps);
  auto names = [&](const std::vector<ns::Entry>& v) {
    std::vector<std::string> out;
    for (const ns::Entry& x : v) out.push_back(ns::EntryName(node, x));
    return out;
  };
  nb::dict d;
  d["list"] = names(s.list);
  d["max_devices_per_pe"] = s.max_devices_per_pe;
  d["devices"] = names(s.devices);
  d["distance"] = s.distance;
  d["qp_ports"] = names(s.qps);
  d["default_handles"] = s.default_handles;
  d["multi_port"] = e.multi_port;
  d["note"] = s.note;
  d["error"] = s.error;
  return d;
}

// NCCL's placement of GIN contexts (kernels/internode/nccl_select.h): same device tuples
// as nvshmem_select; lag_members: bonded device name -> member count.
nb::dict NcclSelect(const std::vector<DeviceTuple>& devices,
                    const std::vector<std::string>& gpu_paths, const std::vector<int>& gpu_numa,
                    const std::map<std::string, std::string>& env, int local_rank,
                    int num_contexts, const std::map<std::string, int>& lag_members,
                    int version, bool gdaki_port_one) {
  namespace cs = nccl_select;
  const cs::NodeDesc node = NodeOf(devices, gpu_paths, gpu_numa);
  cs::EnvDesc e = cs::EnvFrom(env);
  e.lag_members = lag_members;
  e.version = version;
  e.gdaki_port_one = gdaki_port_one;
  const cs::Selection s = cs::Select(node, e, local_rank, num_contexts);
  std::vector<std::string> ib, local, conn, ctx_ib, ctx_port;
  for (const cs::IbDev& x : s.ib_devs) ib.push_back(cs::IbDevName(node, x));
  for (int i : s.local_ib_devs) local.push_back(cs::IbDevName(node, s.ib_devs[i]));
  for (int i : s.connection_dev) conn.push_back(cs::IbDevName(node, s.ib_devs[i]));
  std::vector<int> ctx_conn, ctx_id, ctx_member;
  for (const cs::ContextPlace& c : s.contexts) {
    ctx_ib.push_back(cs::IbDevName(node, s.ib_devs[c.ib_dev]));
    ctx_port.push_back(cs::PlaceName(node, c));
    ctx_conn.push_back(c.connection);
    ctx_id.push_back(c.context_id);
    ctx_member.push_back(c.lag_member);
  }
  nb::dict d;
  d["backend"] = s.backend;
  d["ib_devs"] = ib;
  d["local_ib_devs"] = local;
  d["nets_per_gpu"] = s.nets_per_gpu;
  d["connections"] = conn;
  d["contexts_created"] = s.contexts_created;
  d["context_ib_dev"] = ctx_ib;
  d["context_ports"] = ctx_port;
  d["context_connection"] = ctx_conn;
  d["context_id"] = ctx_id;
  d["context_lag_member"] = ctx_member;
  d["notes"] = s.notes;
  d["error"] = s.error;
  return d;
}
}  // namespace

void AddTransportBindings(nb::module_& m) {
  // NVSHMEM's device and port selection (kernels/internode/nvshmem_select.h).
  m.def("nvshmem_select", &NvshmemSelect, nb::arg("devices"), nb::arg("gpu_paths"),
        nb::arg("gpu_numa"), nb::arg("env"), nb::arg("pe_node"), nb::arg("num_qps"),
        nb::arg("qp_api") = true);
  m.def("nvshmem_pci_distance", &nvshmem_select::PciDistance);
  // NCCL's placement of GIN contexts on devices, ports and LAG members.
  m.def("nccl_select", &NcclSelect, nb::arg("devices"), nb::arg("gpu_paths"),
        nb::arg("gpu_numa"), nb::arg("env"), nb::arg("local_rank"), nb::arg("num_contexts"),
        nb::arg("lag_members") = std::map<std::string, int>{}, nb::arg("version") = 23206,
        nb::arg("gdaki_port_one") = true);
  // The LAG shim's rule (xla_ffi/internode/lag_rule.h) for jax_ep.network.lag_affinity.
  m.def("lag_affinity", &lag_rule::Affinity, nb::arg("k"), nb::arg("group"),
        nb::arg("members"));
  m.def("lag_source_port", &lag_rule::SourcePort, nb::arg("k"), nb::arg("sport_base"));
  m.def("striping_qp_for",
        [](int peer, int channel, int64_t chunk, int num_ports, int qps_per_port) {
          const QpPort r = qp_for(peer, channel, chunk, num_ports, qps_per_port);
          return std::make_pair(r.qp, r.port);
        });
  m.def("striping_qp_for_array", &QpForArray);
  m.def("striping_channel_for_chunk",
        [](int64_t chunk, int num_channels) { return channel_for_chunk(chunk, num_channels); });
  m.def("striping_stripe", &Stripe);
  m.def("internode_heap_bytes",
        [](int64_t num_ranks, int64_t max_tokens, int64_t capacity, int64_t hidden,
           int64_t topk, int64_t x_bytes, int64_t y_bytes, int64_t hier_half_bytes) {
          return heap_bytes(num_ranks, max_tokens, capacity, hidden, topk, x_bytes, y_bytes,
                            hier_half_bytes);
        },
        nb::arg("num_ranks"), nb::arg("max_tokens"), nb::arg("capacity"), nb::arg("hidden"),
        nb::arg("topk"), nb::arg("x_bytes"), nb::arg("y_bytes"), nb::arg("hier_half_bytes") = 0);
  // The internode wire protocol's constants and layout, for the host simulator
  // (tests/sim/internode_sim.py) and `python -m jax_ep.plan --check-wire`.
  m.def("internode_protocol", []() {
    nb::dict d;
    d["max_qps"] = wire::kMaxQps;
    d["control_qp"] = wire::kControlQp;
    d["header_bytes"] = wire::kHeaderBytes;
    d["sig_kinds"] = nb::make_tuple(int(wire::kSigHeader), int(wire::kSigCounts),
                                    int(wire::kSigDispatch), int(wire::kSigCombine));
    d["num_sig_kinds"] = int(wire::kNumSigKinds);
    d["num_cfg_fields"] = int(wire::kNumCfgFields);
    d["heap_align"] = kHeapAlign;
    d["heap_slack_bytes"] = kHeapSlackBytes;
    return d;
  });
  m.def("internode_heap_half_bytes",
        [](int64_t heap_bytes) { return heap_half_bytes(heap_bytes); },
        "Bytes of each heap half the calls alternate over (internode_layout.h).");
  m.def("internode_sig_word", [](int kind, int num_ranks, int source, int qp) {
    return wire::sig_word(kind, num_ranks, source, qp);
  });
  m.def("internode_channel_of_qp", [](int peer, int qp, int num_ports, int qps_per_port) {
    return wire::channel_of_qp(peer, qp, num_ports, qps_per_port);
  });
  m.def("internode_expected_signal", [](int64_t n_chunks, int receiver, int qp, int num_ports,
                                        int qps_per_port) {
    return wire::expected_signal(n_chunks, receiver, qp, num_ports, qps_per_port);
  });
  m.def("internode_config_hash", [](std::vector<int32_t> cfg) {
    if (cfg.size() != static_cast<size_t>(wire::kNumCfgFields))
      throw std::invalid_argument("internode_config_hash: cfg needs kNumCfgFields values");
    return wire::config_hash(cfg.data());
  });
  m.def("internode_heap_layout",
        [](int64_t num_ranks, int64_t max_tokens, int64_t capacity, int64_t hidden,
           int64_t topk, int64_t x_bytes, int64_t y_bytes) {
          const HeapLayout L =
              heap_layout(num_ranks, max_tokens, capacity, hidden, topk, x_bytes, y_bytes);
          nb::dict d;
          d["sigs"] = L.sigs;
          d["hdr"] = L.hdr;
          d["counts"] = L.counts;
          d["recv"] = L.recv;
          d["back"] = L.back;
          d["stage"] = L.stage;
          d["cstage"] = L.cstage;
          d["total"] = L.total;
          d["dispatch_row_stride"] = dispatch_row_stride(hidden * x_bytes, topk);
          d["dispatch_meta_offset"] = dispatch_meta_offset(hidden * x_bytes);
          d["combine_row_stride"] = combine_row_stride(hidden * y_bytes);
          return d;
        });
#ifdef JAX_EP_WITH_NVSHMEM
  AddNvshmemBindings(m);
#endif
}

}  // namespace jax_ep
