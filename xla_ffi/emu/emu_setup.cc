// Group setup of the emulated module: the CUDA backend's own host functions
// (xla_ffi/cuda/cuda_harness.cc, included here so its setup checks and the identity it
// writes into each header are the ones a GPU gets), over one separate allocation per
// virtual GPU so AddressSanitizer's redzones sit between the ranks' buffers.
#include "xla_ffi/cuda/cuda_harness.cc"  // NOLINT(build/include): the setup code itself
#include "kernels/emu/emu_control.h"

#include <type_traits>

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

namespace {
// The cumulative ring counters of rank `rank`'s header (op 0: dispatch, 1: combine, 2:
// gather, whose head counts the ids posted), as
// [channel][peer] lists: what the tests read to see every ring wrap. After synchronize().
nanobind::dict ReadRingCounters(int rank, int op) {
  if (rank < 0 || rank >= static_cast<int>(GroupBuffers().size()) || op < 0 || op >= kNumOpKinds)
    throw std::invalid_argument("jax_ep emu: ring_counters needs a set-up rank and op 0, 1 or 2");
  const RankHeader* h = static_cast<const RankHeader*>(GroupBuffers()[rank]);
  nanobind::dict d;
  auto fill = [&d](const auto& c) {
    constexpr int n = std::decay_t<decltype(c)>::kChannels;
    auto grid = [](const uint64_t (&v)[n][kMaxRanks]) {
      std::vector<std::vector<uint64_t>> out(n);
      for (int ch = 0; ch < n; ++ch) out[ch].assign(v[ch], v[ch] + kMaxRanks);
      return out;
    };
    d["tail"] = grid(c.tail);
    d["head"] = grid(c.head);
    d["sent"] = grid(c.sent);
    d["read"] = grid(c.read);
  };
  if (op == kOpDispatch) fill(h->d_ring);
  else fill(op == kOpCombine ? h->c_ring : h->g_ring);
  return d;
}
}  // namespace

void BindCudaHostFunctions(void* module) {
  DefineCudaBindings(module);
  nanobind::module_ m = nanobind::borrow<nanobind::module_>(
      nanobind::handle(static_cast<PyObject*>(module)));
  m.def("intranode_ring_counters", &ReadRingCounters, nanobind::arg("rank"), nanobind::arg("op"),
        "Cumulative ring counters (tail, head, sent, read) of a rank's header, [channel][peer].");
}

}  // namespace emu_driver
}  // namespace jax_ep
