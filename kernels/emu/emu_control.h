// Host-side control of the emulated GPU: configuration, peer memory, faults and counters.
// Used by the emulated module's driver code (xla_ffi/emu) and by tests.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "kernels/emu/emu_cuda.h"

namespace emu {

struct Config {
  int num_devices = 8;          // virtual GPUs (cudaGetDeviceCount)
  uint64_t seed = 1;            // scheduler, store-buffer drains
  int resident_blocks = 0;      // blocks of one virtual GPU that run at once; 0: per kernel,
                                // from its ptxas registers and shared memory (occupancy.h)
  int num_sms = 132;            // SMs of a virtual GPU (resident_blocks == 0)
  int fallback_blocks = 8;      // a kernel the occupancy table lacks (with a warning)
  double quantum_ns = 100.0;    // virtual time one round of every live thread takes
  double min_sleep_ns = 500.0;  // __nanosleep never sleeps less (the clock's granularity)
  double stay_prob = 0.9;       // chance the next step stays in the block that ran last
  double drain_prob = 0.002;    // chance a step drains part of one pending store buffer
  bool weak_stores = true;      // buffer stores to peer memory (store_bytes / store helpers)
  double late_ns = 20000.0;     // a finished kernel's unfenced peer stores become visible
                                // up to this much later; its stream's next op waits for them
  double max_virtual_ns = 60e9; // a run past this virtual time is reported as a hang
  // Preemption: after each step, with this chance, the block that ran is parked (none of
  // its threads runs) for preempt_ns of virtual time, as a block an SM deschedules or
  // that waits behind other work; 0: off (the default; no random draw is made then).
  double preempt_prob = 0.0;
  double preempt_ns = 0.0;
  // Idle fast-forward. Once every thread has only polled or slept for idle_after_ns of
  // virtual time (no store, atomic, fence, bulk copy, transport delivery or block change,
  // no store buffer or transport operation pending), a __nanosleep lasts a quarter of that
  // idle time, at most idle_sleep_max_ns (which bounds how late a waiter sees a change).
  // A kernel polling for a peer that never comes then reaches its own timeout after a few
  // hundred wake-ups rather than timeout / min_sleep_ns of them. Runs that are never idle
  // that long are not changed at all (the same steps and draws for a seed). 0: off.
  double idle_after_ns = 250e3;
  double idle_sleep_max_ns = 1e6;
  // Hardware queues ("connections") of a virtual GPU, 1 to 32: CUDA_DEVICE_MAX_CONNECTIONS,
  // whose default is 8 (CUDA C++ Programming Guide, "CUDA Environment Variables"). Streams
  // share them round-robin and a queue issues its operations in order (docs/emulator.md,
  // "Streams and hardware queues").
  int connections = 8;
};

// Blocks of `kernel` (its name as launched; namespace and template arguments are ignored)
// one virtual GPU holds at once at this launch configuration under the current Config:
// resident_blocks when set, else num_sms x BlocksPerSm from the occupancy table. 0: the
// launch cannot run (cudaErrorLaunchOutOfResources).
int64_t resident_limit(const char* kernel, int threads, size_t dynamic_smem);
// The kernel's registers per thread in the occupancy table; -1: not in it.
int occupancy_registers(const char* kernel);
// Kernels launched so far that the table lacks (each took Config::fallback_blocks).
std::vector<std::string>& occupancy_fallbacks();

// Memory changed outside a thread's store, atomic and copy helpers (a transport
// delivered, an emulated library wrote): the scheduler is not idle (Config::idle_after_ns).
void note_work();
// Another part of the emulated world with work the scheduler's steps carry forward
// (the emulated NVSHMEM's undelivered operations): while `pending()` holds the scheduler
// is not idle. One probe; null removes it.
void set_pending_probe(bool (*pending)());

// Resets every virtual GPU (memory stays allocated; streams, errors, counters cleared).
void configure(const Config& c);
const Config& config();

// Marks [p, p + n) as memory that other virtual GPUs read: stores into it through the
// store helpers are buffered (weak visibility). Allocations are separate, so AddressSanitizer
// puts redzones between the virtual GPUs' buffers.
void mark_peer_memory(void* p, size_t n);
void unmark_peer_memory(void* p);

// Faults found by the emulator itself (deadlock, hang, a collective naming an exited lane):
// returned and cleared. Empty: none.
std::vector<std::string> take_faults();

// Counters since the last reset, summed over the virtual GPUs (docs/emulator.md, "Counters"):
// "kernel:<name>:launches|blocks|warps|threads", "load_bytes|store_bytes:<local|peer>:<width>"
// and "loads|stores:<space>:<width>" (accesses) through the named load/store/copy helpers,
// "fences:block|gpu|system", "release_stores", "acquire_loads", "polls", "sleeps",
// "idle_sleeps", "atomics", "peer_stores", "nvshmem:*" (the emulated NVSHMEM's), "steps", "virtual_ns".
std::map<std::string, uint64_t> counters();
// The same for one virtual GPU (what its threads did; no "steps"/"virtual_ns").
std::map<std::string, uint64_t> device_counters(int device);
int num_counted_devices();
// The streams of every virtual GPU, each one's default stream included.
int num_streams();
// How a change of block gives the block its __shared__ variables: true, by pointing this
// module's TLS entry at the block's image; false, by copying the image in and out.
bool shared_by_pointer();
void reset_counters();
void add_counter(const std::string& name, uint64_t v = 1);

// The virtual GPU the calling host code addresses (cudaSetDevice) and its default stream.
int current_device();

}  // namespace emu
