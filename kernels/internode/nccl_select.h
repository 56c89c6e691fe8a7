// Which RDMA device and wire port each GIN context of an NCCL rank lands on: a model of
// NCCL's host code (device list, topology, GIN connections, GDAKI QPs, LAG affinity), the
// one definition used by the emulated NCCL and, through the bindings
// (xla_ffi/common/striping_bindings.cc, `nccl_select`), by jax_ep.network.fabric
// (`nccl_selection`, `nccl_env_for`) and plan. Plain C++ (no CUDA, no NCCL headers).
//
// Source read: github.com/NVIDIA/nccl master at 5067397c (v2.30.7-1, 2026-06-11); the dev
// branch at 86fa684d (2.31.0) has the same rules in every file cited here. The 2.32.6
// wheel's libnccl.so.2 is binary only: its strings show the GDAKI LAG affinity
// (NCCL_GIN_GDAKI_LAG_AWARE_DISABLE, "lagTxPortAffinity=%u (LAG enabled)"), modelled from
// PR #2315's description where the rule is not visible. docs/internode.md, "How NCCL picks
// ports for GIN contexts (modelled)", has the rules step by step.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "kernels/internode/nvshmem_select.h"  // NodeDesc, DeviceDesc, PortDesc, PciDistance

namespace jax_ep {
namespace nccl_select {

using nvshmem_select::DeviceDesc;
using nvshmem_select::NodeDesc;
using nvshmem_select::PortDesc;

// NCCL_GIN_TYPE values (src/include/nccl_device/core.h:169-172).
enum GinType { kGinAuto = -1, kGinProxy = 2, kGinGdaki = 3 };

// The NCCL variables that decide the placement, as one rank's environment has them, plus
// what the node's sysfs says about bonds (NCCL reads that from the device, not the env).
struct EnvDesc {
  std::string ib_hca;           // NCCL_IB_HCA ("" = unset): [^][=]name[:port[:rail[:plane]]],...
  bool ib_disable = false;      // NCCL_IB_DISABLE
  bool ib_pci_order = true;     // NCCL_IB_DEVICE_PCI_ORDER (default 1)
  bool ib_merge_nics = true;    // NCCL_IB_MERGE_NICS: read, and shown not to matter for GIN
  std::string netdevs_policy = "AUTO";  // NCCL_NETDEVS_POLICY: AUTO | ALL | MAX:<n>
  int gin_nconnections = -2;    // NCCL_GIN_NCONNECTIONS (-2 = unset)
  int gin_type = kGinAuto;      // NCCL_GIN_TYPE (-1 = GDAKI where possible, else proxy)
  bool gin_enable = true;       // NCCL_GIN_ENABLE (default 1)
  bool lag_aware_disable = false;  // NCCL_GIN_GDAKI_LAG_AWARE_DISABLE (2.32 wheel)
  int version = 23206;          // NCCL_VERSION_CODE of the library (2.32.6 = 23206)
  // Modelling switch, not an NCCL variable: GDAKI creates its QPs on port 1 of the
  // device whatever port NCCL_IB_HCA / the ncclIbDev names (gin_host_gdaki.cc:567,
  // "assume 1 for mlx5 devices"). False models a library that honours the port.
  bool gdaki_port_one = true;
  // LAG members of each bonded device (name -> member count; absent = not a bond).
  std::map<std::string, int> lag_members;
};

// EnvDesc from NCCL_* variables (absent = NCCL's default). Integers as NCCL_PARAM reads
// them (strtoll; an unparsable value keeps the default).
EnvDesc EnvFrom(const std::map<std::string, std::string>& env);

// One ncclIbDev: a (device, port) pair NCCL's IB plugin exposes (init.cc:357-456).
struct IbDev {
  int device = -1;  // index into NodeDesc::devices
  int port = 0;     // the ibv port the ncclIbDev names
};

// Where one GIN context's QPs sit.
struct ContextPlace {
  int connection = -1;  // GIN connection (gin__funcs.h:83-92: context % connections)
  int context_id = -1;  // the context's index inside its connection (context / connections)
  int ib_dev = -1;      // index into Selection::ib_devs
  int device = -1;      // index into NodeDesc::devices
  int port = 0;         // wire port the QPs are created on
  int lag_member = 0;   // bonds: 1-based member its main QPs are pinned to; 0 = not a
                        // bond; -1 = a bond but not pinned (the firmware/hash decides)
};

struct Selection {
  std::string backend;             // "gdaki", "proxy" or "" (no GIN)
  std::vector<IbDev> ib_devs;      // NCCL's device list after NCCL_IB_HCA and PCI sort
  std::vector<int> local_ib_devs;  // this rank's local GIN devices (ncclTopoGetLocalGinDevs)
  int nets_per_gpu = 0;            // ncclTopoGetLocalNetType's netsPerGpu
  int connections = 0;             // ginCommCount
  std::vector<int> connection_dev; // ib_devs index each connection listens on
  int contexts_created = 0;        // ROUNDUP(num_contexts, connections)
  std::vector<ContextPlace> contexts;  // per requested context
  std::vector<std::string> notes;  // why fewer ports than there are, ambiguities hit
  std::string error;               // NCCL's GIN start-up would fail, with why
};

// The placement of local rank `local_rank` (index into node.gpu_paths, which holds the
// GPUs of the node's ranks, CUDA device order) for `num_contexts` GIN contexts
// (ncclDevCommRequirements::ginContextCount).
Selection Select(const NodeDesc& node, const EnvDesc& env, int local_rank, int num_contexts);

// "dev:port" of an ib dev / of a context's wire port.
std::string IbDevName(const NodeDesc& node, const IbDev& d);
std::string PlaceName(const NodeDesc& node, const ContextPlace& c);

}  // namespace nccl_select
}  // namespace jax_ep
