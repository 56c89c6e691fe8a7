// Host API of the internode (NVSHMEM) backend: runtime start/stop and the dispatch and
// combine launches (kernels/internode/nvshmem_host.cu, over the kernels of
// internode_kernels.cu). Plain C++: no NVSHMEM types leak out of the internode sources.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "kernels/common/dtype_convert.h"

namespace jax_ep {
namespace internode {

struct Dims {
  int num_ranks = 0;      // R: PEs in the EP group (= all PEs)
  int rank = 0;           // this PE
  int tokens = 0;         // T: tokens on this rank
  int hidden = 0;         // H
  int topk = 0;           // K
  int capacity = 0;       // C
  int experts_per_rank = 0;
  int num_experts = 0;
  int num_ports = 2;
  int qps_per_port = 1;
  int64_t chunk_bytes = 65536;
  int64_t timeout_ns = 0;  // JAX_EP_TIMEOUT_S; bound of every device wait
  int64_t call_site = 0;   // the custom call's call_site attribute (in the header)
  // Combine's summation order (kernels/common/combine_order.h): ranks per node; <= 0 or
  // >= num_ranks: one node.
  int gpus_per_node = 0;
};

// Runtime. All return "" on success or an error message.
std::string UniqueId(std::string* out);  // 128 bytes, on PE 0 only
// Starts NVSHMEM (collective) and creates `num_qps` explicit QP handles when
// `use_qp_api`. With `adopt`, an NVSHMEM another library already started is used as is
// (the caller has checked its settings); without it, that case is an error.
std::string Init(int rank, int world, const std::string& unique_id, size_t heap_bytes,
                 int num_qps, bool use_qp_api, bool adopt);
// Collective (barrier). Never called at process exit.
// The current GPU's runtime over NCCL GIN, after jax_ep::nccl_host::Start (which made its
// window and device communicators) on this GPU: num_qps GIN contexts per peer, the heap
// halves in the window's first heap_bytes (0: all of it; the rest holds the low-latency
// area). "" or why not (a build without NCCL says which package to install).
std::string InitOverNccl(int num_qps, size_t heap_bytes = 0);
// One process's GPUs over NCCL GIN: nccl_host::Start (ordinals[i] is world rank ranks[i];
// collective over the world) with a window of heap_bytes plus, when low_latency is
// {max_tokens, row_bytes, topk, num_experts}, the low-latency area; then InitOverNccl and
// the low-latency area's ll_internode::Init on each. FinishOverNccl undoes all of it
// (the low-latency area first).
std::string StartOverNccl(const std::vector<int>& ordinals, const std::vector<int>& ranks,
                          int world, const std::string& uid, size_t heap_bytes, int num_qps,
                          int gpus_per_node, const std::vector<int64_t>& low_latency = {});
std::string FinishOverNccl(const std::vector<int>& ordinals);
std::string Finalize();
// A symmetric area of `bytes` for the low-latency mode on the current GPU: nvshmem_malloc
// (collective) over NVSHMEM; over NCCL the window's bytes past the two heap halves (the
// slack), which the bootstrap sizes for it. "" or why not.
std::string SymmetricArea(size_t bytes, char** out);
void SymmetricAreaFree(char* p);
// Every rank of the world at this point (nvshmem_barrier_all); over NCCL none is needed:
// the window was cleared before its collective registration.
void TransportBarrier();
bool Initialized();
size_t HeapBytes();
int Version();         // NVSHMEM headers built against: major*10000 + minor*100 + patch
int RuntimeVersion();  // the loaded host library's, -1 if it cannot say
int InitStatus();      // nvshmemx_init_status() of the loaded library, -1 if unknown
bool QpApiAvailable(); // built with 3.8 headers and the host library has nvshmemx_qp_create
// The sticky error of an earlier call ("" if none); read without synchronising.
std::string PendingError();

struct TransportInfo {
  bool initialized = false;
  bool adopted = false;
  int num_qps = 0;
  std::string qp_path;
  std::vector<int> handles;  // handle of logical QP q, q < num_qps (empty: fallback)
};
TransportInfo TransportState();
// Puts the handle created order[q]-th at logical QP q (host table and the kernels' device
// table), so the stripe follows the recorded handle -> port table whatever order NVSHMEM
// laid the QPs out in (jax_ep.network.fabric.handle_order_for_plan).
std::string SetQpOrder(const std::vector<int>& order);

// Dispatch on `stream`. Outputs follow DESIGN.md, plus the handle parts combine needs:
// counts[R, R] (rows each source sends each rank) and send_slot[T, R] (the token's
// position among the rows this rank sends rank d, -1 if not sent).
struct DispatchOut {
  void* recv_x;                 // [C, H] elem
  int32_t* recv_topk_idx;       // [C, K]
  float* recv_topk_weights;     // [C, K]
  int32_t* num_recv;            // scalar
  int32_t* num_dropped;         // scalar
  int32_t* recv_per_expert;     // [E_local]
  int32_t* src_rank;            // [C]
  int32_t* src_index;           // [C]
  int32_t* counts;              // [R, R]
  int32_t* send_slot;           // [T, R]
};
std::string Dispatch(cudaStream_t stream, const Dims& d, FloatKind elem, const void* x,
                     const int32_t* topk_idx, const float* topk_weights,
                     const DispatchOut& out);

// Combine on `stream`: y[C, H] rows go back to their sources and are summed in float32
// in combine's order (kernels/common/combine_order.h, node size d.gpus_per_node) into
// out[T, H].
std::string Combine(cudaStream_t stream, const Dims& d, FloatKind elem, const void* y,
                    const int32_t* counts, const int32_t* send_slot, void* out);

// Gather on `stream` (combine's transpose): out[C, H] row i is row src_index[i] of
// src[T, H] on rank src_rank[i], by the dispatch handle (counts, send_slot); rows past
// the rows kept are zero.
std::string Gather(cudaStream_t stream, const Dims& d, FloatKind elem, const void* src,
                   const int32_t* counts, const int32_t* send_slot, void* out);

// What the hierarchical mode (kernels/internode/hierarchical_kernels.cu) shares with this
// one: the same heap halves, call counter (so calls of either mode alternate halves) and
// sticky error record. "" on success, else why not (NVSHMEM not started).
struct SharedRuntime {
  char* heap = nullptr;
  size_t half_bytes = 0;
  void* err = nullptr;                       // wire::ErrorRecord*, mapped host memory
  int32_t* bad = nullptr;                    // device [4]: bad-id flag, token, slot, value
  unsigned long long* call_counter = nullptr;  // device address of the call counter
  int rank = 0, world = 0, num_qps = 0;
};
std::string SharedState(SharedRuntime* out);

// Device check for one GPU: a put to itself through the transport interface arrives.
std::string SelfPutCheck(bool* ok);

}  // namespace internode
}  // namespace jax_ep
