#include "xla_ffi/cuda/cuda_state.h"

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdlib>
#include <mutex>
#include <sstream>

#include "xla_ffi/common/ffi_helpers.h"

namespace jax_ep {
namespace {

std::mutex& Mu() {
  static std::mutex mu;
  return mu;
}
CudaDomain* Domains() {
  static CudaDomain domains[kMaxCudaDevices];
  return domains;
}
ErrorRecord* g_mirror = nullptr;
std::atomic<uint64_t> g_used{0};  // bit i: device ordinal i (kMaxCudaDevices <= 64)
static_assert(kMaxCudaDevices <= 64, "g_used is one 64-bit mask");

const char* OpName(int kind) {
  switch (kind) {
    case kOpDispatch: return "dispatch";
    case kOpCombine: return "combine";
    case kOpGather: return "gather (combine's transpose)";
    case 8: return "low-latency dispatch";
    case 9: return "low-latency combine";
    case 10: return "low-latency dispatch (waiting for an owner's credit)";
    case 11: return "low-latency combine (waiting for a source's credit)";
    default: return "?";
  }
}

}  // namespace

void MarkDeviceUsed(int ordinal) {
  if (ordinal < 0 || ordinal >= kMaxCudaDevices) return;
  g_used.fetch_or(uint64_t{1} << ordinal, std::memory_order_relaxed);
}

std::vector<int> DevicesInUse() {
  const uint64_t m = g_used.load(std::memory_order_relaxed);
  std::vector<int> out;
  for (int i = 0; i < kMaxCudaDevices; ++i)
    if ((m >> i) & 1u) out.push_back(i);
  return out;
}

bool GetCudaDomain(int ordinal, CudaDomain* out) {
  if (ordinal < 0 || ordinal >= kMaxCudaDevices) return false;
  std::lock_guard<std::mutex> lock(Mu());
  if (Domains()[ordinal].num_ranks == 0) return false;
  *out = Domains()[ordinal];
  return true;
}

void SetCudaDomain(int ordinal, const CudaDomain& d) {
  if (ordinal < 0 || ordinal >= kMaxCudaDevices) return;
  MarkDeviceUsed(ordinal);
  std::lock_guard<std::mutex> lock(Mu());
  Domains()[ordinal] = d;
}

void ClearCudaDomain(int ordinal) {
  if (ordinal < 0 || ordinal >= kMaxCudaDevices) return;
  std::lock_guard<std::mutex> lock(Mu());
  Domains()[ordinal] = CudaDomain{};
}

bool AllocateErrorMirror(std::string* err) {
  std::lock_guard<std::mutex> lock(Mu());
  if (g_mirror != nullptr) return true;
  void* p = nullptr;
  const cudaError_t e = cudaHostAlloc(&p, sizeof(ErrorRecord) * kMaxCudaDevices,
                                      cudaHostAllocMapped | cudaHostAllocPortable);
  if (e != cudaSuccess) {
    if (err) *err = std::string("cudaHostAlloc for the error records failed: ") + cudaGetErrorString(e);
    return false;
  }
  auto* recs = static_cast<ErrorRecord*>(p);
  for (int i = 0; i < kMaxCudaDevices; ++i) recs[i] = ErrorRecord{};
  g_mirror = recs;
  return true;
}

ErrorRecord* ErrorMirror(int ordinal) {
  if (ordinal < 0 || ordinal >= kMaxCudaDevices) return nullptr;
  std::lock_guard<std::mutex> lock(Mu());
  return g_mirror == nullptr ? nullptr : g_mirror + ordinal;
}

std::string PendingMirrorError() {
  ErrorRecord* m = nullptr;
  {
    std::lock_guard<std::mutex> lock(Mu());
    m = g_mirror;
  }
  if (m == nullptr) return {};
  for (int i = 0; i < kMaxCudaDevices; ++i) {
    const volatile ErrorRecord* r = m + i;
    if (r->code != kErrNone) {
      ErrorRecord copy;
      copy.code = r->code;
      copy.rank = r->rank;
      copy.a = r->a;
      copy.b = r->b;
      copy.c = r->c;
      copy.d = r->d;
      return DescribeError(copy, i);
    }
  }
  return {};
}

void ClearErrorMirror() {
  std::lock_guard<std::mutex> lock(Mu());
  if (g_mirror == nullptr) return;
  for (int i = 0; i < kMaxCudaDevices; ++i) {
    volatile ErrorRecord* r = g_mirror + i;
    r->code = kErrNone;
  }
}

std::string DescribeError(const ErrorRecord& e, int ordinal) {
  std::ostringstream s;
  s << "jax_ep: ";
  switch (e.code) {
    case kErrBadTopkId:
      if (e.d < 0)  // low-latency mode: an id repeated within one token
        s << "jax_ep.low_latency: topk_idx[" << e.a << ", " << e.b << "] = " << e.c
          << " names an expert an earlier slot of token " << e.a << " names (duplicate ids "
          << "in one token's top-k)";
      else
        s << "topk_idx[" << e.a << ", " << e.b << "] = " << e.c << " is outside [-1, " << e.d
          << ") (num_experts=" << e.d << ")";
      break;
    case kErrTimeout:
      s << "timed out in " << OpName(e.b) << " waiting for rank " << e.a << " (epoch " << e.c
        << "); a peer did not take part in the call (raise JAX_EP_TIMEOUT_S if it is slow)";
      break;
    case kErrBadHandle:
      if (e.d == 9 && e.b < 0)  // a source of a low-latency combine, told by owner e.a
        s << "low-latency combine: rank " << e.a << " was given a handle.first_row/row_count "
          << "that does not fit its y and sent no rows (they count as zero); the handle "
          << "does not belong to this call";
      else if (e.d == 9)
        s << "low-latency combine: handle.first_row/row_count do not fit y (local expert "
          << e.a << " (-1: all), source rank " << e.b << ", value " << e.c
          << "); the handle does not belong to this call";
      else
        s << OpName(e.d) << ": handle.src_rank/src_index or send_row out of range (entry "
          << e.a << ", rank " << e.b << ", value " << e.c
          << "); the handle does not belong to this call";
      break;
    case kErrRankMismatch:
      s << "the rank/group passed to the op (rank " << e.a << ", group " << e.c
        << ") differ from those jax_ep.cuda.setup registered for this GPU (rank " << e.b
        << ", group " << e.d << "); call setup with the mesh and axis the op runs on";
      break;
    case kErrCallSite:
      s << OpName(e.b) << ": rank " << e.a << " is in another EP call (its call id/tag or epoch "
        << e.c << ", this rank's " << e.d << "); every rank must run the same EP calls with the "
        << "same shapes in the same order";
      break;
    case kErrPeerFailed:
      s << OpName(e.b) << ": rank " << e.a << " had an error and moved no data; see its record "
        << "(jax_ep.cuda.check_errors on that rank), then jax_ep.cuda.reset()";
      break;
    case kErrPeerBadId:
      s << OpName(e.b) << ": rank " << e.a << "'s topk_idx holds ids outside [-1, num_experts) "
        << "(its record names them; they were treated as unused and the data moved)";
      break;
    default:
      s << "unknown device error code " << e.code;
  }
  s << " [GPU " << ordinal;
  if (e.rank >= 0) s << ", rank " << e.rank;
  s << "]";
  return s.str();
}

int DeviceSmCount(int ordinal) {
  static std::atomic<int> cache[kMaxCudaDevices] = {};
  if (ordinal < 0 || ordinal >= kMaxCudaDevices) return 132;
  int n = cache[ordinal].load(std::memory_order_relaxed);
  if (n > 0) return n;
#if defined(JAX_EP_EMU)
  n = 132;  // the emulated GPU has no SM count; the grids are cut as on an H100/H200
#else
  if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, ordinal) != cudaSuccess ||
      n < 1) {
    cudaGetLastError();  // not sticky; clear it so the launch does not report it
    n = 132;
  }
#endif
  cache[ordinal].store(n, std::memory_order_relaxed);
  return n;
}

int64_t KernelTimeoutNs() { return static_cast<int64_t>(TimeoutSeconds() * 1e9); }

}  // namespace jax_ep
