// The emulated GPU's runtime: virtual GPUs with streams and events, a deterministic seeded
// scheduler that runs every CUDA thread as a fiber on the calling host thread, warp
// collectives with lane semantics, co-residency limits, a virtual clock, per-thread store
// buffers for peer memory (weak visibility) and counters. Model: docs/emulator.md.
#include <link.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "kernels/emu/emu_control.h"
#include "kernels/emu/emu_cuda.h"
#include "kernels/emu/occupancy.h"

#if defined(__SANITIZE_ADDRESS__)
#define JEP_EMU_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define JEP_EMU_ASAN 1
#endif
#endif
#if defined(JEP_EMU_ASAN)
#include <sanitizer/common_interface_defs.h>
#endif

extern "C" {
extern char __jep_emu_device_begin[], __jep_emu_device_end[];
}

// ---------------------------------------------------------------------------------------
// Context switch: saves the callee-saved registers on the old stack, stores its stack
// pointer, loads the new one. A new fiber's stack starts with six register slots (r12 =
// argument, r13 = entry) and the trampoline as return address.
#if defined(__x86_64__)
asm(R"(
.text
.globl jep_emu_switch
.hidden jep_emu_switch
.type jep_emu_switch,@function
jep_emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
.size jep_emu_switch,.-jep_emu_switch
.globl jep_emu_trampoline
.hidden jep_emu_trampoline
.type jep_emu_trampoline,@function
jep_emu_trampoline:
  movq %r12, %rdi
  callq *%r13
  ud2
.size jep_emu_trampoline,.-jep_emu_trampoline
)");
extern "C" void jep_emu_switch(void** save_sp, void* new_sp);
extern "C" void jep_emu_trampoline();
#else
#error "the emulated GPU's context switch is written for x86-64"
#endif

namespace emu {

FiberCtx* g_ctx = nullptr;

namespace {

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
};

}  // namespace

struct Stream {
  Device* dev;
  std::deque<Op> ops;
  bool head_started = false;
  // Peer stores a finished kernel had not fenced: other GPUs see them a little later (by
  // `late_until`); this stream's next operation and the host see them first.
  std::vector<void*> late;
  double late_until = 0;
};
struct Event {
  uint64_t recorded = 0, completed = 0;
};

namespace {

struct Device {
  int id;
  std::vector<Stream*> streams;  // streams[0]: the default stream
  int resident = 0;
  int64_t load = 0;  // residency units taken by its resident blocks (Kernel::cost)
  std::vector<unsigned char> globals;  // the device-global section while not loaded
};

// ---------------------------------------------------------------------------------------
// Counters of one virtual GPU: the hot ones in arrays (every load/store helper bumps one),
// the rest by name. Bytes by direction (load, store), space (local, peer) and width.
enum Hot { kHotAtomics, kHotFenceBlock, kHotFenceGpu, kHotFenceSystem, kHotPolls, kHotRelease,
           kHotPeerStores, kHotAcquire, kHotSleeps, kNumHot };
const char* const kHotNames[kNumHot] = {"atomics", "fences:block", "fences:gpu", "fences:system",
                                        "polls", "release_stores", "peer_stores",
                                        "acquire_loads", "sleeps"};
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
  std::vector<DevCounters> dev_ctr;          // per virtual GPU (counters.cc section below)
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
};

State& S() {
  static State* s = new State();
  return *s;
}

#if defined(JEP_EMU_ASAN)
constexpr size_t kStackBytes = 256 * 1024;
#else
constexpr size_t kStackBytes = 32 * 1024;
#endif
const size_t kPage = static_cast<size_t>(sysconf(_SC_PAGESIZE));

// This module's TLS block on the scheduler thread: every __shared__ variable lives there.
thread_local volatile char g_tls_anchor;
struct TlsBlock {
  char* base = nullptr;
  size_t size = 0;
  size_t align = 16;
  size_t modid = 0;
};
int FindTls(struct dl_phdr_info* info, size_t, void* data) {
  auto* out = static_cast<TlsBlock*>(data);
  const auto self = reinterpret_cast<uintptr_t>(&FindTls);
  bool mine = false;
  size_t tls = 0;
  for (int i = 0; i < info->dlpi_phnum; ++i) {
    const ElfW(Phdr)& p = info->dlpi_phdr[i];
    const uintptr_t lo = info->dlpi_addr + p.p_vaddr;
    if (p.p_type == PT_LOAD && self >= lo && self < lo + p.p_memsz) mine = true;
    if (p.p_type == PT_TLS) {
      tls = p.p_memsz;
      out->align = std::max<size_t>(16, p.p_align);
    }
  }
  if (!mine) return 0;
  out->base = static_cast<char*>(info->dlpi_tls_data);
  out->size = tls;
  out->modid = info->dlpi_tls_modid;
  return 1;
}
// Not itself thread_local: the block it describes is swapped with every block's copy.
TlsBlock& Tls() {
  static TlsBlock t;
  static std::thread::id owner;
  if (t.base == nullptr || owner != std::this_thread::get_id()) {
    g_tls_anchor = 1;  // makes sure this thread's block exists
    t = TlsBlock{};
    dl_iterate_phdr(FindTls, &t);
    if (t.base == nullptr) throw std::runtime_error("emu: cannot find this module's TLS block");
    owner = std::this_thread::get_id();
  }
  return t;
}
size_t SharedBytes() { return Tls().size; }
char* SharedBase() { return Tls().base; }

// A block's __shared__ variables live in its own image; two ways to give the running block
// its image. By pointer (where it works): glibc's __tls_get_addr returns the thread's DTV
// entry for this module plus the variable's offset (the module is built position
// independent, so every access to a thread_local goes through it), so pointing that entry
// at the image makes the block's accesses land there, and a change of block copies nothing.
// By copy (the fallback, and under AddressSanitizer, which tracks the DTV itself): the
// image is copied into the thread's TLS block and back out.
// x86-64 glibc: %fs:8 holds the DTV, an array of 16-byte entries whose first word is the
// block's address.
void** DtvEntry() {
#if defined(__x86_64__) && defined(__GLIBC__)
  char* dtv;
  asm volatile("mov %%fs:8, %0" : "=r"(dtv));
  return reinterpret_cast<void**>(dtv + 16 * Tls().modid);
#else
  return nullptr;
#endif
}
__attribute__((noinline)) const volatile char* AnchorAddress() {
  asm volatile("" ::: "memory");  // computed afresh, not kept from an earlier call
  return &g_tls_anchor;
}
bool ProbeTlsByPointer() {
#if defined(JEP_EMU_ASAN) || !defined(__x86_64__) || !defined(__GLIBC__)
  return false;
#else
  if (std::getenv("JAX_EP_EMU_TLS_COPY") != nullptr) return false;
  const TlsBlock& t = Tls();
  void** e = DtvEntry();
  if (t.modid == 0 || t.align > 64 || e == nullptr || *e != t.base) return false;
  const size_t at = static_cast<size_t>(const_cast<const char*>(AnchorAddress()) - t.base);
  if (at >= t.size) return false;
  alignas(64) static char probe[64];
  *e = probe - at;  // only the anchor's address is taken, never dereferenced
  const bool moved = const_cast<const char*>(AnchorAddress()) == probe;
  *e = t.base;
  return moved && const_cast<const char*>(AnchorAddress()) == t.base + at;
#endif
}
bool TlsByPointer() {
  static const bool by_pointer = ProbeTlsByPointer();
  return by_pointer;
}
size_t DeviceBytes() { return static_cast<size_t>(__jep_emu_device_end - __jep_emu_device_begin); }

// Stacks come in chunks (one mapping each: the kernel limits the number of mappings, and a
// guard page per stack would split them); a canary at each stack's low end catches an
// overflow when its fiber next yields.
constexpr size_t kStacksPerChunk = 256;
constexpr uint64_t kCanary = 0x6a65705f63616e61ull;

char* TakeStack() {
  State& s = S();
  if (s.stack_pool.empty()) {
    void* m = mmap(nullptr, kStackBytes * kStacksPerChunk, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (m == MAP_FAILED) throw std::runtime_error("emu: cannot map fiber stacks");
    for (size_t i = 0; i < kStacksPerChunk; ++i)
      s.stack_pool.push_back(static_cast<char*>(m) + i * kStackBytes);
  }
  char* p = s.stack_pool.back();
  s.stack_pool.pop_back();
  std::memcpy(p, &kCanary, sizeof(kCanary));
  return p;
}

void CheckCanary(const char* stack, const char* kernel) {
  uint64_t c;
  std::memcpy(&c, stack, sizeof(c));
  if (c != kCanary) {
    std::fprintf(stderr, "emu: a thread of kernel %s overflowed its %zu-byte fiber stack\n",
                 kernel, kStackBytes);
    std::abort();
  }
}

// The counters of virtual GPU d (-1: the running thread's GPU, else the host's current one).
DevCounters& Ctr(int d = -1) {
  State& s = S();
  if (d < 0) d = s.cur != nullptr ? s.cur->blk->dev->id : s.current;
  if (d < 0) d = 0;
  if (static_cast<size_t>(d) >= s.dev_ctr.size()) s.dev_ctr.resize(static_cast<size_t>(d) + 1);
  return s.dev_ctr[static_cast<size_t>(d)];
}
uint64_t& Hot(int h) { return Ctr().hot[h]; }
// A counter of virtual GPU d (-1: see Ctr).
void CountDev(int d, const std::string& k, uint64_t v = 1) { Ctr(d).named[k] += v; }
// A counter of the running thread's GPU; outside any GPU, of no GPU (totals only).
void Count(const std::string& k, uint64_t v = 1) {
  if (S().cur != nullptr) CountDev(-1, k, v);
  else S().counters[k] += v;
}
// A kernel's longest per-thread chains, added per launch (launches of a stream run one
// after another, so their chains add up): "chain:fences:system|gpu", "chain:release_stores",
// "chain:wrs".
void CountChains(Kernel* k) {
  static const char* const kChainNames[kNumChains] = {
      "chain:fences:system", "chain:fences:gpu", "chain:release_stores", "chain:wrs"};
  for (int i = 0; i < kNumChains; ++i)
    if (k->chain_max[i] != 0) CountDev(k->dev->id, kChainNames[i], k->chain_max[i]);
  // The busiest block's accesses (one SM's instructions), added per launch likewise:
  // "block_max:accesses:local|peer" (each the maximum over the blocks on its own).
  static const char* const kBlockMaxNames[2] = {"block_max:accesses:local",
                                                "block_max:accesses:peer"};
  for (int i = 0; i < 2; ++i)
    if (k->block_max[i] != 0) CountDev(k->dev->id, kBlockMaxNames[i], k->block_max[i]);
  if (k->block_max_tma != 0) CountDev(k->dev->id, "block_max:tma_bytes", k->block_max_tma);
}


void Fault(const std::string& what) {
  State& s = S();
  if (s.faults.size() < 64) s.faults.push_back(what);
}

Device* Dev(int i) {
  State& s = S();
  if (i < 0 || i >= static_cast<int>(s.devices.size())) return nullptr;
  return s.devices[i];
}

Stream* Resolve(cudaStream_t st) {
  if (st != nullptr) return st;
  Device* d = Dev(S().current);
  return d != nullptr ? d->streams[0] : nullptr;
}

// ---- section swapping ----
// The section shows slot `slot` of the device file (no bytes copied; the pages that the
// next steps touch fault in). False: the mapping failed, swap by copying.
bool MapDeviceSlot(size_t slot) {
  State& s = S();
  const size_t n = DeviceBytes();
  void* p = mmap(__jep_emu_device_begin, n, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED,
                 s.device_fd, static_cast<off_t>(slot * n));
  return p == static_cast<void*>(__jep_emu_device_begin);
}

// Every device slot (and the host's) holds the pristine values, in a file large enough
// for `devices` virtual GPUs; the host's slot is mapped. Swapping 100s of KB of device
// globals by copying on every change of virtual GPU was most of the emulator's time.
void ResetDeviceMap(size_t devices) {
  State& s = S();
  const size_t n = DeviceBytes();
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  if (n == 0 || reinterpret_cast<uintptr_t>(__jep_emu_device_begin) % page != 0 || n % page != 0)
    return;  // not whole pages (another linker script): copy
  if (s.device_fd < 0) {
    s.device_fd = memfd_create("jax_ep_emu_device_globals", MFD_CLOEXEC);
    if (s.device_fd < 0) return;
  }
  bool ok = s.device_slots >= devices + 1 ||
            ftruncate(s.device_fd, static_cast<off_t>((devices + 1) * n)) == 0;
  if (ok) s.device_slots = std::max(s.device_slots, devices + 1);
  for (size_t k = 0; ok && k < s.device_slots; ++k)
    ok = pwrite(s.device_fd, s.device_pristine.data(), n, static_cast<off_t>(k * n)) ==
         static_cast<ssize_t>(n);
  if (ok && MapDeviceSlot(0)) return;
  // Back to the module's own pages, holding the pristine values.
  if (s.device_slots > 0)
    mmap(__jep_emu_device_begin, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
  std::memcpy(__jep_emu_device_begin, s.device_pristine.data(), n);
  close(s.device_fd);
  s.device_fd = -1;
  s.device_slots = 0;
}

void LoadDevice(Device* d) {
  State& s = S();
  if (s.loaded_device == d) return;
  const size_t n = DeviceBytes();
  if (s.device_fd >= 0) {
    if (!MapDeviceSlot(static_cast<size_t>(d->id) + 1))
      throw std::runtime_error("emu: cannot map a virtual GPU's device globals");
  } else if (n > 0) {
    if (s.loaded_device != nullptr) std::memcpy(s.loaded_device->globals.data(), __jep_emu_device_begin, n);
    std::memcpy(__jep_emu_device_begin, d->globals.data(), n);
  }
  s.loaded_device = d;
}
// b == nullptr: the host's own TLS contents (saved when the scheduler starts).
void LoadBlock(Block* b) {
  State& s = S();
  if (!s.loaded_block_dead && s.loaded_block == b) return;
  const size_t n = SharedBytes();
  char* base = SharedBase();
  if (TlsByPointer()) {
    *DtvEntry() = b != nullptr ? static_cast<void*>(b->smem_image) : base;
  } else if (n > 0) {
    unsigned char* from = s.loaded_block != nullptr ? s.loaded_block->smem_image : s.host_tls.data();
    unsigned char* to = b != nullptr ? b->smem_image : s.host_tls.data();
    if (!s.loaded_block_dead) std::memcpy(from, base, n);
    std::memcpy(base, to, n);
  }
  s.loaded_block = b;
  s.loaded_block_dead = false;
}

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

// ---- ready sets ----
void ReadyAdd(Block* b) {
  if (b->parked_until > S().now_ns) return;  // runnable again when it is unparked
  SetAdd<Block, &Block::ready_pos>(S().ready, b);
}
void ReadyRemove(Block* b) { SetRemove<Block, &Block::ready_pos>(S().ready, b); }
void MakeRunnable(Fiber* f) {
  if (f->state != FState::kNew) f->state = FState::kRunnable;
  f->blk->runnable.push_back(f);
  ReadyAdd(f->blk);
}

bool SleepLess(const Fiber* a, const Fiber* b) { return a->wake > b->wake; }

// Idle fast-forward (Config::idle_after_ns): once nothing has changed memory for a while, a
// wait lasts a quarter of the idle time so far, at most idle_sleep_max_ns; 0 otherwise. A
// longer wait changes nothing then but how soon the kernels' own timeouts fire.
double IdleWaitNs() {
  const State& s = S();
  const double idle = s.now_ns - s.idle_since;
  if (s.cfg.idle_after_ns <= 0 || idle <= s.cfg.idle_after_ns) return 0;
  return std::min(idle / 4, s.cfg.idle_sleep_max_ns);
}

// ---- store buffers ----
bool IsPeer(const void* p) {
  const char* c = static_cast<const char*>(p);
  for (auto& r : S().peer_mem)
    if (c >= r.first && c < r.first + r.second) return true;
  return false;
}
int OwnerOf(const void* p);
// Stores of thread f to p sit in its store buffer when p is marked peer memory that another
// virtual GPU owns: what a GPU writes into its own buffers (its own NVSHMEM heap, its own
// intranode buffer) its blocks see at once, as on hardware after a __syncthreads.
bool Remote(const Fiber* f, const void* p) {
  if (f == nullptr || !S().cfg.weak_stores || !IsPeer(p)) return false;
  const int owner = OwnerOf(p);
  return owner >= 0 && owner != f->blk->dev->id;
}
void DirtyAdd(StoreBuf* b) { SetAdd<StoreBuf, &StoreBuf::dirty_pos>(S().dirty, b); }
void DirtyRemove(StoreBuf* b) { SetRemove<StoreBuf, &StoreBuf::dirty_pos>(S().dirty, b); }
// The 16-byte granules a pending store touches (one or two).
int Granules(const Pending& p, uintptr_t g[2]) {
  g[0] = reinterpret_cast<uintptr_t>(p.dst) >> 4;
  g[1] = (reinterpret_cast<uintptr_t>(p.dst) + p.n - 1) >> 4;
  return g[1] == g[0] ? 1 : 2;
}
void NoteGranules(StoreBuf* b, const Pending& p, bool add) {
  auto& m = S().granules;
  uintptr_t g[2];
  for (int i = 0, n = Granules(p, g); i < n; ++i) {
    auto& v = m[g[i]];
    auto it = std::find_if(v.begin(), v.end(), [b](auto& e) { return e.first == b; });
    if (add) {
      if (it == v.end()) v.emplace_back(b, 1u);
      else ++it->second;
    } else if (it != v.end() && --it->second == 0) {
      v.erase(it);
      if (v.empty()) m.erase(g[i]);
    }
  }
}
void Drain(StoreBuf* b, size_t n) {
  if (n > 0 && !b->q.empty()) S().step_work = true;
  while (n-- > 0 && !b->q.empty()) {
    Pending& p = b->q.front();
    std::memcpy(p.dst, p.data, p.n);
    NoteGranules(b, p, false);
    b->q.pop_front();
  }
  if (b->q.empty()) DirtyRemove(b);
}
// Before `p` enters buffer `mine`: every other buffer's pending stores to the same granules
// become visible first (each buffer drained in order up to its last such store). So two
// threads' stores to one address keep the order the emulator ran them in (on a GPU a
// __syncwarp or __syncthreads between them orders them; without one either order is
// allowed): a lane's row copy and lane 0's later rewrite of a word in that row never land
// the other way round.
void OrderAfterOthers(StoreBuf* mine, const Pending& p) {
  auto& m = S().granules;
  uintptr_t g[2];
  for (int i = 0, n = Granules(p, g); i < n; ++i) {
    for (;;) {
      auto it = m.find(g[i]);
      if (it == m.end()) break;
      StoreBuf* other = nullptr;
      for (auto& e : it->second)
        if (e.first != mine) other = e.first;
      if (other == nullptr) break;
      Drain(other, 1);
    }
  }
}

// ---- fibers ----
void SwitchToHost(Fiber* f, bool dying) {
  State& s = S();
#if defined(JEP_EMU_ASAN)
  __sanitizer_start_switch_fiber(dying ? nullptr : &f->asan_fake, s.host_stack_bottom,
                                 s.host_stack_size);
#endif
  jep_emu_switch(&f->sp, s.host_sp);
#if defined(JEP_EMU_ASAN)
  __sanitizer_finish_switch_fiber(f->asan_fake, nullptr, nullptr);
#endif
  (void)dying;
}

void FiberExit(Fiber* f);

void FiberMain(Fiber* f) {
#if defined(JEP_EMU_ASAN)
  __sanitizer_finish_switch_fiber(nullptr, &S().host_stack_bottom, &S().host_stack_size);
#endif
  f->blk->k->spec.body();
  FiberExit(f);
  SwitchToHost(f, true);
  std::abort();  // a finished fiber is never resumed
}

void CheckColls(Block* b, int w);

void FiberExit(Fiber* f) {
  State& s = S();
  Block* b = f->blk;
  s.step_work = true;
  f->state = FState::kDone;
  --b->live;
  --s.live_fibers;
  const int lane = f->ctx.lane, w = f->ctx.warp;
  b->warps[w].exited |= 1u << lane;
  for (int i = 0; i < kNumChains; ++i) b->k->chain_max[i] = std::max(b->k->chain_max[i], f->chain[i]);
  if (f->sbuf != nullptr) {
    b->k->bufs.push_back(f->sbuf);
    f->sbuf = nullptr;
  }
  if (!f->bulk_open.empty() || !f->bulk_groups.empty()) {
    // On a GPU the block's shared memory may go to another block before these read it.
    Fault(std::string("kernel ") + b->k->spec.name + ": a thread exited with bulk stores "
          "not waited for (cp.async.bulk.wait_group)");
    f->bulk_open.clear();
    f->bulk_groups.clear();
  }
  // A barrier waits for the threads that have not exited.
  if (!b->at_barrier.empty() && static_cast<int>(b->at_barrier.size()) == b->live) {
    for (Fiber* g : b->at_barrier) MakeRunnable(g);
    b->at_barrier.clear();
  }
  CheckColls(b, w);
}

// Runs f until it yields. Called on the host stack.
void RunFiber(Fiber* f) {
  State& s = S();
  LoadDevice(f->blk->dev);
  LoadBlock(f->blk);
  if (f->state == FState::kNew) {
    f->stack = TakeStack();
    char* top = f->stack + kStackBytes;  // 16-byte aligned (page aligned)
    void** sp = reinterpret_cast<void**>(top - 64);
    // [0] mxcsr|fpucw, [1] r15, [2] r14, [3] r13 = entry, [4] r12 = arg, [5] rbx, [6] rbp,
    // [7] return address
    uint32_t csr[2];
    asm volatile("stmxcsr %0" : "=m"(csr[0]));
    asm volatile("fnstcw %0" : "=m"(csr[1]));
    std::memcpy(&sp[0], csr, 8);
    sp[1] = nullptr;
    sp[2] = nullptr;
    sp[3] = reinterpret_cast<void*>(&FiberMain);
    sp[4] = f;
    sp[5] = nullptr;
    sp[6] = nullptr;
    sp[7] = reinterpret_cast<void*>(&jep_emu_trampoline);
    f->sp = sp;
  }
  f->state = FState::kRunnable;
  s.cur = f;
  g_ctx = &f->ctx;
#if defined(JEP_EMU_ASAN)
  void* fake = nullptr;
  __sanitizer_start_switch_fiber(&fake, f->stack, kStackBytes);
#endif
  jep_emu_switch(&s.host_sp, f->sp);
#if defined(JEP_EMU_ASAN)
  __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#endif
  g_ctx = nullptr;
  s.cur = nullptr;
  CheckCanary(f->stack, f->blk->k->spec.name);
  if (f->state == FState::kDone) {
    s.stack_pool.push_back(f->stack);
    f->stack = nullptr;
  }
}

// The running fiber gives the scheduler a turn; `keep` says it stays runnable.
void Suspend(bool keep) {
  State& s = S();
  Fiber* f = s.cur;
  if (keep) MakeRunnable(f);
  SwitchToHost(f, false);
}

// ---- warp collectives ----
void CheckColls(Block* b, int w) {
  WarpState& ws = b->warps[w];
  for (size_t i = 0; i < ws.colls.size();) {
    Coll& c = ws.colls[i];
    const unsigned need = c.mask & ws.present & ~ws.exited;
    if ((c.arrived & need) != need || c.arrived == 0) {
      ++i;
      continue;
    }
    if ((c.mask & ws.present & ws.exited) != 0) {
      char buf[160];
      std::snprintf(buf, sizeof(buf),
                    "kernel %s: a warp collective's mask 0x%08x names lanes that have exited (0x%08x)",
                    b->k->spec.name, c.mask, c.mask & ws.exited);
      Fault(buf);
    }
    uint64_t ballot = 0;
    for (int l = 0; l < 32; ++l)
      if ((c.arrived >> l) & 1u && c.val[l] != 0) ballot |= 1ull << l;
    for (int l = 0; l < 32; ++l) {
      if (!((c.arrived >> l) & 1u)) continue;
      Fiber& f = b->fibers[w * 32 + l];
      uint64_t r = 0;
      const int width = c.width, seg = l & ~(width - 1);
      auto from = [&](int src) { return ((c.arrived >> src) & 1u) ? c.val[src] : c.val[l]; };
      switch (c.op) {
        case kWarpSync: break;
        case kWarpBallot: r = ballot; break;
        case kWarpAny: r = ballot != 0; break;
        case kWarpAll: r = ballot == (c.arrived & 0xffffffffull); break;
        case kWarpShfl: r = from(seg + (c.arg[l] & (width - 1))); break;
        case kWarpShflXor: {
          const int src = l ^ c.arg[l];
          r = (src >= seg && src < seg + width) ? from(src) : c.val[l];
          break;
        }
        case kWarpShflDown: {
          const int src = l + c.arg[l];
          r = src < seg + width ? from(src) : c.val[l];
          break;
        }
        case kWarpShflUp: {
          const int src = l - c.arg[l];
          r = src >= seg ? from(src) : c.val[l];
          break;
        }
      }
      f.result = r;
      MakeRunnable(&f);
    }
    ws.colls.erase(ws.colls.begin() + static_cast<long>(i));
  }
}

// ---- co-residency ----
// Residency units: a virtual GPU holds ResidencyCapacity() of them. With a fixed
// `resident_blocks` every block takes one; otherwise one SM is kSmUnits (a multiple of
// every count 1..32) and a block of a kernel of which an SM holds n takes kSmUnits / n, so
// blocks of different kernels share the SMs' resources in proportion (pooled over the SMs:
// no per-SM fragmentation).
constexpr int64_t kSmUnits = 144403552893600LL;  // lcm(1, ..., 32)

int64_t ResidencyCapacity() {
  const Config& c = S().cfg;
  return c.resident_blocks > 0 ? c.resident_blocks : static_cast<int64_t>(c.num_sms) * kSmUnits;
}

struct OccRow {
  const char* name;
  int registers;
  int smem;
};
#define JEP_EMU_OCC_NVCC(v)
#define JEP_EMU_OCC_ROW(name, regs, smem) {name, regs, smem},
const OccRow kOccupancy[] = {
#include JEP_EMU_OCCUPANCY_TABLE
    {nullptr, 0, 0}};
#undef JEP_EMU_OCC_ROW
#undef JEP_EMU_OCC_NVCC

// The name the table uses: no namespace, no template arguments ("ns::K<T>" -> "K").
std::string BaseName(const char* spelled) {
  std::string s;
  int depth = 0;
  for (const char* c = spelled; *c != '\0'; ++c) {
    if (*c == '<') ++depth;
    else if (*c == '>') --depth;
    else if (depth == 0 && *c != '&' && *c != ' ') s += *c;
  }
  const size_t colon = s.rfind("::");
  return colon == std::string::npos ? s : s.substr(colon + 2);
}

const OccRow* FindOccupancy(const std::string& name) {
  for (const OccRow* r = kOccupancy; r->name != nullptr; ++r)
    if (name == r->name) return r;
  return nullptr;
}

// Kernels launched by name (JEP_LAUNCH), by entry point: cudaLaunchKernelEx knows only the
// function, so it finds the name here when the kernel was launched by name before.
std::map<const void*, std::string>& NamesByEntry() {
  static auto* m = new std::map<const void*, std::string>();
  return *m;
}

void WarnFallback(const std::string& name, int blocks) {
  static auto* warned = new std::map<std::string, int>();
  if (warned->count(name) != 0) return;
  (*warned)[name] = blocks;
  std::fprintf(stderr,
               "emu: warning: kernel %s has no row in the occupancy table "
               "(kernels/emu/occupancy_table.inc, scripts/gen_emu_occupancy.py); a virtual GPU "
               "runs at most %d of its blocks at once (the fallback, Config::fallback_blocks)\n",
               name.c_str(), blocks);
  occupancy_fallbacks().push_back(name);
}

// Residency units one block of this launch takes; 0: it cannot run at all (too many
// registers or too much shared memory for one SM).
int64_t BlockCost(LaunchSpec& spec, int threads) {
  const Config& c = S().cfg;
  std::string name = BaseName(spec.name);
  if (spec.entry != nullptr) {
    auto& m = NamesByEntry();
    if (std::strcmp(spec.name, "cudaLaunchKernelEx") != 0) m[spec.entry] = name;
    else if (m.count(spec.entry) != 0) name = m[spec.entry];
  }
  const OccRow* r = FindOccupancy(name);
  int per_sm = 0;
  if (r != nullptr) per_sm = BlocksPerSm(r->registers, static_cast<size_t>(r->smem) + spec.smem, threads);
  if (c.resident_blocks > 0) return per_sm > 0 || r == nullptr ? 1 : 0;
  if (r == nullptr) {
    const int blocks = std::max(1, c.fallback_blocks);
    WarnFallback(name, blocks);
    return ResidencyCapacity() / blocks;
  }
  return per_sm > 0 ? kSmUnits / per_sm : 0;
}

// ---- scheduling ----
void StartBlock(Kernel* k) {
  State& s = S();
  const uint64_t idx = k->next_block++;
  auto* b = new Block();
  b->k = k;
  b->dev = k->dev;
  const dim3 g = k->spec.grid, bd = k->spec.block;
  b->bid = dim3(static_cast<unsigned>(idx % g.x), static_cast<unsigned>((idx / g.x) % g.y),
                static_cast<unsigned>(idx / (static_cast<uint64_t>(g.x) * g.y)));
  const int n = static_cast<int>(bd.x * bd.y * bd.z);
  b->fibers.resize(n);
  b->warps.resize((n + 31) / 32);
  for (int w = 0; w < static_cast<int>(b->warps.size()); ++w) {
    const int lanes = std::min(32, n - 32 * w);
    b->warps[w].present = lanes == 32 ? 0xffffffffu : ((1u << lanes) - 1);
  }
  // Shared memory starts with garbage, as on a GPU: a kernel that reads it before writing
  // it gets a seeded pattern.
  const unsigned char fill = static_cast<unsigned char>(0x80 | (s.rng() & 0x7f));
  const size_t align = Tls().align;
  b->smem_store.assign(SharedBytes() + align, fill);
  b->smem_image = b->smem_store.data() +
                  ((align - reinterpret_cast<uintptr_t>(b->smem_store.data()) % align) % align);
  b->dyn_smem.assign(k->spec.smem + 16, fill);
  for (int i = 0; i < n; ++i) {
    Fiber& f = b->fibers[i];
    f.blk = b;
    f.ctx.tid = dim3(static_cast<unsigned>(i % bd.x), static_cast<unsigned>((i / bd.x) % bd.y),
                     static_cast<unsigned>(i / (bd.x * bd.y)));
    f.ctx.bid = b->bid;
    f.ctx.bdim = bd;
    f.ctx.gdim = g;
    f.ctx.lane = i & 31;
    f.ctx.warp = i >> 5;
    MakeRunnable(&f);
  }
  b->live = n;
  s.live_fibers += n;
  k->dev->resident++;
  k->dev->load += k->cost;
  CountDev(k->dev->id, std::string("kernel:") + k->spec.name + ":blocks");
  CountDev(k->dev->id, std::string("kernel:") + k->spec.name + ":warps", b->warps.size());
  CountDev(k->dev->id, std::string("kernel:") + k->spec.name + ":threads", n);
}

void FinishKernel(Kernel* k) {
  State& s = S();
  Stream* st = k->stream;
  CountChains(k);
  for (StoreBuf* b : k->bufs) {
    if (b->q.empty()) delete b;
    else st->late.push_back(b);
  }
  k->bufs.clear();
  std::uniform_real_distribution<double> u(0.0, s.cfg.late_ns);
  st->late_until = std::max(st->late_until, s.now_ns + u(s.rng));
  st->ops.pop_front();
  st->head_started = false;
}

void FinishBlock(Block* b) {
  State& s = S();
  ReadyRemove(b);
  if (s.loaded_block == b) {
    s.loaded_block = nullptr;  // its memory may hold the next block
    s.loaded_block_dead = true;
    if (TlsByPointer()) *DtvEntry() = SharedBase();  // not left pointing at freed memory
  }
  if (s.last_block == b) s.last_block = nullptr;
  Kernel* k = b->k;
  k->dev->resident--;
  k->dev->load -= k->cost;
  k->done_blocks++;
  for (int i = 0; i < 2; ++i) k->block_max[i] = std::max(k->block_max[i], b->accesses[i]);
  k->block_max_tma = std::max(k->block_max_tma, b->tma_bytes);
  for (const auto& [mbar, copies] : b->bulk_loads)
    if (!copies.empty())
      Fault(std::string("kernel ") + k->spec.name + ": a bulk load into shared memory was "
            "never waited for (its mbarrier phase) before the block exited");
  delete b;
  if (k->done_blocks == k->total_blocks) FinishKernel(k);
}

// Executes stream heads that need no fibers; starts kernels; admits blocks.
void DrainLate(Stream* st) {
  for (void* p : st->late) {
    auto* b = static_cast<StoreBuf*>(p);
    Drain(b, SIZE_MAX);
    delete b;
  }
  st->late.clear();
}

bool Advance() {
  State& s = S();
  bool progress = false;
  for (Device* d : s.devices) {
    for (Stream* st : d->streams) {
      // The stream's next operation waits until the finished kernel's stores are out.
      if (!st->late.empty()) {
        if (s.now_ns < st->late_until) continue;
        DrainLate(st);
        progress = true;
      }
      while (!st->ops.empty()) {
        Op& op = st->ops.front();
        if (op.kind == Op::kKernel) {
          if (!st->head_started) {
            st->head_started = true;
            progress = true;
            CountDev(d->id, std::string("kernel:") + op.kernel->spec.name + ":launches");
          }
          break;
        }
        if (op.kind == Op::kWait && op.ev->completed < op.ticket) break;
        switch (op.kind) {
          case Op::kMemset: std::memset(op.dst, op.value, op.n); break;
          case Op::kMemcpy: std::memmove(op.dst, op.src, op.n); break;
          case Op::kRecord: op.ev->completed = std::max(op.ev->completed, op.ticket); break;
          default: break;
        }
        st->ops.pop_front();
        progress = true;
      }
    }
    // Blocks of started kernels, oldest stream first, while the GPU has room.
    for (Stream* st : d->streams) {
      if (st->ops.empty() || !st->head_started) continue;
      Kernel* k = st->ops.front().kernel.get();
      while (k->next_block < k->total_blocks && d->load + k->cost <= ResidencyCapacity()) {
        StartBlock(k);
        progress = true;
      }
    }
  }
  return progress;
}

Block* PickBlock() {
  State& s = S();
  std::uniform_real_distribution<double> u(0.0, 1.0);
  if (s.last_block != nullptr && s.last_block->ready_pos != SIZE_MAX && u(s.rng) < s.cfg.stay_prob)
    return s.last_block;
  return s.ready[s.rng() % s.ready.size()];
}

void WakeSleepers() {
  State& s = S();
  while (!s.sleepers.empty() && s.sleepers.front()->wake <= s.now_ns) {
    std::pop_heap(s.sleepers.begin(), s.sleepers.end(), SleepLess);
    Fiber* f = s.sleepers.back();
    s.sleepers.pop_back();
    MakeRunnable(f);
  }
}

// A preempted block: off the ready set until now + preempt_ns.
void Park(Block* b) {
  State& s = S();
  ReadyRemove(b);
  b->parked_until = s.now_ns + s.cfg.preempt_ns;
  SetAdd<Block, &Block::parked_pos>(s.parked, b);
  Count("preemptions");
}
void Unpark() {
  State& s = S();
  for (size_t i = 0; i < s.parked.size();) {
    Block* b = s.parked[i];
    if (b->parked_until > s.now_ns) {
      ++i;
      continue;
    }
    SetRemove<Block, &Block::parked_pos>(s.parked, b);
    b->parked_until = 0;
    s.idle_since = s.now_ns;
    if (!b->runnable.empty()) ReadyAdd(b);
  }
}

// Everything left on the GPUs is abandoned (a deadlock or a hang): the process keeps
// running and the tests see the fault.
void AbandonAll(const std::string& why) {
  State& s = S();
  Fault(why);
  std::vector<Block*> blocks;
  for (Device* d : s.devices)
    for (Stream* st : d->streams) {
      st->ops.clear();
      st->head_started = false;
      d->resident = 0;
      d->load = 0;
    }
  s.ready.clear();
  s.parked.clear();
  s.sleepers.clear();
  s.last_block = nullptr;
  s.live_fibers = 0;
  s.last_error = cudaErrorLaunchFailure;
  // Blocks and their stacks leak on purpose: fibers stopped mid-kernel own them.
}

std::string Describe() {
  State& s = S();
  std::string out;
  for (Device* d : s.devices)
    for (Stream* st : d->streams)
      if (!st->ops.empty() && st->ops.front().kind == Op::kKernel)
        out += " gpu" + std::to_string(d->id) + ":" + st->ops.front().kernel->spec.name;
  return out;
}

bool Busy(const std::function<bool()>& done) { return !done(); }

// Virtual time one step takes: a round of every live thread is quantum_ns, or, in an idle
// stretch, as long as a lengthened sleep. So threads that poll without sleeping (the
// internode kernels' spins) reach their timeouts as fast as sleepers.
double StepNs() {
  const double live = static_cast<double>(std::max<uint64_t>(1, S().live_fibers));
  return std::max(S().cfg.quantum_ns, IdleWaitNs()) / live;
}

// Runs the virtual GPUs until `done()` holds.
void RunUntil(const std::function<bool()>& done) {
  State& s = S();
  if (s.in_scheduler) throw std::logic_error("emu: the scheduler is not reentrant");
  s.in_scheduler = true;
  s.host_tls.resize(SharedBytes());
  s.loaded_block = nullptr;  // the host's values are in place
  s.loaded_block_dead = false;
  std::uniform_real_distribution<double> u(0.0, 1.0);
  uint64_t steps = 0;
  s.idle_since = s.now_ns;  // the host has just enqueued work
  for (;;) {
    if (Advance()) s.idle_since = s.now_ns;
    if (!Busy(done)) break;
    WakeSleepers();
    if (!s.parked.empty()) Unpark();
    if (s.ready.empty()) {
      double next = s.sleepers.empty() ? -1 : s.sleepers.front()->wake;
      for (Block* p : s.parked)
        if (next < 0 || p->parked_until < next) next = p->parked_until;
      for (Device* d : s.devices)
        for (Stream* st : d->streams)
          if (!st->late.empty() && (next < 0 || st->late_until < next)) next = st->late_until;
      if (next >= 0) {
        s.now_ns = std::max(s.now_ns, next);
        continue;
      }
      if (Advance()) {
        s.idle_since = s.now_ns;
        continue;
      }
      AbandonAll("deadlock: no thread can run (blocked at a barrier, a warp collective, or "
                 "an event) in" + Describe());
      break;
    }
    if (s.now_ns > s.cfg.max_virtual_ns) {
      AbandonAll("hang: the kernels ran past the emulator's virtual time limit in" + Describe());
      break;
    }
    Block* b = PickBlock();
    const size_t i = s.rng() % b->runnable.size();
    Fiber* f = b->runnable[i];
    b->runnable[i] = b->runnable.back();
    b->runnable.pop_back();
    if (b->runnable.empty()) ReadyRemove(b);
    s.last_block = b;
    s.step_work = false;
    RunFiber(f);
    ++steps;
    if (!s.dirty.empty() && u(s.rng) < s.cfg.drain_prob) {
      StoreBuf* sb = s.dirty[s.rng() % s.dirty.size()];
      Drain(sb, 1 + s.rng() % (sb->q.size()));
    }
    // Pending stores or transport operations drain at later steps: not idle until they have.
    if (s.step_work || !s.dirty.empty() || (s.pending_probe != nullptr && s.pending_probe()))
      s.idle_since = s.now_ns;
    s.now_ns += StepNs();
    if (b->live == 0) FinishBlock(b);
    else if (s.cfg.preempt_prob > 0 && u(s.rng) < s.cfg.preempt_prob) Park(b);
  }
  LoadBlock(nullptr);  // the host's own thread_local values back
  for (Device* d : s.devices)
    for (Stream* st : d->streams) DrainLate(st);  // the host sees everything after a sync
  Count("steps", steps);
  s.in_scheduler = false;
}

bool StreamIdle(Stream* st) { return st->ops.empty(); }
bool DeviceIdle(Device* d) {
  for (Stream* st : d->streams)
    if (!st->ops.empty()) return false;
  return true;
}
void SyncDevice(Device* d) {
  RunUntil([d] { return DeviceIdle(d); });
}

void ResetAll(const Config& c) {
  State& s = S();
  for (Device* d : s.devices) {
    for (Stream* st : d->streams) {
      st->ops.clear();
      st->head_started = false;
    }
  }
  if (s.device_pristine.empty() && DeviceBytes() > 0 && s.loaded_device == nullptr)
    s.device_pristine.assign(__jep_emu_device_begin, __jep_emu_device_end);
  if (s.loaded_device != nullptr) {
    s.loaded_device = nullptr;
  }
  s.cfg = c;
  s.rng.seed(c.seed);
  s.bulk_rng.seed(c.seed ^ 0x5bd1e995u);
  while (static_cast<int>(s.devices.size()) < c.num_devices) {
    auto* d = new Device();
    d->id = static_cast<int>(s.devices.size());
    d->streams.push_back(new Stream{d, {}, false});
    s.devices.push_back(d);
  }
  ResetDeviceMap(s.devices.size());
  for (Device* d : s.devices) {
    d->resident = 0;
    d->load = 0;
    if (s.device_fd < 0) {
      d->globals = s.device_pristine;
      d->globals.resize(DeviceBytes());
    }
  }
  if (s.device_fd < 0 && DeviceBytes() > 0)
    std::memcpy(__jep_emu_device_begin, s.device_pristine.data(), DeviceBytes());
  s.ready.clear();
  s.parked.clear();
  s.sleepers.clear();
  s.dirty.clear();
  s.granules.clear();
  s.loaded_block = nullptr;
  s.last_block = nullptr;
  s.live_fibers = 0;
  s.now_ns = 0;
  s.idle_since = 0;
  s.pending_probe = nullptr;  // a world set up after this reset installs its own
  s.current = 0;
  s.last_error = cudaSuccess;
  s.faults.clear();
  s.counters.clear();
  s.dev_ctr.assign(s.devices.size(), DevCounters{});
}

void EnsureInit() {
  if (S().devices.empty()) ResetAll(Config{});
}

}  // namespace

// ---------------------------------------------------------------------------------------
// Device-side entry points.
void yield(int kind) {
  State& s = S();
  if (s.cur == nullptr) return;  // host code calling a device helper
  if (kind == kYieldAtomic) Hot(kHotAtomics)++;
  // A poll reads and a sleep waits; every other kind writes or orders memory.
  if (kind != kYieldPoll && kind != kYieldSleep) s.step_work = true;
  Suspend(true);
}

void syncthreads() {
  State& s = S();
  Fiber* f = s.cur;
  if (f == nullptr) return;
  Block* b = f->blk;
  f->state = FState::kBlocked;
  b->at_barrier.push_back(f);
  if (static_cast<int>(b->at_barrier.size()) == b->live) {
    for (Fiber* g : b->at_barrier) MakeRunnable(g);
    b->at_barrier.clear();
  }
  SwitchToHost(f, false);
}

// bar.sync id, threads: the first `threads` threads to arrive go on together. Threads that
// exited do not count (a barrier short of them never completes: the deadlock report).
void named_barrier(int id, int threads) {
  State& s = S();
  Fiber* f = s.cur;
  if (f == nullptr) return;
  if (id < 1 || id > 15 || threads <= 0 || threads % 32 != 0) {
    std::fprintf(stderr, "emu: named barrier %d with %d threads (ids 1..15, warps of 32)\n", id,
                 threads);
    std::abort();
  }
  Block* b = f->blk;
  auto& at = b->at_named[id];
  f->state = FState::kBlocked;
  at.push_back(f);
  if (static_cast<int>(at.size()) == threads) {
    for (Fiber* g : at) MakeRunnable(g);
    at.clear();
  }
  SwitchToHost(f, false);
}

uint64_t warp_collective(int op, unsigned mask, uint64_t value, int arg, int width) {
  State& s = S();
  Fiber* f = s.cur;
  if (f == nullptr) return value;
  Block* b = f->blk;
  const int lane = f->ctx.lane, w = f->ctx.warp;
  if (!((mask >> lane) & 1u)) {
    char buf[160];
    std::snprintf(buf, sizeof(buf), "kernel %s: lane %d calls a warp collective whose mask 0x%08x leaves it out",
                  b->k->spec.name, lane, mask);
    Fault(buf);
  }
  if (width <= 0 || width > 32 || (width & (width - 1)) != 0) width = 32;
  WarpState& ws = b->warps[w];
  Coll* c = nullptr;
  for (Coll& x : ws.colls)
    if (x.mask == mask && x.op == op && !((x.arrived >> lane) & 1u)) {
      c = &x;
      break;
    }
  if (c == nullptr) {
    ws.colls.push_back(Coll{op, mask});
    c = &ws.colls.back();
  }
  c->arrived |= 1u << lane;
  c->val[lane] = value;
  c->arg[lane] = arg;
  c->width = width;
  f->state = FState::kBlocked;
  CheckColls(b, w);
  SwitchToHost(f, false);
  return f->result;
}

unsigned activemask() {
  State& s = S();
  Fiber* f = s.cur;
  if (f == nullptr) return 1;
  const WarpState& ws = f->blk->warps[f->ctx.warp];
  return ws.present & ~ws.exited;
}

void fence(int scope) {
  State& s = S();
  Hot(kHotFenceBlock + (scope < 0 || scope > 2 ? 1 : scope))++;
  if (scope == kFenceSystem) note_chain(kChainFenceSystem);
  if (scope == kFenceGpu) note_chain(kChainFenceGpu);
  // A fence only orders this thread's own stores: it drains its buffer and needs no turn.
  if (scope >= kFenceGpu) drain_own_stores();
}

void drain_own_stores() {
  Fiber* f = S().cur;
  if (f != nullptr && f->sbuf != nullptr) Drain(f->sbuf, SIZE_MAX);
}

void nanosleep_ns(unsigned ns) {
  State& s = S();
  Fiber* f = s.cur;
  if (f == nullptr) return;
  Hot(kHotSleeps)++;
  double d = std::max<double>(ns, s.cfg.min_sleep_ns);
  if (IdleWaitNs() > d) {
    d = IdleWaitNs();
    Count("idle_sleeps");
  }
  f->wake = s.now_ns + d;
  f->state = FState::kSleeping;
  s.sleepers.push_back(f);
  std::push_heap(s.sleepers.begin(), s.sleepers.end(), SleepLess);
  SwitchToHost(f, false);
}

uint64_t global_timer_ns() { return static_cast<uint64_t>(S().now_ns) + 1000000000ull; }
long long clock_ticks() { return static_cast<long long>(S().now_ns * 1.98); }

char* dynamic_smem() {
  Fiber* f = S().cur;
  return f == nullptr ? nullptr : reinterpret_cast<char*>(f->blk->dyn_smem.data());
}

void note_poll() {
  Hot(kHotPolls)++;
  yield(kYieldPoll);
}

void note_chain(int which, uint32_t n) {
  Fiber* f = S().cur;
  if (f != nullptr && which >= 0 && which < kNumChains) f->chain[which] += n;
}

void note_acquire() {
  Hot(kHotAcquire)++;
  note_poll();
}

void note_copy(int width, size_t bytes) { Count("copy_bytes:" + std::to_string(width), bytes); }

void store_bytes(void* dst, const void* src, size_t n) {
  note_access(kAccessStore, dst, static_cast<int>(n), 1);
  buffered_store(dst, src, n);
}

bool remote_store(const void* dst) { return Remote(S().cur, dst); }

void buffered_store(void* dst, const void* src, size_t n) {
  State& s = S();
  s.step_work = true;
  Fiber* f = s.cur;
  if (!Remote(f, dst)) {
    std::memcpy(dst, src, n);
    return;
  }
  Hot(kHotPeerStores)++;
  if (f->sbuf == nullptr) {
    f->sbuf = new StoreBuf();
    f->sbuf->kernel = f->blk->k;
  }
  char* d = static_cast<char*>(dst);
  const unsigned char* c = static_cast<const unsigned char*>(src);
  while (n > 0) {
    const uint32_t m = static_cast<uint32_t>(std::min<size_t>(n, 16));
    Pending p;
    p.dst = d;
    p.n = m;
    std::memcpy(p.data, c, m);
    OrderAfterOthers(f->sbuf, p);
    f->sbuf->q.push_back(p);
    NoteGranules(f->sbuf, p, true);
    d += m;
    c += m;
    n -= m;
  }
  DirtyAdd(f->sbuf);
}

void release_store64(uint64_t* p, uint64_t v) {
  State& s = S();
  s.step_work = true;
  Hot(kHotRelease)++;
  note_chain(kChainRelease);
  Fiber* f = s.cur;
  if (f != nullptr && f->sbuf != nullptr) Drain(f->sbuf, SIZE_MAX);
  if (f != nullptr) Suspend(true);
  *reinterpret_cast<volatile uint64_t*>(p) = v;
}

void fault(const char* what) {
  S().step_work = true;
  Fault(what);
}

void note_work() { S().step_work = true; }
void set_pending_probe(bool (*pending)()) { S().pending_probe = pending; }

// ---- bulk copies (TMA) ----
namespace {
void NoteBulk(int dir, const void* global, size_t n) {
  State& s = S();
  const int me = s.cur != nullptr ? s.cur->blk->dev->id : s.current;
  const int owner = OwnerOf(global);
  const bool peer = owner >= 0 && owner != me;
  Count(std::string(dir == kAccessLoad ? "tma_bytes:load:" : "tma_bytes:store:") +
            (peer ? "peer" : "local"), n);
  Count("tma_ops");
  if (s.cur != nullptr) s.cur->blk->tma_bytes += n;
}
void LandStore(Fiber* f, BulkCopy& c) {
  if (c.landed) return;
  S().step_work = true;
  if (Remote(f, c.dst)) buffered_store(c.dst, c.src, c.n);
  else std::memcpy(c.dst, c.src, c.n);
  c.landed = true;
}
// A bulk copy may land any time from its issue to its wait: the emulator picks one end,
// seeded. At the issue, it shows shared memory still in use by an earlier copy (a load
// over a piece a store has not read yet) or not yet filled (a store of a piece before the
// wait for its load); at the wait, a read before the wait.
bool LandAtIssue() { return (S().bulk_rng() & 1u) != 0; }
}  // namespace

void mbar_init(uint64_t* mbar) {
  Fiber* f = S().cur;
  *mbar = 0;  // phase 0
  if (f != nullptr) f->blk->bulk_loads.erase(mbar);
}

void bulk_load(void* smem, const void* src, size_t n, uint64_t* mbar) {
  Fiber* f = S().cur;
  if (f == nullptr) throw std::logic_error("emu: bulk_load outside a kernel");
  NoteBulk(kAccessLoad, src, n);
  S().step_work = true;
  BulkCopy c{smem, src, n};
  if (LandAtIssue()) {
    std::memcpy(smem, src, n);
    c.landed = true;
  }
  f->blk->bulk_loads[mbar].push_back(c);
}

void mbar_wait(uint64_t* mbar, uint32_t parity) {
  Fiber* f = S().cur;
  if (f == nullptr) throw std::logic_error("emu: mbar_wait outside a kernel");
  yield(kYieldPoll);
  if ((*mbar & 1u) != (parity & 1u)) return;  // that phase has completed already
  auto it = f->blk->bulk_loads.find(mbar);
  if (it == f->blk->bulk_loads.end() || it->second.empty()) {
    Fault(std::string("kernel ") + f->blk->k->spec.name + ": a wait on an mbarrier phase "
          "that no bulk load completes (it would never return on a GPU)");
    return;
  }
  // Loads not landed at their issue land now: they read what the source holds now.
  S().step_work = true;
  for (const BulkCopy& c : it->second)
    if (!c.landed) std::memcpy(c.dst, c.src, c.n);
  it->second.clear();
  *mbar += 1;
}

void bulk_store(void* dst, const void* smem, size_t n) {
  Fiber* f = S().cur;
  if (f == nullptr) throw std::logic_error("emu: bulk_store outside a kernel");
  NoteBulk(kAccessStore, dst, n);
  S().step_work = true;
  f->bulk_open.push_back(BulkCopy{dst, smem, n});
  if (LandAtIssue()) LandStore(f, f->bulk_open.back());
}

void bulk_commit() {
  Fiber* f = S().cur;
  if (f == nullptr) return;
  f->bulk_groups.push_back(std::move(f->bulk_open));
  f->bulk_open.clear();
}

void bulk_wait(int keep) {
  Fiber* f = S().cur;
  if (f == nullptr) return;
  yield(kYieldPoll);
  // The groups past the newest `keep` that have not landed read their shared memory
  // and land now.
  while (f->bulk_groups.size() > static_cast<size_t>(keep < 0 ? 0 : keep)) {
    for (BulkCopy& c : f->bulk_groups.front()) LandStore(f, c);
    f->bulk_groups.erase(f->bulk_groups.begin());
  }
}

cudaError_t enqueue_kernel(LaunchSpec spec) {
  EnsureInit();
  State& s = S();
  Stream* st = Resolve(spec.stream);
  if (st == nullptr) return s.last_error = cudaErrorInvalidResourceHandle;
  const uint64_t blocks = static_cast<uint64_t>(spec.grid.x) * spec.grid.y * spec.grid.z;
  const uint64_t threads = static_cast<uint64_t>(spec.block.x) * spec.block.y * spec.block.z;
  if (blocks == 0 || threads == 0 || threads > 1024) return s.last_error = cudaErrorInvalidConfiguration;
  const int64_t cost = BlockCost(spec, static_cast<int>(threads));
  if (cost <= 0) return s.last_error = cudaErrorLaunchOutOfResources;
  // A cooperative grid must be resident all at once, on an idle GPU.
  if (spec.cooperative && blocks > static_cast<uint64_t>(ResidencyCapacity() / cost))
    return s.last_error = cudaErrorCooperativeLaunchTooLarge;
  auto k = std::make_shared<Kernel>();
  k->dev = st->dev;
  k->stream = st;
  k->total_blocks = blocks;
  k->cost = cost;
  k->spec = std::move(spec);
  Op op;
  op.kind = Op::kKernel;
  op.kernel = k;
  st->ops.push_back(std::move(op));
  return cudaSuccess;
}

// ---------------------------------------------------------------------------------------
// Control.
std::vector<std::string>& occupancy_fallbacks() {
  static auto* v = new std::vector<std::string>();
  return *v;
}

int64_t resident_limit(const char* kernel, int threads, size_t dynamic_smem) {
  EnsureInit();
  LaunchSpec spec;
  spec.name = kernel;
  spec.smem = dynamic_smem;
  const int64_t cost = BlockCost(spec, threads);
  return cost <= 0 ? 0 : ResidencyCapacity() / cost;
}

int occupancy_registers(const char* kernel) {
  const OccRow* r = FindOccupancy(BaseName(kernel));
  return r == nullptr ? -1 : r->registers;
}

void configure(const Config& c) {
  State& s = S();
  if (s.in_scheduler) throw std::logic_error("emu: configure inside a kernel");
  ResetAll(c);
}
const Config& config() {
  EnsureInit();
  return S().cfg;
}
void mark_peer_memory(void* p, size_t n) { S().peer_mem.emplace_back(static_cast<char*>(p), n); }
void unmark_peer_memory(void* p) {
  auto& v = S().peer_mem;
  v.erase(std::remove_if(v.begin(), v.end(), [p](auto& r) { return r.first == p; }), v.end());
}
std::vector<std::string> take_faults() {
  std::vector<std::string> out;
  out.swap(S().faults);
  return out;
}
std::map<std::string, uint64_t> counters() {
  State& s = S();
  auto c = s.counters;
  for (size_t d = 0; d < s.dev_ctr.size(); ++d)
    for (const auto& kv : device_counters(static_cast<int>(d))) c[kv.first] += kv.second;
  c["virtual_ns"] = static_cast<uint64_t>(s.now_ns);
  return c;
}
std::map<std::string, uint64_t> device_counters(int device) {
  State& s = S();
  std::map<std::string, uint64_t> c;
  if (device < 0 || static_cast<size_t>(device) >= s.dev_ctr.size()) return c;
  const DevCounters& k = s.dev_ctr[static_cast<size_t>(device)];
  c = k.named;
  for (int i = 0; i < kNumHot; ++i)
    if (k.hot[i] != 0) c[kHotNames[i]] += k.hot[i];
  static const char* const kDir[2] = {"load_bytes", "store_bytes"};
  static const char* const kDirN[2] = {"loads", "stores"};
  static const char* const kSpace[2] = {"local", "peer"};
  for (int dir = 0; dir < 2; ++dir)
    for (int sp = 0; sp < 2; ++sp)
      for (int w = 0; w < kNumWidths; ++w) {
        if (k.accesses[dir][sp][w] == 0) continue;
        const std::string tail = std::string(":") + kSpace[sp] + ":" + std::to_string(1 << w);
        c[kDir[dir] + tail] += k.bytes[dir][sp][w];
        c[kDirN[dir] + tail] += k.accesses[dir][sp][w];
      }
  return c;
}
int num_counted_devices() { return static_cast<int>(S().dev_ctr.size()); }
bool shared_by_pointer() { return TlsByPointer(); }
int num_streams() {
  size_t n = 0;
  for (const Device* d : S().devices) n += d->streams.size();
  return static_cast<int>(n);
}
void reset_counters() {
  State& s = S();
  s.counters.clear();
  for (DevCounters& k : s.dev_ctr) k = DevCounters{};
}
void add_counter(const std::string& name, uint64_t v) { CountDev(-1, name, v); }

// ---- bytes by width and space ----
namespace {
int OwnerOf(const void* p) {
  const State& s = S();
  const auto a = reinterpret_cast<uintptr_t>(p);
  auto it = s.allocs.upper_bound(a);
  if (it == s.allocs.begin()) return -1;
  --it;
  return a < it->first + it->second.first ? it->second.second : -1;
}
}  // namespace

void note_access(int dir, const void* p, int width, size_t n) {
  State& s = S();
  DevCounters& k = Ctr();
  const int me = s.cur != nullptr ? s.cur->blk->dev->id : s.current;
  const int owner = OwnerOf(p);
  const int sp = owner >= 0 && owner != me ? 1 : 0;
  int w = 0;
  while (w + 1 < kNumWidths && (1 << (w + 1)) <= width) ++w;
  if ((1 << w) != width) {  // not 1/2/4/8/16 bytes (a struct stored whole): byte accesses
    n *= static_cast<size_t>(width);
    w = 0;
  }
  const int d = dir == kAccessStore ? 1 : 0;
  k.bytes[d][sp][w] += n << w;
  k.accesses[d][sp][w] += n;
  if (s.cur != nullptr) s.cur->blk->accesses[sp] += n;
}

void note_copy_share(const void* dst, const void* src, int width, int64_t count, int tid,
                     int stride) {
  if (tid < 0 || stride <= 0 || count <= tid) return;
  const size_t mine = static_cast<size_t>((count - 1 - tid) / stride + 1);
  if (src != nullptr) note_access(kAccessLoad, src, width, mine);
  if (dst != nullptr) note_access(kAccessStore, dst, width, mine);
}
int current_device() { return S().current; }

cudaError_t symbol_copy(void* dst, const void* src, size_t n, bool to_symbol, const void* symbol) {
  EnsureInit();
  State& s = S();
  Device* d = Dev(s.current);
  if (d == nullptr) return cudaErrorInvalidDevice;
  SyncDevice(d);
  LoadDevice(d);
  std::memcpy(dst, src, n);
  (void)to_symbol;
  (void)symbol;
  return cudaSuccess;
}
void* symbol_address(const void* symbol) { return const_cast<void*>(symbol); }

}  // namespace emu

// ---------------------------------------------------------------------------------------
// Runtime API.
using emu::S;

namespace {
cudaError_t Ret(cudaError_t e) {
  if (e != cudaSuccess) S().last_error = e;
  return e;
}
}  // namespace

cudaError_t cudaGetLastError() {
  emu::EnsureInit();
  const cudaError_t e = S().last_error;
  S().last_error = cudaSuccess;
  return e;
}
cudaError_t cudaPeekAtLastError() { return S().last_error; }
const char* cudaGetErrorName(cudaError_t e) { return cudaGetErrorString(e); }
const char* cudaGetErrorString(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "no error (emulated GPU)";
    case cudaErrorInvalidValue: return "invalid argument (emulated GPU)";
    case cudaErrorMemoryAllocation: return "out of memory (emulated GPU)";
    case cudaErrorLaunchFailure: return "unspecified launch failure: the emulator abandoned a deadlocked or hung kernel";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument (emulated GPU)";
    case cudaErrorInvalidDevice: return "invalid device ordinal (emulated GPU)";
    case cudaErrorInvalidResourceHandle: return "invalid resource handle (emulated GPU)";
    case cudaErrorCooperativeLaunchTooLarge: return "too many blocks in cooperative launch: more than the emulated GPU holds at once (its co-residency limit for this kernel)";
    case cudaErrorLaunchOutOfResources: return "too many resources requested for launch: one block needs more registers or shared memory than an SM has (emulated GPU, ptxas usage)";
    case cudaErrorNotSupported: return "operation not supported (emulated GPU)";
    default: return "unknown error (emulated GPU)";
  }
}
cudaError_t cudaGetDeviceCount(int* n) {
  emu::EnsureInit();
  *n = static_cast<int>(S().devices.size());
  return cudaSuccess;
}
cudaError_t cudaGetDevice(int* d) {
  emu::EnsureInit();
  *d = S().current;
  return cudaSuccess;
}
cudaError_t cudaSetDevice(int d) {
  emu::EnsureInit();
  if (emu::Dev(d) == nullptr) return Ret(cudaErrorInvalidDevice);
  S().current = d;
  return cudaSuccess;
}
cudaError_t cudaDeviceSynchronize() {
  emu::EnsureInit();
  emu::Device* d = emu::Dev(S().current);
  emu::SyncDevice(d);
  return S().last_error == cudaErrorLaunchFailure ? cudaErrorLaunchFailure : cudaSuccess;
}
cudaError_t cudaDeviceCanAccessPeer(int* can, int, int) {
  *can = 1;
  return cudaSuccess;
}
cudaError_t cudaDeviceEnablePeerAccess(int, unsigned) { return cudaSuccess; }
cudaError_t cudaMalloc(void** p, size_t bytes) {
  emu::EnsureInit();
  // Separate allocations (AddressSanitizer redzones between them), 256-byte aligned as
  // cudaMalloc's are, of exactly `bytes` (not rounded up as a GPU's allocator would), so
  // AddressSanitizer reports a write even one byte past the end.
  if (posix_memalign(p, 256, std::max<size_t>(bytes, 1)) != 0) *p = nullptr;
  if (*p == nullptr) return Ret(cudaErrorMemoryAllocation);
  S().allocs[reinterpret_cast<uintptr_t>(*p)] = {bytes, S().current};  // counters' spaces
  return cudaSuccess;
}
cudaError_t cudaFree(void* p) {
  S().allocs.erase(reinterpret_cast<uintptr_t>(p));
  emu::unmark_peer_memory(p);
  std::free(p);
  return cudaSuccess;
}
cudaError_t cudaHostAlloc(void** p, size_t bytes, unsigned) {
  const cudaError_t e = cudaMalloc(p, bytes);
  if (e == cudaSuccess) S().allocs[reinterpret_cast<uintptr_t>(*p)].second = -1;  // host memory
  return e;
}
cudaError_t cudaMallocHost(void** p, size_t bytes) { return cudaMalloc(p, bytes); }
cudaError_t cudaFreeHost(void* p) { return cudaFree(p); }
cudaError_t cudaHostGetDevicePointer(void** dev, void* host, unsigned) {
  *dev = host;
  return cudaSuccess;
}
cudaError_t cudaMemset(void* p, int v, size_t n) {
  emu::EnsureInit();
  emu::SyncDevice(emu::Dev(S().current));
  std::memset(p, v, n);
  return cudaSuccess;
}
// An operation queued on a stream (the default stream of the current device for null).
static cudaError_t EnqueueOp(cudaStream_t s, const emu::Op& op) {
  emu::EnsureInit();
  emu::Stream* st = emu::Resolve(s);
  if (st == nullptr) return Ret(cudaErrorInvalidResourceHandle);
  st->ops.push_back(op);
  return cudaSuccess;
}
cudaError_t cudaMemsetAsync(void* p, int v, size_t n, cudaStream_t s) {
  emu::Op op;
  op.kind = emu::Op::kMemset;
  op.dst = p;
  op.value = v;
  op.n = n;
  return EnqueueOp(s, op);
}
cudaError_t cudaMemcpy(void* dst, const void* src, size_t n, cudaMemcpyKind) {
  emu::EnsureInit();
  emu::SyncDevice(emu::Dev(S().current));
  std::memmove(dst, src, n);
  return cudaSuccess;
}
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t n, cudaMemcpyKind, cudaStream_t s) {
  emu::Op op;
  op.kind = emu::Op::kMemcpy;
  op.dst = dst;
  op.src = src;
  op.n = n;
  return EnqueueOp(s, op);
}
cudaError_t cudaStreamCreate(cudaStream_t* s) { return cudaStreamCreateWithFlags(s, 0); }
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned) {
  emu::EnsureInit();
  emu::Device* d = emu::Dev(S().current);
  auto* st = new emu::Stream{d, {}, false};
  d->streams.push_back(st);
  *s = st;
  return cudaSuccess;
}
cudaError_t cudaStreamDestroy(cudaStream_t s) {
  if (s == nullptr) return cudaSuccess;
  emu::SyncDevice(s->dev);
  auto& v = s->dev->streams;
  v.erase(std::remove(v.begin(), v.end(), s), v.end());
  delete s;
  return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t s) {
  emu::EnsureInit();
  emu::Stream* st = emu::Resolve(s);
  emu::RunUntil([st] { return st->ops.empty(); });
  return S().last_error == cudaErrorLaunchFailure ? cudaErrorLaunchFailure : cudaSuccess;
}
cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned) {
  emu::Op op;
  op.kind = emu::Op::kWait;
  op.ev = e;
  op.ticket = e->recorded;
  return EnqueueOp(s, op);
}
cudaError_t cudaEventCreate(cudaEvent_t* e) { return cudaEventCreateWithFlags(e, 0); }
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned) {
  *e = new emu::Event();
  return cudaSuccess;
}
cudaError_t cudaEventDestroy(cudaEvent_t e) {
  delete e;
  return cudaSuccess;
}
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s) {
  emu::Op op;
  op.kind = emu::Op::kRecord;
  op.ev = e;
  op.ticket = e->recorded + 1;
  const cudaError_t r = EnqueueOp(s, op);
  if (r == cudaSuccess) ++e->recorded;
  return r;
}
cudaError_t cudaEventSynchronize(cudaEvent_t e) {
  emu::RunUntil([e] { return e->completed >= e->recorded; });
  return cudaSuccess;
}
cudaError_t cudaIpcGetMemHandle(cudaIpcMemHandle_t* h, void* p) {
  // One process holds every virtual GPU: the handle is the pointer itself.
  std::memset(h, 0, sizeof(*h));
  std::memcpy(h->reserved, &p, sizeof(p));
  return cudaSuccess;
}
cudaError_t cudaIpcOpenMemHandle(void** p, cudaIpcMemHandle_t h, unsigned) {
  std::memcpy(p, h.reserved, sizeof(*p));
  return cudaSuccess;
}
cudaError_t cudaIpcCloseMemHandle(void*) { return cudaSuccess; }
