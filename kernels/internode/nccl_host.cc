// Host side of the NCCL GIN transport: the library lookup, the communicators,
// the symmetric window that is the internode heap, the FULL and RAIL device
// communicators and the device global transport::g_nccl_gin. API in nccl_host.h.
//
// NCCL is never linked: its host functions come from a table (nccl_api.h) that dlsym
// fills from libnccl.so.2, so the extension loads where NCCL is absent and shares the
// copy jax's CUDA plugin may already have loaded. On the emulated GPU (JAX_EP_EMU) the
// table points at the emulated NCCL of kernels/emu/nccl_emu.h instead.
//
// Compiled as CUDA in the real build (cmake/nccl.cmake: it defines the device global) and
// through the emulator's wrapper in the emulated one (cmake/emu_internode.cmake).
#include "kernels/internode/nccl_host.h"

#include <cuda_runtime.h>

#if !defined(JAX_EP_EMU)
#include <dlfcn.h>
#include <link.h>
#include <sys/stat.h>
#endif

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "kernels/internode/nccl_api.h"
#include "kernels/internode/nccl_gin_state.h"

namespace jax_ep {
namespace transport {
JEP_DEVICE_GLOBAL NcclGinState g_nccl_gin;
}  // namespace transport

namespace nccl_host {

static_assert(NCCL_VERSION_CODE >= kMinVersion,
              "jax_ep: the NCCL GIN transport needs NCCL 2.30 headers or newer "
              "(pip install 'nvidia-nccl-cu13>=2.30')");
// The host writes the state with one byte copy (cudaMemcpyToSymbol).
static_assert(std::is_trivially_copyable<transport::NcclGinState>::value,
              "transport::NcclGinState must be plain bytes");

namespace {

constexpr int kMaxDevices = 64;
// NCCL_WIN_REQUIRED_ALIGNMENT: a window's size is a multiple of it.
constexpr size_t kWindowAlign = 4096;
constexpr const char* kInstall =
    "pip install 'nvidia-nccl-cu13>=2.30' (or pip install 'jax-ep[cuda]')";

// The resolved library: the table, or why there is none.
struct Library {
  NcclApi api;
  std::string path;  // where libnccl.so.2 was found ("emulated NCCL" on the emulated GPU)
  std::string why;   // empty when the table is complete
};

struct DeviceState {
  bool resolved = false;
  Library lib;           // kept across Finish
  bool started = false;  // Start completed
  bool made = false;     // something NCCL made here that Finish must free
  int rank = -1;
  int world = 0;
  int gpus_per_node = 0;
  int num_contexts = 0;  // granted on both connections
  ncclComm_t comm = nullptr;
  char* heap = nullptr;
  size_t heap_bytes = 0;
  ncclWindow_t win = nullptr;
  // Filled by ncclDevCommCreate when the group ends: the addresses must stay put.
  ncclDevComm full{};
  ncclDevComm rail{};
  bool have_full = false;
  bool have_rail = false;
};

// The per-device table: one slot per CUDA device (per virtual GPU on the emulated GPU).
DeviceState g_dev[kMaxDevices];

DeviceState* Dev(int ordinal) {
  return ordinal >= 0 && ordinal < kMaxDevices ? &g_dev[ordinal] : nullptr;
}

DeviceState* Current() {
  int d = -1;
  if (cudaGetDevice(&d) != cudaSuccess) return nullptr;
  return Dev(d);
}

std::string VersionText(int v) {
  if (v <= 0) return {};
  // NCCL_VERSION(): X*1000 + Y*100 + Z up to 2.8, X*10000 + Y*100 + Z after.
  const bool old = v < 10000;
  const int major = old ? v / 1000 : v / 10000;
  const int minor = old ? (v / 100) % 10 : (v / 100) % 100;
  return std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(v % 100);
}

#if defined(JAX_EP_EMU)
// The emulated NCCL's entry points by name, as dlsym gives the real ones, so the emulated
// build resolves the same table the same way.
bool Open(Library* lib, void** handle) {
  *handle = nullptr;
  lib->path = "the emulated NCCL (kernels/emu/nccl_emu.h)";
  return true;
}
void* Symbol(void*, const char* name) { return nccl_emu::host_symbol(name); }
#else
void* TryOpen(const std::string& name, int flags, std::string* errors) {
  void* h = dlopen(name.c_str(), flags);
  if (h == nullptr) {
    const char* e = dlerror();
    if (!errors->empty()) *errors += "; ";
    *errors += e != nullptr ? e : name + ": not found";
  }
  return h;
}

// libnccl.so.2: the copy already in the process (jax's CUDA plugin loads one), else by
// name: the loader's path and this module's RUNPATH, which holds the nvidia-nccl-cu13
// wheel's lib/ (cmake/nccl.cmake).
bool Open(Library* lib, void** handle) {
  const char* kName = "libnccl.so.2";
  void* h = dlopen(kName, RTLD_NOLOAD | RTLD_NOW);
  std::string errors;
  if (h == nullptr) h = TryOpen(kName, RTLD_NOW | RTLD_LOCAL, &errors);
  if (h == nullptr) {
    lib->why = "libnccl.so.2 was not found (" + errors + "); " + kInstall;
    return false;
  }
  struct link_map* map = nullptr;
  lib->path = dlinfo(h, RTLD_DI_LINKMAP, &map) == 0 && map != nullptr && map->l_name != nullptr &&
                      *map->l_name != '\0'
                  ? map->l_name
                  : kName;
  *handle = h;
  return true;
}
void* Symbol(void* handle, const char* name) { return dlsym(handle, name); }
#endif

void Resolve(Library* lib) {
  void* h = nullptr;
  if (!Open(lib, &h)) return;
  std::string missing;
#define JAX_EP_NCCL_RESOLVE(name)                                                       \
  lib->api.name = reinterpret_cast<decltype(lib->api.name)>(Symbol(h, "nccl" #name)); \
  if (lib->api.name == nullptr) missing += std::string(missing.empty() ? "" : ", ") + "nccl" #name;
  JAX_EP_NCCL_FUNCTIONS(JAX_EP_NCCL_RESOLVE)
#undef JAX_EP_NCCL_RESOLVE
  lib->api.GetLastError =
      reinterpret_cast<const char* (*)(ncclComm_t)>(Symbol(h, "ncclGetLastError"));
  if (lib->api.GetVersion != nullptr && lib->api.GetVersion(&lib->api.version) != ncclSuccess)
    lib->api.version = 0;
  if (!missing.empty()) {
    const std::string v = VersionText(lib->api.version);
    lib->why = lib->path + (v.empty() ? "" : " (NCCL " + v + ")") + " has no " + missing +
               ": the NCCL GIN transport needs NCCL 2.30 or newer; " + kInstall;
  }
}

// The current device's resolved library (resolved once per device); a fresh one where
// there is no CUDA device to key it by (Available() must answer there too).
Library Lib() {
  DeviceState* s = Current();
  if (s == nullptr) {
    Library lib;
    Resolve(&lib);
    return lib;
  }
  if (!s->resolved) {
    Resolve(&s->lib);
    s->resolved = true;
  }
  return s->lib;
}

// "" when the library can run the transport, else what to install.
std::string Usable(const Library& lib) {
  if (!lib.why.empty()) return "jax_ep nccl: " + lib.why;
  const int v = lib.api.version;
  if (v < kMinVersion)
    return "jax_ep nccl: " + lib.path + " is NCCL " + VersionText(v) +
           "; the NCCL GIN transport needs 2.30 or newer: " + kInstall;
  // The device communicators are laid out as in the headers the kernels were compiled
  // with; an older library cannot fill that layout.
  if (v < NCCL_VERSION_CODE)
    return "jax_ep nccl: " + lib.path + " is NCCL " + VersionText(v) +
           ", older than the headers this jax_ep was built with (" +
           VersionText(NCCL_VERSION_CODE) + "): pip install 'nvidia-nccl-cu13>=" +
           VersionText(NCCL_VERSION_CODE) + "'";
  return {};
}

std::string NcclErr(const NcclApi& api, ncclResult_t r, const std::string& call,
                    ncclComm_t comm = nullptr) {
  std::string m = "jax_ep nccl: " + call + " failed: " +
                  (api.GetErrorString != nullptr ? api.GetErrorString(r) : "error") +
                  " (ncclResult_t " + std::to_string(static_cast<int>(r)) + ")";
  if (comm != nullptr && api.GetLastError != nullptr) {
    const char* last = api.GetLastError(comm);
    if (last != nullptr && *last != '\0') m += ": " + std::string(last);
  }
  return m + "; NCCL_DEBUG=WARN (or INFO) prints NCCL's own account";
}

std::string CudaErr(cudaError_t e, const std::string& what) {
  if (e == cudaSuccess) return {};
  return "jax_ep nccl: " + what + ": " + cudaGetErrorString(e);
}

// The current device's g_nccl_gin. The emulator's cudaMemcpyToSymbol takes the symbol
// itself; CUDA's C entry point takes its host address, which also compiles with the host
// compiler alone (the template overload is nvcc's), as the compile check does.
cudaError_t WriteState(const transport::NcclGinState& st) {
#if defined(JAX_EP_EMU)
  return cudaMemcpyToSymbol(transport::g_nccl_gin, &st, sizeof(st));
#else
  return cudaMemcpyToSymbol(static_cast<const void*>(&transport::g_nccl_gin), &st, sizeof(st));
#endif
}

std::string Where(int ordinal, const DeviceState& s) {
  return " (GPU " + std::to_string(ordinal) + ", rank " + std::to_string(s.rank) + ")";
}

// fn(ordinal, state) on every GPU of `ordinals` with it current, fused into one NCCL group
// when there are several: the collective calls of several GPUs of one process must be,
// or the first would wait for the others forever. Runs on every GPU even after an error
// (a group must still end); returns the first error. A call that fails inside the group
// may only report at ncclGroupEnd, named after the fused call.
template <class Fn>
std::string OnEach(const NcclApi& api, const std::vector<int>& ordinals, const char* call,
                   Fn fn) {
  const bool group = ordinals.size() > 1;
  if (group) {
    const ncclResult_t r = api.GroupStart();
    if (r != ncclSuccess) return NcclErr(api, r, std::string("ncclGroupStart (for ") + call + ")");
  }
  std::string first;
  for (int o : ordinals) {
    std::string e = CudaErr(cudaSetDevice(o), "cudaSetDevice(" + std::to_string(o) + ")");
    if (e.empty()) e = fn(o, *Dev(o));
    if (first.empty()) first = e;
  }
  if (group) {
    const ncclResult_t r = api.GroupEnd();
    if (r != ncclSuccess && first.empty())
      first = NcclErr(api, r, std::string("ncclGroupEnd (of ") + call + " on " +
                                  std::to_string(ordinals.size()) + " GPUs)");
  }
  return first;
}

const char* ConnName(ncclGinConnectionType_t c) {
  return c == NCCL_GIN_CONNECTION_FULL ? "FULL" : "RAIL";
}

std::string StartOn(const NcclApi& api, const std::vector<int>& ordinals,
                    const std::vector<int>& ranks, int world, const ncclUniqueId& id,
                    size_t bytes, int num_contexts, int gpus_per_node) {
  for (size_t i = 0; i < ordinals.size(); ++i) {
    DeviceState& s = *Dev(ordinals[i]);
    s.rank = ranks[i];
    s.world = world;
    s.gpus_per_node = gpus_per_node;
  }
  // The communicators (ncclCommInitRank of several GPUs of one process must be grouped).
  std::string e = OnEach(api, ordinals, "ncclCommInitRank", [&](int o, DeviceState& s) {
    s.made = true;
    const ncclResult_t r = api.CommInitRank(&s.comm, world, id, s.rank);
    return r == ncclSuccess ? std::string()
                            : NcclErr(api, r, "ncclCommInitRank" + Where(o, s), s.comm);
  });
  if (!e.empty()) return e;
  for (int o : ordinals) {
    DeviceState& s = *Dev(o);
    int rank = -1, count = 0;
    ncclResult_t r = api.CommUserRank(s.comm, &rank);
    if (r == ncclSuccess) r = api.CommCount(s.comm, &count);
    if (r != ncclSuccess) return NcclErr(api, r, "ncclCommUserRank/ncclCommCount" + Where(o, s), s.comm);
    if (rank != s.rank || count != world)
      return "jax_ep nccl: the communicator of GPU " + std::to_string(o) + " is rank " +
             std::to_string(rank) + " of " + std::to_string(count) + ", expected " +
             std::to_string(s.rank) + " of " + std::to_string(world);
  }
  // The heap: NCCL's allocation (what a symmetric window needs), cleared so every signal
  // word starts at zero before any peer can reach it (the window is not registered yet).
  for (int o : ordinals) {
    DeviceState& s = *Dev(o);
    e = CudaErr(cudaSetDevice(o), "cudaSetDevice(" + std::to_string(o) + ")");
    if (!e.empty()) return e;
    void* p = nullptr;
    const ncclResult_t r = api.MemAlloc(&p, bytes);
    if (r != ncclSuccess)
      return NcclErr(api, r, "ncclMemAlloc(" + std::to_string(bytes) + " bytes)" + Where(o, s),
                     s.comm);
    s.heap = static_cast<char*>(p);
    s.heap_bytes = bytes;
    e = CudaErr(cudaMemset(s.heap, 0, bytes), "clear the heap" + Where(o, s));
    if (e.empty()) e = CudaErr(cudaDeviceSynchronize(), "clear the heap" + Where(o, s));
    if (!e.empty()) return e;
  }
  e = OnEach(api, ordinals, "ncclCommWindowRegister", [&](int o, DeviceState& s) {
    const ncclResult_t r =
        api.CommWindowRegister(s.comm, s.heap, s.heap_bytes, &s.win, NCCL_WIN_COLL_SYMMETRIC);
    return r == ncclSuccess
               ? std::string()
               : NcclErr(api, r, "ncclCommWindowRegister(NCCL_WIN_COLL_SYMMETRIC)" + Where(o, s),
                         s.comm);
  });
  if (!e.empty()) return e;
  // The device communicators: FULL (every rank: direct and low-latency modes) and RAIL
  // (the same local GPU of the other nodes: hierarchical mode), one GIN context per
  // planned QP. ginContextCount is a hint; what NCCL granted is checked below.
  for (const ncclGinConnectionType_t conn : {NCCL_GIN_CONNECTION_FULL, NCCL_GIN_CONNECTION_RAIL}) {
    ncclDevCommRequirements_t req = NCCL_DEV_COMM_REQUIREMENTS_INITIALIZER;
    req.ginForceEnable = true;
    req.ginContextCount = num_contexts;
    req.ginConnectionType = conn;
    const std::string call = std::string("ncclDevCommCreate(") + ConnName(conn) + ")";
    e = OnEach(api, ordinals, call.c_str(), [&](int o, DeviceState& s) {
      const bool full = conn == NCCL_GIN_CONNECTION_FULL;
      (full ? s.have_full : s.have_rail) = true;
      const ncclResult_t r = api.DevCommCreate(s.comm, &req, full ? &s.full : &s.rail);
      if (r != ncclSuccess) (full ? s.have_full : s.have_rail) = false;
      return r == ncclSuccess ? std::string() : NcclErr(api, r, call + Where(o, s), s.comm);
    });
    if (!e.empty()) return e;
  }
  for (int o : ordinals) {
    DeviceState& s = *Dev(o);
    for (const ncclGinConnectionType_t conn : {NCCL_GIN_CONNECTION_FULL, NCCL_GIN_CONNECTION_RAIL}) {
      const int got = static_cast<int>(
          (conn == NCCL_GIN_CONNECTION_FULL ? s.full : s.rail).ginContextCount);
      if (got < num_contexts)
        return "jax_ep nccl: NCCL gave " + std::to_string(got) + " GIN context(s) on the " +
               ConnName(conn) + " connections" + Where(o, s) + ", but the plan needs " +
               std::to_string(num_contexts) + " (one per QP: num_ports x qps_per_port). "
               "Lower the plan's QPs to at most " + std::to_string(got) +
               " per peer: qps_per_port (JAX_EP_QPS_PER_PORT) or num_ports of the "
               "TransportConfig";
    }
    s.num_contexts = static_cast<int>(std::min(s.full.ginContextCount, s.rail.ginContextCount));
  }
  // The device global of every GPU.
  for (int o : ordinals) {
    DeviceState& s = *Dev(o);
    transport::NcclGinState st;
    std::memset(&st, 0, sizeof(st));
    st.full = s.full;
    st.rail = s.rail;
    st.win = s.win;
    st.base = s.heap;
    st.num_contexts = s.num_contexts;
    // One context per logical QP for now (the port selection, nccl_select.h, may reorder them).
    for (int q = 0; q < kMaxQps; ++q) st.ctx_of_qp[q] = q % s.num_contexts;
    e = CudaErr(cudaSetDevice(o), "cudaSetDevice(" + std::to_string(o) + ")");
    if (e.empty())
      e = CudaErr(WriteState(st),
                  "write g_nccl_gin" + Where(o, s));
    if (e.empty()) e = CudaErr(cudaDeviceSynchronize(), "write g_nccl_gin" + Where(o, s));
    if (!e.empty()) return e;
  }
  for (int o : ordinals) Dev(o)->started = true;
  return {};
}

}  // namespace

std::string UniqueId(std::string* out) {
  const Library lib = Lib();
  std::string e = Usable(lib);
  if (!e.empty()) return e;
  ncclUniqueId id;
  std::memset(&id, 0, sizeof(id));
  const ncclResult_t r = lib.api.GetUniqueId(&id);
  if (r != ncclSuccess) return NcclErr(lib.api, r, "ncclGetUniqueId");
  out->assign(reinterpret_cast<const char*>(&id), sizeof(id));
  return {};
}

std::string Start(const std::vector<int>& ordinals, const std::vector<int>& ranks, int world,
                  const std::string& uid, size_t heap_bytes, int num_contexts,
                  int gpus_per_node) {
  if (ordinals.empty() || ranks.size() != ordinals.size())
    return "jax_ep nccl: Start needs one world rank per local GPU (got " +
           std::to_string(ordinals.size()) + " GPUs, " + std::to_string(ranks.size()) +
           " ranks)";
  if (world < 1 || gpus_per_node < 1)
    return "jax_ep nccl: world and gpus_per_node must be at least 1";
  if (num_contexts < 1 || num_contexts > kMaxQps)
    return "jax_ep nccl: num_contexts must be in [1, " + std::to_string(kMaxQps) + "]";
  if (heap_bytes == 0) return "jax_ep nccl: heap_bytes must be positive";
  for (size_t i = 0; i < ordinals.size(); ++i) {
    const DeviceState* s = Dev(ordinals[i]);
    if (s == nullptr)
      return "jax_ep nccl: GPU ordinal " + std::to_string(ordinals[i]) + " is outside [0, " +
             std::to_string(kMaxDevices) + ")";
    if (ranks[i] < 0 || ranks[i] >= world)
      return "jax_ep nccl: rank " + std::to_string(ranks[i]) + " is outside [0, " +
             std::to_string(world) + ")";
    for (size_t j = 0; j < i; ++j)
      if (ordinals[j] == ordinals[i] || ranks[j] == ranks[i])
        return "jax_ep nccl: GPU ordinals and ranks must be distinct";
    if (s->started)
      return "jax_ep nccl: already started on GPU " + std::to_string(ordinals[i]) +
             " (rank " + std::to_string(s->rank) + ")";
    if (s->made)
      return "jax_ep nccl: GPU " + std::to_string(ordinals[i]) +
             " still holds what a failed start made; call Finish on every rank first";
  }
  ncclUniqueId id;
  if (uid.size() != sizeof(id))
    return "jax_ep nccl: unique id has " + std::to_string(uid.size()) + " bytes, expected " +
           std::to_string(sizeof(id));
  std::memcpy(&id, uid.data(), sizeof(id));
  const Library lib = Lib();
  const std::string why = Usable(lib);
  if (!why.empty()) return why;
  const size_t bytes = (heap_bytes + kWindowAlign - 1) / kWindowAlign * kWindowAlign;
  int saved = 0;
  std::string e = CudaErr(cudaGetDevice(&saved), "cudaGetDevice");
  if (!e.empty()) return e;
  e = StartOn(lib.api, ordinals, ranks, world, id, bytes, num_contexts, gpus_per_node);
  (void)cudaSetDevice(saved);  // the caller's device, whatever happened
  return e;
}

bool Started() {
  const DeviceState* s = Current();
  return s != nullptr && s->started;
}
char* Heap() { return Started() ? Current()->heap : nullptr; }
size_t HeapBytes() { return Started() ? Current()->heap_bytes : 0; }
int Rank() { return Started() ? Current()->rank : -1; }
int World() { return Started() ? Current()->world : 0; }
int NumContexts() { return Started() ? Current()->num_contexts : 0; }

std::string Finish(const std::vector<int>& ordinals) {
  std::vector<int> live;
  for (int o : ordinals) {
    const DeviceState* s = Dev(o);
    if (s != nullptr && s->made) live.push_back(o);
  }
  if (live.empty()) return {};
  const Library lib = Lib();
  if (!lib.why.empty()) return "jax_ep nccl: " + lib.why;
  const NcclApi& api = lib.api;
  int saved = 0;
  std::string first = CudaErr(cudaGetDevice(&saved), "cudaGetDevice");
  auto keep = [&](const std::string& e) {
    if (first.empty()) first = e;
  };
  // Every kernel that may still touch the window is done before it goes.
  for (int o : live) {
    keep(CudaErr(cudaSetDevice(o), "cudaSetDevice(" + std::to_string(o) + ")"));
    keep(CudaErr(cudaDeviceSynchronize(), "synchronize before Finish" + Where(o, *Dev(o))));
  }
  keep(OnEach(api, live, "ncclDevCommDestroy", [&](int o, DeviceState& s) {
    std::string e;
    for (const bool full : {false, true}) {
      bool& have = full ? s.have_full : s.have_rail;
      if (!have) continue;
      const ncclResult_t r = api.DevCommDestroy(s.comm, full ? &s.full : &s.rail);
      if (r != ncclSuccess && e.empty())
        e = NcclErr(api, r, std::string("ncclDevCommDestroy(") + (full ? "FULL" : "RAIL") +
                                ")" + Where(o, s), s.comm);
      have = false;
    }
    return e;
  }));
  keep(OnEach(api, live, "ncclCommWindowDeregister", [&](int o, DeviceState& s) {
    if (s.win == nullptr) return std::string();
    const ncclResult_t r = api.CommWindowDeregister(s.comm, s.win);
    s.win = nullptr;
    return r == ncclSuccess ? std::string()
                            : NcclErr(api, r, "ncclCommWindowDeregister" + Where(o, s), s.comm);
  }));
  for (int o : live) {
    DeviceState& s = *Dev(o);
    keep(CudaErr(cudaSetDevice(o), "cudaSetDevice(" + std::to_string(o) + ")"));
    if (s.heap != nullptr) {
      const ncclResult_t r = api.MemFree(s.heap);
      if (r != ncclSuccess) keep(NcclErr(api, r, "ncclMemFree" + Where(o, s), s.comm));
      s.heap = nullptr;
    }
    // No stale communicator for a kernel launched after Finish.
    transport::NcclGinState zero;
    std::memset(&zero, 0, sizeof(zero));
    keep(CudaErr(WriteState(zero),
                 "clear g_nccl_gin" + Where(o, s)));
  }
  keep(OnEach(api, live, "ncclCommDestroy", [&](int o, DeviceState& s) {
    if (s.comm == nullptr) return std::string();
    const ncclResult_t r = api.CommDestroy(s.comm);
    s.comm = nullptr;
    return r == ncclSuccess ? std::string()
                            : NcclErr(api, r, "ncclCommDestroy" + Where(o, s));
  }));
  for (int o : live) {
    DeviceState& s = *Dev(o);
    const Library kept = s.lib;
    const bool resolved = s.resolved;
    s = DeviceState{};
    s.lib = kept;
    s.resolved = resolved;
  }
  (void)cudaSetDevice(saved);
  return first;
}

bool Available(std::string* why) {
  const std::string e = Usable(Lib());
  if (why != nullptr) *why = e;
  return e.empty();
}

std::string VersionString() {
  const Library lib = Lib();
  return lib.why.empty() ? VersionText(lib.api.version) : std::string();
}

int HeaderVersion() { return NCCL_VERSION_CODE; }

}  // namespace nccl_host
}  // namespace jax_ep
