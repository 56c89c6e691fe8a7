// Host side of the NCCL GIN transport: NCCL communicators, the symmetric
// window that is the internode heap, the device communicators and the device global
// transport::g_nccl_gin (kernels/internode/nccl_gin_state.h). No NCCL type
// appears here, so the bindings compile without NCCL's headers. State is per CUDA device
// (cudaGetDevice), in the real and the emulated build; every function that returns a
// string returns "" on success, else an error naming the NCCL or CUDA call.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

namespace jax_ep {
namespace nccl_host {

// Oldest libnccl the transport runs on (2.30: GIN connection types, context counts).
constexpr int kMinVersion = 23000;

// A new 128-byte ncclUniqueId as bytes (rank 0 of the world makes it; the others get it
// through JAX's key-value store).
std::string UniqueId(std::string* out);
// One communicator per local GPU: ordinals[i] (CUDA device) gets world rank ranks[i];
// all created in one ncclGroupStart/End (a process may drive 1 or 8 GPUs). On each:
// ncclMemAlloc heap_bytes (rounded up to NCCL's window alignment, cleared),
// ncclCommWindowRegister(NCCL_WIN_COLL_SYMMETRIC), two ncclDevCommCreate (FULL and RAIL
// connections, ginContextCount >= num_contexts, ginForceEnable), then g_nccl_gin.
// Collective over the world. After a failure, Finish (also collective) frees what was made.
std::string Start(const std::vector<int>& ordinals, const std::vector<int>& ranks, int world,
                  const std::string& uid, size_t heap_bytes, int num_contexts,
                  int gpus_per_node);
bool Started();          // on the current CUDA device
char* Heap();            // the current device's window memory, or nullptr
size_t HeapBytes();      // its size (heap_bytes rounded up), 0 when not started
int Rank();              // world rank of the current device, -1 when not started
int World();             // world size, 0 when not started
int NumContexts();       // GIN contexts granted on both connections, 0 when not started
// Collective: frees every device's communicators, window and memory.
std::string Finish(const std::vector<int>& ordinals);
// libnccl.so.2 found, every function above present and version >= kMinVersion (and not
// older than the headers this build was compiled with); else *why says what to install.
bool Available(std::string* why);
std::string VersionString();  // the library's version, "2.32.6", or "" when unavailable
int HeaderVersion();          // NCCL_VERSION_CODE of the headers this build was compiled with

}  // namespace nccl_host
}  // namespace jax_ep
