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

// Each intranode op runs as three kernels per rank, in this order on the rank's stream:
//   kPhasePlan    one block: next epoch, prefix positions, requests to peers
//   kPhasePush    many blocks: wait for credits/requests, write rows into peers, signal
//   kPhaseFinish  many blocks: wait for arrivals, copy staged rows into XLA outputs
// A real group launches all three on each rank's stream. The virtual-rank harness
// launches phase p for every rank before phase p + 1 of any, so no kernel ever waits for
// one that was launched after it, and no two ranks' kernels need to be co-resident.
enum Phase : int { kPhasePlan = 0, kPhasePush = 1, kPhaseFinish = 2, kNumPhases = 3 };

cudaError_t LaunchDispatchPhase(int phase, const DispatchArgs& a, const IntranodePreset& p,
                                cudaStream_t stream);
cudaError_t LaunchCombinePhase(int phase, const CombineArgs& a, const IntranodePreset& p,
                               cudaStream_t stream);
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
