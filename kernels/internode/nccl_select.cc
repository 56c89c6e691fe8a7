// NCCL's placement of GIN contexts on devices and ports (kernels/internode/nccl_select.h).
// Each step cites the NCCL source it follows: github.com/NVIDIA/nccl master 5067397c
// (v2.30.7-1); file:line as in that commit.
#include "kernels/internode/nccl_select.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <strings.h>

namespace jax_ep {
namespace nccl_select {
namespace {

constexpr int kMaxConnections = 4;  // NCCL_GIN_MAX_CONNECTIONS (gin_device_host_common.h:15)

// src/misc/utils.cc:189 parseStringList: "prefix[:port[:rail[:plane]]]" items separated
// by ','; an empty or absent port is -1 (every port).
struct HcaItem {
  std::string prefix;
  int port = -1;
};

std::vector<HcaItem> ParseList(const std::string& s) {
  std::vector<HcaItem> out;
  size_t i = 0;
  while (i <= s.size()) {
    size_t j = s.find(',', i);
    if (j == std::string::npos) j = s.size();
    const std::string item = s.substr(i, j - i);
    i = j + 1;
    const size_t c1 = item.find(':');
    HcaItem h;
    h.prefix = item.substr(0, c1);
    if (h.prefix.empty()) continue;
    if (c1 != std::string::npos && c1 + 1 < item.size() && item[c1 + 1] != ':')
      h.port = std::atoi(item.c_str() + c1 + 1);
    out.push_back(h);
  }
  return out;
}

// src/misc/utils.cc:218-243 matchIf / matchPort / matchIfList: a prefix match, or the
// whole name with '='; a port of -1 on either side matches; an empty list matches all.
bool MatchIfList(const std::string& name, int port, const std::vector<HcaItem>& list,
                 bool exact) {
  if (list.empty()) return true;
  for (const HcaItem& h : list) {
    const bool name_ok = exact ? name == h.prefix
                               : name.compare(0, h.prefix.size(), h.prefix) == 0;
    const bool port_ok = h.port == -1 || port == -1 || h.port == port;
    if (name_ok && port_ok) return true;
  }
  return false;
}

// init.cc:53-57 ncclIbCompareDevs via pciPathToInt64: the PCI function of the path's last
// component ("0000:17:00.0") as a number.
int64_t PciKey(const std::string& path) {
  const size_t slash = path.rfind('/');
  const std::string last = slash == std::string::npos ? path : path.substr(slash + 1);
  int64_t v = 0;
  for (char c : last) {
    if (c >= '0' && c <= '9') v = v * 16 + (c - '0');
    else if (c >= 'a' && c <= 'f') v = v * 16 + (c - 'a' + 10);
    else if (c >= 'A' && c <= 'F') v = v * 16 + (c - 'A' + 10);
  }
  return v;
}

bool IsPow2(int v) { return v > 0 && (v & (v - 1)) == 0; }

// src/graph/topo.h:288 mirrorBits.
int MirrorBits(int val, int pow2) {
  int mirror = 0;
  for (int b = 1, mb = (pow2 >> 1); b < pow2; b <<= 1, mb >>= 1)
    if (val & b) mirror |= mb;
  return mirror;
}

bool ParseInt(const std::map<std::string, std::string>& env, const char* k, int64_t* out) {
  auto it = env.find(k);
  if (it == env.end() || it->second.empty()) return false;
  char* end = nullptr;
  const long long v = std::strtoll(it->second.c_str(), &end, 0);
  if (end == it->second.c_str()) return false;
  *out = v;
  return true;
}

}  // namespace

EnvDesc EnvFrom(const std::map<std::string, std::string>& env) {
  EnvDesc e;
  auto it = env.find("NCCL_IB_HCA");
  if (it != env.end()) e.ib_hca = it->second;
  int64_t v;
  if (ParseInt(env, "NCCL_IB_DISABLE", &v)) e.ib_disable = v != 0;
  if (ParseInt(env, "NCCL_IB_DEVICE_PCI_ORDER", &v)) e.ib_pci_order = v != 0;
  if (ParseInt(env, "NCCL_IB_MERGE_NICS", &v)) e.ib_merge_nics = v != 0;
  it = env.find("NCCL_NETDEVS_POLICY");
  if (it != env.end()) e.netdevs_policy = it->second;
  if (ParseInt(env, "NCCL_GIN_NCONNECTIONS", &v)) e.gin_nconnections = static_cast<int>(v);
  if (ParseInt(env, "NCCL_GIN_TYPE", &v)) e.gin_type = static_cast<int>(v);
  if (ParseInt(env, "NCCL_GIN_ENABLE", &v)) e.gin_enable = v != 0;
  if (ParseInt(env, "NCCL_GIN_GDAKI_LAG_AWARE_DISABLE", &v)) e.lag_aware_disable = v != 0;
  return e;
}

std::string IbDevName(const NodeDesc& node, const IbDev& d) {
  if (d.device < 0 || d.device >= static_cast<int>(node.devices.size())) return "?";
  return node.devices[d.device].name + ":" + std::to_string(d.port);
}

std::string PlaceName(const NodeDesc& node, const ContextPlace& c) {
  return IbDevName(node, IbDev{c.device, c.port});
}

Selection Select(const NodeDesc& node, const EnvDesc& env, int local_rank, int num_contexts) {
  Selection s;
  const int ngpus = static_cast<int>(node.gpu_paths.size());
  if (local_rank < 0 || local_rank >= ngpus) {
    s.error = "local rank " + std::to_string(local_rank) + " has no GPU in the node";
    return s;
  }
  // gin_host.cc:85-88: NCCL_GIN_ENABLE=0 fails ncclGinConnectOnce.
  if (!env.gin_enable) {
    s.error = "NCCL_GIN_ENABLE=0: GIN is disabled";
    return s;
  }
  // init.cc:291: NCCL_IB_DISABLE=1 leaves the IB plugin (and GIN over it) without devices.
  if (env.ib_disable) {
    s.error = "NCCL_IB_DISABLE=1: no IB devices for GIN";
    return s;
  }

  // 1. The device list, init.cc:317-462: every ACTIVE port with an IB or Ethernet link
  //    layer of every device, kept where NCCL_IB_HCA matches (init.cc:320-324 strip a
  //    leading '^' (exclude) then '=' (exact names); init.cc:370 the match XOR '^').
  std::string hca = env.ib_hca;
  const bool search_not = !hca.empty() && hca[0] == '^';
  if (search_not) hca = hca.substr(1);
  const bool search_exact = !hca.empty() && hca[0] == '=';
  if (search_exact) hca = hca.substr(1);
  const std::vector<HcaItem> list = ParseList(hca);
  for (size_t d = 0; d < node.devices.size(); ++d) {
    for (const PortDesc& p : node.devices[d].ports) {
      if (!p.active || !p.rdma_link) continue;  // init.cc:363-366
      if (!(MatchIfList(node.devices[d].name, p.num, list, search_exact) ^ search_not))
        continue;
      s.ib_devs.push_back(IbDev{static_cast<int>(d), p.num});
    }
  }
  // init.cc:484: sorted by PCI function (NCCL_IB_DEVICE_PCI_ORDER, default 1) so ranks
  // agree. The two ports of one device compare equal; NCCL uses qsort, which does not
  // promise an order for equal keys: modelled stable (port order), what glibc's merge
  // sort gives.
  if (env.ib_pci_order) {
    std::stable_sort(s.ib_devs.begin(), s.ib_devs.end(), [&](const IbDev& a, const IbDev& b) {
      return PciKey(node.devices[a.device].pci_path) < PciKey(node.devices[b.device].pci_path);
    });
  }

  // NCCL_IB_MERGE_NICS: vNICs come from ncclTopoMakeVNics (topo.cc:1586), called only
  // where netInfo.makeVDevice is set (topo.cc:1710-1718); the GIN import sets it NULL
  // (topo.cc:1827), so GIN always works on the physical (device, port) list above.
  if (!env.ib_merge_nics)
    s.notes.push_back("NCCL_IB_MERGE_NICS=0 changes the net transport's virtual NICs only; "
                      "GIN uses physical ports either way (topo.cc:1827)");

  // 2. The backend. plugin/gin.cc:246-253: the internal GDAKI plugin first, the proxy as
  //    fallback. GDAKI exposes only mlx5-provider devices (gin.cc:54-72; the provider is
  //    mlx5dv_is_supported, init.cc:341: modelled by the name "mlx5*"), and none at all
  //    when NCCL_GIN_TYPE names another backend (gin.cc:58-61).
  std::vector<int> gin;  // indices into s.ib_devs GIN can use
  auto is_mlx5 = [&](const IbDev& d) {
    return node.devices[d.device].name.compare(0, 4, "mlx5") == 0;
  };
  bool gdaki = false;
  if (env.gin_type == kGinAuto || env.gin_type == kGinGdaki) {
    for (size_t i = 0; i < s.ib_devs.size(); ++i)
      if (is_mlx5(s.ib_devs[i])) gin.push_back(static_cast<int>(i));
    gdaki = !gin.empty();
  }
  if (!gdaki) {
    if (env.gin_type == kGinGdaki) {
      s.error = "NCCL_GIN_TYPE=3 (GDAKI) but no mlx5 port is left by NCCL_IB_HCA";
      return s;
    }
    if (env.gin_type != kGinAuto && env.gin_type != kGinProxy) {
      s.error = "NCCL_GIN_TYPE=" + std::to_string(env.gin_type) + " is not modelled";
      return s;
    }
    gin.clear();
    for (size_t i = 0; i < s.ib_devs.size(); ++i) gin.push_back(static_cast<int>(i));
  }
  if (gin.empty()) {
    s.error = "no IB device/port is left for GIN (NCCL_IB_HCA=" + env.ib_hca +
              "): ncclGinConnectOnce fails with 'No GIN-capable devices found' "
              "(gin_host.cc:99-104)";
    return s;
  }
  s.backend = gdaki ? "gdaki" : "proxy";

  // 3. This rank's local GIN devices, topo.cc:2039-2093 (ncclTopoGetLocalNetType with
  //    type GIN, then ncclTopoGetLocalGinDevs). "Local" is ncclTopoGetLocal (topo.cc:1943):
  //    the best path, here by PCI distance class (bandwidths taken equal). The two ports
  //    of one NIC share its PCI path (init.cc:69-72 zero the function digit), so both are
  //    equally local. Nets in topology order = NCCL's device order (assumed: the topology
  //    adds nets in dev index order).
  auto dist = [&](int g, int ib) {
    const DeviceDesc& d = node.devices[s.ib_devs[ib].device];
    return nvshmem_select::PciDistance(node.gpu_paths[g], d.pci_path,
                                       g < static_cast<int>(node.gpu_numa.size())
                                           ? node.gpu_numa[g] : -1, d.numa);
  };
  int best = 1 << 30;
  for (int n : gin) best = std::min(best, dist(local_rank, n));
  std::vector<int> local_nets;
  for (int n : gin)
    if (dist(local_rank, n) == best) local_nets.push_back(n);
  // topo.cc:2056: the GPUs local to the first local net (its best path to a GPU).
  int gbest = 1 << 30;
  for (int g = 0; g < ngpus; ++g) gbest = std::min(gbest, dist(g, local_nets[0]));
  int local_gpus = 0;
  for (int g = 0; g < ngpus; ++g)
    if (dist(g, local_nets[0]) == gbest) ++local_gpus;
  const int nlocal = static_cast<int>(local_nets.size());
  // topo.cc:2002-2037, 2057-2066: NCCL_NETDEVS_POLICY AUTO (default) | ALL | MAX:n.
  const std::string& pol = env.netdevs_policy;
  if (strcasecmp(pol.c_str(), "ALL") == 0) {
    s.nets_per_gpu = nlocal;
  } else if (strncasecmp(pol.c_str(), "MAX:", 4) == 0 && std::atoi(pol.c_str() + 4) > 0) {
    s.nets_per_gpu = std::min(std::atoi(pol.c_str() + 4), nlocal);
  } else {
    if (!pol.empty() && strcasecmp(pol.c_str(), "AUTO") != 0)
      s.notes.push_back("NCCL_NETDEVS_POLICY=" + pol + " not recognized: NCCL uses AUTO");
    s.nets_per_gpu = (nlocal + local_gpus - 1) / local_gpus;  // DIVUP
  }
  // topo.cc:2070-2074: start at gpu.dev % localGpuCount (mirrored when the net count is a
  // power of two), channel c takes net start + c % netsPerGpu. gpu.dev is the CUDA index:
  // modelled as the rank's index in node.gpu_paths.
  int start = local_rank % local_gpus;
  if (IsPow2(nlocal)) start = MirrorBits(start, nlocal);
  for (int c = 0; c < 640; ++c) {  // topo.cc:2084-2093, NCCL_TOPO_MAX_NODES
    const int n = local_nets[(start + c % s.nets_per_gpu) % nlocal];
    if (c > 0 && n == s.local_ib_devs[0]) break;
    s.local_ib_devs.push_back(n);
  }
  if (static_cast<int>(s.local_ib_devs.size()) < nlocal)
    s.notes.push_back("this GPU shares its closest " + std::to_string(nlocal) +
                      " port(s) with " + std::to_string(local_gpus) +
                      " GPU(s): NCCL_NETDEVS_POLICY=" + pol + " gives it " +
                      std::to_string(s.local_ib_devs.size()) + " (ALL would give all)");

  // 4. GIN connections, gin_host.cc:121-134: one per local GIN device (the internal GDAKI
  //    plugin is version 14 >= 13, plugin/gin.cc:25,248), NCCL_GIN_NCONNECTIONS overrides,
  //    at most NCCL_GIN_MAX_CONNECTIONS, then the minimum over all ranks (not modelled:
  //    one rank's view). Connection n listens on localGinDevs[n % nLocalGinDevs]
  //    (gin_host.cc:157-163).
  const int nl = static_cast<int>(s.local_ib_devs.size());
  s.connections = env.gin_nconnections != -2 ? env.gin_nconnections : nl;
  s.connections = std::min(kMaxConnections, s.connections);
  if (s.connections < 1) {
    s.error = "NCCL_GIN_NCONNECTIONS=" + std::to_string(env.gin_nconnections) +
              " leaves no GIN connection";
    return s;
  }
  for (int n = 0; n < s.connections; ++n) s.connection_dev.push_back(s.local_ib_devs[n % nl]);

  // 5. Contexts, gin_host.cc:210-222: ROUNDUP(ginContextCount, connections) created, the
  //    same number on each connection; device side (nccl_device/impl/gin__funcs.h:80-92,
  //    ncclGinInitCommon) context c uses connection c % connections, index c / connections
  //    inside it. GDAKI: one main QP per peer and context on the connection's device
  //    (gin_host_gdaki.cc:476-478), created with port_num 1 (gin_host_gdaki.cc:567, "assume
  //    1 for mlx5 devices"; used at :404, :568, :571) whatever port the ncclIbDev names.
  //    The proxy backend's QPs go through ncclNetIb's connect, on the ncclIbDev's port.
  const int want = std::max(num_contexts, 0);
  s.contexts_created = ((want + s.connections - 1) / s.connections) * s.connections;
  // LAG: the 2.30/2.31 source sets no TX affinity; PR #2150 (a93cc034, in 2.30u1) orders
  // the main QPs' connects peer-major then context (gin_host_gdaki.cc:678-688) so that a
  // queue-affinity bond, which hands ports out in QP order, alternates contexts. The 2.32
  // wheel programs lag_tx_port_affinity per main QP itself (strings of libnccl.so.2.32.6:
  // "Connected main QP: ... lagTxPortAffinity=%u (LAG enabled)", off with
  // NCCL_GIN_GDAKI_LAG_AWARE_DISABLE). Its rule is not public: modelled as PR #2315's
  // "alternating contexts across both ports", member = context index in the connection %
  // members + 1.
  const bool lag_pinned = gdaki && env.version >= 23200 && !env.lag_aware_disable;
  bool noted_port = false, noted_lag = false;
  for (int c = 0; c < want; ++c) {
    ContextPlace p;
    p.connection = c % s.connections;
    p.context_id = c / s.connections;
    p.ib_dev = s.connection_dev[p.connection];
    const IbDev& d = s.ib_devs[p.ib_dev];
    p.device = d.device;
    p.port = (gdaki && env.gdaki_port_one) ? 1 : d.port;
    if (p.port != d.port && !noted_port) {
      noted_port = true;
      s.notes.push_back("GDAKI creates its QPs on port 1 of " + node.devices[d.device].name +
                        " although NCCL's device is " + IbDevName(node, d) +
                        " (gin_host_gdaki.cc:567): the ports of one multi-port RDMA device "
                        "collapse onto port 1");
    }
    auto it = env.lag_members.find(node.devices[d.device].name);
    if (it != env.lag_members.end() && it->second > 1) {
      if (lag_pinned) {
        p.lag_member = p.context_id % it->second + 1;
      } else {
        p.lag_member = -1;
        if (!noted_lag) {
          noted_lag = true;
          s.notes.push_back(
              std::string("bond ") + node.devices[d.device].name + ": " +
              (!gdaki ? "the proxy backend sets no LAG TX affinity"
               : env.lag_aware_disable ? "NCCL_GIN_GDAKI_LAG_AWARE_DISABLE=1"
                                       : "NCCL before 2.32 sets no LAG TX affinity") +
              ", so the member of each QP is the bond's choice (hash or queue affinity), "
              "not pinned");
        }
      }
    }
    s.contexts.push_back(p);
  }
  return s;
}

}  // namespace nccl_select
}  // namespace jax_ep
