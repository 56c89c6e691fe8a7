// Probes of the emulated NCCL GIN (kernels/emu/nccl_emu.h): small kernels that use ncclGin
// directly, and ops that start an emulated NCCL world and read its transport log, so
// tests/emu/test_gin_emu.py can show each rule of the model both holding and catching
// its misuse (docs/emulator.md, "NCCL GIN (emulated)"). Ops:
//   gin_world     (GPU 0) a fresh world from WorldConfig attrs
//   gin_init      (GPU 0) one host thread creates every rank's comm in one group, then on
//                 each: ncclMemAlloc, window, FULL and RAIL devComms; s32[1]: contexts granted
//   gin_host_case (GPU 0) one host-side misuse; its error is the op's error
//   gin_probe     (per rank) the probe kernel `case`
//   gin_log       (GPU 0) s32[n, 10] of the log (then cleared), gin_log_size s32[2]
#include <map>
#include <string>
#include <vector>

#include "kernels/cuda/launch.cuh"
#include "kernels/emu/nccl_emu.h"
#include "xla_ffi/emu/emu_call.h"

namespace jax_ep {
namespace emu_gin_probe {
namespace {
using emu_driver::CallArgs;

// The heap (one window): signal words, then the source rows, then the destination rows.
constexpr size_t kSig = 0;
constexpr size_t kSrc = 4096;
constexpr size_t kDst = 4096 + 65536;
constexpr size_t kHeapBytes = kDst + 65536;
constexpr long kSpinLimit = 200000;

struct ProbeState {
  ncclDevComm full, rail;
  ncclWindow_t win;
  char* base;
};
JEP_DEVICE_GLOBAL ProbeState g_probe;

struct Host {
  ncclComm_t comm = nullptr;
  void* heap = nullptr;
  ncclWindow_t win = nullptr;
  ncclDevComm full{}, rail{};
};
std::map<int, Host>& Hosts() {
  static std::map<int, Host> h;
  return h;
}

enum Case : int {
  kVisibility = 0,  // rows then a signal; the receiver waits for it and reads the rows
  kOverwrite = 1,   // put, (flush), rewrite the source, strong signal
  kContexts = 2,    // puts alternating over two contexts
  kRail = 3,        // a put over the RAIL devComm to `peer`
  kPeerPtrs = 4,    // ncclGetPeerPointer(win, 0, p) != nullptr for every p
  kContext = 5,     // ncclGin on context `ctx`
  kKinds = 6,       // one operation of each kind
  kDivergent = 7,   // a warp-wide put whose lane 5 passes another offset
};

struct Args {
  int kase, rank, peer, rows, row_bytes, sig, flush, ctx;
};

// Waits until the signal word at `off` reaches `least`; false at the spin limit.
bool Wait(const ncclGin& gin, size_t off, uint64_t least) {
  for (long i = 0; i < kSpinLimit; ++i)
    if (gin.readSignal(g_probe.win, off) >= least) return true;
  return false;
}

// One warp per rank. Rank 0 sends to `peer`; `peer` receives into out (rows, then a word
// saying whether the wait timed out).
__global__ void GinProbe(Args a, const uint8_t* in, uint8_t* out, int32_t* flags) {
  const int lane = static_cast<int>(threadIdx.x);
  const ProbeState& p = g_probe;
  const size_t rb = static_cast<size_t>(a.row_bytes);
  const ncclTeam world = ncclTeamWorld(p.full);
  if (a.kase == kPeerPtrs) {
    if (lane == 0)
      for (int r = 0; r < p.full.nRanks; ++r)
        flags[r] = ncclGetPeerPointer(p.win, 0, r) != nullptr ? 1 : 0;
    return;
  }
  if (a.kase == kContext) {
    ncclGin gin(p.full, a.ctx);  // a context not granted is a fault
    (void)gin;
    return;
  }
  if (a.kase == kDivergent) {
    ncclGin gin(p.full, 0);
    gin.put(world, a.peer, p.win, kDst + (lane == 5 ? rb : 0), p.win, kSrc, rb, ncclGin_None{},
            ncclGin_None{}, ncclCoopWarp{});
    return;
  }
  if (a.kase == kRail) {
    ncclGin gin(p.rail, 0);
    gin.put(world, a.peer, p.win, kDst, p.win, kSrc, rb, ncclGin_None{}, ncclGin_None{},
            ncclCoopWarp{});
    return;
  }
  if (a.rank == 0) {  // the sender
    for (size_t i = static_cast<size_t>(lane); i < rb * static_cast<size_t>(a.rows); i += 32)
      p.base[kSrc + i] = static_cast<char>(in[i]);  // its own memory: lands at once
    __syncwarp();
    if (a.kase == kVisibility) {
      ncclGin gin(p.full, 0);
      const int last = a.rows - 1;
      for (int k = 0; k < last; ++k)
        gin.put(world, a.peer, p.win, kDst + k * rb, p.win, kSrc + k * rb, rb, ncclGin_None{},
                ncclGin_None{}, ncclCoopWarp{});
      const size_t d = kDst + last * rb, s = kSrc + last * rb;
      switch (a.sig) {
        case 1:  // put + strong signal
          gin.put(world, a.peer, p.win, d, p.win, s, rb, ncclGin_StrongVASignalAdd{p.win, kSig, 1},
                  ncclGin_None{}, ncclCoopWarp{});
          break;
        case 2:  // put + weak signal: only this row is promised
          gin.put(world, a.peer, p.win, d, p.win, s, rb, ncclGin_WeakVASignalAdd{p.win, kSig, 1},
                  ncclGin_None{}, ncclCoopWarp{});
          break;
        case 3:  // put, then a strong signal alone
        case 4:  // put, then a weak signal alone: promises nothing
          gin.put(world, a.peer, p.win, d, p.win, s, rb, ncclGin_None{}, ncclGin_None{},
                  ncclCoopWarp{});
          if (a.sig == 3)
            gin.signal(world, a.peer, ncclGin_StrongVASignalAdd{p.win, kSig, 1}, ncclCoopWarp{});
          else
            gin.signal(world, a.peer, ncclGin_WeakVASignalAdd{p.win, kSig, 1}, ncclCoopWarp{});
          break;
        default:
          break;
      }
    } else if (a.kase == kOverwrite) {
      ncclGin gin(p.full, 0);
      gin.put(world, a.peer, p.win, kDst, p.win, kSrc, rb, ncclGin_None{}, ncclGin_None{},
              ncclCoopWarp{});
      if (a.flush) gin.flush(ncclCoopWarp{});
      for (size_t i = static_cast<size_t>(lane); i < rb; i += 32)
        p.base[kSrc + i] = static_cast<char>(~in[i]);  // the source rewritten
      __syncwarp();
      if (lane == 0)
        gin.signal(world, a.peer, ncclGin_StrongVASignalAdd{p.win, kSig, 1}, ncclCoopThread{});
    } else if (a.kase == kContexts) {
      for (int k = 0; k < a.rows; ++k) {
        ncclGin gin(p.full, k % 2);
        gin.put(world, a.peer, p.win, kDst + k * rb, p.win, kSrc + k * rb, rb,
                ncclGin_StrongVASignalAdd{p.win, kSig + 8 * (k % 2), 1}, ncclGin_None{},
                ncclCoopWarp{});
      }
    } else if (a.kase == kKinds) {
      ncclGin gin(p.full, a.ctx);
      gin.put(world, a.peer, p.win, kDst, p.win, kSrc, rb, ncclGin_None{}, ncclGin_None{},
              ncclCoopWarp{});
      gin.put(world, a.peer, p.win, kDst + rb, p.win, kSrc + rb, rb,
              ncclGin_StrongVASignalAdd{p.win, kSig, 1}, ncclGin_None{}, ncclCoopWarp{});
      gin.put(world, a.peer, p.win, kDst + 2 * rb, p.win, kSrc + 2 * rb, rb,
              ncclGin_WeakVASignalAdd{p.win, kSig, 1}, ncclGin_None{}, ncclCoopWarp{});
      gin.signal(world, a.peer, ncclGin_StrongVASignalAdd{p.win, kSig, 1}, ncclCoopWarp{});
      if (lane == 0)
        gin.signal(world, a.peer, ncclGin_WeakVASignalInc{p.win, kSig}, ncclCoopThread{});
      gin.flush(ncclCoopWarp{});
    }
    return;
  }
  if (a.rank != a.peer) return;
  // The receiver.
  ncclGin gin(p.full, 0);
  int32_t ok = 1;
  if (lane == 0) {
    if (a.kase == kContexts) {
      ok = Wait(gin, kSig, static_cast<uint64_t>((a.rows + 1) / 2)) &&
           Wait(gin, kSig + 8, static_cast<uint64_t>(a.rows / 2));
    } else {
      ok = Wait(gin, kSig, a.kase == kKinds ? 4 : 1);
    }
    flags[0] = ok ? 0 : 1;
  }
  __syncwarp();
  for (size_t i = static_cast<size_t>(lane); i < rb * static_cast<size_t>(a.rows); i += 32)
    out[i] = static_cast<uint8_t>(p.base[kDst + i]);
}

std::string Err(const char* call, ncclResult_t r) {
  return std::string(call) + ": " + ncclGetErrorString(r) + ": " + nccl_emu::last_error();
}
#define GIN_TRY(call)                                \
  do {                                               \
    const ncclResult_t r_ = (call);                  \
    if (r_ != ncclSuccess) return Err(#call, r_);    \
  } while (0)

void TearDown() {
  for (auto& kv : Hosts()) {
    cudaSetDevice(kv.first);
    Host& h = kv.second;
    if (h.comm != nullptr) {
      ncclDevCommDestroy(h.comm, &h.full);
      ncclDevCommDestroy(h.comm, &h.rail);
      if (h.win != nullptr) ncclCommWindowDeregister(h.comm, h.win);
      ncclCommDestroy(h.comm);
    }
    if (h.heap != nullptr) ncclMemFree(h.heap);
  }
  Hosts().clear();
}

std::string Init(const CallArgs& a) {
  const int R = static_cast<int>(a.attr("num_ranks"));
  const int contexts = static_cast<int>(a.attr("contexts"));
  const int64_t mismatch = a.attr("size_mismatch");
  ncclUniqueId id;
  GIN_TRY(ncclGetUniqueId(&id));
  std::vector<ncclComm_t> comms(static_cast<size_t>(R), nullptr);
  // One host thread driving every GPU: the comms are created inside one group.
  GIN_TRY(ncclGroupStart());
  for (int r = 0; r < R; ++r) {
    cudaSetDevice(r);
    ncclCommInitRank(&comms[static_cast<size_t>(r)], R, id, r);
  }
  GIN_TRY(ncclGroupEnd());
  int32_t granted = 0;
  for (int r = 0; r < R; ++r) {
    cudaSetDevice(r);
    Host& h = Hosts()[r];
    h.comm = comms[static_cast<size_t>(r)];
    GIN_TRY(ncclMemAlloc(&h.heap, kHeapBytes));
    cudaMemset(h.heap, 0, kHeapBytes);
    const size_t bytes = (mismatch != 0 && r == 1) ? kHeapBytes / 2 : kHeapBytes;
    GIN_TRY(ncclCommWindowRegister(h.comm, h.heap, bytes, &h.win, NCCL_WIN_COLL_SYMMETRIC));
    ncclDevCommRequirements_t req = NCCL_DEV_COMM_REQUIREMENTS_INITIALIZER;
    req.ginForceEnable = true;
    req.ginContextCount = contexts;
    req.ginConnectionType = NCCL_GIN_CONNECTION_FULL;
    GIN_TRY(ncclDevCommCreate(h.comm, &req, &h.full));
    req.ginConnectionType = NCCL_GIN_CONNECTION_RAIL;
    GIN_TRY(ncclDevCommCreate(h.comm, &req, &h.rail));
    ProbeState st{h.full, h.rail, h.win, static_cast<char*>(h.heap)};
    cudaMemcpyToSymbol(g_probe, &st, sizeof(st));
    granted = static_cast<int32_t>(h.full.ginContextCount);
  }
  cudaSetDevice(a.ordinal);
  *static_cast<int32_t*>(a.out.at(0)->data) = granted;
  return {};
}

// One host-side misuse; the op's error is what NCCL returned and said (empty: accepted).
std::string HostCase(int kase) {
  ncclUniqueId id;
  ncclGetUniqueId(&id);
  ncclComm_t c0 = nullptr, c1 = nullptr;
  cudaSetDevice(0);
  switch (kase) {
    case 0:  // rank out of range
      GIN_TRY(ncclCommInitRank(&c0, 2, id, 2));
      break;
    case 1:  // duplicate rank
      GIN_TRY(ncclCommInitRank(&c0, 2, id, 0));
      cudaSetDevice(1);
      GIN_TRY(ncclCommInitRank(&c1, 2, id, 0));
      break;
    case 2:  // mismatched nranks
      GIN_TRY(ncclCommInitRank(&c0, 2, id, 0));
      cudaSetDevice(1);
      GIN_TRY(ncclCommInitRank(&c1, 3, id, 1));
      break;
    case 3: {  // use before init
      void* p = nullptr;
      ncclWindow_t w = nullptr;
      GIN_TRY(ncclMemAlloc(&p, 4096));
      const ncclResult_t r = ncclCommWindowRegister(c0, p, 4096, &w, NCCL_WIN_COLL_SYMMETRIC);
      ncclMemFree(p);
      GIN_TRY(r);
      break;
    }
    case 4: {  // an error inside a group is ncclGroupEnd's
      GIN_TRY(ncclGroupStart());
      ncclCommInitRank(&c0, 2, id, 0);
      ncclCommInitRank(&c1, 2, id, 7);
      GIN_TRY(ncclGroupEnd());
      break;
    }
    default:
      return "unknown host case";
  }
  return {};
}

std::string Invoke(const CallArgs& a, bool* known) {
  *known = true;
  if (a.op == "gin_world") {
    TearDown();
    nccl_emu::WorldConfig w;
    w.num_ranks = static_cast<int>(a.attr("num_ranks"));
    w.gpus_per_node = static_cast<int>(a.attr("gpus_per_node"));
    w.seed = static_cast<uint64_t>(a.attr("seed"));
    w.max_delay = static_cast<int>(a.attr("max_delay"));
    w.settle_delay = static_cast<int>(a.attr("settle_delay"));
    w.max_contexts = static_cast<int>(a.attr("max_contexts"));
    nccl_emu::reset(w);
    for (int r = 0; r < w.num_ranks; ++r)  // as the port rule would: context c on port c % 2
      nccl_emu::set_context_ports(r, {0, 1, 0, 1});
    return {};
  }
  if (a.op == "gin_init") return Init(a);
  if (a.op == "gin_host_case") return HostCase(static_cast<int>(a.attr("case")));
  if (a.op == "gin_probe") {
    Args g{static_cast<int>(a.attr("case")),      static_cast<int>(a.attr("rank")),
           static_cast<int>(a.attr("peer")),      static_cast<int>(a.attr("rows")),
           static_cast<int>(a.attr("row_bytes")), static_cast<int>(a.attr("sig")),
           static_cast<int>(a.attr("flush")),     static_cast<int>(a.attr("ctx"))};
    if (static_cast<size_t>(g.rows) * static_cast<size_t>(g.row_bytes) > kDst - kSrc)
      return "gin_probe: rows * row_bytes exceeds the probe's areas";
    JEP_LAUNCH(GinProbe, 1, 32, 0, a.stream)
    (g, static_cast<const uint8_t*>(a.in.at(0)->data), static_cast<uint8_t*>(a.out.at(0)->data),
     static_cast<int32_t*>(a.out.at(1)->data));
    return {};
  }
  if (a.op == "gin_log_size") {  // s32[2]: records, operations pending
    int32_t* o = static_cast<int32_t*>(a.out.at(0)->data);
    o[0] = static_cast<int32_t>(nccl_emu::log().size());
    o[1] = static_cast<int32_t>(nccl_emu::pending());
    return {};
  }
  if (a.op == "gin_log") {  // s32[n, 10]: src dst context port devcomm block bytes kind call done
    const auto& log = nccl_emu::log();
    const int64_t n = a.out.at(0)->dims[0];
    int32_t* o = static_cast<int32_t*>(a.out.at(0)->data);
    for (int64_t i = 0; i < n && i < static_cast<int64_t>(log.size()); ++i) {
      const nccl_emu::LogRecord& r = log[static_cast<size_t>(i)];
      const int64_t row[10] = {r.src, r.dst, r.context, r.port, r.devcomm,
                               r.block, r.bytes, r.kind, r.call, r.done};
      for (int c = 0; c < 10; ++c) o[i * 10 + c] = static_cast<int32_t>(row[c]);
    }
    nccl_emu::clear_log();
    return {};
  }
  *known = false;
  return {};
}

emu_driver::RegisterInvoker g_register(Invoke);

}  // namespace
}  // namespace emu_gin_probe
}  // namespace jax_ep
