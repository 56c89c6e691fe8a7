// The emulated GPU's runtime (kernels/emu/emu_internal.h): counters per virtual GPU (the
// hot ones in arrays, bytes and accesses by direction, space and width, the rest by name),
// per-launch chains, faults, and the control calls that read and reset them.
// Model: docs/emulator.md.
#include <algorithm>
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

}  // namespace emu
