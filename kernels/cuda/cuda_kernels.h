// Host entry points of the CUDA kernels (kernels/*.cu). Every launch is asynchronous on
// the given stream; nothing here synchronizes, so XLA can capture the launches in a
// CUDA graph.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/common/configs.h"
#include "kernels/cuda/intranode_buffer.h"

namespace jax_ep {

// Layout of one rank's routing (same results as LayoutCpu). Ids outside [-1, E) are
// counted as unused slots and recorded as kErrBadTopkId.
cudaError_t LaunchLayout(cudaStream_t stream, const int32_t* topk_idx, int T, int K, int E,
                         int R, int32_t* tokens_per_rank, int32_t* tokens_per_expert,
                         bool* is_token_in_rank, ErrorRecord* host_err);

// Dispatch and combine run as two kernels per rank, in this order on the rank's stream:
//   kPhaseNotify   one block: next epoch, positions and counts (dispatch) or row ranges
//                  (combine), exchanged with the peers
//   kPhaseChannel  the channel kernel: sending and receiving warps through the
//                  (channel, peer) rings in one kernel (intranode_buffer.h: dispatch a
//                  channel per block, DispatchBlocks; combine 2 x channels blocks)
// Gather (combine's transpose, cached dispatch) runs the channel kernel only: the handle
// holds the layout, and the counts travel with the requests (kNumGatherPhases).
// The channel kernels of all ranks of a group must run at once (their blocks wait on each
// other), so the virtual-rank harness launches each rank on its own stream.
enum ChannelPhase : int { kPhaseNotify = 0, kPhaseChannel = 1, kNumChannelPhases = 2 };
constexpr int kNumGatherPhases = 1;

// `p.num_sms` carries the channel kernel's blocks (what runs: DispatchBlocks(R,
// a.c.channels) for dispatch, 2 x a.c.channels for combine and gather).
cudaError_t LaunchDispatchPhase(int phase, const DispatchArgs& a, const IntranodePreset& p,
                                cudaStream_t stream);
cudaError_t LaunchCombinePhase(int phase, const CombineArgs& a, const IntranodePreset& p,
                               cudaStream_t stream);
// Gather's only phase (0) is its channel kernel.
cudaError_t LaunchGatherPhase(int phase, const GatherArgs& a, const IntranodePreset& p,
                              cudaStream_t stream);

// Reads (and optionally clears) the sticky device error records of the current device.
// Synchronous: for check_errors() and tests, never called inside an FFI handler.
cudaError_t ReadLayoutError(ErrorRecord* out, bool clear);
cudaError_t ReadIntranodeError(ErrorRecord* out, bool clear);
// Lifts the intranode failed state (moves no data, waits end at once): only once the
// buffer headers are re-zeroed (jax_ep.cuda.reset), never by check_errors alone.
cudaError_t ClearIntranodeFailure();

}  // namespace jax_ep
