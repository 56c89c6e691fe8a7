// The emulated GPU's runtime (kernels/emu/emu_internal.h): bulk copies (TMA,
// cp.async.bulk) between global and shared memory, with mbarrier phases for loads and
// commit groups for stores; each copy lands at its issue or at its wait, seeded. The
// hardware's rules a kernel can break, each a fault or stale bytes in some seeds: 16-byte
// alignment and size, mbarrier arrival and transaction-byte accounting, the async proxy's
// fences; and non-coherent (.nc) loads of peer memory. Model: docs/emulator.md.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <map>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "kernels/emu/emu_internal.h"

namespace emu {

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
void FillStale(void* dst, size_t n);
void LandStore(Fiber* f, BulkCopy& c) {
  if (c.landed) return;
  S().step_work = true;
  std::vector<unsigned char> stale;
  const void* src = c.src;
  if (c.stale) {
    stale.resize(c.n);
    FillStale(stale.data(), c.n);
    src = stale.data();
  }
  if (Remote(f, c.dst)) buffered_store(c.dst, src, c.n);
  else std::memcpy(c.dst, src, c.n);
  c.landed = true;
}
// A bulk copy may land any time from its issue to its wait: the emulator picks one end,
// seeded. At the issue, it shows shared memory still in use by an earlier copy (a load
// over a piece a store has not read yet) or not yet filled (a store of a piece before the
// wait for its load); at the wait, a read before the wait.
bool LandAtIssue() { return (S().bulk_rng() & 1u) != 0; }
}  // namespace

namespace {
std::string Where(const Fiber* f) { return std::string("kernel ") + f->blk->k->spec.name + ": "; }
std::string Addr(const void* p) {
  char b[32];
  std::snprintf(b, sizeof(b), "%p", p);
  return b;
}

// PTX ISA, Data Movement and Conversion Instructions, "cp.async.bulk": the shared and
// global addresses must be 16-byte aligned and the size a multiple of 16; a GPU faults
// (misaligned address) otherwise. Reported as an emulator fault naming the helper; the
// copy still runs so the run ends normally and the fault is read at synchronize.
void CheckLegal(const Fiber* f, const char* helper, const void* global, const void* smem, size_t n) {
  const auto bad = [](const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) != 0; };
  if (!bad(global) && !bad(smem) && n % 16 == 0 && n > 0) return;
  Fault(Where(f) + helper + ": a bulk copy (cp.async.bulk) of " + std::to_string(n) +
        " bytes between global " + Addr(global) + " and shared " + Addr(smem) +
        " is not 16-byte aligned and sized (a misaligned-address fault on a GPU)");
}

// The part of [p, p + n) in the block's dynamic shared memory, as granule indices.
bool DynGranules(Block* b, const void* p, size_t n, size_t* g0, size_t* g1) {
  const char* base = reinterpret_cast<const char*>(b->dyn_smem.data());
  const char* c = static_cast<const char*>(p);
  if (n == 0 || c < base || c + n > base + b->dyn_smem.size()) return false;
  *g0 = static_cast<size_t>(c - base) / 16;
  *g1 = static_cast<size_t>(c + n - 1 - base) / 16;
  if (b->async_written.size() < b->dyn_smem.size() / 16 + 1)
    b->async_written.resize(b->dyn_smem.size() / 16 + 1, false);
  return true;
}

// Stale bytes: the emulator keeps no older copy of memory, so what a copy reads without
// the fence that orders it is a seeded garbage pattern (on a GPU it is whatever the
// async proxy last saw: older data, which a test checking results sees as wrong).
void FillStale(void* dst, size_t n) {
  std::memset(dst, static_cast<int>(0xa0 | (S().rules_rng() & 0x0f)), n);
}

// Writes a landed load and marks its granules as written by the async proxy.
void LandLoad(Fiber* f, const BulkCopy& c) {
  if (c.stale) FillStale(c.dst, c.n);
  else std::memcpy(c.dst, c.src, c.n);
  size_t g0, g1;
  if (DynGranules(f->blk, c.dst, c.n, &g0, &g1))
    for (size_t g = g0; g <= g1; ++g) f->blk->async_written[g] = true;
}

MbarState* Mbar(Fiber* f, const void* mbar, const char* helper) {
  auto it = f->blk->mbars.find(mbar);
  if (it != f->blk->mbars.end()) return &it->second;
  Fault(Where(f) + helper + ": mbarrier " + Addr(mbar) + " used before mbarrier.init");
  return &f->blk->mbars[mbar];  // counted from here so the run goes on
}

// PTX ISA, Parallel Synchronization and Communication Instructions, "mbarrier": a phase
// completes when its pending arrival count and its tx-count both reach zero. The
// emulator lands a phase's in-flight copies when it completes (at a wait, or when the
// next phase's first arrival finds it complete).
bool PhaseReady(const MbarState& m) { return m.arrived >= m.count && m.issued_tx == m.expect_tx; }
void CompletePhase(Fiber* f, uint64_t* mbar, MbarState& m) {
  S().step_work = true;
  auto it = f->blk->bulk_loads.find(mbar);
  if (it != f->blk->bulk_loads.end()) {
    for (const BulkCopy& c : it->second)
      if (!c.landed) LandLoad(f, c);
    it->second.clear();
  }
  m.arrived = 0;
  m.expect_tx = m.issued_tx = 0;
  *mbar += 1;
}
std::string Describe(const void* mbar, const MbarState& m) {
  return "mbarrier " + Addr(mbar) + " (arrivals " + std::to_string(m.arrived) + " of " +
         std::to_string(m.count) + ", expect_tx " + std::to_string(m.expect_tx) +
         " bytes, copies " + std::to_string(m.issued_tx) + " bytes)";
}
}  // namespace

void mbar_init(uint64_t* mbar, uint32_t count) {
  Fiber* f = S().cur;
  *mbar = 0;  // phase 0
  if (f == nullptr) return;
  f->blk->bulk_loads.erase(mbar);
  MbarState m;
  m.count = count;
  m.init_fences = f->blk->shared_proxy_fences;
  f->blk->mbars[mbar] = m;
}

void mbar_arrive_expect_tx(uint64_t* mbar, uint32_t bytes) {
  Fiber* f = S().cur;
  if (f == nullptr) throw std::logic_error("emu: mbarrier arrive outside a kernel");
  MbarState* m = Mbar(f, mbar, "peer::mbar_arrive_expect_tx");
  if (m->arrived >= m->count) {
    if (PhaseReady(*m)) {
      CompletePhase(f, mbar, *m);  // this arrival is the next phase's
    } else {
      Fault(Where(f) + "peer::mbar_arrive_expect_tx: an arrival past the expected count on " +
            Describe(mbar, *m));
    }
  }
  m->arrived++;
  m->expect_tx += bytes;
}

void bulk_load_tx(void* smem, const void* src, size_t n, uint64_t* mbar) {
  State& s = S();
  Fiber* f = s.cur;
  if (f == nullptr) throw std::logic_error("emu: bulk_load outside a kernel");
  CheckLegal(f, "peer::bulk_load", src, smem, n);
  NoteBulk(kAccessLoad, src, n);
  s.step_work = true;
  MbarState* m = Mbar(f, mbar, "peer::bulk_load");
  // PTX ISA, Memory Consistency Model, "Proxies", and "membar/fence" (fence.proxy.async,
  // fence.mbarrier_init): mbarrier.init is a generic-proxy write, and the copy's
  // complete_tx reaches the barrier through the async proxy; without a proxy fence in
  // between, the TMA may signal a barrier it does not see initialized (a lost completion,
  // a hang on a GPU).
  if (m->init_fences == f->blk->shared_proxy_fences)
    Fault(Where(f) + "peer::bulk_load: " + Describe(mbar, *m) + " was initialized with no "
          "fence.mbarrier_init / fence.proxy.async (peer::fence_bulk_shared) before a bulk "
          "copy completes on it");
  m->issued_tx += static_cast<int64_t>(n);
  NoteBulkLoad(f, mbar, src, n);  // in flight until its wait (emu_counters.cc, "Rounds")
  BulkCopy c{smem, src, n};
  // The same rules, for global memory: a peer's writes the thread acquired (generic proxy)
  // are ordered before a bulk load's reads (async proxy) only by a fence.proxy.async.global
  // after the acquire; without one the copy may read what the async proxy saw before.
  if (!f->global_proxy_fenced && PeerMem(src)) c.stale = (s.rules_rng() & 1u) != 0;
  if (LandAtIssue()) {
    LandLoad(f, c);
    c.landed = true;
  }
  f->blk->bulk_loads[mbar].push_back(c);
}

bool mbar_wait(uint64_t* mbar, uint32_t parity, int64_t timeout_ns) {
  Fiber* f = S().cur;
  if (f == nullptr) throw std::logic_error("emu: mbar_wait outside a kernel");
  uint64_t start = 0;
  unsigned nap = 64;
  for (;;) {
    yield(kYieldPoll);
    if ((*mbar & 1u) != (parity & 1u)) {  // that phase has completed already
      NoteBulkWait(f, mbar);
      return true;
    }
    MbarState* m = Mbar(f, mbar, "peer::mbar_wait");
    if (m->arrived >= m->count && m->issued_tx > m->expect_tx) {
      // On a GPU the tx-count reaches zero before the last bytes land: the phase completes
      // early and the rest counts against the next one.
      Fault(Where(f) + "peer::mbar_wait: bulk copies of more bytes than expect_tx announced "
            "on " + Describe(mbar, *m));
      CompletePhase(f, mbar, *m);
      return true;
    }
    if (PhaseReady(*m)) {
      CompletePhase(f, mbar, *m);
      NoteBulkWait(f, mbar);
      return true;
    }
    // Short of arrivals or of bytes: on a GPU this phase never completes unless another
    // thread arrives or copies more. The wait ends at the kernels' timeout (the caller
    // records it), and the emulator names the barrier.
    const uint64_t now = global_timer_ns();
    if (start == 0) start = now;
    if (timeout_ns > 0 && now - start > static_cast<uint64_t>(timeout_ns)) {
      Fault(Where(f) + "peer::mbar_wait: a phase that never completes (a hang on a GPU) on " +
            Describe(mbar, *m));
      return false;
    }
    nanosleep_ns(nap);
    if (nap < (1u << 20)) nap *= 2;
  }
}

void bulk_store(void* dst, const void* smem, size_t n) {
  Fiber* f = S().cur;
  if (f == nullptr) throw std::logic_error("emu: bulk_store outside a kernel");
  CheckLegal(f, "peer::bulk_store", dst, smem, n);
  NoteBulk(kAccessStore, dst, n);
  NoteWrite(f, dst, false);  // waited for by the next fence, not by its issue
  S().step_work = true;
  BulkCopy c{dst, smem, n};
  // PTX ISA, Memory Consistency Model, "Proxies": shared memory the threads wrote with
  // ordinary stores (generic proxy) is seen by a bulk copy (async proxy) only after a
  // fence.proxy.async.shared::cta. The emulator cannot see ordinary stores to shared
  // memory, so it takes the block's proxy fences as the rule: a bulk store whose source
  // was not last written by a bulk load (the async proxy itself) reads stale bytes in some
  // seeds when no thread of the block has executed the fence (peer::fence_bulk_shared).
  size_t g0, g1;
  if (f->blk->shared_proxy_fences == 0 && DynGranules(f->blk, smem, n, &g0, &g1)) {
    bool generic = false;
    for (size_t g = g0; g <= g1 && !generic; ++g) generic = !f->blk->async_written[g];
    if (generic) c.stale = (S().rules_rng() & 1u) != 0;
  }
  f->bulk_open.push_back(c);
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

}  // namespace emu

namespace emu {

void proxy_fence(int space) {
  Fiber* f = S().cur;
  if (f == nullptr) return;
  if (space == kProxyShared) f->blk->shared_proxy_fences++;
  else f->global_proxy_fenced = true;
}

// PTX ISA, "ld" (.nc: the non-coherent, read-only path) and CUDA C++ Programming Guide,
// "Read-Only Data Cache Load Function" (__ldg): data read through it must not change
// while the kernel runs; a change a peer makes may never be seen. Peer memory read this
// way is snapshotted per block (an SM's cache) at its first .nc read of each 16-byte
// granule, and a later .nc read returns the snapshot in some seeds, for the rest of the
// block's life. Memory not marked as peer memory (XLA inputs) reads as it is.
void load_nc(void* out, const void* p, size_t n) {
  State& s = S();
  Fiber* f = s.cur;
  if (f == nullptr || !PeerMem(p)) {
    std::memcpy(out, p, n);
    return;
  }
  const auto a = reinterpret_cast<uintptr_t>(p);
  auto* o = static_cast<unsigned char*>(out);
  for (uintptr_t g = a >> 4; g <= (a + n - 1) >> 4; ++g) {
    const uintptr_t lo = std::max(a, g << 4), hi = std::min(a + n, (g + 1) << 4);
    auto it = f->blk->nc_snap.find(g);
    const unsigned char* from = reinterpret_cast<const unsigned char*>(lo);
    if (it == f->blk->nc_snap.end()) {
      std::array<unsigned char, 16> snap;
      std::memcpy(snap.data(), reinterpret_cast<const void*>(g << 4), 16);
      f->blk->nc_snap.emplace(g, snap);
    } else if ((s.rules_rng() & 1u) != 0) {
      from = it->second.data() + (lo - (g << 4));
    }
    std::memcpy(o + (lo - a), from, hi - lo);
  }
}

}  // namespace emu
