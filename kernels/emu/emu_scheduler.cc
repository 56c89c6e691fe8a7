// The emulated GPU's runtime (kernels/emu/emu_internal.h): the deterministic seeded
// scheduler (virtual GPUs, their streams' operations, block admission under co-residency
// limits from the occupancy table, the ready, parked and sleeping sets, the virtual
// clock, idle fast-forward, deadlock and hang detection), kernel launches, and the
// control calls of kernels/emu/emu_control.h that set it up. Model: docs/emulator.md.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/emu/emu_internal.h"
#include "kernels/emu/occupancy.h"

namespace emu {

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

// Hardware queues. A GPU takes work from the host through CUDA_DEVICE_MAX_CONNECTIONS
// queues (default 8; CUDA C++ Programming Guide, "CUDA Environment Variables"), and the
// driver gives streams the queues round-robin in the order it creates them, so with more
// streams than queues, streams share one. A queue issues its commands in the order they
// were enqueued, and a command that must wait (for the previous operation of its own
// stream, or for an event) holds back every later command of the queue, whatever its
// stream: the "false dependencies" between streams that share a hardware queue (NVIDIA,
// Kepler GK110 whitepaper, "Hyper-Q"; the MPS documentation calls the queues "work
// queues"). Here each device's default stream is its first stream (queue 0), and a reset
// (configure) renumbers the streams alive in their creation order.
Stream* NewStream(Device* d) {
  auto* st = new Stream{d, {}, false};
  st->queue = static_cast<int>(d->streams_made++ % d->queues.size());
  d->streams.push_back(st);
  return st;
}

void PushOp(Stream* st, Op op) {
  op.seq = ++S().op_seq;
  st->dev->queues[st->queue].push_back(op.seq);
  st->ops.push_back(std::move(op));
}

namespace {
// Whether the head operation of `st` is the oldest one of its hardware queue not issued.
bool QueueFront(const Stream* st, const Op& op) {
  const std::deque<uint64_t>& q = st->dev->queues[st->queue];
  return !q.empty() && q.front() == op.seq;
}
void QueueIssue(Stream* st) { st->dev->queues[st->queue].pop_front(); }
}  // namespace

// ---- ready sets ----
namespace {
void ReadyAdd(Block* b) {
  if (b->parked_until > S().now_ns) return;  // runnable again when it is unparked
  SetAdd<Block, &Block::ready_pos>(S().ready, b);
}
void ReadyRemove(Block* b) { SetRemove<Block, &Block::ready_pos>(S().ready, b); }
}  // namespace

void MakeRunnable(Fiber* f) {
  if (f->state != FState::kNew) f->state = FState::kRunnable;
  f->blk->runnable.push_back(f);
  ReadyAdd(f->blk);
}

namespace {
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
}  // namespace

// ---- co-residency ----
namespace {
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
  // An instance without a row of its own (a table from before the instance existed)
  // takes its name's worst-of-all row.
  const size_t at = name.find('@');
  return at == std::string::npos ? nullptr : FindOccupancy(name.substr(0, at));
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
}  // namespace

// What the counters call a kernel: its spelling without the launch bound (emu::bound_name);
// every counter that names a kernel (kernel:..., warp_mrounds:...) uses it, so the model
// finds one kernel's counters under one name.
std::string CounterName(const char* spelled) {
  const char* at = std::strchr(spelled, '@');
  return at == nullptr ? std::string(spelled) : std::string(spelled, at);
}

// ---- scheduling ----
namespace {
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
  CountDev(k->dev->id, "kernel:" + CounterName(k->spec.name) + ":blocks");
  CountDev(k->dev->id, "kernel:" + CounterName(k->spec.name) + ":warps", b->warps.size());
  CountDev(k->dev->id, "kernel:" + CounterName(k->spec.name) + ":threads", n);
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
  CountWarpRounds(b);
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
        if (op.kind == Op::kKernel && st->head_started) break;  // running
        if (!QueueFront(st, op)) break;  // behind another stream's command in its queue
        if (op.kind == Op::kKernel) {
          QueueIssue(st);
          st->head_started = true;
          progress = true;
          CountDev(d->id, "kernel:" + CounterName(op.kernel->spec.name) + ":launches");
          break;
        }
        if (op.kind == Op::kWait && op.ev->completed < op.ticket) break;
        QueueIssue(st);
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
  for (Device* d : s.devices) {
    for (Stream* st : d->streams) {
      st->ops.clear();
      st->head_started = false;
      d->resident = 0;
      d->load = 0;
    }
    for (auto& q : d->queues) q.clear();
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
      if (!st->ops.empty() && st->ops.front().kind == Op::kKernel) {
        out += " gpu" + std::to_string(d->id) + ":" + st->ops.front().kernel->spec.name;
        if (!st->head_started && !QueueFront(st, st->ops.front()))
          out += " (not started: behind another stream's command in hardware queue " +
                 std::to_string(st->queue) + ")";
      }
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
}  // namespace

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

namespace {
bool DeviceIdle(Device* d) {
  for (Stream* st : d->streams)
    if (!st->ops.empty()) return false;
  return true;
}
}  // namespace

void SyncDevice(Device* d) {
  RunUntil([d] { return DeviceIdle(d); });
}

namespace {
void ResetAll(const Config& c) {
  State& s = S();
  if (c.connections < 1 || c.connections > 32)
    throw std::invalid_argument("emu: connections (CUDA_DEVICE_MAX_CONNECTIONS) must be in [1, 32]");
  for (Device* d : s.devices) {
    d->queues.assign(static_cast<size_t>(c.connections), {});
    d->streams_made = 0;
    for (Stream* st : d->streams) {
      st->ops.clear();
      st->head_started = false;
      st->queue = static_cast<int>(d->streams_made++ % d->queues.size());
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
  s.rules_rng.seed(c.seed ^ 0x27d4eb2fu);
  while (static_cast<int>(s.devices.size()) < c.num_devices) {
    auto* d = new Device();
    d->id = static_cast<int>(s.devices.size());
    d->queues.assign(static_cast<size_t>(c.connections), {});
    NewStream(d);  // its default stream
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
}  // namespace

void EnsureInit() {
  if (S().devices.empty()) ResetAll(Config{});
}

// ---------------------------------------------------------------------------------------
// Device-side entry points: sleeps and the clocks.
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

// ---------------------------------------------------------------------------------------
// Launches.
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
  PushOp(st, std::move(op));
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

const char* bound_name(const char* name, int bound) {
  static std::mutex mu;
  static auto* names = new std::set<std::string>();
  std::lock_guard<std::mutex> lock(mu);
  return names->insert(std::string(name) + "@" + std::to_string(bound)).first->c_str();
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

bool shared_by_pointer() { return TlsByPointer(); }
int num_streams() {
  size_t n = 0;
  for (const Device* d : S().devices) n += d->streams.size();
  return static_cast<int>(n);
}
int current_device() { return S().current; }

}  // namespace emu
