// The emulated GPU's runtime (kernels/emu/emu_internal.h): bulk copies (TMA,
// cp.async.bulk) between global and shared memory, with mbarrier phases for loads and
// commit groups for stores; each copy lands at its issue or at its wait, seeded.
// Model: docs/emulator.md.
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

}  // namespace emu
