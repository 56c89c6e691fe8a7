// kernels/internode/nccl_host.cc over the emulated NCCL on 4 virtual GPUs (2 per node):
// the context-count refusal, Finish after a failed Start, one grouped Start of every GPU
// (ranks permuted) and what it wrote to g_nccl_gin, and one Start per GPU as a process
// per GPU makes them. Built and run by tests/runtime/test_nccl_host.py.
#include <cstdio>
#include <string>
#include <vector>
#include "kernels/emu/emu_control.h"
#include "kernels/emu/nccl_emu.h"
#include "kernels/internode/nccl_host.h"
#include "kernels/internode/nccl_gin_state.h"
using namespace jax_ep;
#define CHECK(c) do { if (!(c)) { std::printf("FAIL %s:%d %s\n", __FILE__, __LINE__, #c); return 1; } } while (0)
int main() {
  emu::Config c; c.num_devices = 4; emu::configure(c);
  nccl_emu::WorldConfig w; w.num_ranks = 4; w.gpus_per_node = 2; w.max_contexts = 4;
  nccl_emu::reset(w);
  std::string why; CHECK(nccl_host::Available(&why)); std::printf("avail '%s' v%s\n", why.c_str(), nccl_host::VersionString().c_str());
  std::string uid; std::string e = nccl_host::UniqueId(&uid); CHECK(e.empty()); CHECK(uid.size() == 128);
  // too many contexts: clear error
  e = nccl_host::Start({0, 1, 2, 3}, {0, 1, 2, 3}, 4, uid, 100000, 8, 2);
  std::printf("8 ctx: %s\n", e.c_str()); CHECK(e.find("gave 4 GIN context") != std::string::npos);
  e = nccl_host::Start({0}, {0}, 4, uid, 100000, 2, 2);
  std::printf("restart before finish: %s\n", e.c_str()); CHECK(!e.empty());
  e = nccl_host::Finish({0, 1, 2, 3}); std::printf("finish after failure: '%s'\n", e.c_str()); CHECK(e.empty());
  nccl_emu::reset(w);
  CHECK(nccl_host::UniqueId(&uid).empty());
  e = nccl_host::Start({0, 1, 2, 3}, {3, 2, 1, 0}, 4, uid, 100000, 4, 2);
  std::printf("start: '%s'\n", e.c_str()); CHECK(e.empty());
  for (int d = 0; d < 4; ++d) {
    cudaSetDevice(d);
    CHECK(nccl_host::Started()); CHECK(nccl_host::Rank() == 3 - d); CHECK(nccl_host::World() == 4);
    CHECK(nccl_host::HeapBytes() == 102400); CHECK(nccl_host::Heap() != nullptr); CHECK(nccl_host::NumContexts() == 4);
    transport::NcclGinState st; cudaMemcpyFromSymbol(&st, transport::g_nccl_gin, sizeof(st));
    CHECK(st.base == nccl_host::Heap()); CHECK(st.num_contexts == 4); CHECK(st.full.rank == 3 - d);
    CHECK(st.full.nRanks == 4); CHECK(st.rail.ginContextCount == 4); CHECK(st.ctx_of_qp[5] == 1);
    CHECK(st.win != nullptr);
    std::printf("GPU %d: rank %d lsa %d/%d\n", d, st.full.rank, st.full.lsaRank, st.full.lsaSize);
  }
  cudaSetDevice(0);
  e = nccl_host::Finish({0, 1, 2, 3}); std::printf("finish: '%s'\n", e.c_str()); CHECK(e.empty());
  for (int d = 0; d < 4; ++d) { cudaSetDevice(d); CHECK(!nccl_host::Started()); CHECK(nccl_host::Heap() == nullptr); }
  // One Start per GPU (a process per GPU), no group.
  nccl_emu::reset(w);
  CHECK(nccl_host::UniqueId(&uid).empty());
  for (int d = 0; d < 4; ++d) { e = nccl_host::Start({d}, {d}, 4, uid, 4096, 2, 2); CHECK(e.empty()); }
  for (int d = 0; d < 4; ++d) { cudaSetDevice(d); CHECK(nccl_host::Rank() == d); CHECK(nccl_host::NumContexts() == 2); }
  for (int d = 0; d < 4; ++d) { e = nccl_host::Finish({d}); CHECK(e.empty()); }
  std::printf("OK\n");
  return 0;
}
