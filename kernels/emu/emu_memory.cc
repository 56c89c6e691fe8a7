// The emulated GPU's runtime (kernels/emu/emu_internal.h): memory and its visibility --
// per-thread store buffers for peer memory (weak stores, drained by fences, releases,
// the scheduler and the end of a kernel, ordered per 16-byte granule), which allocation
// and virtual GPU an address belongs to, the device entry points that store or fence,
// peer-memory marks and device-global symbol copies. Model: docs/emulator.md.
#include <algorithm>
#include <cstring>
#include <map>
#include <vector>

#include "kernels/emu/emu_internal.h"

namespace emu {

// ---- store buffers ----
namespace {
bool IsPeer(const void* p) {
  const char* c = static_cast<const char*>(p);
  for (auto& r : S().peer_mem)
    if (c >= r.first && c < r.first + r.second) return true;
  return false;
}
}  // namespace

bool PeerMem(const void* p) { return IsPeer(p); }

// Stores of thread f to p sit in its store buffer when p is marked peer memory that another
// virtual GPU owns: what a GPU writes into its own buffers (its own NVSHMEM heap, its own
// intranode buffer) its blocks see at once, as on hardware after a __syncthreads.
bool Remote(const Fiber* f, const void* p) {
  if (f == nullptr || !S().cfg.weak_stores || !IsPeer(p)) return false;
  const int owner = OwnerOf(p);
  return owner >= 0 && owner != f->blk->dev->id;
}

namespace {
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
}  // namespace

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

namespace {
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
}  // namespace

int OwnerOf(const void* p) {
  const State& s = S();
  const auto a = reinterpret_cast<uintptr_t>(p);
  auto it = s.allocs.upper_bound(a);
  if (it == s.allocs.begin()) return -1;
  --it;
  return a < it->first + it->second.first ? it->second.second : -1;
}

// ---------------------------------------------------------------------------------------
// Device-side entry points: fences and stores.
void fence(int scope) {
  State& s = S();
  Hot(kHotFenceBlock + (scope < 0 || scope > 2 ? 1 : scope))++;
  if (scope == kFenceSystem) note_chain(kChainFenceSystem);
  if (scope == kFenceGpu) note_chain(kChainFenceGpu);
  // A .gpu or .sys fence waits for this thread's writes to reach their scope (a round,
  // emu_counters.cc "Rounds"); a .cta fence orders them within the SM only.
  if (scope >= kFenceGpu) NoteFence(s.cur);
  else NoteUse(s.cur);
  // A fence only orders this thread's own stores: it drains its buffer and needs no turn.
  // Only a .sys fence does: the buffer holds nothing but stores into memory another
  // virtual GPU owns, and another GPU's threads are outside a .gpu fence's scope. PTX
  // ISA, Memory Consistency Model, "Scope": morally strong operations synchronize only
  // with threads within their scope (.cta, .gpu, .sys), so a fence.gpu (__threadfence)
  // orders this thread's stores for the threads of its own GPU alone, and a peer polling
  // its flag may still read the older bytes (what a GPU may do across NVLink).
  if (scope >= kFenceSystem) drain_own_stores();
}

void drain_own_stores() {
  Fiber* f = S().cur;
  if (f != nullptr && f->sbuf != nullptr) Drain(f->sbuf, SIZE_MAX);
}

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
  NoteFence(f);  // a release at system scope waits for the writes before it
  if (f != nullptr && f->sbuf != nullptr) Drain(f->sbuf, SIZE_MAX);
  if (f != nullptr) Suspend(true);
  *reinterpret_cast<volatile uint64_t*>(p) = v;
}

void note_work() { S().step_work = true; }
void set_pending_probe(bool (*pending)()) { S().pending_probe = pending; }

// ---------------------------------------------------------------------------------------
// Control: peer memory, device-global symbols.
void mark_peer_memory(void* p, size_t n) { S().peer_mem.emplace_back(static_cast<char*>(p), n); }
void unmark_peer_memory(void* p) {
  auto& v = S().peer_mem;
  v.erase(std::remove_if(v.begin(), v.end(), [p](auto& r) { return r.first == p; }), v.end());
}

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
