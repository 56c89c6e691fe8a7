// Emulated NCCL (kernels/emu/nccl_emu.h): communicators per ncclUniqueId over the virtual
// GPUs, symmetric windows, device communicators with GIN contexts, and a transport that
// queues every GIN operation per (source, destination, devComm, context), processes them
// later in order within a queue, and settles put data later still, as gin.h allows.
// Sources of each rule: NCCL 2.32.6 nccl.h, nccl_device/host.h, core.h, gin.h (cited as
// file:line); docs/emulator.md, "NCCL GIN (emulated)".
#include "kernels/emu/nccl_emu.h"

#include <algorithm>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <tuple>

#include "kernels/emu/emu_control.h"
#include "kernels/emu/emu_cuda.h"
#include "kernels/emu/nvshmem_emu.h"

// One rank's copy of a registered window (ncclWindow_t points at it).
struct ncclWindow_vidmem {
  int world;
  int rank;
  int index;  // k: the k-th registration of every rank of the comm is one window
  char* base;
  size_t size;
  bool live;
};

struct ncclComm {
  int world;
  int rank;
  int nranks;
  int device;
  bool live;
  std::vector<ncclWindow_vidmem*> windows;
  int devcomms = 0;
  std::string last_error;
};

namespace nccl_emu {
namespace {

// The k-th devComm of a world (the k-th ncclDevCommCreate of every rank).
struct DevCommInfo {
  ncclGinConnectionType_t conn;
  uint32_t contexts;  // granted
  int requested;
  int signals, counters;
};

struct CommWorld {
  std::string uid;
  int nranks = 0;
  std::vector<ncclComm*> ranks;                          // by rank, null until init
  std::vector<std::vector<ncclWindow_vidmem*>> windows;  // by rank, k-th registration
  std::vector<DevCommInfo> devcomms;
  std::map<std::pair<int, int>, bool> devcomm_live;              // (k, rank)
  std::map<std::pair<int, int>, std::vector<uint64_t>> counters;  // (k, rank): GIN counters
};

struct Op {
  bool is_put;
  int world, dc, src, dst, ctx;
  char* dst_ptr;
  const char* src_ptr;  // read when processed (the NIC reads it then)
  size_t bytes;
  uint64_t* sig;        // destination's signal word, or null
  uint64_t value;
  int sig_kind;         // kSigNone / kSigStrong / kSigWeak
  uint64_t* counter;    // source's GIN counter (ncclGin_WeakCounterInc), or null
  uint64_t ready;       // transport step from which it may be processed
  int dev, block, warp; // the issuing threads, for flush
  uint32_t mask;
  int64_t log_index;
  uint64_t log_epoch;
};

// A processed put's bytes, not yet visible at the destination.
struct Unsettled {
  char* dst;
  std::vector<char> bytes;
  uint64_t due;  // step from which it settles on its own
};

struct Queue {
  std::deque<Op> ops;
  std::vector<Unsettled> unsettled;  // in processing order
};

using QueueKey = std::tuple<int, int, int, int, int>;  // world, devComm, src, dst, context

struct State {
  WorldConfig cfg;
  std::vector<std::unique_ptr<CommWorld>> worlds;
  std::vector<std::unique_ptr<ncclComm>> comm_store;
  std::vector<std::unique_ptr<ncclWindow_vidmem>> window_store;
  std::set<const ncclComm*> comms;              // valid handles
  std::set<const ncclWindow_vidmem*> windows;   // valid handles
  std::map<void*, size_t> allocs;               // ncclMemAlloc's
  std::set<void*> marked;                       // peer-memory marks made here
  std::map<QueueKey, Queue> queues;
  std::mt19937_64 rng{1};
  uint64_t step = 0;
  int64_t queued = 0;
  int64_t unsettled = 0;
  uint64_t seq = 0;  // processing order, for the log
  std::vector<LogRecord> log;
  uint64_t log_epoch = 0;
  std::map<std::string, uint64_t> counters;
  int64_t call = 0;
  std::map<int, std::vector<int>> ports;  // world rank -> port of each context
  int group_depth = 0;
  ncclResult_t group_error = ncclSuccess;
  std::string last_error;
  uint64_t uid_serial = 0;
  std::map<const void*, int> sig_space;  // signal word -> path of its last writer
};

State& S() {
  static State s;
  return s;
}

// This virtual GPU's ordinal, in the device-global section (one copy per virtual GPU):
// device code finds which GPU it runs on.
JEP_EMU_DEVICE_GLOBAL int g_nccl_dev = -1;

int RunningDevice() { return emu::g_ctx != nullptr ? g_nccl_dev : emu::current_device(); }

int Gpn() { return S().cfg.gpus_per_node > 0 ? S().cfg.gpus_per_node : 1; }
int NodeOf(int rank) { return rank / Gpn(); }

void Count(const std::string& k, uint64_t v = 1) {
  S().counters[k] += v;
  emu::add_counter("nccl:" + k, v);
}

// A device-side misuse: an emulator fault (reported by synchronize), as nvshmem_emu's.
void Fault(const std::string& what) { emu::fault(("nccl gin: " + what).c_str()); }

// ---- host errors ----
ncclResult_t Fail(ncclResult_t r, const std::string& what, ncclComm* c = nullptr) {
  State& s = S();
  s.last_error = what;
  if (c != nullptr) c->last_error = what;
  if (s.group_depth > 0 && s.group_error == ncclSuccess) s.group_error = r;
  return r;
}
// As ncclGetLastError, the last error's text stays until the next error.
ncclResult_t Ok() { return ncclSuccess; }
bool ValidComm(const ncclComm* c) { return c != nullptr && S().comms.count(c) && c->live; }
ncclResult_t BadComm(const char* call) {
  return Fail(ncclInvalidUsage, std::string(call) +
                                    ": communicator not initialized (use before "
                                    "ncclCommInitRank, or after ncclCommDestroy)");
}

// ---- device-side resolution ----
// The world and devComm info of `c`, checked against the running GPU; null after a fault.
CommWorld* Resolve(ncclDevComm const& c, const DevCommInfo** info) {
  State& s = S();
  if (c.magic != NCCL_API_MAGIC || c._emuWorld < 0 ||
      c._emuWorld >= static_cast<int>(s.worlds.size())) {
    Fault("a ncclDevComm that ncclDevCommCreate did not fill (or of a world reset since)");
    return nullptr;
  }
  CommWorld& w = *s.worlds[static_cast<size_t>(c._emuWorld)];
  if (c._emuDevComm < 0 || c._emuDevComm >= static_cast<int>(w.devcomms.size()) ||
      c.rank < 0 || c.rank >= w.nranks || !w.devcomm_live[{c._emuDevComm, c.rank}]) {
    Fault("a ncclDevComm that is not live (destroyed, or never created on rank " +
          std::to_string(c.rank) + ")");
    return nullptr;
  }
  const ncclComm* mine = w.ranks[static_cast<size_t>(c.rank)];
  const int dev = RunningDevice();
  if (mine == nullptr || mine->device != dev) {
    Fault("the ncclDevComm of rank " + std::to_string(c.rank) + " used on virtual GPU " +
          std::to_string(dev) + " (its rank runs on GPU " +
          std::to_string(mine != nullptr ? mine->device : -1) + ")");
    return nullptr;
  }
  *info = &w.devcomms[static_cast<size_t>(c._emuDevComm)];
  return &w;
}

bool ValidWindow(ncclWindow_t win) { return win != nullptr && S().windows.count(win) != 0; }

// `rank`'s copy of window `win` at [off, off + n), or null after a fault.
char* Translate(CommWorld& w, ncclWindow_t win, int world, size_t off, size_t n, int rank,
                const char* what) {
  if (!ValidWindow(win) || win->world != world) {
    Fault(std::string(what) + ": not a window of this devComm's communicator");
    return nullptr;
  }
  const auto& wins = w.windows[static_cast<size_t>(rank)];
  if (win->index >= static_cast<int>(wins.size()) || !wins[static_cast<size_t>(win->index)]->live) {
    Fault(std::string(what) + ": rank " + std::to_string(rank) + " has not registered window " +
          std::to_string(win->index) + " (or deregistered it)");
    return nullptr;
  }
  const ncclWindow_vidmem* t = wins[static_cast<size_t>(win->index)];
  if (off + n > t->size || off + n < off) {
    Fault(std::string(what) + ": [" + std::to_string(off) + ", +" + std::to_string(n) +
          ") leaves window " + std::to_string(win->index) + " of " + std::to_string(t->size) +
          " bytes");
    return nullptr;
  }
  return t->base + off;
}

bool Overlap(const char* a, size_t an, const char* b, size_t bn) {
  return a < b + bn && b < a + an;
}

// Makes the entries of q.unsettled before `end` that overlap [d, d + n) visible (and,
// transitively, earlier ones overlapping those), in processing order: an earlier payload
// never lands over a later one.
void SettleOverlapping(Queue& q, size_t end, const char* d, size_t n) {
  std::vector<bool> take(end, false);
  std::vector<std::pair<const char*, size_t>> ranges{{d, n}};
  for (size_t j = end; j-- > 0;) {
    const Unsettled& u = q.unsettled[j];
    for (const auto& r : ranges)
      if (Overlap(u.dst, u.bytes.size(), r.first, r.second)) {
        take[j] = true;
        ranges.emplace_back(u.dst, u.bytes.size());
        break;
      }
  }
  std::vector<Unsettled> keep;
  for (size_t j = 0; j < q.unsettled.size(); ++j) {
    if (j < end && take[j]) {
      std::memcpy(q.unsettled[j].dst, q.unsettled[j].bytes.data(), q.unsettled[j].bytes.size());
      --S().unsettled;
      Count("settled");
    } else {
      keep.push_back(std::move(q.unsettled[j]));
    }
  }
  q.unsettled.swap(keep);
  emu::note_work();
}

// Every unsettled put of the queue lands: what a strong signal guarantees (gin.h:160-161:
// "this put AND all preceding puts on this context to the same peer are settled").
void SettleAll(Queue& q) {
  for (Unsettled& u : q.unsettled) std::memcpy(u.dst, u.bytes.data(), u.bytes.size());
  S().unsettled -= static_cast<int64_t>(q.unsettled.size());
  Count("settled", q.unsettled.size());
  q.unsettled.clear();
  emu::note_work();
}

// Data whose delay has passed settles on its own (no operation is lost).
void SettleDue() {
  State& s = S();
  if (s.unsettled == 0) return;
  for (auto& kv : s.queues) {
    Queue& q = kv.second;
    for (size_t i = 0; i < q.unsettled.size();) {
      if (q.unsettled[i].due <= s.step) {
        SettleOverlapping(q, i + 1, q.unsettled[i].dst, q.unsettled[i].bytes.size());
        i = 0;  // indices moved
      } else {
        ++i;
      }
    }
  }
}

void ApplySignal(const Op& op) {
  *op.sig += op.value;  // VA signal: an add on the destination's 8-byte word
  S().sig_space[op.sig] = NodeOf(op.src) != NodeOf(op.dst) ? emu::kLatRdma : emu::kLatPeer;
  emu::note_work();
}

// Processes the head of `q`: a put reads its source now (the NIC consumes it); its data
// waits to settle unless a signal bundled with it settles it.
void ProcessHead(Queue& q) {
  State& s = S();
  Op op = q.ops.front();
  q.ops.pop_front();
  --s.queued;
  ++s.seq;
  if (op.log_epoch == s.log_epoch && op.log_index >= 0 &&
      op.log_index < static_cast<int64_t>(s.log.size()))
    s.log[static_cast<size_t>(op.log_index)].done = static_cast<int64_t>(s.seq);
  Count("processed");
  emu::note_work();
  std::vector<char> data;
  if (op.is_put && op.bytes > 0) data.assign(op.src_ptr, op.src_ptr + op.bytes);
  if (op.counter != nullptr) ++*op.counter;  // source consumed (gin.h:100)
  if (op.is_put && op.sig_kind == kSigNone) {
    if (op.bytes > 0) {
      std::uniform_int_distribution<int> delay(0, std::max(s.cfg.settle_delay, 0));
      q.unsettled.push_back({op.dst_ptr, std::move(data), s.step + static_cast<uint64_t>(delay(s.rng))});
      ++s.unsettled;
    }
    return;
  }
  if (op.sig_kind == kSigStrong) {
    if (!q.unsettled.empty()) Count("strong_settles");
    SettleAll(q);
  }
  if (op.is_put && op.bytes > 0) {
    // A weak signal settles its bundled put only (gin.h:28, 162: "guarantees only the bundled
    // put is settled"); earlier puts of the queue may still be in flight.
    SettleOverlapping(q, q.unsettled.size(), op.dst_ptr, op.bytes);
    std::memcpy(op.dst_ptr, data.data(), op.bytes);
  }
  if (op.sig != nullptr) ApplySignal(op);
}

// One transport step: due data settles, and maybe one ready operation is processed,
// chosen at random among the queues whose head is ready.
void Progress() {
  State& s = S();
  ++s.step;
  SettleDue();
  if (s.queued == 0) return;
  std::vector<Queue*> ready;
  for (auto& kv : s.queues)
    if (!kv.second.ops.empty() && kv.second.ops.front().ready <= s.step)
      ready.push_back(&kv.second);
  if (ready.empty()) return;
  std::uniform_int_distribution<size_t> pick(0, ready.size() - 1);
  ProcessHead(*ready[pick(s.rng)]);
}

int WarpOf() { return static_cast<int>(threadIdx.x) / 32; }
int BlockLinear() {
  return static_cast<int>(blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z));
}

// A cooperative call: every lane of the coop arrives with the same arguments (`args`, a
// digest), then its first lane runs `issue` once. A coop of one thread runs it directly.
template <typename F>
void Cooperative(const CoopDesc& coop, uint64_t args, const char* call, F issue) {
  if (coop.cta) {
    __syncthreads();
    if (threadIdx.x == 0) issue();
    __syncthreads();
    return;
  }
  const int lane = static_cast<int>(threadIdx.x & 31);
  if (((coop.mask >> lane) & 1u) == 0) {
    Fault(std::string(call) + ": called from lane " + std::to_string(lane) +
          " outside its coop's lanes");
    return;
  }
  if (__popc(coop.mask) == 1) {
    issue();
    return;
  }
  const int leader = __ffs(static_cast<int>(coop.mask)) - 1;
  const uint64_t lead = __shfl_sync(coop.mask, args, leader);
  if (!__all_sync(coop.mask, lead == args) && lane == leader)
    Fault(std::string(call) + ": the lanes of a cooperative call passed different arguments "
                              "(every lane of the coop must pass the same)");
  if (lane == leader) issue();
  __syncwarp(coop.mask);
}

uint64_t Mix(uint64_t h, uint64_t v) {
  h ^= v + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
  return h;
}

// Checks and queues one operation (the coop's leader). False after a fault.
void Issue(ncclDevComm const& c, int ctx, int peer, bool is_put, ncclWindow_t dst,
           size_t dst_off, ncclWindow_t src, size_t src_off, size_t bytes, ActionDesc a,
           int counter, const CoopDesc& coop) {
  State& s = S();
  const DevCommInfo* info = nullptr;
  CommWorld* w = Resolve(c, &info);
  if (w == nullptr) return;
  const int me = c.rank;
  const char* what = is_put ? "put" : "signal";
  if (info->conn == NCCL_GIN_CONNECTION_NONE) {
    Fault(std::string(what) + " on a devComm created without GIN connections "
                              "(ginConnectionType NCCL_GIN_CONNECTION_NONE)");
    return;
  }
  if (ctx < 0 || static_cast<uint32_t>(ctx) >= info->contexts) {
    Fault(std::string(what) + " on context " + std::to_string(ctx) + " of a devComm granted " +
          std::to_string(info->contexts) + " (ginContextCount is a hint: read "
          "ncclDevComm::ginContextCount)");
    return;
  }
  if (peer < 0 || peer >= w->nranks) {
    Fault(std::string(what) + " to rank " + std::to_string(peer) + " of a world of " +
          std::to_string(w->nranks));
    return;
  }
  const int g = Gpn();
  if (peer == me) {
    Fault(std::string(what) + " from rank " + std::to_string(me) +
          " to itself: a GIN connection joins two different ranks");
    return;
  }
  if (info->conn == NCCL_GIN_CONNECTION_RAIL && peer % g != me % g) {
    Fault(std::string(what) + " from rank " + std::to_string(me) + " to rank " +
          std::to_string(peer) + " over a RAIL devComm: RAIL connects only the ranks with "
          "the same local index (rank % " + std::to_string(g) + " == " +
          std::to_string(me % g) + ") on other nodes; rank " + std::to_string(peer) +
          " is not connected");
    return;
  }
  Op op{};
  op.is_put = is_put;
  op.world = c._emuWorld;
  op.dc = c._emuDevComm;
  op.src = me;
  op.dst = peer;
  op.ctx = ctx;
  op.sig_kind = a.kind;
  op.value = a.value;
  if (is_put && bytes > 0) {
    if (!ValidWindow(src) || src->rank != me) {
      Fault("put: the source window is not this rank's (pass the window handle of the "
            "calling rank)");
      return;
    }
    op.dst_ptr = Translate(*w, dst, op.world, dst_off, bytes, peer, "put destination");
    op.src_ptr = Translate(*w, src, op.world, src_off, bytes, me, "put source");
    if (op.dst_ptr == nullptr || op.src_ptr == nullptr) return;
    op.bytes = bytes;
  }
  if (a.kind != kSigNone) {
    if (a.offset % 8 != 0) {
      Fault(std::string(what) + ": signal offset " + std::to_string(a.offset) +
            " is not 8-byte aligned");
      return;
    }
    op.sig = reinterpret_cast<uint64_t*>(Translate(*w, a.win, op.world, a.offset, 8, peer,
                                                   "signal word"));
    if (op.sig == nullptr) return;
  } else if (!is_put) {
    Fault("signal with ncclGin_None: nothing to signal");
    return;
  }
  if (counter >= 0) {
    auto& cv = w->counters[{op.dc, me}];
    if (counter >= static_cast<int>(cv.size())) {
      Fault("put: counter " + std::to_string(counter) + " of a devComm with " +
            std::to_string(cv.size()) + " (ginCounterCount)");
      return;
    }
    op.counter = &cv[static_cast<size_t>(counter)];
  }
  std::uniform_int_distribution<int> delay(0, std::max(s.cfg.max_delay, 0));
  op.ready = s.step + static_cast<uint64_t>(delay(s.rng));
  op.dev = RunningDevice();
  op.block = BlockLinear();
  op.warp = coop.cta ? 0 : WarpOf();
  op.mask = coop.cta ? 1u : coop.mask;
  LogRecord r{};
  r.src = me;
  r.dst = peer;
  r.context = ctx;
  auto pit = s.ports.find(me);
  r.port = pit != s.ports.end() && ctx < static_cast<int>(pit->second.size())
               ? pit->second[static_cast<size_t>(ctx)] : -1;
  r.devcomm = op.dc;
  r.block = op.block;
  r.bytes = static_cast<int64_t>(op.bytes);
  r.kind = is_put ? (a.kind == kSigStrong ? kPutStrong : a.kind == kSigWeak ? kPutWeak : kPut)
                  : (a.kind == kSigStrong ? kSignalStrong : kSignalWeak);
  r.call = s.call;
  r.done = -1;
  r.sig_off = a.kind != kSigNone ? static_cast<int64_t>(a.offset) : -1;
  op.log_index = static_cast<int64_t>(s.log.size());
  op.log_epoch = s.log_epoch;
  s.log.push_back(r);
  s.queues[QueueKey{op.world, op.dc, me, peer, ctx}].ops.push_back(op);
  ++s.queued;
  const std::string key = "ctx" + std::to_string(ctx);
  const int wrs = (is_put ? 1 : 0) + (a.kind != kSigNone ? 1 : 0);
  if (is_put) {
    Count(key + ":puts");
    Count(key + ":bytes", op.bytes);
  }
  if (a.kind != kSigNone) Count(key + ":signals");
  Count(key + ":wrs", static_cast<uint64_t>(wrs));
  // In the emulator's own names, as nvshmem_emu's: between nodes RDMA, else NVLink.
  const std::string space = NodeOf(me) != NodeOf(peer) ? "rdma" : "peer";
  emu::note_remote_write(space == "rdma" ? emu::kLatRdma : emu::kLatPeer);
  if (is_put) {
    emu::add_counter("puts:" + space);
    emu::add_counter("put_bytes:" + space, op.bytes);
  }
  if (a.kind != kSigNone) emu::add_counter("signals:" + space);
  emu::add_counter("wrs:" + space, static_cast<uint64_t>(wrs));
  emu::note_chain(emu::kChainWr, static_cast<uint32_t>(wrs));
  emu::yield(emu::kYieldStore);
  Progress();
}

uint64_t Digest(std::initializer_list<uint64_t> vs) {
  uint64_t h = 0;
  for (uint64_t v : vs) h = Mix(h, v);
  return h;
}

uint64_t MaskBits(uint64_t v, int bits) { return bits >= 64 ? v : v & ((uint64_t{1} << bits) - 1); }

int SigSpace(const void* p) {
  auto it = S().sig_space.find(p);
  return it != S().sig_space.end() ? it->second : -1;
}

}  // namespace

// ---------------------------------------------------------------------------------------
// Device side.
void gin_check(ncclDevComm const& comm, int ctx) {
  const DevCommInfo* info = nullptr;
  if (Resolve(comm, &info) == nullptr) return;
  if (ctx < 0 || static_cast<uint32_t>(ctx) >= info->contexts)
    Fault("ncclGin on context " + std::to_string(ctx) + " of a devComm granted " +
          std::to_string(info->contexts) + " contexts (ginContextCount is a hint, host.h:50: "
          "read ncclDevComm::ginContextCount)");
}

void gin_put(ncclDevComm const& comm, int ctx, int peer, ncclWindow_t dst, size_t dst_off,
             ncclWindow_t src, size_t src_off, size_t bytes, ActionDesc remote, int counter,
             CoopDesc coop) {
  const uint64_t args = Digest({static_cast<uint64_t>(ctx), static_cast<uint64_t>(peer),
                                reinterpret_cast<uintptr_t>(dst), dst_off,
                                reinterpret_cast<uintptr_t>(src), src_off, bytes,
                                static_cast<uint64_t>(remote.kind),
                                reinterpret_cast<uintptr_t>(remote.win), remote.offset,
                                remote.value, static_cast<uint64_t>(counter)});
  Cooperative(coop, args, "ncclGin::put", [&] {
    Issue(comm, ctx, peer, true, dst, dst_off, src, src_off, bytes, remote, counter, coop);
  });
}

void gin_signal(ncclDevComm const& comm, int ctx, int peer, ActionDesc remote, CoopDesc coop) {
  const uint64_t args = Digest({static_cast<uint64_t>(ctx), static_cast<uint64_t>(peer),
                                static_cast<uint64_t>(remote.kind),
                                reinterpret_cast<uintptr_t>(remote.win), remote.offset,
                                remote.value});
  Cooperative(coop, args, "ncclGin::signal", [&] {
    Issue(comm, ctx, peer, false, nullptr, 0, nullptr, 0, 0, remote, -1, coop);
  });
}

// Processes (in queue order) every queued operation that a thread of the coop issued on
// this context; what it moves is consumed at the source, not settled (gin.h:234-235).
void gin_flush(ncclDevComm const& comm, int ctx, CoopDesc coop) {
  const uint64_t args = Digest({static_cast<uint64_t>(ctx)});
  Cooperative(coop, args, "ncclGin::flush", [&] {
    State& s = S();
    const DevCommInfo* info = nullptr;
    if (Resolve(comm, &info) == nullptr) return;
    Count("flushes");
    emu::note_complete_writes();
    const int dev = RunningDevice(), block = BlockLinear(), warp = WarpOf();
    auto mine = [&](const Op& op) {
      if (op.dev != dev || op.block != block) return false;
      return coop.cta || (op.warp == warp && (op.mask & coop.mask) != 0);
    };
    std::vector<Queue*> qs;
    for (auto& kv : s.queues) {
      const QueueKey& k = kv.first;
      if (std::get<0>(k) == comm._emuWorld && std::get<1>(k) == comm._emuDevComm &&
          std::get<2>(k) == comm.rank && std::get<4>(k) == ctx)
        qs.push_back(&kv.second);
    }
    std::shuffle(qs.begin(), qs.end(), s.rng);
    for (Queue* q : qs) {
      size_t last = 0;  // through the last of the coop's operations in this queue
      for (size_t i = 0; i < q->ops.size(); ++i)
        if (mine(q->ops[i])) last = i + 1;
      for (size_t i = 0; i < last; ++i) ProcessHead(*q);
    }
  });
  emu::yield(emu::kYieldFence);
}

uint64_t gin_read_signal(ncclDevComm const& comm, int ctx, ncclWindow_t w, size_t off, int bits) {
  (void)ctx;
  const DevCommInfo* info = nullptr;
  CommWorld* world = Resolve(comm, &info);
  if (world == nullptr) return 0;
  if (off % 8 != 0) {
    Fault("readSignal: offset " + std::to_string(off) + " is not 8-byte aligned");
    return 0;
  }
  const uint64_t* p = reinterpret_cast<const uint64_t*>(
      Translate(*world, w, comm._emuWorld, off, 8, comm.rank, "readSignal"));
  if (p == nullptr) return 0;
  return MaskBits(load_acquire(p), bits);
}

uint64_t gin_read_counter(ncclDevComm const& comm, int ctx, ncclGinCounter_t c, int bits) {
  (void)ctx;
  const DevCommInfo* info = nullptr;
  CommWorld* world = Resolve(comm, &info);
  if (world == nullptr) return 0;
  auto& cv = world->counters[{comm._emuDevComm, comm.rank}];
  if (c >= cv.size()) {
    Fault("readCounter: counter " + std::to_string(c) + " of a devComm with " +
          std::to_string(cv.size()) + " (ginCounterCount)");
    return 0;
  }
  emu::note_acquire_at(&cv[c], emu::kLatLocal);
  Count("polls");
  Progress();
  return MaskBits(cv[c], bits);
}

void gin_reset_signal(ncclDevComm const& comm, int ctx, ncclWindow_t w, size_t off) {
  (void)ctx;
  const DevCommInfo* info = nullptr;
  CommWorld* world = Resolve(comm, &info);
  if (world == nullptr) return;
  uint64_t* p = reinterpret_cast<uint64_t*>(
      Translate(*world, w, comm._emuWorld, off, 8, comm.rank, "resetSignal"));
  if (p != nullptr) atomicExch(reinterpret_cast<unsigned long long*>(p), 0ull);
}

void gin_reset_counter(ncclDevComm const& comm, int ctx, ncclGinCounter_t c) {
  (void)ctx;
  const DevCommInfo* info = nullptr;
  CommWorld* world = Resolve(comm, &info);
  if (world == nullptr) return;
  auto& cv = world->counters[{comm._emuDevComm, comm.rank}];
  if (c < cv.size()) cv[c] = 0;
}

uint64_t load_acquire(const uint64_t* p) {
  emu::note_acquire_at(p, SigSpace(p));
  Count("polls");
  Progress();
  emu::drain_own_stores();  // an acquire orders this thread's later accesses
  return *reinterpret_cast<const volatile uint64_t*>(p);
}

}  // namespace nccl_emu

using nccl_emu::S;

void* ncclGetLocalPointer(ncclWindow_t w, size_t offset) {
  if (!nccl_emu::ValidWindow(w)) {
    nccl_emu::Fault("ncclGetLocalPointer: not a window");
    return nullptr;
  }
  return w->base + offset;
}

// nullptr for a peer outside the caller's node: NCCL's load/store-accessible (LSA) team is
// the node's GPUs (core.h:104, ncclTeamLsa); the contract reads an unreachable peer as null.
void* ncclGetPeerPointer(ncclWindow_t w, size_t offset, int peer) {
  auto& s = S();
  if (!nccl_emu::ValidWindow(w)) {
    nccl_emu::Fault("ncclGetPeerPointer: not a window");
    return nullptr;
  }
  nccl_emu::CommWorld& world = *s.worlds[static_cast<size_t>(w->world)];
  if (peer < 0 || peer >= world.nranks) {
    nccl_emu::Fault("ncclGetPeerPointer: peer " + std::to_string(peer) + " of a world of " +
                    std::to_string(world.nranks));
    return nullptr;
  }
  if (nccl_emu::NodeOf(peer) != nccl_emu::NodeOf(w->rank)) return nullptr;
  return nccl_emu::Translate(world, w, w->world, offset, 1, peer, "ncclGetPeerPointer");
}

void* ncclGetPeerPointer(ncclWindow_t w, size_t offset, ncclTeam tm, int peer) {
  if (!nccl_emu::ValidWindow(w)) {
    nccl_emu::Fault("ncclGetPeerPointer: not a window");
    return nullptr;
  }
  return ncclGetPeerPointer(w, offset, w->rank + (peer - tm.rank) * tm.stride);  // core__funcs.h:173
}

// ---------------------------------------------------------------------------------------
// Host side.
ncclResult_t ncclGetVersion(int* version) {
  if (version == nullptr) return nccl_emu::Fail(ncclInvalidArgument, "ncclGetVersion: null");
  *version = NCCL_VERSION_CODE;
  return nccl_emu::Ok();
}

const char* ncclGetErrorString(ncclResult_t r) {
  switch (r) {
    case ncclSuccess: return "no error";
    case ncclUnhandledCudaError: return "unhandled cuda error (run with NCCL_DEBUG=INFO for details)";
    case ncclSystemError: return "unhandled system error (run with NCCL_DEBUG=INFO for details)";
    case ncclInternalError: return "internal error - please report this issue to the NCCL developers";
    case ncclInvalidArgument: return "invalid argument (run with NCCL_DEBUG=WARN for details)";
    case ncclInvalidUsage: return "invalid usage (run with NCCL_DEBUG=WARN for details)";
    case ncclRemoteError: return "remote process exited or there was a network error";
    case ncclInProgress: return "NCCL operation in progress";
    case ncclTimeout: return "NCCL operation timed out";
    default: return "unknown result code";
  }
}

const char* ncclGetLastError(ncclComm_t comm) {
  if (comm != nullptr && S().comms.count(comm)) return comm->last_error.c_str();
  return S().last_error.c_str();
}

ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
  if (id == nullptr) return nccl_emu::Fail(ncclInvalidArgument, "ncclGetUniqueId: null id");
  std::memset(id->internal, 0, sizeof(id->internal));
  const std::string t = "jax-ep emulated nccl " + std::to_string(++S().uid_serial);
  std::memcpy(id->internal, t.data(), t.size());
  return nccl_emu::Ok();
}

// nccl.h:287-291: "rank must be between 0 and nranks-1 and unique within a communicator
// clique. Each rank is associated to a CUDA device, which has to be set before calling";
// it "implicitly syncronizes with other ranks": here it returns at once (one host thread
// starts every rank, inside a group or not) and the device-side calls need the peers.
ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank) {
  using nccl_emu::Fail;
  auto& s = S();
  if (comm == nullptr) return Fail(ncclInvalidArgument, "ncclCommInitRank: comm is null");
  *comm = nullptr;
  const std::string uid(commId.internal, sizeof(commId.internal));
  if (nranks < 1 || nranks > s.cfg.num_ranks)
    return Fail(ncclInvalidArgument,
                "ncclCommInitRank: nranks " + std::to_string(nranks) + " outside [1, " +
                    std::to_string(s.cfg.num_ranks) + "] (the emulated world's num_ranks)");
  if (rank < 0 || rank >= nranks)
    return Fail(ncclInvalidArgument, "ncclCommInitRank: rank " + std::to_string(rank) +
                                         " out of range [0, " + std::to_string(nranks) + ")");
  nccl_emu::CommWorld* w = nullptr;
  int wi = -1;
  for (size_t i = 0; i < s.worlds.size(); ++i)
    if (s.worlds[i]->uid == uid) {
      w = s.worlds[i].get();
      wi = static_cast<int>(i);
    }
  if (w != nullptr && w->nranks != nranks)
    return Fail(ncclInvalidArgument, "ncclCommInitRank: mismatched nranks: rank " +
                                         std::to_string(rank) + " passes " +
                                         std::to_string(nranks) + ", earlier ranks of this "
                                         "ncclUniqueId passed " + std::to_string(w->nranks));
  const int dev = emu::current_device();
  if (w != nullptr) {
    const ncclComm* had = w->ranks[static_cast<size_t>(rank)];
    if (had != nullptr)
      return Fail(ncclInvalidUsage, "ncclCommInitRank: duplicate rank " + std::to_string(rank) +
                                        " (already initialized on virtual GPU " +
                                        std::to_string(had->device) + ")");
    for (const ncclComm* c : w->ranks)
      if (c != nullptr && c->device == dev)
        return Fail(ncclInvalidUsage, "ncclCommInitRank: duplicate GPU: virtual GPU " +
                                          std::to_string(dev) + " already holds rank " +
                                          std::to_string(c->rank) + " of this ncclUniqueId");
  } else {
    s.worlds.push_back(std::make_unique<nccl_emu::CommWorld>());
    w = s.worlds.back().get();
    wi = static_cast<int>(s.worlds.size() - 1);
    w->uid = uid;
    w->nranks = nranks;
    w->ranks.assign(static_cast<size_t>(nranks), nullptr);
    w->windows.assign(static_cast<size_t>(nranks), {});
  }
  s.comm_store.push_back(std::make_unique<ncclComm>());
  ncclComm* c = s.comm_store.back().get();
  c->world = wi;
  c->rank = rank;
  c->nranks = nranks;
  c->device = dev;
  c->live = true;
  w->ranks[static_cast<size_t>(rank)] = c;
  s.comms.insert(c);
  if (cudaMemcpyToSymbol(nccl_emu::g_nccl_dev, &dev, sizeof(dev)) != cudaSuccess)
    return Fail(ncclUnhandledCudaError, "ncclCommInitRank: cudaMemcpyToSymbol failed");
  *comm = c;
  return nccl_emu::Ok();
}

ncclResult_t ncclGroupStart() {
  auto& s = S();
  if (s.group_depth++ == 0) s.group_error = ncclSuccess;
  return nccl_emu::Ok();
}

ncclResult_t ncclGroupEnd() {
  auto& s = S();
  if (s.group_depth == 0)
    return nccl_emu::Fail(ncclInvalidUsage, "ncclGroupEnd without ncclGroupStart");
  if (--s.group_depth > 0) return ncclSuccess;
  const ncclResult_t r = s.group_error;
  s.group_error = ncclSuccess;
  return r;  // the failing call's text stays in last_error()
}

ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  if (!nccl_emu::ValidComm(comm)) return nccl_emu::BadComm("ncclCommDestroy");
  auto& s = S();
  nccl_emu::CommWorld& w = *s.worlds[static_cast<size_t>(comm->world)];
  comm->live = false;
  for (ncclWindow_vidmem* win : comm->windows) win->live = false;
  for (auto& kv : w.devcomm_live)
    if (kv.first.second == comm->rank) kv.second = false;
  w.ranks[static_cast<size_t>(comm->rank)] = nullptr;
  w.windows[static_cast<size_t>(comm->rank)].clear();
  s.comms.erase(comm);
  return nccl_emu::Ok();
}

ncclResult_t ncclCommCount(const ncclComm_t comm, int* count) {
  if (!nccl_emu::ValidComm(comm)) return nccl_emu::BadComm("ncclCommCount");
  *count = comm->nranks;
  return nccl_emu::Ok();
}

ncclResult_t ncclCommUserRank(const ncclComm_t comm, int* rank) {
  if (!nccl_emu::ValidComm(comm)) return nccl_emu::BadComm("ncclCommUserRank");
  *rank = comm->rank;
  return nccl_emu::Ok();
}

ncclResult_t ncclCommCuDevice(const ncclComm_t comm, int* device) {
  if (!nccl_emu::ValidComm(comm)) return nccl_emu::BadComm("ncclCommCuDevice");
  *device = comm->device;
  return nccl_emu::Ok();
}

ncclResult_t ncclMemAlloc(void** ptr, size_t size) {
  if (ptr == nullptr || size == 0)
    return nccl_emu::Fail(ncclInvalidArgument, "ncclMemAlloc: null pointer or size 0");
  void* p = nullptr;
  if (cudaMalloc(&p, size) != cudaSuccess)
    return nccl_emu::Fail(ncclUnhandledCudaError, "ncclMemAlloc: cudaMalloc failed");
  // Other GPUs of the node store into it through ncclGetPeerPointer: those stores are weak
  // (buffered per writing thread until its fence or release), as into nvshmem_malloc's.
  emu::mark_peer_memory(p, size);
  S().allocs[p] = size;
  S().marked.insert(p);
  *ptr = p;
  return nccl_emu::Ok();
}

ncclResult_t ncclMemFree(void* ptr) {
  auto& s = S();
  auto it = s.allocs.find(ptr);
  if (it == s.allocs.end())
    return nccl_emu::Fail(ncclInvalidArgument, "ncclMemFree: not a pointer ncclMemAlloc returned");
  emu::unmark_peer_memory(ptr);
  s.marked.erase(ptr);
  cudaFree(ptr);
  s.allocs.erase(it);
  return nccl_emu::Ok();
}

ncclResult_t ncclCommWindowRegister(ncclComm_t comm, void* buff, size_t size, ncclWindow_t* win,
                                    int winFlags) {
  using nccl_emu::Fail;
  if (!nccl_emu::ValidComm(comm)) return nccl_emu::BadComm("ncclCommWindowRegister");
  if (buff == nullptr || size == 0 || win == nullptr)
    return Fail(ncclInvalidArgument, "ncclCommWindowRegister: null buffer, size 0 or null win",
                comm);
  // The device API's windows (LSA pointers, GIN) are symmetric registrations.
  if ((winFlags & NCCL_WIN_COLL_SYMMETRIC) == 0)
    return Fail(ncclInvalidArgument,
                "ncclCommWindowRegister: the emulated device API needs NCCL_WIN_COLL_SYMMETRIC",
                comm);
  auto& s = S();
  nccl_emu::CommWorld& w = *s.worlds[static_cast<size_t>(comm->world)];
  const size_t k = comm->windows.size();
  for (int r = 0; r < w.nranks; ++r) {
    const auto& other = w.windows[static_cast<size_t>(r)];
    if (r != comm->rank && k < other.size() && other[k]->live && other[k]->size != size)
      return Fail(ncclInvalidArgument,
                  "ncclCommWindowRegister: window size mismatch: rank " +
                      std::to_string(comm->rank) + " registers window " + std::to_string(k) +
                      " with " + std::to_string(size) + " bytes, rank " + std::to_string(r) +
                      " with " + std::to_string(other[k]->size),
                  comm);
  }
  if (!s.marked.count(buff)) {  // peers' stores into it are weak, whoever allocated it
    emu::mark_peer_memory(buff, size);
    s.marked.insert(buff);
  }
  s.window_store.push_back(std::make_unique<ncclWindow_vidmem>(
      ncclWindow_vidmem{comm->world, comm->rank, static_cast<int>(k), static_cast<char*>(buff),
                        size, true}));
  ncclWindow_vidmem* v = s.window_store.back().get();
  comm->windows.push_back(v);
  w.windows[static_cast<size_t>(comm->rank)].push_back(v);
  s.windows.insert(v);
  *win = v;
  return nccl_emu::Ok();
}

ncclResult_t ncclCommWindowDeregister(ncclComm_t comm, ncclWindow_t win) {
  if (!nccl_emu::ValidComm(comm)) return nccl_emu::BadComm("ncclCommWindowDeregister");
  if (!nccl_emu::ValidWindow(win) || win->world != comm->world || win->rank != comm->rank)
    return nccl_emu::Fail(ncclInvalidArgument,
                          "ncclCommWindowDeregister: not a window of this communicator", comm);
  win->live = false;
  return nccl_emu::Ok();
}

ncclResult_t ncclDevCommCreate(ncclComm_t comm, ncclDevCommRequirements_t const* reqs,
                               ncclDevComm_t* out) {
  using nccl_emu::Fail;
  if (!nccl_emu::ValidComm(comm)) return nccl_emu::BadComm("ncclDevCommCreate");
  if (reqs == nullptr || out == nullptr)
    return Fail(ncclInvalidArgument, "ncclDevCommCreate: null requirements or devComm", comm);
  if (reqs->size != sizeof(ncclDevCommRequirements_t) || reqs->magic != NCCL_API_MAGIC)
    return Fail(ncclInvalidArgument,
                "ncclDevCommCreate: requirements not set up with "
                "NCCL_DEV_COMM_REQUIREMENTS_INITIALIZER",
                comm);
  const ncclGinConnectionType_t conn = reqs->ginConnectionType;
  if (conn != NCCL_GIN_CONNECTION_NONE && conn != NCCL_GIN_CONNECTION_FULL &&
      conn != NCCL_GIN_CONNECTION_RAIL)
    return Fail(ncclInvalidArgument,
                "ncclDevCommCreate: only NONE, FULL and RAIL GIN connections are emulated", comm);
  if (conn != NCCL_GIN_CONNECTION_NONE && reqs->ginContextCount < 1)
    return Fail(ncclInvalidArgument, "ncclDevCommCreate: ginContextCount < 1", comm);
  if (reqs->ginSignalCount < 0 || reqs->ginCounterCount < 0)
    return Fail(ncclInvalidArgument, "ncclDevCommCreate: negative signal or counter count", comm);
  auto& s = S();
  nccl_emu::CommWorld& w = *s.worlds[static_cast<size_t>(comm->world)];
  const int k = comm->devcomms;
  // host.h:50, "This is a hint, the actual context count in the devcomm may not match".
  nccl_emu::DevCommInfo info{conn,
                             conn == NCCL_GIN_CONNECTION_NONE
                                 ? 0u
                                 : static_cast<uint32_t>(std::max(
                                       1, std::min(reqs->ginContextCount, s.cfg.max_contexts))),
                             reqs->ginContextCount, reqs->ginSignalCount, reqs->ginCounterCount};
  if (k < static_cast<int>(w.devcomms.size())) {
    const nccl_emu::DevCommInfo& had = w.devcomms[static_cast<size_t>(k)];
    if (had.conn != info.conn || had.requested != info.requested ||
        had.counters != info.counters || had.signals != info.signals)
      return Fail(ncclInvalidUsage,
                  "ncclDevCommCreate: rank " + std::to_string(comm->rank) + "'s devComm " +
                      std::to_string(k) + " asks for other connections, contexts, signals or "
                      "counters than an earlier rank's",
                  comm);
  } else {
    w.devcomms.push_back(info);
  }
  comm->devcomms = k + 1;
  w.devcomm_live[{k, comm->rank}] = true;
  w.counters[{k, comm->rank}].assign(static_cast<size_t>(info.counters), 0);
  const int g = std::min(nccl_emu::Gpn(), comm->nranks);
  ncclDevComm d{};
  d.magic = NCCL_API_MAGIC;
  d.version = NCCL_VERSION_CODE;
  d.rank = comm->rank;
  d.nRanks = comm->nranks;
  d.lsaSize = g;
  d.lsaRank = comm->rank % g;
  d.ginSignalCount = info.signals;
  d.ginCounterCount = info.counters;
  d.ginContextCount = info.contexts;
  d._emuConnection = conn;
  d._emuWorld = comm->world;
  d._emuDevComm = k;
  *out = d;
  return nccl_emu::Ok();
}

ncclResult_t ncclDevCommDestroy(ncclComm_t comm, ncclDevComm_t const* devComm) {
  if (!nccl_emu::ValidComm(comm)) return nccl_emu::BadComm("ncclDevCommDestroy");
  auto& w = *S().worlds[static_cast<size_t>(comm->world)];
  if (devComm == nullptr || devComm->_emuWorld != comm->world || devComm->rank != comm->rank ||
      !w.devcomm_live[{devComm->_emuDevComm, comm->rank}])
    return nccl_emu::Fail(ncclInvalidArgument,
                          "ncclDevCommDestroy: not a live devComm of this communicator", comm);
  w.devcomm_live[{devComm->_emuDevComm, comm->rank}] = false;
  return nccl_emu::Ok();
}

ncclTeam_t ncclTeamWorld(ncclComm_t comm) {
  if (!nccl_emu::ValidComm(comm)) return ncclTeam{0, -1, 1};
  return ncclTeam{comm->nranks, comm->rank, 1};
}

// ---------------------------------------------------------------------------------------
// Control.
namespace nccl_emu {

void reset(const WorldConfig& c) {
  State& s = S();
  s.cfg = c;
  s.worlds.clear();
  s.comms.clear();
  s.windows.clear();
  s.comm_store.clear();
  s.window_store.clear();
  s.queues.clear();
  s.rng.seed(c.seed);
  s.step = 0;
  s.queued = 0;
  s.unsettled = 0;
  s.seq = 0;
  s.log.clear();
  ++s.log_epoch;
  s.counters.clear();
  s.call = 0;
  s.ports.clear();
  s.group_depth = 0;
  s.group_error = ncclSuccess;
  s.last_error.clear();
  s.sig_space.clear();
  // Queued operations and unsettled data move only at later steps: the scheduler is not
  // idle while they exist (nor while the emulated NVSHMEM's do; the emulator has one probe).
  emu::set_pending_probe([] { return pending() > 0 || nvshmem_emu::pending() > 0; });
}

void grow(int num_ranks) {
  if (num_ranks > S().cfg.num_ranks) S().cfg.num_ranks = num_ranks;
}

const WorldConfig& world_config() { return S().cfg; }
std::string last_error() { return S().last_error; }
void set_context_ports(int rank, std::vector<int> ports) { S().ports[rank] = std::move(ports); }
// Data left unsettled by the previous call lands first: the hardware settles a put within
// microseconds, far less than the time between two calls.
void set_call(int64_t call) {
  for (auto& kv : S().queues) SettleAll(kv.second);
  S().call = call;
}
const std::vector<LogRecord>& log() { return S().log; }
void clear_log() {
  S().log.clear();
  ++S().log_epoch;
  S().counters.clear();
}
std::map<std::string, uint64_t> counters() { return S().counters; }
int64_t pending() { return S().queued + S().unsettled; }

void drain() {
  State& s = S();
  for (auto& kv : s.queues)
    while (!kv.second.ops.empty()) ProcessHead(kv.second);
  for (auto& kv : s.queues) SettleAll(kv.second);
}

void* host_symbol(const char* name) {
  static const std::map<std::string, void*> table = {
      {"ncclGetVersion", reinterpret_cast<void*>(&ncclGetVersion)},
      {"ncclGetErrorString", reinterpret_cast<void*>(&ncclGetErrorString)},
      {"ncclGetLastError", reinterpret_cast<void*>(&ncclGetLastError)},
      {"ncclGetUniqueId", reinterpret_cast<void*>(&ncclGetUniqueId)},
      {"ncclCommInitRank", reinterpret_cast<void*>(&ncclCommInitRank)},
      {"ncclGroupStart", reinterpret_cast<void*>(&ncclGroupStart)},
      {"ncclGroupEnd", reinterpret_cast<void*>(&ncclGroupEnd)},
      {"ncclCommDestroy", reinterpret_cast<void*>(&ncclCommDestroy)},
      {"ncclCommCount", reinterpret_cast<void*>(&ncclCommCount)},
      {"ncclCommUserRank", reinterpret_cast<void*>(&ncclCommUserRank)},
      {"ncclCommCuDevice", reinterpret_cast<void*>(&ncclCommCuDevice)},
      {"ncclMemAlloc", reinterpret_cast<void*>(&ncclMemAlloc)},
      {"ncclMemFree", reinterpret_cast<void*>(&ncclMemFree)},
      {"ncclCommWindowRegister", reinterpret_cast<void*>(&ncclCommWindowRegister)},
      {"ncclCommWindowDeregister", reinterpret_cast<void*>(&ncclCommWindowDeregister)},
      {"ncclDevCommCreate", reinterpret_cast<void*>(&ncclDevCommCreate)},
      {"ncclDevCommDestroy", reinterpret_cast<void*>(&ncclDevCommDestroy)},
      {"ncclTeamWorld",
       reinterpret_cast<void*>(static_cast<ncclTeam_t (*)(ncclComm_t)>(&ncclTeamWorld))},
  };
  auto it = table.find(name);
  return it != table.end() ? it->second : nullptr;
}

}  // namespace nccl_emu
