// The emulated GPU's runtime (kernels/emu/emu_internal.h): the CUDA runtime API subset the
// host code uses (kernels/emu/emu_cuda.h declares it) -- devices, memory, streams, events,
// IPC handles -- over the virtual GPUs and the scheduler. Model: docs/emulator.md.
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "kernels/emu/emu_internal.h"

// ---------------------------------------------------------------------------------------
// Runtime API.
using emu::S;

namespace {
cudaError_t Ret(cudaError_t e) {
  if (e != cudaSuccess) S().last_error = e;
  return e;
}
}  // namespace

cudaError_t cudaGetLastError() {
  emu::EnsureInit();
  const cudaError_t e = S().last_error;
  S().last_error = cudaSuccess;
  return e;
}
cudaError_t cudaPeekAtLastError() { return S().last_error; }
const char* cudaGetErrorName(cudaError_t e) { return cudaGetErrorString(e); }
const char* cudaGetErrorString(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "no error (emulated GPU)";
    case cudaErrorInvalidValue: return "invalid argument (emulated GPU)";
    case cudaErrorMemoryAllocation: return "out of memory (emulated GPU)";
    case cudaErrorLaunchFailure: return "unspecified launch failure: the emulator abandoned a deadlocked or hung kernel";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument (emulated GPU)";
    case cudaErrorInvalidDevice: return "invalid device ordinal (emulated GPU)";
    case cudaErrorInvalidResourceHandle: return "invalid resource handle (emulated GPU)";
    case cudaErrorCooperativeLaunchTooLarge: return "too many blocks in cooperative launch: more than the emulated GPU holds at once (its co-residency limit for this kernel)";
    case cudaErrorLaunchOutOfResources: return "too many resources requested for launch: one block needs more registers or shared memory than an SM has (emulated GPU, ptxas usage)";
    case cudaErrorNotSupported: return "operation not supported (emulated GPU)";
    default: return "unknown error (emulated GPU)";
  }
}
cudaError_t cudaGetDeviceCount(int* n) {
  emu::EnsureInit();
  *n = static_cast<int>(S().devices.size());
  return cudaSuccess;
}
cudaError_t cudaGetDevice(int* d) {
  emu::EnsureInit();
  *d = S().current;
  return cudaSuccess;
}
cudaError_t cudaSetDevice(int d) {
  emu::EnsureInit();
  if (emu::Dev(d) == nullptr) return Ret(cudaErrorInvalidDevice);
  S().current = d;
  return cudaSuccess;
}
cudaError_t cudaDeviceSynchronize() {
  emu::EnsureInit();
  emu::Device* d = emu::Dev(S().current);
  emu::SyncDevice(d);
  return S().last_error == cudaErrorLaunchFailure ? cudaErrorLaunchFailure : cudaSuccess;
}
cudaError_t cudaDeviceCanAccessPeer(int* can, int, int) {
  *can = 1;
  return cudaSuccess;
}
cudaError_t cudaDeviceEnablePeerAccess(int, unsigned) { return cudaSuccess; }
cudaError_t cudaMalloc(void** p, size_t bytes) {
  emu::EnsureInit();
  // Separate allocations (AddressSanitizer redzones between them), 256-byte aligned as
  // cudaMalloc's are, of exactly `bytes` (not rounded up as a GPU's allocator would), so
  // AddressSanitizer reports a write even one byte past the end.
  if (posix_memalign(p, 256, std::max<size_t>(bytes, 1)) != 0) *p = nullptr;
  if (*p == nullptr) return Ret(cudaErrorMemoryAllocation);
  S().allocs[reinterpret_cast<uintptr_t>(*p)] = {bytes, S().current};  // counters' spaces
  return cudaSuccess;
}
cudaError_t cudaFree(void* p) {
  S().allocs.erase(reinterpret_cast<uintptr_t>(p));
  emu::unmark_peer_memory(p);
  std::free(p);
  return cudaSuccess;
}
cudaError_t cudaHostAlloc(void** p, size_t bytes, unsigned) {
  const cudaError_t e = cudaMalloc(p, bytes);
  if (e == cudaSuccess) S().allocs[reinterpret_cast<uintptr_t>(*p)].second = -1;  // host memory
  return e;
}
cudaError_t cudaMallocHost(void** p, size_t bytes) { return cudaMalloc(p, bytes); }
cudaError_t cudaFreeHost(void* p) { return cudaFree(p); }
cudaError_t cudaHostGetDevicePointer(void** dev, void* host, unsigned) {
  *dev = host;
  return cudaSuccess;
}
cudaError_t cudaMemset(void* p, int v, size_t n) {
  emu::EnsureInit();
  emu::SyncDevice(emu::Dev(S().current));
  std::memset(p, v, n);
  return cudaSuccess;
}
// An operation queued on a stream (the default stream of the current device for null).
static cudaError_t EnqueueOp(cudaStream_t s, const emu::Op& op) {
  emu::EnsureInit();
  emu::Stream* st = emu::Resolve(s);
  if (st == nullptr) return Ret(cudaErrorInvalidResourceHandle);
  emu::PushOp(st, op);
  return cudaSuccess;
}
cudaError_t cudaMemsetAsync(void* p, int v, size_t n, cudaStream_t s) {
  emu::Op op;
  op.kind = emu::Op::kMemset;
  op.dst = p;
  op.value = v;
  op.n = n;
  return EnqueueOp(s, op);
}
cudaError_t cudaMemcpy(void* dst, const void* src, size_t n, cudaMemcpyKind) {
  emu::EnsureInit();
  emu::SyncDevice(emu::Dev(S().current));
  std::memmove(dst, src, n);
  return cudaSuccess;
}
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t n, cudaMemcpyKind, cudaStream_t s) {
  emu::Op op;
  op.kind = emu::Op::kMemcpy;
  op.dst = dst;
  op.src = src;
  op.n = n;
  return EnqueueOp(s, op);
}
cudaError_t cudaStreamCreate(cudaStream_t* s) { return cudaStreamCreateWithFlags(s, 0); }
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned) {
  emu::EnsureInit();
  *s = emu::NewStream(emu::Dev(S().current));
  return cudaSuccess;
}
cudaError_t cudaStreamDestroy(cudaStream_t s) {
  if (s == nullptr) return cudaSuccess;
  emu::SyncDevice(s->dev);
  auto& v = s->dev->streams;
  v.erase(std::remove(v.begin(), v.end(), s), v.end());
  delete s;
  return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t s) {
  emu::EnsureInit();
  emu::Stream* st = emu::Resolve(s);
  emu::RunUntil([st] { return st->ops.empty(); });
  return S().last_error == cudaErrorLaunchFailure ? cudaErrorLaunchFailure : cudaSuccess;
}
cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned) {
  emu::Op op;
  op.kind = emu::Op::kWait;
  op.ev = e;
  op.ticket = e->recorded;
  return EnqueueOp(s, op);
}
cudaError_t cudaEventCreate(cudaEvent_t* e) { return cudaEventCreateWithFlags(e, 0); }
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned) {
  *e = new emu::Event();
  return cudaSuccess;
}
cudaError_t cudaEventDestroy(cudaEvent_t e) {
  delete e;
  return cudaSuccess;
}
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s) {
  emu::Op op;
  op.kind = emu::Op::kRecord;
  op.ev = e;
  op.ticket = e->recorded + 1;
  const cudaError_t r = EnqueueOp(s, op);
  if (r == cudaSuccess) ++e->recorded;
  return r;
}
cudaError_t cudaEventSynchronize(cudaEvent_t e) {
  emu::RunUntil([e] { return e->completed >= e->recorded; });
  return cudaSuccess;
}
cudaError_t cudaIpcGetMemHandle(cudaIpcMemHandle_t* h, void* p) {
  // One process holds every virtual GPU: the handle is the pointer itself.
  std::memset(h, 0, sizeof(*h));
  std::memcpy(h->reserved, &p, sizeof(p));
  return cudaSuccess;
}
cudaError_t cudaIpcOpenMemHandle(void** p, cudaIpcMemHandle_t h, unsigned) {
  std::memcpy(p, h.reserved, sizeof(*p));
  return cudaSuccess;
}
cudaError_t cudaIpcCloseMemHandle(void*) { return cudaSuccess; }
