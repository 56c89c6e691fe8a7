// Group setup of the emulated module: the CUDA backend's own host functions
// (xla_ffi/cuda/cuda_harness.cc, included here so its setup checks and the identity it
// writes into each header are the ones a GPU gets), over one separate allocation per
// virtual GPU so AddressSanitizer's redzones sit between the ranks' buffers.
#include "xla_ffi/cuda/cuda_harness.cc"  // NOLINT(build/include): the setup code itself
#include "kernels/emu/emu_control.h"

namespace jax_ep {
namespace emu_driver {

namespace {
std::vector<void*>& GroupBuffers() {
  static std::vector<void*> v;
  return v;
}
}  // namespace

// Frees the previous group's buffers, allocates R fresh ones (zeroed) and registers
// virtual GPU r as rank r of the group. Returns the buffers' addresses.
std::vector<uint64_t> SetupGroup(int num_ranks, int group, std::vector<uint64_t> area_bytes,
                                 std::vector<int64_t> ll_shape) {
  if (num_ranks < 1 || num_ranks > kMaxRanks)
    throw std::invalid_argument("jax_ep emu: num_ranks must be in [1, 32]");
  if (num_ranks > emu::config().num_devices)
    throw std::invalid_argument("jax_ep emu: num_ranks exceeds the configured virtual GPUs");
  // The previous group's domains go with its buffers (reset() would clear freed headers).
  for (int i = 0; i < kMaxCudaDevices; ++i) {
    CudaDomain old;
    if (GetCudaDomain(i, &old)) SetCudaDomain(i, CudaDomain{});
  }
  for (void* p : GroupBuffers()) cudaFree(p);
  GroupBuffers().clear();
  const size_t total = Areas(area_bytes).total() + LowLatencyBytes(area_bytes);
  std::vector<uint64_t> peers;
  for (int r = 0; r < num_ranks; ++r) {
    Check(cudaSetDevice(r), "cudaSetDevice");
    void* p = nullptr;
    Check(cudaMalloc(&p, total), "cudaMalloc of a communication buffer");
    Check(cudaMemset(p, 0, total), "cudaMemset of a communication buffer");
    emu::mark_peer_memory(p, total);
    GroupBuffers().push_back(p);
    peers.push_back(reinterpret_cast<uint64_t>(p));
  }
  for (int r = 0; r < num_ranks; ++r) {
    SetCudaDomain(r, CudaDomain{});
    SetDomain(r, r, group, num_ranks, peers, area_bytes, ll_shape);
  }
  Check(cudaSetDevice(0), "cudaSetDevice");
  return peers;
}

void BindCudaHostFunctions(void* module) { DefineCudaBindings(module); }

}  // namespace emu_driver
}  // namespace jax_ep
