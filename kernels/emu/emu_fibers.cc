// The emulated GPU's runtime (kernels/emu/emu_internal.h): the fibers every CUDA thread
// runs as (context switch, stacks), the running block's shared memory (this module's TLS
// block, given the block's image), the device globals of the running virtual GPU (the
// section swap), and the block-level device entry points (barriers, warp collectives).
// Model: docs/emulator.md.
#include <link.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "kernels/emu/emu_internal.h"

#if defined(JEP_EMU_ASAN)
#include <sanitizer/common_interface_defs.h>
#endif

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
#if defined(JEP_EMU_ASAN)
constexpr size_t kStackBytes = 256 * 1024;
#else
constexpr size_t kStackBytes = 32 * 1024;
#endif
const size_t kPage = static_cast<size_t>(sysconf(_SC_PAGESIZE));
}  // namespace

// This module's TLS block on the scheduler thread: every __shared__ variable lives there.
namespace {
thread_local volatile char g_tls_anchor;
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
}  // namespace

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

namespace {
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
}  // namespace

bool TlsByPointer() {
  static const bool by_pointer = ProbeTlsByPointer();
  return by_pointer;
}
size_t DeviceBytes() { return static_cast<size_t>(__jep_emu_device_end - __jep_emu_device_begin); }

// Stacks come in chunks (one mapping each: the kernel limits the number of mappings, and a
// guard page per stack would split them); a canary at each stack's low end catches an
// overflow when its fiber next yields.

namespace {
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
}  // namespace

// ---- section swapping ----
namespace {
// The section shows slot `slot` of the device file (no bytes copied; the pages that the
// next steps touch fault in). False: the mapping failed, swap by copying.
bool MapDeviceSlot(size_t slot) {
  State& s = S();
  const size_t n = DeviceBytes();
  void* p = mmap(__jep_emu_device_begin, n, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED,
                 s.device_fd, static_cast<off_t>(slot * n));
  return p == static_cast<void*>(__jep_emu_device_begin);
}
}  // namespace

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

namespace {
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
  EndRun(f);  // loads never used still land before the thread is done
  for (int sp = 0; sp < kNumLatSpaces; ++sp) {
    b->k->mrounds_max[sp] = std::max(b->k->mrounds_max[sp], f->load_mrounds[sp]);
    b->k->sync_mrounds_max[sp] =
        std::max(b->k->sync_mrounds_max[sp], f->mrounds[sp] - f->load_mrounds[sp]);
  }
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
}  // namespace

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
namespace {
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
}  // namespace

// ---------------------------------------------------------------------------------------
// Device-side entry points: a turn, barriers, warp collectives, the block's shared memory.
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
  NoteUse(f);  // a use point of its loads in flight (emu_counters.cc, "Rounds")
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
  NoteUse(f);  // a use point of its loads in flight (emu_counters.cc, "Rounds")
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
  NoteUse(f);  // a use point of its loads in flight (emu_counters.cc, "Rounds")
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

char* dynamic_smem() {
  Fiber* f = S().cur;
  return f == nullptr ? nullptr : reinterpret_cast<char*>(f->blk->dyn_smem.data());
}

}  // namespace emu
