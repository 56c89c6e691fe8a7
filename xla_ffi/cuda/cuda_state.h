// Process-wide state of the CUDA backend: the communication domain of each local GPU
// (its rank, group and peers' buffer pointers, set up once by jax_ep.cuda.setup), the
// mapped host mirror of the device error records, and how errors read as text.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kernels/cuda/intranode_buffer.h"

namespace jax_ep {

constexpr int kMaxCudaDevices = 64;

struct CudaDomain {
  int rank = -1;
  int group = -1;
  int num_ranks = 0;
  PeerTable peers{};
  AreaConfig areas{};
};

// Domain registered for a device ordinal; false if none.
bool GetCudaDomain(int ordinal, CudaDomain* out);
void SetCudaDomain(int ordinal, const CudaDomain& d);

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

// JAX_EP_TIMEOUT_S (default 300 s), in nanoseconds, for the kernels' waits.
int64_t KernelTimeoutNs();

}  // namespace jax_ep
