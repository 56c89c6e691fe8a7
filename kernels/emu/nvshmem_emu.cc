// Emulated NVSHMEM (kernels/emu/nvshmem_emu.h): symmetric heaps over the virtual GPUs'
// memory and a transport that queues every put and signal per (source, destination, QP)
// and delivers them later, in order within a queue, in a seeded random order across them.
#include "kernels/emu/nvshmem_emu.h"

#include <algorithm>
#include <cstring>
#include <deque>
#include <map>
#include <random>
#include <sstream>
#include <tuple>

#include "kernels/emu/emu_control.h"
#include "kernels/emu/emu_cuda.h"
#include "kernels/emu/nccl_emu.h"
#include "kernels/internode/nvshmem_select.h"
#include "xla_ffi/internode/lag_rule.h"

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

namespace ns = jax_ep::nvshmem_select;

struct Pe {
  bool initialized = false;
  std::vector<Alloc> heap;  // k-th symmetric allocation of this PE (nullptr once freed)
  int num_handles = 0;
  std::vector<nvshmemx_qp_handle_t> handles;
  std::vector<ns::Entry> opened;   // the devices NVSHMEM opened for it (its selection)
  std::vector<ns::Entry> qp_dev;   // the device of each handle, in creation order
};

// The node and the environments the world's PEs start with (set_fabric).
struct Fabric {
  bool set = false;
  ns::NodeDesc node;
  std::vector<std::vector<std::string>> members;  // per device: bond members, or none
  std::map<int, std::map<std::string, std::string>> env;  // per PE
  bool lag_affinity = false;
  std::vector<std::string> names;                 // wire port id -> name
  std::map<std::pair<int, int>, int> port_id;     // (device, port) -> id
  std::map<std::pair<int, int>, int> member_id;   // (device, member) -> id
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
  Fabric fabric;
  // Each signal word's last writer's path (emu::LatSpace: a PE of another node writes it
  // over RDMA, one of this node over NVLink): a poll of it waits for that path's latency.
  std::map<const void*, int> sig_space;
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
    const int g = W().cfg.gpus_per_node > 0 ? W().cfg.gpus_per_node : 1;
    W().sig_space[op.sig] = op.src / g != dst_pe / g ? emu::kLatRdma : emu::kLatPeer;
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

// Logical QP and the queue slot of a call: handle >= 0 is an explicit QP handle;
// NVSHMEMX_QP_DEFAULT (what a transport without custom QPs returns) is -1, NVSHMEM's own.
int QpOfHandle(nvshmemx_qp_handle_t h) {
  if (h == NVSHMEMX_QP_DEFAULT && W().cfg.default_handles) return -1;
  const int q = (h - kHandleBase) / kHandleStride;
  if (h < kHandleBase || (h - kHandleBase) % kHandleStride != 0 ||
      q >= W().pes[CurrentPe()].num_handles) {
    emu::fault("nvshmem: a QP handle nvshmemx_qp_create did not return");
    return 0;
  }
  return q;
}

// NVSHMEM's selection for PE `me` on the world's node with its environment: the devices
// it opens and the devices of `n` QP handles. False where NVSHMEM would fail to start.
bool Open(int me, int n) {
  World& w = W();
  Pe& pe = w.pes[me];
  pe.opened.clear();
  pe.qp_dev.clear();
  if (!w.fabric.set) return true;
  ns::NodeDesc node = w.fabric.node;
  const int g = w.cfg.gpus_per_node > 0 ? w.cfg.gpus_per_node : 1;
  if (static_cast<int>(node.gpu_paths.size()) < g) {
    emu::fault("nvshmem: the fabric's node has fewer GPUs than gpus_per_node");
    return false;
  }
  node.gpu_paths.resize(static_cast<size_t>(g));
  node.gpu_numa.resize(static_cast<size_t>(g));
  auto it = w.fabric.env.find(me);
  ns::EnvDesc env = ns::EnvFrom(it != w.fabric.env.end()
                                    ? it->second : std::map<std::string, std::string>{});
  env.qp_api = !w.cfg.default_handles;
  const ns::Selection s = ns::Select(node, env, me % g, n);
  if (!s.error.empty()) return false;
  pe.opened = s.devices;
  pe.qp_dev = s.qps;
  return true;
}

// The wire port id a put from `src` to `dst` leaves on: the device of its handle (or, for
// NVSHMEM's own QPs, of its CTA's QP: IBGDA spreads a PE's default QPs over its devices),
// and on a bond the member: the QP's LAG TX affinity where set (one per handle, members
// in turn), else the bond's layer3+4 hash of the pair, the same for every QP of it since
// IBGDA gives every QP one UDP source port (0xC000). -1 with no fabric.
int WirePort(int src, int dst, int qp, int block) {
  World& w = W();
  const Fabric& f = w.fabric;
  const Pe& pe = w.pes[src];
  if (!f.set || pe.opened.empty()) return -1;
  const bool own = qp < 0;
  const int k = own ? block % w.cfg.default_qps : qp;
  const ns::Entry e = own ? pe.opened[static_cast<size_t>(k) % pe.opened.size()]
                          : pe.qp_dev[static_cast<size_t>(qp)];
  const std::vector<std::string>& m = f.members[static_cast<size_t>(e.device)];
  if (m.empty()) return f.port_id.at({e.device, e.port});
  const int n = static_cast<int>(m.size());
  const uint32_t pair = static_cast<uint32_t>(src) * 2654435761u ^
                        static_cast<uint32_t>(dst) * 40503u ^ 0xC000u;
  // handle k's QPs are the k-th group of num_pes - 1 the shim numbers (one per peer)
  const int group = std::max(static_cast<int>(w.pes.size()) - 1, 1);
  const int member = (f.lag_affinity && !own)
                         ? jax_ep::lag_rule::Affinity(k * group, group, n) - 1
                         : static_cast<int>((pair >> 7) % n);
  return f.member_id.at({e.device, member});
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
  // Without a handle of its own (none, or NVSHMEMX_QP_DEFAULT) a put takes NVSHMEM's QP
  // for its CTA (IBGDA's RC map by CTA): CTAs' puts to one PE may pass each other.
  const int slot = qp >= 0 ? qp : -1 - static_cast<int>(blockIdx.x) % w.cfg.default_qps;
  w.queues[{src, dst_pe, slot}].ops.push_back(op);
  ++w.pending;
  const std::string key = qp >= 0 ? "qp" + std::to_string(qp) : std::string("fallback");
  // By space as well, in the emulator's own names: a put between nodes is RDMA, one to a
  // PE of the same node travels over NVLink ("peer").
  const int g = w.cfg.gpus_per_node > 0 ? w.cfg.gpus_per_node : 1;
  const std::string space = src / g != dst_pe / g ? "rdma" : "peer";
  // Completes later, over its path: the thread's next quiet waits for it.
  emu::note_remote_write(space == "rdma" ? emu::kLatRdma : emu::kLatPeer);
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
    r.qp = qp;
    r.port = WirePort(src, dst_pe, qp, static_cast<int>(blockIdx.x));
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
  w.sig_space.clear();
  w.fabric = Fabric{};
  // Undelivered operations reach their destinations only at later transport steps (the
  // emulated NCCL's too: the emulator has one probe).
  emu::set_pending_probe([] { return W().pending > 0 || nccl_emu::pending() > 0; });
}

void grow(int num_pes) {
  World& w = W();
  if (num_pes > static_cast<int>(w.pes.size())) w.pes.resize(static_cast<size_t>(num_pes));
}

const WorldConfig& world_config() { return W().cfg; }

std::string set_fabric(const std::string& text) {
  Fabric f;
  std::istringstream in(text);
  std::string line;
  int n = 0;
  auto bad = [&](const std::string& why) {
    return "nvshmem emu: fabric line " + std::to_string(n) + " (" + line + "): " + why;
  };
  while (std::getline(in, line)) {
    ++n;
    std::istringstream ls(line);
    std::string kind;
    if (!(ls >> kind)) continue;
    if (kind == "dev") {
      ns::DeviceDesc d;
      std::string ports, members;
      if (!(ls >> d.name >> d.numa >> d.pci_path >> ports)) return bad("dev needs 4 fields");
      std::istringstream ps(ports);
      std::string item;
      while (std::getline(ps, item, ',')) {
        int num = 0, active = 0, rdma = 0;
        if (std::sscanf(item.c_str(), "%d:%d:%d", &num, &active, &rdma) != 3)
          return bad("port " + item + " is not num:active:rdma");
        d.ports.push_back({num, active != 0, rdma != 0});
      }
      std::vector<std::string> m;
      if (ls >> members) {
        std::istringstream ms(members);
        while (std::getline(ms, item, ',')) m.push_back(item);
      }
      f.node.devices.push_back(d);
      f.members.push_back(m);
    } else if (kind == "gpu") {
      int numa = -1;
      std::string path;
      if (!(ls >> numa >> path)) return bad("gpu needs numa and path");
      f.node.gpu_numa.push_back(numa);
      f.node.gpu_paths.push_back(path);
    } else if (kind == "env") {
      int pe = -1;
      std::string kvs, item;
      if (!(ls >> pe)) return bad("env needs a PE");
      f.env[pe];  // a PE with nothing set has NVSHMEM's defaults
      if (ls >> kvs) {
        std::istringstream ks(kvs);
        while (std::getline(ks, item, ';')) {
          const size_t eq = item.find('=');
          if (eq == std::string::npos) return bad(item + " is not KEY=VALUE");
          f.env[pe][item.substr(0, eq)] = item.substr(eq + 1);
        }
      }
    } else if (kind == "lag_affinity") {
      int v = 0;
      if (!(ls >> v)) return bad("lag_affinity needs 0 or 1");
      f.lag_affinity = v != 0;
    } else {
      return bad("unknown kind " + kind);
    }
  }
  for (size_t d = 0; d < f.node.devices.size(); ++d) {
    const ns::DeviceDesc& dev = f.node.devices[d];
    for (const ns::PortDesc& p : dev.ports) {
      f.port_id[{static_cast<int>(d), p.num}] = static_cast<int>(f.names.size());
      f.names.push_back(dev.name + ":" + std::to_string(p.num));
    }
    for (size_t m = 0; m < f.members[d].size(); ++m) {
      f.member_id[{static_cast<int>(d), static_cast<int>(m)}] = static_cast<int>(f.names.size());
      f.names.push_back(f.members[d][m]);
    }
  }
  f.set = true;
  W().fabric = std::move(f);
  return {};
}

std::vector<std::string> port_names() { return W().fabric.names; }
void set_call(int64_t call) { W().call = call; }
const std::vector<PutRecord>& put_log() { return W().log; }
void clear_log() {
  W().log.clear();
  W().counters.clear();
}
std::map<std::string, uint64_t> counters() { return W().counters; }
int64_t pending() { return W().pending; }

// The path a signal word's writer reaches this PE over (-1: not written by a put yet).
int SigSpace(const void* p) {
  auto it = W().sig_space.find(p);
  return it != W().sig_space.end() ? it->second : -1;
}

uint64_t load_acquire(const uint64_t* p) {
  emu::note_acquire_at(p, SigSpace(p));
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
  if (!nvshmem_emu::Open(attr->rank, 0)) return 1;  // no device NVSHMEM could open
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

// The handles' devices follow NVSHMEM's selection for this PE (nvshmem_select.h) on the
// world's node with the PE's environment; a selection NVSHMEM would refuse fails here.
int nvshmemx_qp_create(int n, nvshmemx_qp_handle_t** handles) {
  auto& w = W();
  const int me = nvshmem_emu::CurrentPe();
  nvshmem_emu::Pe& pe = w.pes[me];
  if (!nvshmem_emu::Open(me, n)) return 1;  // NVSHMEM's init would have failed
  pe.handles.assign(static_cast<size_t>(n), 0);
  for (int i = 0; i < n; ++i)
    pe.handles[i] = w.cfg.default_handles
                        ? NVSHMEMX_QP_DEFAULT
                        : nvshmem_emu::kHandleBase + nvshmem_emu::kHandleStride * i;
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
  emu::note_complete_writes();  // waits for this thread's puts (a round of their path)
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
  emu::note_poll_at(sig, nvshmem_emu::SigSpace(sig));
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
