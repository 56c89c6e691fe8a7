// Emulated NCCL for the emulated GPU (kernels/emu/emu_cuda.h): the host and device subset
// of NCCL 2.32.6 that the GIN transport uses (/work/gin/CONTRACT.md, "Emulated NCCL"),
// with the names and signatures of nccl.h, nccl_device/host.h, core.h, coop.h and gin.h,
// so kernels/internode/transport_nccl_gin.cuh and nccl_host.cc compile unchanged.
//
// Model (docs/emulator.md, "NCCL GIN (emulated)"; gin.h lines cited as gin.h:N):
//   * A world per ncclUniqueId; a rank is a virtual GPU (ncclCommInitRank on the current
//     device). Rank r is on node r / gpus_per_node. Misuse returns ncclInvalidArgument or
//     ncclInvalidUsage with a text nccl_emu::last_error() returns.
//   * The k-th ncclCommWindowRegister of every rank of a comm is one symmetric window.
//   * GIN operations queue per (source, destination, devComm, context), are processed in
//     issue order within a queue after a seeded delay, in any order across queues. A
//     processed put has read its source (the NIC consumed it) but its data settles later;
//     a weak signal settles only its own put first (gin.h:28,45,162), a strong signal every
//     earlier put of its queue (gin.h:23,39,160-161). flush waits for processing, not settling
//     (gin.h:234-235).
#pragma once

#include <climits>
#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "kernels/emu/emu_control.h"
#include "kernels/emu/emu_cuda.h"

// ---------------------------------------------------------------------------------------
// nccl.h subset.
#define NCCL_MAJOR 2
#define NCCL_MINOR 32
#define NCCL_PATCH 6
#define NCCL_SUFFIX ""
#define NCCL_VERSION_CODE 23206
#define NCCL_VERSION(X, Y, Z) \
  (((X) <= 2 && (Y) <= 8) ? (X) * 1000 + (Y) * 100 + (Z) : (X) * 10000 + (Y) * 100 + (Z))
#define NCCL_UNIQUE_ID_BYTES 128
#define NCCL_CONFIG_UNDEF_INT INT_MIN
#define NCCL_API_MAGIC 0xcafebeef
#define NCCL_WIN_DEFAULT 0x00
#define NCCL_WIN_COLL_SYMMETRIC 0x01
#define NCCL_WIN_STRICT_ORDERING 0x02
#define NCCL_WIN_GIN_ONLY 0x04
#define NCCL_WIN_REQUIRED_ALIGNMENT 4096

typedef struct ncclComm* ncclComm_t;
typedef struct ncclWindow_vidmem* ncclWindow_t;
typedef struct {
  char internal[NCCL_UNIQUE_ID_BYTES];
} ncclUniqueId;
typedef enum {
  ncclSuccess = 0,
  ncclUnhandledCudaError = 1,
  ncclSystemError = 2,
  ncclInternalError = 3,
  ncclInvalidArgument = 4,
  ncclInvalidUsage = 5,
  ncclRemoteError = 6,
  ncclInProgress = 7,
  ncclTimeout = 8,
  ncclNumResults = 9
} ncclResult_t;

ncclResult_t ncclGetVersion(int* version);
const char* ncclGetErrorString(ncclResult_t result);
const char* ncclGetLastError(ncclComm_t comm);
ncclResult_t ncclGetUniqueId(ncclUniqueId* uniqueId);
// On the current virtual GPU (cudaSetDevice); does not wait for the other ranks (one host
// thread starts them one after another), so it behaves the same inside a group or not.
ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank);
ncclResult_t ncclGroupStart();
// Returns the first error of a call made since the matching ncclGroupStart.
ncclResult_t ncclGroupEnd();
ncclResult_t ncclCommDestroy(ncclComm_t comm);
ncclResult_t ncclCommCount(const ncclComm_t comm, int* count);
ncclResult_t ncclCommUserRank(const ncclComm_t comm, int* rank);
ncclResult_t ncclCommCuDevice(const ncclComm_t comm, int* device);
ncclResult_t ncclMemAlloc(void** ptr, size_t size);
ncclResult_t ncclMemFree(void* ptr);
ncclResult_t ncclCommWindowRegister(ncclComm_t comm, void* buff, size_t size, ncclWindow_t* win,
                                    int winFlags);
ncclResult_t ncclCommWindowDeregister(ncclComm_t comm, ncclWindow_t win);

// ---------------------------------------------------------------------------------------
// nccl_device/core.h, host.h subset.
struct ncclDevComm;
typedef struct ncclDevComm ncclDevComm_t;
typedef uint32_t ncclGinSignal_t;
typedef uint32_t ncclGinCounter_t;

struct ncclTeam {
  int nRanks, rank, stride;
};
typedef struct ncclTeam ncclTeam_t;

typedef enum {
  NCCL_GIN_CONNECTION_NONE,
  NCCL_GIN_CONNECTION_FULL,
  NCCL_GIN_CONNECTION_RAIL,
  NCCL_GIN_CONNECTION_CUSTOM_STRIDE,
  NCCL_GIN_CONNECTION_CUSTOM_ARRAY,
} ncclGinConnectionType_t;

typedef enum {
  NCCL_GIN_TYPE_NONE = 0,
  NCCL_GIN_TYPE_PROXY = 2,
  NCCL_GIN_TYPE_GDAKI = 3,
  NCCL_GIN_TYPE_GPI = 4,
  NCCL_GIN_TYPE_EFA_GDA = 5,
  NCCL_GIN_MAX_TYPES = 6,
} ncclGinType_t;

typedef enum { NCCL_CFT_NONE = 0x0, NCCL_CFT = 0x1, NCCL_CFT_MULTIMEM = 0x2 } ncclCftCap_t;

struct ncclDevResourceRequirements;
struct ncclTeamRequirements;

// The layout and initializer of host.h (positional), so either header's code builds one.
typedef struct ncclDevCommRequirements {
  size_t size;
  unsigned int magic;
  unsigned int version;
  struct ncclDevResourceRequirements* resourceRequirementsList;
  struct ncclTeamRequirements* teamRequirementsList;
  bool lsaMultimem;
  int barrierCount;
  int lsaBarrierCount;
  int railGinBarrierCount;
  int lsaLLA2ABlockCount, lsaLLA2ASlotCount;
  bool ginForceEnable;
  int ginContextCount;  // a hint (host.h:50): the devComm says what was granted
  int ginSignalCount;
  int ginCounterCount;
  ncclGinConnectionType_t ginConnectionType;
  bool ginExclusiveContexts;
  int ginQueueDepth;
  int ginTrafficClass;
  int worldGinBarrierCount;
  bool ginStrongSignalsRequired;
  bool ginVaSignalsRequired;
  int ginCustomStride;
  ncclGinType_t ginType;
  bool useRuntimeVersion;
  int cftCaps;
  int cftBarrierCount;
  int* ginCustomArray;
  int ginCustomArrayCount;
} ncclDevCommRequirements_t;

#define NCCL_DEV_COMM_REQUIREMENTS_INITIALIZER                                               \
  {                                                                                          \
    sizeof(ncclDevCommRequirements_t), NCCL_API_MAGIC, NCCL_VERSION_CODE, NULL, NULL, false, \
        0, 0, 0, 0, 0, false, 4, 0, 0, NCCL_GIN_CONNECTION_NONE, false, 0,                   \
        NCCL_CONFIG_UNDEF_INT, 0, true, true, 1, NCCL_GIN_TYPE_NONE, false, NCCL_CFT_NONE, 0, \
        NULL, 0                                                                              \
  }

// The device communicator, copied by value into device globals. Fields of
// impl/comm__types.h the transport reads, then the emulator's own (a world and the
// devComm's place in it; never read by kernels).
struct ncclDevComm {
  unsigned int magic;
  unsigned int version;
  int rank, nRanks;
  int lsaRank, lsaSize;
  int ginSignalCount;
  int ginCounterCount;
  uint32_t ginContextCount;  // granted: min(requested, WorldConfig::max_contexts)
  ncclGinConnectionType_t _emuConnection;
  int _emuWorld;    // index of the ncclUniqueId's world
  int _emuDevComm;  // k: the k-th ncclDevCommCreate of every rank is one devComm
};

ncclResult_t ncclDevCommCreate(ncclComm_t comm, ncclDevCommRequirements_t const* reqs,
                               ncclDevComm_t* outDevComm);
ncclResult_t ncclDevCommDestroy(ncclComm_t comm, ncclDevComm_t const* devComm);
ncclTeam_t ncclTeamWorld(ncclComm_t comm);

// Device-side teams (core.h:101-132).
inline ncclTeam ncclTeamWorld(ncclDevComm const& comm) { return ncclTeam{comm.nRanks, comm.rank, 1}; }
inline ncclTeam ncclTeamLsa(ncclDevComm const& comm) {
  return ncclTeam{comm.lsaSize, comm.lsaRank, 1};
}
inline ncclTeam ncclTeamRail(ncclDevComm const& comm) {
  return ncclTeam{comm.nRanks / comm.lsaSize, comm.rank / comm.lsaSize, comm.lsaSize};
}

// Window pointers (core.h:146-149). ncclGetPeerPointer: a load/store pointer into `peer`'s
// (world rank) copy of the window, or nullptr when `peer` is on another node; stores
// through it are peer stores (weak until a .sys fence or release, as nvshmem_ptr's).
void* ncclGetLocalPointer(ncclWindow_t w, size_t offset);
void* ncclGetPeerPointer(ncclWindow_t w, size_t offset, int peer);
void* ncclGetPeerPointer(ncclWindow_t w, size_t offset, ncclTeam tm, int peer);

// ---------------------------------------------------------------------------------------
// cuda:: names the device API's defaults use (libcu++ is not part of the emulated build).
namespace cuda {
enum thread_scope {
  thread_scope_system = 0,
  thread_scope_device = 1,
  thread_scope_block = 2,
  thread_scope_thread = 3
};
enum memory_order {
  memory_order_relaxed,
  memory_order_consume,
  memory_order_acquire,
  memory_order_release,
  memory_order_acq_rel,
  memory_order_seq_cst
};
}  // namespace cuda

// coop.h subset: an aligned power-of-two tile of lanes, some lanes, the whole CTA.
namespace nccl_emu {
// The threads a cooperative call spans: lanes `mask` of the calling warp, or the CTA.
struct CoopDesc {
  uint32_t mask;
  bool cta;
};
}  // namespace nccl_emu

template <int nThreadsPow2>
struct ncclCoopTile {
  static_assert(nThreadsPow2 >= 1 && nThreadsPow2 <= 32 &&
                    (nThreadsPow2 & (nThreadsPow2 - 1)) == 0,
                "ncclCoopTile: a power of two up to 32");
  int thread_rank() const { return static_cast<int>(threadIdx.x & 31) % nThreadsPow2; }
  constexpr int size() const { return nThreadsPow2; }
  constexpr int num_threads() const { return nThreadsPow2; }
  uint32_t laneMask() const {
    return (~0u >> (32 - nThreadsPow2)) << (static_cast<int>(threadIdx.x & 31) & -nThreadsPow2);
  }
  void sync() {
    if (nThreadsPow2 > 1) __syncwarp(laneMask());
  }
};
typedef ncclCoopTile<1> ncclCoopThread;
typedef ncclCoopTile<32> ncclCoopWarp;

struct ncclCoopLanes {
  uint32_t lmask;
  constexpr ncclCoopLanes(uint32_t m = ~0u) : lmask(m) {}
  int thread_rank() const {
    return __popc(lmask & ((1u << (threadIdx.x & 31)) - 1u));
  }
  int size() const { return __popc(lmask); }
  int num_threads() const { return __popc(lmask); }
  void sync() { __syncwarp(lmask); }
};

struct ncclCoopCta {
  int thread_rank() const { return static_cast<int>(threadIdx.x); }
  int size() const { return static_cast<int>(blockDim.x); }
  int num_threads() const { return static_cast<int>(blockDim.x); }
  void sync() { __syncthreads(); }
};

namespace nccl_emu {
template <int N>
inline CoopDesc coop_desc(ncclCoopTile<N> c) {
  return CoopDesc{c.laneMask(), false};
}
inline CoopDesc coop_desc(ncclCoopLanes c) { return CoopDesc{c.lmask, false}; }
inline CoopDesc coop_desc(ncclCoopCta) { return CoopDesc{0, true}; }
}  // namespace nccl_emu

// ---------------------------------------------------------------------------------------
// gin.h subset: remote actions (VA signals) and local actions.
struct ncclGin_None {};
// Strong: "visibility implies all preceding puts are settled" (gin.h:23, 39).
struct ncclGin_StrongVASignalInc {
  ncclWindow_t signalWindow;
  size_t signalOffset;
};
// Weak: "guarantees only the bundled put is settled" (gin.h:28, 45).
struct ncclGin_WeakVASignalInc {
  ncclWindow_t signalWindow;
  size_t signalOffset;
};
struct ncclGin_StrongVASignalAdd {
  ncclWindow_t signalWindow;
  size_t signalOffset;
  uint64_t value;
};
struct ncclGin_WeakVASignalAdd {
  ncclWindow_t signalWindow;
  size_t signalOffset;
  uint64_t value;
};
// "only guarantees that the bundled put is locally complete" (gin.h:100): counted when
// the put's source has been read.
struct ncclGin_WeakCounterInc {
  ncclGinCounter_t counter;
};
// No ncclGin_SignalSet: "Support deferred" (gin.h:92-93).

namespace nccl_emu {

enum SignalKind : int { kSigNone = 0, kSigStrong = 1, kSigWeak = 2 };
struct ActionDesc {
  int kind = kSigNone;
  ncclWindow_t win = nullptr;
  size_t offset = 0;
  uint64_t value = 0;
};
inline ActionDesc action_desc(ncclGin_None) { return {}; }
inline ActionDesc action_desc(ncclGin_StrongVASignalInc a) {
  return {kSigStrong, a.signalWindow, a.signalOffset, 1};
}
inline ActionDesc action_desc(ncclGin_WeakVASignalInc a) {
  return {kSigWeak, a.signalWindow, a.signalOffset, 1};
}
inline ActionDesc action_desc(ncclGin_StrongVASignalAdd a) {
  return {kSigStrong, a.signalWindow, a.signalOffset, a.value};
}
inline ActionDesc action_desc(ncclGin_WeakVASignalAdd a) {
  return {kSigWeak, a.signalWindow, a.signalOffset, a.value};
}
inline int local_counter(ncclGin_None) { return -1; }
inline int local_counter(ncclGin_WeakCounterInc a) { return static_cast<int>(a.counter); }

// The device side of ncclGin (nccl_emu.cc). `peer` is a world rank; `coop` the calling
// threads: one operation per cooperative call, issued by its first lane once every lane
// of the coop has arrived with the same arguments.
void gin_put(ncclDevComm const& comm, int ctx, int peer, ncclWindow_t dst, size_t dst_off,
             ncclWindow_t src, size_t src_off, size_t bytes, ActionDesc remote, int counter,
             CoopDesc coop);
void gin_signal(ncclDevComm const& comm, int ctx, int peer, ActionDesc remote, CoopDesc coop);
void gin_flush(ncclDevComm const& comm, int ctx, CoopDesc coop);
uint64_t gin_read_signal(ncclDevComm const& comm, int ctx, ncclWindow_t w, size_t off, int bits);
uint64_t gin_read_counter(ncclDevComm const& comm, int ctx, ncclGinCounter_t c, int bits);
void gin_reset_signal(ncclDevComm const& comm, int ctx, ncclWindow_t w, size_t off);
void gin_reset_counter(ncclDevComm const& comm, int ctx, ncclGinCounter_t c);
void gin_check(ncclDevComm const& comm, int ctx);
inline bool rolling_less_equal(uint64_t a, uint64_t b, int bits) {
  const uint64_t m = ~uint64_t{0} >> (64 - bits);
  return ((b - a) & m) <= (m >> 1);
}

}  // namespace nccl_emu

// ncclGin (gin.h:120-334), one GIN context of a devComm: put, signal, flush, read/wait.
struct ncclGin {
  ncclDevComm const& comm;
  uint32_t contextId;

  // "Each context has one QP per peer" (gin.h:130); a context the devComm was not granted
  // is an emulator fault.
  ncclGin(ncclDevComm const& c, int contextIndex) : comm(c), contextId(static_cast<uint32_t>(contextIndex)) {
    nccl_emu::gin_check(comm, contextIndex);
  }

  template <typename RemoteAction = ncclGin_None, typename LocalAction = ncclGin_None,
            typename Coop = ncclCoopThread, typename DescriptorSmem = ncclGin_None>
  void put(ncclTeam team, int peer, ncclWindow_t dstWnd, size_t dstOffset, ncclWindow_t srcWnd,
           size_t srcOffset, size_t bytes, RemoteAction remoteAction = ncclGin_None{},
           LocalAction localAction = ncclGin_None{}, Coop coop = ncclCoopThread{},
           DescriptorSmem = ncclGin_None{},
           cuda::thread_scope = cuda::thread_scope_thread,
           cuda::thread_scope = cuda::thread_scope_device, uint32_t = 0) const {
    nccl_emu::gin_put(comm, static_cast<int>(contextId), WorldPeer(team, peer), dstWnd,
                      dstOffset, srcWnd, srcOffset, bytes, nccl_emu::action_desc(remoteAction),
                      nccl_emu::local_counter(localAction), nccl_emu::coop_desc(coop));
  }

  template <typename RemoteAction, typename Coop = ncclCoopThread,
            typename DescriptorSmem = ncclGin_None>
  void signal(ncclTeam team, int peer, RemoteAction remoteAction, Coop coop = ncclCoopThread(),
              DescriptorSmem = ncclGin_None{}, cuda::thread_scope = cuda::thread_scope_thread,
              cuda::thread_scope = cuda::thread_scope_device, uint32_t = 0) const {
    nccl_emu::gin_signal(comm, static_cast<int>(contextId), WorldPeer(team, peer),
                         nccl_emu::action_desc(remoteAction), nccl_emu::coop_desc(coop));
  }

  // "All source buffers from put's from any thread in this coop will be safe to reuse.
  // Flush does not guarantee that data has settled in remote memory." (gin.h:234-235)
  template <typename Coop, typename DescriptorSmem = ncclGin_None>
  void flush(Coop coop, cuda::memory_order = cuda::memory_order_acquire,
             DescriptorSmem = ncclGin_None{}) const {
    nccl_emu::gin_flush(comm, static_cast<int>(contextId), nccl_emu::coop_desc(coop));
  }

  // A poll: the emulated transport makes progress before the read (gin.h:280).
  uint64_t readSignal(ncclWindow_t signalWindow, size_t signalOffset, int bits = 64,
                      cuda::memory_order = cuda::memory_order_acquire) const {
    return nccl_emu::gin_read_signal(comm, static_cast<int>(contextId), signalWindow,
                                     signalOffset, bits);
  }

  template <typename Coop>
  void waitSignal(Coop coop, ncclWindow_t signalWindow, size_t signalOffset, uint64_t least,
                  int bits = 64, cuda::memory_order = cuda::memory_order_acquire) const {
    while (!nccl_emu::rolling_less_equal(least, readSignal(signalWindow, signalOffset, bits),
                                         bits)) {
    }
    coop.sync();
  }

  void resetSignal(ncclWindow_t signalWindow, size_t signalOffset) const {
    nccl_emu::gin_reset_signal(comm, static_cast<int>(contextId), signalWindow, signalOffset);
  }

  uint64_t readCounter(ncclGinCounter_t counter, int bits = 56,
                       cuda::memory_order = cuda::memory_order_acquire) const {
    return nccl_emu::gin_read_counter(comm, static_cast<int>(contextId), counter, bits);
  }

  template <typename Coop>
  void waitCounter(Coop coop, ncclGinCounter_t counter, uint64_t least, int bits = 56,
                   cuda::memory_order = cuda::memory_order_acquire) const {
    while (!nccl_emu::rolling_less_equal(least, readCounter(counter, bits), bits)) {
    }
    coop.sync();
  }

  void resetCounter(ncclGinCounter_t counter) const {
    nccl_emu::gin_reset_counter(comm, static_cast<int>(contextId), counter);
  }

 private:
  // A team rank as a world rank (core__funcs.h:173).
  int WorldPeer(ncclTeam tm, int peer) const { return comm.rank + (peer - tm.rank) * tm.stride; }
};

// ---------------------------------------------------------------------------------------
// Control of the emulated NCCL (drivers and tests).
namespace nccl_emu {

// Delays are in transport steps: one per GIN call or poll anywhere in the world, so a
// receiver's poll loop runs many while the sender issues one put (hence long defaults).
struct WorldConfig {
  int num_ranks = 2;        // ranks of every comm (ncclCommInitRank's nranks must match)
  int gpus_per_node = 1;    // rank r is on node r / gpus_per_node (LSA peers, rails)
  uint64_t seed = 1;
  int max_delay = 64;       // transport steps an operation may wait before processing
  int settle_delay = 1024;  // further steps a processed put's data may take to settle
  int max_contexts = 4;     // GIN contexts a devComm is granted at most
};

// Starts a fresh world: every comm, window and devComm forgotten (memory stays allocated:
// ncclMemFree frees it), queues, log and counters cleared, context ports unset.
void reset(const WorldConfig& c);
// Raises num_ranks to at least n, keeping everything else.
void grow(int num_ranks);
const WorldConfig& world_config();

// The text of the last failed host call (kept until the next failure or reset; as
// ncclGetLastError's "last error that occurred", nccl.h:376).
std::string last_error();

// Which wire port each GIN context of world rank `rank` sits on (kernels/internode/
// nccl_select.h decides); a context without one logs port -1.
void set_context_ports(int rank, std::vector<int> ports);

enum LogKind : int { kPut = 0, kPutStrong = 1, kPutWeak = 2, kSignalStrong = 3, kSignalWeak = 4 };
struct LogRecord {
  int src, dst, context, port, devcomm, block;
  int64_t bytes;  // 0 for a signal alone
  int kind;       // LogKind
  int64_t call;   // set_call's number at issue
  int64_t done;   // the transport's processing sequence number, -1 while queued
  int64_t sig_off;  // the signal word's offset in its window (the atomic's address), -1: none
};
// Tags the operations logged from now on (the driver numbers its calls); data the previous
// call left unsettled lands first.
void set_call(int64_t call);
// Every GIN operation since the last clear, in issue order.
const std::vector<LogRecord>& log();
void clear_log();
// "ctx<c>:puts|signals|bytes|wrs", "processed", "settled", "strong_settles", "flushes",
// "polls" (also in the emulator's counters as "nccl:<name>").
std::map<std::string, uint64_t> counters();
// Operations not processed yet plus processed puts whose data has not settled.
int64_t pending();
// Processes every queued operation and settles all data (host; the end of a test's call).
void drain();
// A poll of a local window word (an acquire), as readSignal: the transport makes progress.
uint64_t load_acquire(const uint64_t* p);
// A host function of the emulated library by name (what dlsym finds in a real one), or null.
void* host_symbol(const char* name);

}  // namespace nccl_emu
