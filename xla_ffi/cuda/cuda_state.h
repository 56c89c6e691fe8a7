// Process-wide state of the CUDA backend: the communication domain of each local GPU
// (its rank, group and peers' buffer pointers, set up once by jax_ep.cuda.setup), the
// mapped host mirror of the device error records, and how errors read as text.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>
#include <vector>

#include "kernels/cuda/intranode_buffer.h"

namespace jax_ep {

constexpr int kMaxCudaDevices = 64;

// The low-latency area of a domain (jax_ep.cuda.setup(..., max_tokens_per_rank=M,
// num_experts=E)): where it starts in every buffer of the group and the largest shapes it
// holds (kernels/cuda/low_latency_layout.h LowLatencyLayout). bytes == 0: none.
struct LowLatencyArea {
  size_t offset = 0;
  size_t bytes = 0;
  int max_tokens = 0;
  int topk = 0;
  int num_experts = 0;
  size_t row_bytes = 0;
};

struct CudaDomain {
  int rank = -1;
  int group = -1;
  int num_ranks = 0;
  PeerTable peers{};
  AreaConfig areas{};
  LowLatencyArea ll{};
};

// Domain registered for a device ordinal; false if none.
bool GetCudaDomain(int ordinal, CudaDomain* out);
void SetCudaDomain(int ordinal, const CudaDomain& d);
// Forgets the domain of an ordinal (its peers' mappings are about to be closed): EP calls
// there fail on the host until setup registers one again.
void ClearCudaDomain(int ordinal);

// GPUs this process has used for EP work (a domain set up, a harness buffer, a layout
// call): jax_ep.cuda.check_errors() and reset() touch only these, so they neither wait
// for nor create contexts on GPUs the process never uses.
void MarkDeviceUsed(int ordinal);
std::vector<int> DevicesInUse();

// Mapped, pinned host records (one per device ordinal) that kernels also write their
// errors to. Allocate() creates them (not inside an FFI call); Get() returns null until
// then, or for an ordinal out of range.
bool AllocateErrorMirror(std::string* err);
ErrorRecord* ErrorMirror(int ordinal);

// Message of the first pending error in the mirror ("" if none). Does not clear.
std::string PendingMirrorError();
void ClearErrorMirror();

std::string DescribeError(const ErrorRecord& e, int ordinal);

// The current device's first intranode protocol error (kernels/cuda/intranode_kernels.cu),
// kept beside the first-error record ReadIntranodeError reads: when that one holds an
// earlier bad id or foreign handle, this tells the timeout or mismatch behind it.
// Synchronous, never inside an FFI handler; only ClearIntranodeFailure() (from reset(),
// after the headers are re-zeroed) clears it, never ReadIntranodeError(clear=true).
cudaError_t ReadIntranodeFailure(ErrorRecord* out);

// SMs of a device ordinal (cached; 132 where the runtime cannot say, e.g. emulated).
int DeviceSmCount(int ordinal);

// JAX_EP_TIMEOUT_S (default 300 s), in nanoseconds, for the kernels' waits.
int64_t KernelTimeoutNs();

}  // namespace jax_ep
