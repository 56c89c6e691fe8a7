// Which RDMA devices and ports NVSHMEM's IBGDA transport opens for a PE, and on which of
// them each QP handle of `nvshmemx_qp_create` sits: a model of NVSHMEM's host code, the
// one definition used by the emulated NVSHMEM (kernels/emu/nvshmem_emu.cc) and, through
// the bindings, by jax_ep.network.fabric and jax_ep.network.plan. Plain C++ (no CUDA).
//
// It follows NVSHMEM's public host source (github.com/NVIDIA/nvshmem, 3.5.1, commit
// 2d7d25f; the 3.8 wheel's host library has the same variables): see docs/internode.md,
// "How NVSHMEM picks devices (modelled)", for the rules step by step with their source
// lines.
#pragma once

#include <map>
#include <string>
#include <vector>

namespace jax_ep {
namespace nvshmem_select {

// One port of an RDMA device as sysfs shows it.
struct PortDesc {
  int num = 1;             // 1-based
  bool active = true;      // state ACTIVE
  bool rdma_link = true;   // link layer InfiniBand or Ethernet (IBGDA takes both)
};

// One RDMA device; `pci_path` is its PCI function's sysfs path from the root complex,
// "/sys/devices/pci0000:00/0000:00:01.0/.../0000:17:00.0" (what realpath gives NVSHMEM).
struct DeviceDesc {
  std::string name;
  std::string pci_path;
  int numa = -1;
  std::vector<PortDesc> ports;
};

// A node: its devices in the order ibv_get_device_list returns them, and the GPUs of its
// PEs (local PE i drives gpu_paths[i]; paths as for devices).
struct NodeDesc {
  std::vector<DeviceDesc> devices;
  std::vector<std::string> gpu_paths;
  std::vector<int> gpu_numa;
};

// The NVSHMEM variables that decide the selection, as one PE's environment has them.
struct EnvDesc {
  std::string hca_list;        // NVSHMEM_HCA_LIST ("" = unset; "^..." excludes)
  std::string hca_pe_mapping;  // NVSHMEM_HCA_PE_MAPPING ("dev:port:count,...")
  std::string hca_prefix = "mlx5";  // NVSHMEM_HCA_PREFIX: IBGDA takes devices named so
  bool multi_port = false;     // NVSHMEM_ENABLE_MULTI_PORT / NVSHMEM_IBGDA_ENABLE_MULTI_PORT
  bool nic_pe_mapping = false; // NVSHMEM_ENABLE_NIC_PE_MAPPING
  bool qp_api = true;          // the transport supports nvshmemx_qp_create's custom QPs
};

// EnvDesc from NVSHMEM_* variables (absent = NVSHMEM's default). Booleans as NVSHMEM's
// nvshmemi_getenv_bool reads them: set and starting with 0/n/N/f/F is false, any other
// value true. NVSHMEM_ENABLE_MULTI_PORT (3.8's name) wins over the older
// NVSHMEM_IBGDA_ENABLE_MULTI_PORT.
EnvDesc EnvFrom(const std::map<std::string, std::string>& env);

// An entry of NVSHMEM's ordered device list: a (device, port) pair.
struct Entry {
  int device = -1;  // index into NodeDesc::devices
  int port = 0;
};

// PCI distance classes, best first (topo.cpp's enum pci_distance).
enum Distance { kPix = 0, kPxb = 1, kPhb = 2, kNode = 3, kSys = 4 };

struct Selection {
  std::vector<Entry> list;        // the transport's device list (ibgda.cpp's dev_ids/port_ids)
  int max_devices_per_pe = 0;     // transport.cpp: n_devices / npes_node, at least 1
  std::vector<Entry> devices;     // what this PE opens, in the order QPs cycle over them
  std::vector<int> distance;      // of each opened device from this PE's GPU (Distance)
  std::vector<Entry> qps;         // the device of each handle nvshmemx_qp_create returns
  bool default_handles = false;   // every handle is NVSHMEMX_QP_DEFAULT (no custom QPs)
  std::string note;               // why fewer devices than asked, if so
  std::string error;              // NVSHMEM's start-up would fail (no device), with why
};

// The selection of local PE `pe_node` (0-based) with `env`, for `num_qps` handles created
// by one nvshmemx_qp_create call, the process's first.
Selection Select(const NodeDesc& node, const EnvDesc& env, int pe_node, int num_qps);

// topo.cpp get_pci_distance: the distance class of two sysfs PCI paths (numa ids decide
// between NODE and SYS for paths that share no bridge below the root).
int PciDistance(const std::string& gpu_path, const std::string& dev_path, int gpu_numa,
                int dev_numa);

// "dev:port" of an entry, as NVSHMEM_HCA_LIST spells it.
std::string EntryName(const NodeDesc& node, const Entry& e);

}  // namespace nvshmem_select
}  // namespace jax_ep
