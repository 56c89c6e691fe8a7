// Emulated NVSHMEM for the emulated GPU (kernels/emu/emu_cuda.h): the subset of NVSHMEM's
// host and device API that kernels/internode/*.cu and transport_nvshmem.cuh use, so that
// those sources compile unchanged with the host compiler and run over R virtual GPUs.
//
// Model (docs/emulator.md, "Internode"):
//   * One PE per virtual GPU (PE p = virtual GPU p). nvshmem_malloc is collective: the k-th
//     allocation of every PE is one symmetric object, each PE's copy a separate allocation.
//   * A put (with or without signal) and a signal alone are queued per (source PE,
//     destination PE, QP) and delivered in issue order within a queue, in any order across
//     queues, after a seeded random number of transport steps; the source bytes are read at
//     delivery (as the NIC reads them), the signal applied after its data. nvshmem_quiet
//     delivers every operation the calling PE issued.
//   * QP handles (nvshmemx_qp_create) are opaque numbers that map back to a logical QP. The
//     device and port each handle sits on come from NVSHMEM's own selection rules
//     (kernels/internode/nvshmem_select.h) applied to the world's node and each PE's
//     NVSHMEM_* environment (set_fabric); on a bonded device the member is the QP's LAG
//     TX affinity where one is set, else the bond's hash of the pair. Every put is logged
//     as (source, destination, QP handle, logical QP, wire port id, bytes) and counted per
//     QP (puts, signals, work requests, bytes); port_names() names the ids.
//   * Without custom QPs (default_handles) every handle is NVSHMEMX_QP_DEFAULT and, as
//     NVSHMEM's IBGDA maps its default QPs, a put travels on the QP of its CTA.
//   * nvshmem_ptr gives a pointer only between PEs of one emulated node (gpus_per_node).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "kernels/emu/emu_control.h"
#include "kernels/emu/emu_cuda.h"


#define NVSHMEM_VENDOR_MAJOR_VERSION 3
#define NVSHMEM_VENDOR_MINOR_VERSION 8
#define NVSHMEM_VENDOR_PATCH_VERSION 0

#define NVSHMEM_SIGNAL_SET 0
#define NVSHMEM_SIGNAL_ADD 5
#define NVSHMEM_STATUS_NOT_INITIALIZED 0
#define NVSHMEM_STATUS_IS_BOOTSTRAPPED 1
#define NVSHMEM_STATUS_IS_INITIALIZED 2
#define NVSHMEMX_INIT_WITH_UNIQUEID (1 << 3)

struct nvshmemx_uniqueid_t {
  int version;
  char internal[124];
};
#define NVSHMEMX_UNIQUEID_INITIALIZER \
  { 1, {} }
struct nvshmemx_init_attr_t {
  int rank = -1, nranks = 0;
  nvshmemx_uniqueid_t id{};
};
#define NVSHMEMX_INIT_ATTR_INITIALIZER \
  {}
typedef int nvshmemx_qp_handle_t;
#define NVSHMEMX_QP_DEFAULT 1

// Host API.
int nvshmemx_get_uniqueid(nvshmemx_uniqueid_t* id);
int nvshmemx_set_attr_uniqueid_args(int rank, int nranks, const nvshmemx_uniqueid_t* id,
                                    nvshmemx_init_attr_t* attr);
int nvshmemx_init_attr(unsigned flags, nvshmemx_init_attr_t* attr);
int nvshmemx_init_status();
void nvshmem_finalize();
void* nvshmem_malloc(size_t bytes);
void nvshmem_free(void* p);
void nvshmem_barrier_all();
int nvshmemx_qp_create(int n, nvshmemx_qp_handle_t** handles);
void nvshmemx_vendor_get_version_info(int* major, int* minor, int* patch);

// Both sides.
int nvshmem_my_pe();
int nvshmem_n_pes();
void* nvshmem_ptr(const void* sym, int pe);
void nvshmem_quiet();
// Orders this PE's earlier operations to a PE before its later ones: every queue is
// delivered in order and handle-less operations share one queue per (source, destination),
// so nothing moves; counted ("fences").
void nvshmem_fence();
uint64_t nvshmem_signal_fetch(const uint64_t* sig);

// Device API (called by whole warps where the name says _warp).
void nvshmemx_putmem_nbi_warp(void* dst, const void* src, size_t bytes, int pe);
void nvshmemx_putmem_signal_nbi_warp(void* dst, const void* src, size_t bytes, uint64_t* sig,
                                     uint64_t value, int op, int pe);
void nvshmemx_signal_op(uint64_t* sig, uint64_t value, int op, int pe);
void nvshmemx_qp_uint8_put_nbi_warp(uint8_t* dst, const uint8_t* src, size_t n, int pe,
                                    nvshmemx_qp_handle_t qp);
void nvshmemx_qp_uint8_put_signal_nbi_warp(uint8_t* dst, const uint8_t* src, size_t n,
                                           uint64_t* sig, uint64_t value, int op, int pe,
                                           nvshmemx_qp_handle_t qp);
void nvshmemx_qp_signal_op(uint64_t* sig, uint64_t value, int op, int pe,
                           nvshmemx_qp_handle_t qp);

namespace nvshmem_emu {

// Acquire load of a local signal word (the PTX ld.acquire.sys of transport_nvshmem.cuh):
// a poll, so the scheduler and the transport make progress.
uint64_t load_acquire(const uint64_t* p);

struct WorldConfig {
  int num_pes = 2;
  int gpus_per_node = 1;     // nvshmem_ptr reaches PEs of the same node only
  int num_ports = 2;         // the plan's ports (the wire's come from the fabric)
  int qps_per_port = 1;
  uint64_t seed = 1;
  int max_delay = 64;        // transport steps an operation may wait before delivery
  bool qp_api = true;        // nvshmemx_qp_create exists (NVSHMEM >= 3.8 host library)
  bool default_handles = false;  // it exists but returns NVSHMEMX_QP_DEFAULT for all
  int default_qps = 2;       // QPs a PE's default (handle-less) puts spread over, by CTA
};

// The node every emulated node is, and each PE's NVSHMEM_* environment, as text lines:
//   dev <name> <numa> <pci_path> <port>:<active>:<rdma>[,...] [<member>,<member>...]
//   gpu <numa> <pci_path>
//   env <pe> KEY=VALUE;KEY=VALUE...
//   lag_affinity <0|1>      (the QPs of a bonded device carry a LAG TX affinity)
// Devices with members are bonds (their one port's traffic goes out on a member). An
// error names the bad line. Must follow reset and come before the PEs' init.
std::string set_fabric(const std::string& text);
// The name of each wire port id of the put log ("mlx5_0:1", or a bond member's netdev).
std::vector<std::string> port_names();

// Starts a fresh world (every PE uninitialised, heaps freed, log and counters cleared).
void reset(const WorldConfig& c);
// Widens the current world to at least num_pes PEs, keeping every existing PE's heap: a
// new world calls it before finalizing the previous worlds' state on each of its virtual
// GPUs, some of which a smaller world in between did not contain.
void grow(int num_pes);
const WorldConfig& world_config();

struct PutRecord {
  int src, dst, handle, qp, port, block;
  int64_t bytes;
  int sig_op;    // NVSHMEM_SIGNAL_SET / _ADD of a put-with-signal, -1 for a put alone
  int64_t call;  // set_call's number when the put was issued
};
// Tags the puts logged from now on (the driver numbers its calls).
void set_call(int64_t call);
// Puts since the last clear (signals alone are counted, not logged).
const std::vector<PutRecord>& put_log();
void clear_log();
// Counters per logical QP: "qp<q>:puts", "qp<q>:signals", "qp<q>:wrs", "qp<q>:bytes";
// and "fallback:*" for puts without a QP handle; "deliveries", "quiets", "polls".
std::map<std::string, uint64_t> counters();
// Operations queued and not yet delivered (a finished call must leave none).
int64_t pending();
// A symbol of the emulated host library by name (what dlsym finds in a real one), or null.
void* host_symbol(const char* name);

}  // namespace nvshmem_emu
