// The launch arguments of an internode call (direct and hierarchical), built from plain
// numbers. One definition shared by the XLA FFI handlers (internode_handlers.cc,
// hierarchical_handlers.cc) and the emulated GPU's driver (emu_bindings.cc), so the calls
// the emulator runs are built exactly as the handlers build them. No FFI types here.
#pragma once

#include <cstdint>
#include <string>

#include "kernels/internode/hierarchical_kernels.h"
#include "kernels/internode/hierarchical_layout.h"
#include "kernels/internode/internode_kernels.h"

namespace jax_ep {
namespace internode {

// Fills `d` from the call's sizes and attributes; "" or what is wrong, naming the argument.
// T = tokens, H = hidden, K = topk, C = capacity; timeout_ns bounds every device wait.
inline std::string CallDims(int64_t R, int64_t rank, int64_t T, int64_t H, int64_t K, int64_t C,
                            int64_t num_ports, int64_t qps_per_port, int64_t chunk_bytes,
                            int64_t call_site, int64_t timeout_ns, Dims* d) {
  if (R < 1) return "num_ranks must be >= 1";
  if (rank < 0 || rank >= R) return "rank is outside [0, num_ranks)";
  if (C < 1) return "capacity must be >= 1";
  if (num_ports < 1) return "num_ports must be >= 1";
  if (qps_per_port < 1) return "qps_per_port must be >= 1";
  if (chunk_bytes < 1) return "chunk_bytes must be >= 1";
  d->num_ranks = static_cast<int>(R);
  d->rank = static_cast<int>(rank);
  d->tokens = static_cast<int>(T);
  d->hidden = static_cast<int>(H);
  d->topk = static_cast<int>(K);
  d->capacity = static_cast<int>(C);
  d->num_ports = static_cast<int>(num_ports);
  d->qps_per_port = static_cast<int>(qps_per_port);
  d->chunk_bytes = chunk_bytes;
  d->timeout_ns = timeout_ns;
  d->call_site = call_site;
  return {};
}

// Dispatch only: the experts (E = num_experts, E / R per rank).
inline std::string CallExperts(int64_t num_experts, Dims* d) {
  if (num_experts < 1 || num_experts % d->num_ranks != 0)
    return "num_experts must be a positive multiple of num_ranks";
  d->experts_per_rank = static_cast<int>(num_experts / d->num_ranks);
  d->num_experts = static_cast<int>(num_experts);
  return {};
}

// The hierarchical mode's node size (ranks are node-major).
inline std::string CallNodeSize(int64_t gpus_per_node, hier::HierDims* hd) {
  const int64_t R = hd->base.num_ranks;
  if (gpus_per_node < 1 || gpus_per_node > hier::kMaxGpusPerNode || R % gpus_per_node != 0)
    return "gpus_per_node must divide num_ranks and be in [1, " +
           std::to_string(hier::kMaxGpusPerNode) + "], got " + std::to_string(gpus_per_node);
  hd->gpus_per_node = static_cast<int>(gpus_per_node);
  return {};
}

}  // namespace internode
}  // namespace jax_ep
