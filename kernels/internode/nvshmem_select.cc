// NVSHMEM's device selection for IBGDA (kernels/internode/nvshmem_select.h). Each step
// names the function of NVSHMEM's host source (3.5.1, commit 2d7d25f) it follows; the
// line numbers are in docs/internode.md.
#include "kernels/internode/nvshmem_select.h"

#include <algorithm>
#include <cstdlib>
#include <list>

namespace jax_ep {
namespace nvshmem_select {
namespace {

// src/include/device_host_transport/nvshmem_common_ibgda.h
constexpr int kMaxDevicesPerPe = 15;
// topo.cpp pci_distance_perf: PIX and PXB count as equally good.
constexpr int kPerf[5] = {4, 4, 3, 2, 1};
constexpr int kNotAssigned = -1;
constexpr int kNoOptimal = -2;

struct HcaItem {
  std::string name;
  int port = -1;  // -1: every port
  int count = 1;
};

// transport_common.cpp nvshmemt_parse_hca_list: "name[:port[:count]]" items, a leading
// '^' (handled by the caller) excluding them.
std::vector<HcaItem> ParseHcaList(const std::string& s) {
  std::vector<HcaItem> out;
  size_t i = (!s.empty() && s[0] == '^') ? 1 : 0;
  while (i <= s.size()) {
    size_t j = s.find(',', i);
    if (j == std::string::npos) j = s.size();
    const std::string item = s.substr(i, j - i);
    i = j + 1;
    if (item.empty()) continue;
    HcaItem h;
    const size_t c1 = item.find(':');
    h.name = item.substr(0, c1);
    if (c1 != std::string::npos) {
      h.port = std::atoi(item.c_str() + c1 + 1);
      const size_t c2 = item.find(':', c1 + 1);
      if (c2 != std::string::npos) h.count = std::atoi(item.c_str() + c2 + 1);
    }
    if (!h.name.empty()) out.push_back(h);
  }
  return out;
}

// ibgda.cpp nvshmemt_init, the device enumeration: devices in ibv_get_device_list order,
// ports in order; NVSHMEM_HCA_LIST filters (and wins over NVSHMEM_HCA_PE_MAPPING, which
// replicates an entry `count` times); inactive ports and other link layers are skipped.
std::vector<Entry> OrderedList(const NodeDesc& node, const EnvDesc& env) {
  const std::vector<HcaItem> hca = ParseHcaList(env.hca_list);
  const bool exclude = !env.hca_list.empty() && env.hca_list[0] == '^';
  const std::vector<HcaItem> map = hca.empty() ? ParseHcaList(env.hca_pe_mapping)
                                               : std::vector<HcaItem>{};
  std::vector<Entry> list;
  for (size_t d = 0; d < node.devices.size(); ++d) {
    const DeviceDesc& dev = node.devices[d];
    // ibgda.cpp nvshmemt_init: a device whose name lacks NVSHMEM_HCA_PREFIX is skipped
    if (dev.name.find(env.hca_prefix) == std::string::npos) continue;
    for (const PortDesc& p : dev.ports) {
      bool allowed = true;
      int replicate = 1;
      if (!hca.empty()) {
        allowed = exclude;
        for (const HcaItem& h : hca)
          if (h.name == dev.name && (h.port == -1 || h.port == p.num)) allowed = !exclude;
      } else if (!map.empty()) {
        allowed = false;
        for (const HcaItem& h : map)
          if (h.name == dev.name && (h.port == -1 || h.port == p.num)) {
            allowed = true;
            replicate = h.count;
          }
      }
      if (!allowed || !p.active || !p.rdma_link) continue;
      for (int k = 0; k < replicate; ++k) list.push_back({static_cast<int>(d), p.num});
    }
  }
  return list;
}

int NumaOf(const std::vector<int>& v, size_t i) {
  return i < v.size() ? v[i] : -1;
}

struct Pair {
  int pe, dev, dist;
};

// topo.cpp nvshmemi_get_devices_by_distance: every local PE's GPU against every entry,
// pairs ordered by distance (stable: PE-major, then list order); loop one gives each PE
// up to `max` entries rated as its best (pci_distance_perf: PIX = PXB); loop two moves a PE
// off an entry that two or more PEs share onto one rated no lower used by at least two
// fewer PEs.
std::vector<int> ByDistance(const NodeDesc& node, const std::vector<Entry>& list, int max,
                            int mype, std::vector<int>* dist_out) {
  const int npes = static_cast<int>(node.gpu_paths.size());
  const int ndev = static_cast<int>(list.size());
  std::list<Pair> pairs;
  for (int pe = 0; pe < npes; ++pe)
    for (int d = 0; d < ndev; ++d) {
      const DeviceDesc& dev = node.devices[static_cast<size_t>(list[d].device)];
      const int dist = PciDistance(node.gpu_paths[pe], dev.pci_path,
                                   NumaOf(node.gpu_numa, static_cast<size_t>(pe)), dev.numa);
      auto it = pairs.begin();
      while (it != pairs.end() && !(dist < it->dist)) ++it;
      pairs.insert(it, {pe, d, dist});
    }
  std::vector<int> sel(static_cast<size_t>(npes * max), kNotAssigned);
  std::vector<int> sdist(static_cast<size_t>(npes * max), kSys);
  std::vector<int> used(static_cast<size_t>(ndev), 0);
  int assigned = 0;
  for (const Pair& pr : pairs) {
    const int base = pr.pe * max;
    int slot = 0;
    while (slot < max && sel[base + slot] != kNotAssigned) ++slot;
    if (slot == max) continue;
    if (kPerf[pr.dist] < kPerf[sdist[base]]) {  // slot 0's distance, as the source reads it
      for (; slot < max; ++slot) {
        sel[base + slot] = kNoOptimal;
        ++assigned;
      }
    } else {
      sel[base + slot] = pr.dev;
      sdist[base + slot] = pr.dist;
      ++used[pr.dev];
      ++assigned;
    }
    if (assigned == npes * max) break;
  }
  for (int pe = 0; pe < npes; ++pe)
    for (int s = 0; s < max; ++s) {
      const int idx = pe * max + s;
      if (sel[idx] < 0) continue;
      int density = used[sel[idx]];
      if (density < 2) continue;
      for (const Pair& pr : pairs) {
        if (pr.pe != pe) continue;
        if (kPerf[pr.dist] < kPerf[sdist[idx]]) break;  // never a less optimal NIC
        if (density - used[pr.dev] >= 2) {
          --used[sel[idx]];
          ++used[pr.dev];
          density = used[pr.dev];
          sel[idx] = pr.dev;
          sdist[idx] = pr.dist;
          if (density < 2) break;
        }
      }
    }
  std::vector<int> mine;
  for (int s = 0; s < max; ++s) {
    const int v = sel[static_cast<size_t>(mype * max + s)];
    if (v < 0) break;  // the caller counts devices up to the first unset one
    mine.push_back(v);
    dist_out->push_back(sdist[static_cast<size_t>(mype * max + s)]);
  }
  return mine;
}

}  // namespace

int PciDistance(const std::string& gpu_path, const std::string& dev_path, int gpu_numa,
                int dev_numa) {
  int score = 0, depth = 0;
  bool same = true;
  for (size_t i = 0; i < gpu_path.size(); ++i) {
    const char other = i < dev_path.size() ? dev_path[i] : '\0';
    if (gpu_path[i] != other) same = false;
    if (gpu_path[i] == '/') {
      ++depth;
      if (same) ++score;
    }
  }
  if (score <= 3) return gpu_numa == dev_numa ? kNode : kSys;
  if (score == 4) return kPhb;
  if (score == depth - 1) return kPix;
  return kPxb;
}

namespace {
bool EnvBool(const std::map<std::string, std::string>& env, const char* name, bool* out) {
  auto it = env.find(name);
  if (it == env.end()) return false;
  const char c = it->second.empty() ? '1' : it->second[0];
  *out = !(c == '0' || c == 'n' || c == 'N' || c == 'f' || c == 'F');
  return true;
}
}  // namespace

EnvDesc EnvFrom(const std::map<std::string, std::string>& env) {
  EnvDesc e;
  auto str = [&](const char* k) {
    auto it = env.find(k);
    return it == env.end() ? std::string() : it->second;
  };
  e.hca_list = str("NVSHMEM_HCA_LIST");
  e.hca_pe_mapping = str("NVSHMEM_HCA_PE_MAPPING");
  if (env.count("NVSHMEM_HCA_PREFIX")) e.hca_prefix = str("NVSHMEM_HCA_PREFIX");
  if (!EnvBool(env, "NVSHMEM_ENABLE_MULTI_PORT", &e.multi_port))
    EnvBool(env, "NVSHMEM_IBGDA_ENABLE_MULTI_PORT", &e.multi_port);
  EnvBool(env, "NVSHMEM_ENABLE_NIC_PE_MAPPING", &e.nic_pe_mapping);
  return e;
}

std::string EntryName(const NodeDesc& node, const Entry& e) {
  if (e.device < 0 || e.device >= static_cast<int>(node.devices.size())) return "?";
  return node.devices[static_cast<size_t>(e.device)].name + ":" + std::to_string(e.port);
}

Selection Select(const NodeDesc& node, const EnvDesc& env, int pe_node, int num_qps) {
  Selection s;
  const int npes = static_cast<int>(node.gpu_paths.size());
  if (npes < 1 || pe_node < 0 || pe_node >= npes) {
    s.error = "local PE " + std::to_string(pe_node) + " is not one of the node's " +
              std::to_string(npes) + " GPU(s)";
    return s;
  }
  s.list = OrderedList(node, env);
  const int n = static_cast<int>(s.list.size());
  if (n == 0) {  // ibgda.cpp: "no active IB device that supports GPU-initiated ..."
    s.error = "no active RDMA port is left after NVSHMEM_HCA_LIST / NVSHMEM_HCA_PE_MAPPING";
    return s;
  }
  // transport.cpp nvshmemi_setup_connections
  s.max_devices_per_pe = std::max(n / npes, 1);
  std::vector<int> chosen, dist;
  if (n <= 1) {
    chosen = {0};
  } else if (env.nic_pe_mapping) {
    chosen = {pe_node % n};
  } else {
    chosen = ByDistance(node, s.list, s.max_devices_per_pe, pe_node, &dist);
    if (chosen.empty()) {
      s.error = "no device was assigned to this PE";
      return s;
    }
  }
  // ibgda.cpp nvshmemt_ibgda_connect_endpoints: one device unless multi-port is on.
  if (chosen.size() > 1 && !env.multi_port) {
    s.note = std::to_string(chosen.size()) + " devices were selected but multi-port is off: "
             "the first only";
    chosen.resize(1);
  }
  if (chosen.size() > static_cast<size_t>(kMaxDevicesPerPe)) chosen.resize(kMaxDevicesPerPe);
  if (s.max_devices_per_pe == 1 && n > 1 && !env.nic_pe_mapping && s.note.empty())
    s.note = std::to_string(n) + " device(s) for " + std::to_string(npes) +
             " PE(s) on the node: at most one per PE";
  for (size_t i = 0; i < chosen.size(); ++i) {
    s.devices.push_back(s.list[static_cast<size_t>(chosen[i])]);
    const Entry& e = s.devices.back();
    const DeviceDesc& d = node.devices[static_cast<size_t>(e.device)];
    s.distance.push_back(i < dist.size()
                             ? dist[i]
                             : PciDistance(node.gpu_paths[pe_node], d.pci_path,
                                           NumaOf(node.gpu_numa, static_cast<size_t>(pe_node)),
                                           d.numa));
  }
  // init.cu nvshmemx_qp_create -> ibgda.cpp ibgda_connect_rc_only: QP i on selected
  // device (last_device_index + i) % n, last_device_index 0 at the first call; without
  // custom QPs every handle stays NVSHMEMX_QP_DEFAULT.
  s.default_handles = !env.qp_api;
  for (int i = 0; i < num_qps; ++i)
    s.qps.push_back(s.devices[static_cast<size_t>(i) % s.devices.size()]);
  return s;
}

}  // namespace nvshmem_select
}  // namespace jax_ep
