// Emulated NVSHMEM (kernels/emu/nvshmem_emu.h): symmetric heaps over the virtual GPUs'
// memory and a transport that queues every put and signal per (source, destination, QP)
// and delivers them later, in order within a queue, in a seeded random order across them.
#include "kernels/emu/nvshmem_emu.h"

#include <cstring>
#include <deque>
#include <map>
#include <random>
#include <tuple>

#include "kernels/emu/emu_control.h"
#include "kernels/emu/emu_cuda.h"

namespace nvshmem_emu {
namespace {

// Logical QP of a handle (handles are deliberately not the QP numbers, so a kernel that
// passes a logical QP where a handle belongs is caught).
constexpr int kHandleBase = 1000;
constexpr int kHandleStride = 7;

struct Alloc {
  char* base;
  size_t bytes;
};

struct Pe {
  bool initialized = false;
  std::vector<Alloc> heap;  // k-th symmetric allocation of this PE (nullptr once freed)
  int num_handles = 0;
  std::vector<nvshmemx_qp_handle_t> handles;
};

struct Op {
  int src;
  int dst_pe;
  char* dst;            // on the destination PE
  const char* src_ptr;  // read at delivery
  size_t bytes;
  uint64_t* sig;        // on the destination PE, or null
  uint64_t value;
  int sig_op;
  uint64_t ready;       // transport step from which it may be delivered
};

struct Queue {
  std::deque<Op> ops;
};

// The data of a delivered put-with-signal that a relaxed poll on the destination may not
// see yet (its bytes as read from the source at delivery).
struct Late {
  char* dst;
  std::vector<char> bytes;
};

struct World {
  WorldConfig cfg;
  std::vector<Pe> pes;
  std::map<std::tuple<int, int, int>, Queue> queues;  // (src, dst, qp slot)
  std::mt19937_64 rng{1};
  uint64_t step = 0;
  int64_t pending = 0;
  std::vector<PutRecord> log;
  std::map<std::string, uint64_t> counters;
  int64_t call = 0;
  std::map<int, std::deque<Late>> late;  // per destination PE, in delivery order
};

World& W() {
  static World w;
  return w;
}

// This virtual GPU's PE, in the device-global section (one copy per virtual GPU), so
// device code finds its own PE; host code goes by the current device.
JEP_EMU_DEVICE_GLOBAL int g_emu_pe = -1;

int CurrentPe() {
  const int d = emu::g_ctx != nullptr ? g_emu_pe : emu::current_device();
  World& w = W();
  if (d < 0 || d >= static_cast<int>(w.pes.size())) {
    emu::fault("nvshmem: called from a virtual GPU outside the emulated world");
    return 0;
  }
  return d;
}

// The PE and symmetric allocation index of `p` on PE `pe`; false if it is not in its heap.
bool Locate(int pe, const void* p, size_t* index, size_t* offset) {
  const char* c = static_cast<const char*>(p);
  const std::vector<Alloc>& h = W().pes[pe].heap;
  for (size_t k = 0; k < h.size(); ++k) {
    if (h[k].base != nullptr && c >= h[k].base && c < h[k].base + h[k].bytes) {
      *index = k;
      *offset = static_cast<size_t>(c - h[k].base);
      return true;
    }
  }
  return false;
}

// `sym` (an address in the calling PE's heap) as the same object on `pe`.
char* Translate(const void* sym, int pe, size_t bytes) {
  World& w = W();
  if (pe < 0 || pe >= static_cast<int>(w.pes.size())) {
    emu::fault("nvshmem: destination PE out of range");
    return nullptr;
  }
  size_t k = 0, off = 0;
  if (!Locate(CurrentPe(), sym, &k, &off)) {
    emu::fault("nvshmem: a symmetric address outside the calling PE's heap");
    return nullptr;
  }
  const std::vector<Alloc>& h = w.pes[pe].heap;
  if (k >= h.size() || h[k].base == nullptr || off + bytes > h[k].bytes) {
    emu::fault("nvshmem: the destination range leaves the symmetric allocation");
    return nullptr;
  }
  return h[k].base + off;
}

// Counted here and in the emulator's counters ("nvshmem:<name>").
void Count(const std::string& k, uint64_t v = 1) {
  W().counters[k] += v;
  emu::add_counter("nvshmem:" + k, v);
}

// Makes every late payload into `pe` visible, in delivery order.
void FlushLate(int pe) {
  auto it = W().late.find(pe);
  if (it == W().late.end()) return;
  emu::note_work();
  for (const Late& l : it->second) std::memcpy(l.dst, l.bytes.data(), l.bytes.size());
  W().late.erase(it);
}

// A put's source bytes are read here, at delivery (a source reused before quiet corrupts
// it). A put-with-signal's signal is ordered after its data for an acquiring reader only:
// in some seeds the data stays late until the destination acquires (load_acquire), the
// destination receives anything else, or someone quiets, so a relaxed poll that sees the
// signal and reads at once reads stale bytes.
void Apply(const Op& op, int dst_pe) {
  emu::note_work();
  FlushLate(dst_pe);  // an earlier payload never lands over a later one
  if (op.bytes > 0 && op.sig != nullptr && std::bernoulli_distribution(0.5)(W().rng)) {
    Late l{op.dst, std::vector<char>(op.src_ptr, op.src_ptr + op.bytes)};
    W().late[dst_pe].push_back(std::move(l));
  } else if (op.bytes > 0) {
    std::memcpy(op.dst, op.src_ptr, op.bytes);
  }
  if (op.sig != nullptr) {
    if (op.sig_op == NVSHMEM_SIGNAL_ADD)
      *op.sig += op.value;
    else
      *op.sig = op.value;
  }
}

// Delivers the head of `q` (its data, then its signal).
void DeliverHead(Queue& q) {
  Op op = q.ops.front();
  q.ops.pop_front();
  --W().pending;
  Count("deliveries");
  Apply(op, op.dst_pe);
}

// One transport step: maybe deliver one ready operation, chosen at random among the
// queues whose head is ready.
void Progress() {
  World& w = W();
  ++w.step;
  if (w.pending == 0) return;
  std::vector<Queue*> ready;
  for (auto& kv : w.queues)
    if (!kv.second.ops.empty() && kv.second.ops.front().ready <= w.step)
      ready.push_back(&kv.second);
  if (ready.empty()) return;
  std::uniform_int_distribution<size_t> pick(0, ready.size() - 1);
  DeliverHead(*ready[pick(w.rng)]);
}

// Lowest active lane of the calling warp issues a warp-wide call once.
bool WarpLeader() {
  const unsigned mask = __activemask();
  const int lane = static_cast<int>(threadIdx.x & 31);
  return mask == 0 || lane == __ffs(mask) - 1;
}

// Logical QP and the queue slot of a call: handle >= 0 is an explicit QP handle.
int QpOfHandle(nvshmemx_qp_handle_t h) {
  const int q = (h - kHandleBase) / kHandleStride;
  if (h < kHandleBase || (h - kHandleBase) % kHandleStride != 0 ||
      q >= W().pes[CurrentPe()].num_handles) {
    emu::fault("nvshmem: a QP handle nvshmemx_qp_create did not return");
    return 0;
  }
  return q;
}

void Enqueue(int src, int dst_pe, int qp, int handle, void* dst, const void* src_ptr,
             size_t bytes, uint64_t* sig, uint64_t value, int sig_op, bool is_put) {
  World& w = W();
  Op op;
  op.src = src;
  op.dst_pe = dst_pe;
  op.dst = bytes > 0 ? Translate(dst, dst_pe, bytes) : nullptr;
  op.src_ptr = static_cast<const char*>(src_ptr);
  op.bytes = op.dst != nullptr ? bytes : 0;
  op.sig = sig != nullptr ? reinterpret_cast<uint64_t*>(Translate(sig, dst_pe, 8)) : nullptr;
  op.value = value;
  op.sig_op = sig_op;
  std::uniform_int_distribution<int> delay(0, w.cfg.max_delay > 0 ? w.cfg.max_delay : 0);
  op.ready = w.step + static_cast<uint64_t>(delay(w.rng));
  // Without a handle NVSHMEM picks the QP itself (by CTA); the emulator keeps one queue.
  const int slot = handle >= 0 ? qp : -1;
  w.queues[{src, dst_pe, slot}].ops.push_back(op);
  ++w.pending;
  const std::string key = handle >= 0 ? "qp" + std::to_string(qp) : std::string("fallback");
  // By space as well, in the emulator's own names: a put between nodes is RDMA, one to a
  // PE of the same node travels over NVLink ("peer").
  const int g = w.cfg.gpus_per_node > 0 ? w.cfg.gpus_per_node : 1;
  const std::string space = src / g != dst_pe / g ? "rdma" : "peer";
  if (is_put) {
    emu::add_counter("puts:" + space);
    emu::add_counter("put_bytes:" + space, bytes);
    emu::add_counter("wrs:" + space, sig != nullptr ? 2 : 1);
    emu::note_chain(emu::kChainWr, sig != nullptr ? 2 : 1);
    if (sig != nullptr) emu::add_counter("signals:" + space);
  } else {
    emu::add_counter("signals:" + space);
    emu::add_counter("wrs:" + space);
    emu::note_chain(emu::kChainWr);
  }
  if (is_put) {
    PutRecord r;
    r.src = src;
    r.dst = dst_pe;
    r.handle = handle;
    r.qp = handle >= 0 ? qp : -1;
    r.port = handle >= 0 ? qp % (w.cfg.num_ports > 0 ? w.cfg.num_ports : 1) : -1;
    r.block = static_cast<int>(blockIdx.x);
    r.bytes = static_cast<int64_t>(bytes);
    r.sig_op = sig != nullptr ? sig_op : -1;
    r.call = w.call;
    w.log.push_back(r);
    Count(key + ":puts");
    Count(key + ":bytes", bytes);
    Count(key + ":wrs", sig != nullptr ? 2 : 1);  // a put-with-signal is a write + an atomic
    if (sig != nullptr) Count(key + ":signals");
  } else {
    Count(key + ":signals");
    Count(key + ":wrs");
  }
  emu::yield(emu::kYieldStore);
  Progress();
}

void Put(void* dst, const void* src, size_t bytes, uint64_t* sig, uint64_t value, int op,
         int pe, int handle, bool warp) {
  if (!warp || WarpLeader()) {
    const int me = CurrentPe();
    const int qp = handle >= 0 ? QpOfHandle(handle) : -1;
    Enqueue(me, pe, qp, handle, dst, src, bytes, sig, value, op, true);
  }
  if (warp) __syncwarp(__activemask());
}

}  // namespace

void reset(const WorldConfig& c) {
  World& w = W();
  w.cfg = c;
  w.pes.assign(static_cast<size_t>(c.num_pes > 0 ? c.num_pes : 0), Pe{});
  w.queues.clear();
  w.rng.seed(c.seed);
  w.step = 0;
  w.pending = 0;
  w.log.clear();
  w.counters.clear();
  w.late.clear();
  // Undelivered operations reach their destinations only at later transport steps.
  emu::set_pending_probe([] { return W().pending > 0; });
}

void grow(int num_pes) {
  World& w = W();
  if (num_pes > static_cast<int>(w.pes.size())) w.pes.resize(static_cast<size_t>(num_pes));
}

const WorldConfig& world_config() { return W().cfg; }
void set_call(int64_t call) { W().call = call; }
const std::vector<PutRecord>& put_log() { return W().log; }
void clear_log() {
  W().log.clear();
  W().counters.clear();
}
std::map<std::string, uint64_t> counters() { return W().counters; }
int64_t pending() { return W().pending; }

uint64_t load_acquire(const uint64_t* p) {
  emu::note_acquire();
  Count("polls");
  Progress();
  emu::drain_own_stores();  // an acquire orders this thread's later accesses (not a fence)
  const int me = CurrentPe();
  const uint64_t v = *reinterpret_cast<const volatile uint64_t*>(p);
  FlushLate(me);  // what the value just read guards is visible to the acquirer
  return v;
}

void* host_symbol(const char* name) {
  if (std::strcmp(name, "nvshmemx_init_status") == 0)
    return reinterpret_cast<void*>(&nvshmemx_init_status);
  if (std::strcmp(name, "nvshmemx_vendor_get_version_info") == 0)
    return reinterpret_cast<void*>(&nvshmemx_vendor_get_version_info);
  if (std::strcmp(name, "nvshmemx_qp_create") == 0 && W().cfg.qp_api)
    return reinterpret_cast<void*>(&nvshmemx_qp_create);
  return nullptr;
}

}  // namespace nvshmem_emu

using nvshmem_emu::W;

int nvshmemx_get_uniqueid(nvshmemx_uniqueid_t* id) {
  *id = nvshmemx_uniqueid_t{};
  id->version = 1;
  std::memcpy(id->internal, "jax-ep emulated nvshmem", 23);
  return 0;
}

int nvshmemx_set_attr_uniqueid_args(int rank, int nranks, const nvshmemx_uniqueid_t* id,
                                    nvshmemx_init_attr_t* attr) {
  attr->rank = rank;
  attr->nranks = nranks;
  attr->id = *id;
  return 0;
}

int nvshmemx_init_attr(unsigned flags, nvshmemx_init_attr_t* attr) {
  auto& w = W();
  if (attr->nranks != static_cast<int>(w.pes.size()) || attr->rank != emu::current_device())
    return 1;  // a PE of another world (the real library would exit)
  w.pes[attr->rank].initialized = true;
  const int pe = attr->rank;
  return cudaMemcpyToSymbol(nvshmem_emu::g_emu_pe, &pe, sizeof(pe)) == cudaSuccess ? 0 : 1;
}

int nvshmemx_init_status() {
  const int d = emu::current_device();
  auto& w = W();
  if (d < 0 || d >= static_cast<int>(w.pes.size())) return NVSHMEM_STATUS_NOT_INITIALIZED;
  return w.pes[d].initialized ? NVSHMEM_STATUS_IS_INITIALIZED : NVSHMEM_STATUS_NOT_INITIALIZED;
}

void nvshmem_finalize() {
  auto& w = W();
  w.pes[nvshmem_emu::CurrentPe()].initialized = false;
}

void* nvshmem_malloc(size_t bytes) {
  void* p = nullptr;
  if (cudaMalloc(&p, bytes) != cudaSuccess) return nullptr;
  W().pes[nvshmem_emu::CurrentPe()].heap.push_back({static_cast<char*>(p), bytes});
  // Other PEs of the node store into it through nvshmem_ptr: those stores are weak
  // (buffered per writing thread until its fence or release), the owner's own are not.
  emu::mark_peer_memory(p, bytes);
  return p;
}

void nvshmem_free(void* p) {
  for (auto& a : W().pes[nvshmem_emu::CurrentPe()].heap)
    if (a.base == p) {
      cudaFree(p);
      a.base = nullptr;
    }
}

// Host-side collective: the emulated world's PEs are started one after another by one
// host thread, so there is nothing to wait for.
void nvshmem_barrier_all() {}

int nvshmemx_qp_create(int n, nvshmemx_qp_handle_t** handles) {
  auto& w = W();
  nvshmem_emu::Pe& pe = w.pes[nvshmem_emu::CurrentPe()];
  pe.handles.assign(static_cast<size_t>(n), 0);
  for (int i = 0; i < n; ++i)
    pe.handles[i] = nvshmem_emu::kHandleBase + nvshmem_emu::kHandleStride * i;
  pe.num_handles = n;
  *handles = pe.handles.data();
  return 0;
}

void nvshmemx_vendor_get_version_info(int* major, int* minor, int* patch) {
  *major = NVSHMEM_VENDOR_MAJOR_VERSION;
  *minor = NVSHMEM_VENDOR_MINOR_VERSION;
  *patch = NVSHMEM_VENDOR_PATCH_VERSION;
}

int nvshmem_my_pe() { return nvshmem_emu::CurrentPe(); }
int nvshmem_n_pes() { return static_cast<int>(W().pes.size()); }

void* nvshmem_ptr(const void* sym, int pe) {
  auto& w = W();
  const int me = nvshmem_emu::CurrentPe();
  const int g = w.cfg.gpus_per_node > 0 ? w.cfg.gpus_per_node : 1;
  if (pe < 0 || pe >= static_cast<int>(w.pes.size()) || pe / g != me / g) return nullptr;
  return nvshmem_emu::Translate(sym, pe, 1);
}

void nvshmem_quiet() {
  auto& w = W();
  const int me = nvshmem_emu::CurrentPe();
  nvshmem_emu::Count("quiets");
  // Every operation this PE issued completes; across queues in a random order.
  std::vector<nvshmem_emu::Queue*> mine;
  for (auto& kv : w.queues)
    if (std::get<0>(kv.first) == me && !kv.second.ops.empty()) mine.push_back(&kv.second);
  while (!mine.empty()) {
    std::uniform_int_distribution<size_t> pick(0, mine.size() - 1);
    const size_t i = pick(w.rng);
    nvshmem_emu::DeliverHead(*mine[i]);
    if (mine[i]->ops.empty()) mine.erase(mine.begin() + static_cast<long>(i));
  }
  // complete: every payload this PE sent is in place (conservatively, every late one)
  std::vector<int> dsts;
  for (const auto& kv : w.late) dsts.push_back(kv.first);
  for (int d : dsts) nvshmem_emu::FlushLate(d);
  emu::yield(emu::kYieldFence);
}

void nvshmem_fence() {
  nvshmem_emu::Count("fences");
  emu::yield(emu::kYieldFence);
}

uint64_t nvshmem_signal_fetch(const uint64_t* sig) {
  emu::note_poll();
  nvshmem_emu::Count("polls");
  nvshmem_emu::Progress();
  return *reinterpret_cast<const volatile uint64_t*>(sig);
}

void nvshmemx_putmem_nbi_warp(void* dst, const void* src, size_t bytes, int pe) {
  nvshmem_emu::Put(dst, src, bytes, nullptr, 0, 0, pe, -1, true);
}

void nvshmemx_putmem_signal_nbi_warp(void* dst, const void* src, size_t bytes, uint64_t* sig,
                                     uint64_t value, int op, int pe) {
  nvshmem_emu::Put(dst, src, bytes, sig, value, op, pe, -1, true);
}

void nvshmemx_signal_op(uint64_t* sig, uint64_t value, int op, int pe) {
  nvshmem_emu::Enqueue(nvshmem_emu::CurrentPe(), pe, -1, -1, nullptr, nullptr, 0, sig, value,
                       op, false);
}

void nvshmemx_qp_uint8_put_nbi_warp(uint8_t* dst, const uint8_t* src, size_t n, int pe,
                                    nvshmemx_qp_handle_t qp) {
  nvshmem_emu::Put(dst, src, n, nullptr, 0, 0, pe, qp, true);
}

void nvshmemx_qp_uint8_put_signal_nbi_warp(uint8_t* dst, const uint8_t* src, size_t n,
                                           uint64_t* sig, uint64_t value, int op, int pe,
                                           nvshmemx_qp_handle_t qp) {
  nvshmem_emu::Put(dst, src, n, sig, value, op, pe, qp, true);
}

void nvshmemx_qp_signal_op(uint64_t* sig, uint64_t value, int op, int pe,
                           nvshmemx_qp_handle_t qp) {
  const int q = nvshmem_emu::QpOfHandle(qp);
  nvshmem_emu::Enqueue(nvshmem_emu::CurrentPe(), pe, q, qp, nullptr, nullptr, 0, sig, value, op,
                       false);
}
