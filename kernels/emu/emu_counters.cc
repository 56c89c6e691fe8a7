// The emulated GPU's runtime (kernels/emu/emu_internal.h): counters per virtual GPU (the
// hot ones in arrays, bytes and accesses by direction, space and width, the rest by name),
// per-launch chains, faults, and the control calls that read and reset them.
// Model: docs/emulator.md.
#include <algorithm>
#include <array>
#include <map>
#include <string>
#include <vector>

#include "kernels/emu/emu_internal.h"

namespace emu {

namespace {
const char* const kHotNames[kNumHot] = {"atomics", "fences:block", "fences:gpu", "fences:system",
                                        "polls", "release_stores", "peer_stores",
                                        "acquire_loads", "sleeps"};
}  // namespace

const char* const kLatNames[kNumLatSpaces] = {"local", "peer", "rdma"};

// A counter of virtual GPU d (-1: see Ctr).
void CountDev(int d, const std::string& k, uint64_t v) { Ctr(d).named[k] += v; }
// A counter of the running thread's GPU; outside any GPU, of no GPU (totals only).
void Count(const std::string& k, uint64_t v) {
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
  // Rounds (below): the longest thread's, by space and kind, each the maximum over the
  // threads on its own, added per launch like the chains: data rounds (loads, bulk loads)
  // as "longest:mrounds:<space>", which grow with the bytes a thread copies; polls and
  // waits for writes as "chain:mrounds:<space>", which the kernels make per row, chunk or
  // call, never per byte (the model fits them as it fits the other chains). And the data
  // rounds of its warps ("warp_mrounds:<space>:<kernel>", added over warps and launches;
  // with "kernel:<kernel>:warps" the model gets the average warp's rounds).
  for (int sp = 0; sp < kNumLatSpaces; ++sp) {
    if (k->mrounds_max[sp] != 0)
      CountDev(k->dev->id, std::string("longest:mrounds:") + kLatNames[sp], k->mrounds_max[sp]);
    if (k->sync_mrounds_max[sp] != 0)
      CountDev(k->dev->id, std::string("chain:mrounds:") + kLatNames[sp],
               k->sync_mrounds_max[sp]);
    if (k->warp_mrounds[sp] != 0)
      CountDev(k->dev->id, std::string("warp_mrounds:") + kLatNames[sp] + ":" +
                   CounterName(k->spec.name),
               k->warp_mrounds[sp]);
  }
}

// ---------------------------------------------------------------------------------------
// Rounds and bytes in flight: what a thread waits for, for a model that counts latency
// (docs/emulator.md, "Rounds and bytes in flight"). The emulator runs each access at once,
// so it counts the program's order instead:
// - A thread's plain loads issued one after another with nothing that needs them in
//   between are in flight together; the first store, fence, poll, barrier or warp
//   collective after them (a use point) waits for them all: one round of the farthest
//   space they read. A store is taken as a use of the loads before it: it usually stores
//   what they loaded, and a compiler may not move a later load above a store to memory it
//   cannot prove apart (without __restrict__), so the next loads start a new round.
// - At most kMaxRunBytes of loads are in flight per thread: they land in its registers.
// - A copy split over threads (note_copy_share: devcopy's loops, element by element, a
//   load then its store) is one round per element.
// - A bulk load (TMA) is in flight from its issue to its mbarrier wait; the wait retires a
//   share of the thread's bulk loads in flight (its bytes over theirs): a double-buffered
//   copy that waits for piece p with piece p + 1 in flight pays half a round per piece.
// - Writes (stores, bulk stores, RDMA puts) do not stall the thread; a fence, release or
//   quiet after them waits for them: one round of the farthest space written.
// - A poll that waits for a flag is one round of the space its writer reaches it over
//   (note_acquire_at), however often it spins.
// Counted in millirounds (the SI prefix; kMilli below), per device: "round_bytes:<space>"
// (bytes retired by data rounds, added over threads), with the per-kernel counters above.
namespace {
// CUDA C++ Programming Guide, "Technical Specifications per Compute Capability": at most
// 255 32-bit registers per thread (compute capability 9.0): the bytes one thread's loads
// can hold in flight.
constexpr uint64_t kMaxRunBytes = 255 * 4;
constexpr uint64_t kMilli = 1000;

void AddRounds(Fiber* f, int sp, uint64_t mrounds, uint64_t bytes, bool data) {
  f->mrounds[sp] += mrounds;
  if (!data) return;
  f->load_mrounds[sp] += mrounds;
  if (bytes != 0) CountDev(f->blk->dev->id, std::string("round_bytes:") + kLatNames[sp], bytes);
}
// A space's index from an address: a peer's memory is reached over NVLink, this GPU's
// from its HBM. A poll waits for the flag's writer instead: memory of this GPU that peers
// write (mark_peer_memory) is written over NVLink (flag_writer).
int SpaceOf(const Fiber* f, const void* p, bool flag_writer = false) {
  const int owner = OwnerOf(p);
  if (owner >= 0 && owner != f->blk->dev->id) return kLatPeer;
  return flag_writer && PeerMem(p) ? kLatPeer : kLatLocal;
}
void LoadRun(Fiber* f, int sp, uint64_t bytes) {
  f->poll_flag = nullptr;
  f->run_space = std::max(f->run_space, sp);
  f->run_bytes += bytes;
  while (f->run_bytes > kMaxRunBytes) {  // registers full: the oldest wait first
    AddRounds(f, f->run_space, kMilli, kMaxRunBytes, true);
    f->run_bytes -= kMaxRunBytes;
  }
}
// Waits for this thread's writes (a fence, release or quiet): one round of the farthest.
void WaitWrites(Fiber* f) {
  if (f->write_spaces == 0) return;
  int far = kLatLocal;
  for (int sp = 0; sp < kNumLatSpaces; ++sp)
    if ((f->write_spaces >> sp) & 1u) far = sp;
  AddRounds(f, far, kMilli, 0, false);
  f->write_spaces = 0;
}
void PollRound(Fiber* f, const void* flag, int space) {
  EndRun(f);
  if (f->poll_flag == flag) return;  // the same wait, spinning
  f->poll_flag = flag;
  AddRounds(f, space >= 0 ? space : SpaceOf(f, flag, true), kMilli, 0, false);
}
}  // namespace

void EndRun(Fiber* f) {
  if (f == nullptr || f->run_bytes == 0) return;
  AddRounds(f, f->run_space, kMilli, f->run_bytes, true);
  f->run_bytes = 0;
  f->run_space = kLatLocal;
}

void CountWarpRounds(Block* b) {
  // A warp's lanes issue together: its rounds are its busiest lane's.
  std::vector<std::array<uint64_t, kNumLatSpaces>> per(b->warps.size());
  for (Fiber& f : b->fibers) {
    auto& w = per[static_cast<size_t>(f.ctx.warp)];
    for (int sp = 0; sp < kNumLatSpaces; ++sp) w[sp] = std::max(w[sp], f.load_mrounds[sp]);
  }
  for (const auto& w : per)
    for (int sp = 0; sp < kNumLatSpaces; ++sp) b->k->warp_mrounds[sp] += w[sp];
}

void note_acquire_at(const void* flag, int space) {
  Hot(kHotAcquire)++;
  Fiber* f = S().cur;
  if (f != nullptr) {
    f->global_proxy_fenced = false;  // as note_acquire
    PollRound(f, flag, space);
  }
  note_poll();
}

void note_poll_at(const void* flag, int space) {
  Fiber* f = S().cur;
  if (f != nullptr) PollRound(f, flag, space);
  note_poll();
}

void note_remote_write(int space) {
  Fiber* f = S().cur;
  if (f != nullptr && space >= 0 && space < kNumLatSpaces) f->write_spaces |= 1u << space;
}

void note_complete_writes() {
  Fiber* f = S().cur;
  if (f == nullptr) return;
  EndRun(f);
  WaitWrites(f);
}

// The hooks the other files call at a use point or a fence.
void NoteUse(Fiber* f) {
  if (f == nullptr) return;
  EndRun(f);
  f->poll_flag = nullptr;
}
void NoteFence(Fiber* f) {
  if (f == nullptr) return;
  NoteUse(f);
  WaitWrites(f);
}
void NoteWrite(Fiber* f, const void* p, bool use) {
  if (f == nullptr) return;
  if (use) NoteUse(f);
  f->write_spaces |= 1u << SpaceOf(f, p);
}
void NoteBulkLoad(Fiber* f, const void* mbar, const void* src, size_t n) {
  if (f == nullptr) return;
  auto& e = f->bulk_inflight[mbar];
  e.first += n;
  e.second = std::max(e.second, SpaceOf(f, src));
}
void NoteBulkWait(Fiber* f, const void* mbar) {
  if (f == nullptr) return;
  NoteUse(f);
  auto it = f->bulk_inflight.find(mbar);
  if (it == f->bulk_inflight.end()) return;
  uint64_t all = 0;
  for (const auto& kv : f->bulk_inflight) all += kv.second.first;
  const uint64_t mine = it->second.first;
  if (all != 0 && mine != 0) AddRounds(f, it->second.second, kMilli * mine / all, mine, true);
  f->bulk_inflight.erase(it);
}

void Fault(const std::string& what) {
  State& s = S();
  if (s.faults.size() < 64) s.faults.push_back(what);
}

// ---------------------------------------------------------------------------------------
// Device-side entry points: notes.
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
  NoteUse(S().cur);  // no flag known: a use point, no round (note_acquire_at counts one)
  // What this acquire orders reaches a later bulk load only through a proxy fence after it
  // (emu_tma.cc, bulk_load_tx).
  if (S().cur != nullptr) S().cur->global_proxy_fenced = false;
  note_poll();
}

void note_copy(int width, size_t bytes) { Count("copy_bytes:" + std::to_string(width), bytes); }

void fault(const char* what) {
  S().step_work = true;
  Fault(what);
}

// ---------------------------------------------------------------------------------------
// Control: counters and faults.
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
void reset_counters() {
  State& s = S();
  s.counters.clear();
  for (DevCounters& k : s.dev_ctr) k = DevCounters{};
}
void add_counter(const std::string& name, uint64_t v) { CountDev(-1, name, v); }

// ---- bytes by width and space ----
void CountAccess(int dir, const void* p, int width, size_t n) {
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

void note_access(int dir, const void* p, int width, size_t n) {
  CountAccess(dir, p, width, n);
  Fiber* f = S().cur;
  if (f == nullptr) return;
  if (dir == kAccessStore) NoteWrite(f, p);
  else LoadRun(f, SpaceOf(f, p), static_cast<uint64_t>(width) * n);
}

void note_copy_share(const void* dst, const void* src, int width, int64_t count, int tid,
                     int stride) {
  if (tid < 0 || stride <= 0 || count <= tid) return;
  const size_t mine = static_cast<size_t>((count - 1 - tid) / stride + 1);
  if (src != nullptr) CountAccess(kAccessLoad, src, width, mine);
  if (dst != nullptr) CountAccess(kAccessStore, dst, width, mine);
  Fiber* f = S().cur;
  if (f == nullptr) return;
  // Element by element, a load and then its store: a round per element.
  NoteUse(f);
  if (src != nullptr)
    AddRounds(f, SpaceOf(f, src), kMilli * mine, static_cast<uint64_t>(width) * mine, true);
  if (dst != nullptr) NoteWrite(f, dst);
}

}  // namespace emu
