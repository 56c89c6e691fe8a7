// The emulated GPU's runtime, internals shared by its files (kernels/emu/emu_fibers.cc,
// emu_scheduler.cc, emu_memory.cc, emu_tma.cc, emu_counters.cc, emu_cuda_api.cc): the
// state of virtual GPUs, streams, kernels, blocks and fibers, and the functions one file
// gives the others. Private to kernels/emu (kernel code sees kernels/emu/emu_cuda.h only).
// Model: docs/emulator.md.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "kernels/emu/emu_control.h"
#include "kernels/emu/emu_cuda.h"

#if defined(__SANITIZE_ADDRESS__)
#define JEP_EMU_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define JEP_EMU_ASAN 1
#endif
#endif

// The device-global section (kernels/emu/emu.ld), swapped per virtual GPU.
extern "C" {
extern char __jep_emu_device_begin[], __jep_emu_device_end[];
}

namespace emu {

// ---- state ------------------------------------------------------------------------------
struct Kernel;
struct Block;
struct Device;

struct Pending {
  char* dst;
  uint32_t n;
  alignas(16) unsigned char data[16];
};
struct StoreBuf {
  Kernel* kernel;
  std::deque<Pending> q;
  size_t dirty_pos = SIZE_MAX;
};

enum class FState { kNew, kRunnable, kBlocked, kSleeping, kDone };

// One bulk copy (cp.async.bulk) issued and not yet waited for.
struct BulkCopy {
  void* dst;
  const void* src;
  size_t n;
  bool landed = false;
  bool stale = false;  // reads garbage: the proxy fence that orders its source is missing
};

struct Fiber {
  FiberCtx ctx;
  Block* blk = nullptr;
  void* sp = nullptr;
  char* stack = nullptr;
  FState state = FState::kNew;
  uint64_t result = 0;
  double wake = 0;
  StoreBuf* sbuf = nullptr;
  void* asan_fake = nullptr;
  uint32_t chain[kNumChains] = {};  // this thread's fences, releases, work requests
  std::vector<BulkCopy> bulk_open;                 // bulk stores since its last commit
  std::vector<std::vector<BulkCopy>> bulk_groups;  // committed groups, oldest first
  // Async proxy (emu_tma.cc): whether a fence.proxy.async.global came after this thread's
  // last acquire (a bulk load of peer-written global memory needs one between them).
  bool global_proxy_fenced = false;
  // Rounds and bytes in flight (emu_counters.cc, "Rounds"), in millirounds (a bulk load's
  // wait retires a share of what is in flight: a fraction of a round).
  uint64_t run_bytes = 0;        // plain loads issued since this thread's last use point
  int run_space = kLatLocal;     // the farthest space those loads read
  unsigned write_spaces = 0;     // bit s: writes to space s not yet waited for (a fence)
  const void* poll_flag = nullptr;  // the flag of the poll round in progress
  uint64_t mrounds[kNumLatSpaces] = {};       // every round: data, polls, fences
  uint64_t load_mrounds[kNumLatSpaces] = {};  // data rounds (loads, bulk loads) only
  std::map<const void*, std::pair<uint64_t, int>> bulk_inflight;  // by mbarrier: bytes, space
};

// An mbarrier's accounting (emu_tma.cc): the arrivals and transaction bytes of its current
// phase, and the copies issued on it that have not landed.
struct MbarState {
  uint32_t count = 1;        // arrivals a phase needs (mbarrier.init)
  uint32_t arrived = 0;      // arrivals in the current phase
  int64_t expect_tx = 0;     // bytes announced by expect_tx in the current phase
  int64_t issued_tx = 0;     // bytes of the copies that complete_tx on the current phase
  uint64_t init_fences = 0;  // the block's shared proxy fences when it was initialized
};

struct Coll {
  int op;
  unsigned mask;
  unsigned arrived = 0;
  uint64_t val[32];
  int arg[32];
  int width = 32;
};
struct WarpState {
  unsigned exited = 0;
  unsigned present = 0;  // lanes that exist (a partial last warp)
  std::vector<Coll> colls;
};

struct Block {
  Kernel* k;
  Device* dev;
  dim3 bid;
  std::vector<Fiber> fibers;
  std::vector<Fiber*> runnable;
  std::vector<Fiber*> at_barrier;
  // Named barriers 1..15 (bar.sync id, threads): the threads waiting at each.
  std::vector<Fiber*> at_named[16];
  std::vector<WarpState> warps;
  int live = 0;
  std::vector<unsigned char> smem_store;  // holds its __shared__ image (aligned: smem_image)
  unsigned char* smem_image = nullptr;
  std::vector<unsigned char> dyn_smem;
  size_t ready_pos = SIZE_MAX;
  double parked_until = 0;  // preempted: none of its threads runs before this virtual time
  size_t parked_pos = SIZE_MAX;
  uint64_t accesses[2] = {};  // its threads' loads and stores, [0] own GPU's memory, [1] a peer's
  uint64_t tma_bytes = 0;     // bytes of its bulk copies (loads and stores)
  std::map<const void*, std::vector<BulkCopy>> bulk_loads;  // by mbarrier: not yet waited
  std::map<const void*, MbarState> mbars;                   // by address (emu_tma.cc)
  // Async proxy (emu_tma.cc): fence.proxy.async.shared::cta executed by its threads, and
  // the 16-byte granules of its dynamic shared memory that bulk loads (the async proxy)
  // wrote last.
  uint64_t shared_proxy_fences = 0;
  std::vector<bool> async_written;
  // Non-coherent loads of peer memory (emu_tma.cc): the 16 bytes each granule held at
  // this block's first .nc load of it.
  std::unordered_map<uintptr_t, std::array<unsigned char, 16>> nc_snap;
};

struct Kernel {
  LaunchSpec spec;
  Device* dev;
  Stream* stream;
  uint64_t total_blocks = 0, next_block = 0, done_blocks = 0;
  int64_t cost = 1;  // the share of its GPU one resident block takes (residency units)
  std::vector<StoreBuf*> bufs;
  uint32_t chain_max[kNumChains] = {};  // the longest of its threads' chains
  uint64_t block_max[2] = {};           // the most accesses one of its blocks made, by space
  uint64_t block_max_tma = 0;           // the most bulk-copy bytes one of its blocks moved
  uint64_t mrounds_max[kNumLatSpaces] = {};  // the most data rounds of one of its threads
  uint64_t sync_mrounds_max[kNumLatSpaces] = {};  // the most polls and write waits of one
  uint64_t warp_mrounds[kNumLatSpaces] = {};  // over its warps: each warp's data rounds
};

struct Op {
  enum Kind { kKernel, kMemset, kMemcpy, kRecord, kWait } kind;
  std::shared_ptr<Kernel> kernel;
  void* dst = nullptr;
  const void* src = nullptr;
  size_t n = 0;
  int value = 0;
  Event* ev = nullptr;
  uint64_t ticket = 0;
  uint64_t seq = 0;  // its place in its hardware queue (Device::queues)
};

struct Stream {
  Device* dev;
  std::deque<Op> ops;
  bool head_started = false;
  // Peer stores a finished kernel had not fenced: other GPUs see them a little later (by
  // `late_until`); this stream's next operation and the host see them first.
  std::vector<void*> late;
  double late_until = 0;
  int queue = 0;  // the hardware queue its operations go to (Device::queues)
};
struct Event {
  uint64_t recorded = 0, completed = 0;
};

struct Device {
  int id;
  std::vector<Stream*> streams;  // streams[0]: the default stream
  // Hardware queues (Config::connections): each holds the sequence numbers of the operations
  // of its streams not issued yet, in enqueue order; only the front one may issue.
  std::vector<std::deque<uint64_t>> queues;
  uint64_t streams_made = 0;  // streams created since the last reset (the round-robin index)
  int resident = 0;
  int64_t load = 0;  // residency units taken by its resident blocks (Kernel::cost)
  std::vector<unsigned char> globals;  // the device-global section while not loaded
};

// Counters of one virtual GPU: the hot ones in arrays (every load/store helper bumps one),
// the rest by name. Bytes by direction (load, store), space (local, peer) and width.
enum Hot { kHotAtomics, kHotFenceBlock, kHotFenceGpu, kHotFenceSystem, kHotPolls, kHotRelease,
           kHotPeerStores, kHotAcquire, kHotSleeps, kNumHot };
constexpr int kNumWidths = 5;  // 1, 2, 4, 8, 16 bytes
struct DevCounters {
  uint64_t hot[kNumHot] = {};
  uint64_t bytes[2][2][kNumWidths] = {};  // [load/store][local/peer][width]
  uint64_t accesses[2][2][kNumWidths] = {};
  std::map<std::string, uint64_t> named;
};

struct State {
  Config cfg;
  std::vector<Device*> devices;
  std::mt19937_64 rng{1};
  // When each bulk copy lands (at its issue or at its wait): a stream of its own, so the
  // scheduler's interleavings stay what they were for a seed.
  std::mt19937_64 bulk_rng{1};
  // The hardware rules' own draws (async-proxy staleness, non-coherent loads): a stream of
  // their own, so a correct kernel's run draws what it drew before these rules existed.
  std::mt19937_64 rules_rng{1};
  int current = 0;  // host's current device
  cudaError_t last_error = cudaSuccess;
  double now_ns = 0;
  uint64_t live_fibers = 0;
  std::vector<Block*> ready;     // blocks with runnable fibers
  std::vector<Block*> parked;    // preempted blocks (Config::preempt_prob)
  std::vector<Fiber*> sleepers;  // a heap on wake time
  std::vector<StoreBuf*> dirty;  // store buffers with pending stores
  // 16-byte granules with pending stores: which buffers hold how many of them (coherence,
  // see BufferStore).
  std::unordered_map<uintptr_t, std::vector<std::pair<StoreBuf*, uint32_t>>> granules;
  Block* loaded_block = nullptr;      // whose __shared__ copy is in the TLS block (null: host)
  bool loaded_block_dead = false;     // it finished: nothing to save
  std::vector<unsigned char> host_tls;
  Device* loaded_device = nullptr;
  Block* last_block = nullptr;
  Fiber* cur = nullptr;
  void* host_sp = nullptr;
  const void* host_stack_bottom = nullptr;
  size_t host_stack_size = 0;
  std::vector<char*> stack_pool;
  std::vector<std::pair<char*, size_t>> peer_mem;
  std::vector<std::string> faults;
  std::map<std::string, uint64_t> counters;  // not tied to a virtual GPU (scheduler steps)
  std::vector<DevCounters> dev_ctr;          // per virtual GPU (emu_counters.cc)
  std::map<uintptr_t, std::pair<size_t, int>> allocs;  // base -> (bytes, owning GPU; -1 host)
  std::vector<unsigned char> device_pristine;
  // Device globals by mapping (ResetDeviceMap): one memory file, a page-aligned slot per virtual
  // GPU after the host's (slot 0: the pristine values the host sees after a reset); -1:
  // swapped by copying instead.
  int device_fd = -1;
  size_t device_slots = 0;
  bool in_scheduler = false;
  // Idle fast-forward (Config::idle_after_ns): when memory last changed, and whether the
  // step running now changed it.
  double idle_since = 0;
  bool step_work = false;
  bool (*pending_probe)() = nullptr;
  uint64_t op_seq = 0;  // operations enqueued so far (Op::seq)
};

inline State& S() {
  static State* s = new State();
  return *s;
}

// ---- counters and faults (emu_counters.cc) ------------------------------------------------
// The counters of virtual GPU d (-1: the running thread's GPU, else the host's current one).
inline DevCounters& Ctr(int d = -1) {
  State& s = S();
  if (d < 0) d = s.cur != nullptr ? s.cur->blk->dev->id : s.current;
  if (d < 0) d = 0;
  if (static_cast<size_t>(d) >= s.dev_ctr.size()) s.dev_ctr.resize(static_cast<size_t>(d) + 1);
  return s.dev_ctr[static_cast<size_t>(d)];
}
inline uint64_t& Hot(int h) { return Ctr().hot[h]; }
// A counter of virtual GPU d (-1: see Ctr).
void CountDev(int d, const std::string& k, uint64_t v = 1);
// A kernel's name in the counters: its spelling without the launch bound (emu_scheduler.cc).
std::string CounterName(const char* spelled);
// A counter of the running thread's GPU; outside any GPU, of no GPU (totals only).
void Count(const std::string& k, uint64_t v = 1);
// A kernel's longest per-thread chains and busiest block, added per launch.
void CountChains(Kernel* k);
// Rounds (emu_counters.cc): the running thread's loads since its last use point end as one
// round (a store, fence, poll, barrier or warp collective is a use point); a block's warps'
// data rounds go to its kernel when the block finishes.
void EndRun(Fiber* f);
void CountWarpRounds(Block* b);
extern const char* const kLatNames[kNumLatSpaces];  // "local", "peer", "rdma"
// Bytes by width and space, without the latency accounting (note_access does both).
void CountAccess(int dir, const void* p, int width, size_t n);
void NoteUse(Fiber* f);    // a use point: the loads in flight are waited for
void NoteFence(Fiber* f);  // a fence or release: also the writes in flight
// A store (use: a use point of the loads before it) or a bulk store (not one) to p.
void NoteWrite(Fiber* f, const void* p, bool use = true);
void NoteBulkLoad(Fiber* f, const void* mbar, const void* src, size_t n);
void NoteBulkWait(Fiber* f, const void* mbar);  // the phase of mbar completed
void Fault(const std::string& what);

// ---- sets with O(1) insert and remove: each member keeps its index (`Pos`, SIZE_MAX when
// absent); removal moves the last member into the hole ----
template <typename T, size_t T::*Pos>
void SetAdd(std::vector<T*>& v, T* x) {
  if (x->*Pos != SIZE_MAX) return;
  x->*Pos = v.size();
  v.push_back(x);
}
template <typename T, size_t T::*Pos>
void SetRemove(std::vector<T*>& v, T* x) {
  if (x->*Pos == SIZE_MAX) return;
  T* last = v.back();
  v[x->*Pos] = last;
  last->*Pos = x->*Pos;
  v.pop_back();
  x->*Pos = SIZE_MAX;
}

// ---- fibers, shared memory images, device globals (emu_fibers.cc) -------------------------
// This module's TLS block on the scheduler thread: every __shared__ variable lives there.
struct TlsBlock {
  char* base = nullptr;
  size_t size = 0;
  size_t align = 16;
  size_t modid = 0;
};
TlsBlock& Tls();
size_t SharedBytes();
char* SharedBase();
void** DtvEntry();
bool TlsByPointer();
size_t DeviceBytes();
void ResetDeviceMap(size_t devices);
void LoadDevice(Device* d);
// b == nullptr: the host's own TLS contents (saved when the scheduler starts).
void LoadBlock(Block* b);
void SwitchToHost(Fiber* f, bool dying);
// Runs f until it yields. Called on the host stack.
void RunFiber(Fiber* f);
// The running fiber gives the scheduler a turn; `keep` says it stays runnable.
void Suspend(bool keep);

// ---- scheduler (emu_scheduler.cc) ---------------------------------------------------------
Device* Dev(int i);
Stream* Resolve(cudaStream_t st);
void MakeRunnable(Fiber* f);
// Runs the virtual GPUs until `done()` holds.
void RunUntil(const std::function<bool()>& done);
bool StreamIdle(Stream* st);
void SyncDevice(Device* d);
void EnsureInit();
// A new stream of d on the next hardware queue (round-robin), and an operation queued on a
// stream and on its hardware queue.
Stream* NewStream(Device* d);
void PushOp(Stream* st, Op op);

// ---- store buffers, visibility (emu_memory.cc) --------------------------------------------
// The virtual GPU whose allocation holds p (-1: host memory or not allocated here).
int OwnerOf(const void* p);
bool Remote(const Fiber* f, const void* p);
// Whether p is in memory marked as peer memory (mark_peer_memory), whoever owns it.
bool PeerMem(const void* p);
void Drain(StoreBuf* b, size_t n);

}  // namespace emu
