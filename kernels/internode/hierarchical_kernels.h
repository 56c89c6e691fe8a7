// Host API of the hierarchical internode mode (hierarchical_host.cu, over the kernels of
// hierarchical_kernels.cu): dispatch,
// combine and gather with the direct mode's outputs and handle, where a token crosses the
// network at most once per destination node (to the same-local-index GPU there, its rail
// peer) and is forwarded over NVLink inside the node. Plain C++, no NVSHMEM types.
//
// Runs on the NVSHMEM runtime the direct mode starts (internode::Init), in the same heap
// halves: the hierarchical region (kernels/internode/hierarchical_layout.h) sits at the end
// of each half, the direct mode's regions at its start.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "kernels/common/dtype_convert.h"
#include "kernels/internode/internode_kernels.h"

namespace jax_ep {
namespace hier {

// `gpus_per_node` G must divide num_ranks and be at most kMaxGpusPerNode; ranks are
// node-major (rank = node * G + local index). Other fields as internode::Dims.
struct HierDims {
  internode::Dims base;
  int gpus_per_node = 1;
};

// Same outputs as internode::Dispatch (DESIGN.md plus counts[R, R], send_slot[T, R]).
std::string Dispatch(cudaStream_t stream, const HierDims& d, FloatKind elem, const void* x,
                     const int32_t* topk_idx, const float* topk_weights,
                     const internode::DispatchOut& out);

// y[C, H] -> out[T, H]: every row of a token summed at its source in float32 in ascending
// rank order (the rows cross the network once per node, unsummed). src_index[C] is the
// dispatch handle's (it orders the rows a node's forwarder merges).
std::string Combine(cudaStream_t stream, const HierDims& d, FloatKind elem, const void* y,
                    const int32_t* counts, const int32_t* send_slot, const int32_t* src_index,
                    void* out);

// Combine's transpose: src[T, H] -> out[C, H], dispatch's paths for rows of src.
std::string Gather(cudaStream_t stream, const HierDims& d, FloatKind elem, const void* src,
                   const int32_t* counts, const int32_t* send_slot, void* out);

// The sticky error of an earlier call of either mode ("" if none), with the hierarchical
// mode's own wait kinds (RDMA ring credit, NVLink ring) spelled out.
std::string PendingError();

}  // namespace hier
}  // namespace jax_ep
