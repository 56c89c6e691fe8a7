// The NCCL host functions the NCCL GIN transport calls, as a table of pointers. The
// extension never links libnccl (it must load where NCCL is absent, and use the copy
// jax's CUDA plugin may already have loaded): kernels/internode/nccl_host.cc fills the
// table by name: with dlsym from libnccl.so.2, or, on the emulated GPU (JAX_EP_EMU), from
// nccl_emu::host_symbol (the emulated functions of kernels/emu/nccl_emu.h). The pointer
// types come from the declarations themselves, so the table cannot drift from the headers.
#pragma once

#if defined(JAX_EP_EMU)
#include "kernels/emu/nccl_emu.h"
#else
#include <nccl.h>
#include <nccl_device/host.h>
#endif

namespace jax_ep {
namespace nccl_host {

// Every function the host side needs, by name without the "nccl" prefix. All are
// required: a library that lacks one is too old (the device API arrived in 2.28, the
// GIN connection types and context counts in 2.30).
#define JAX_EP_NCCL_FUNCTIONS(X) \
  X(GetVersion)                  \
  X(GetErrorString)              \
  X(GetUniqueId)                 \
  X(CommInitRank)                \
  X(CommDestroy)                 \
  X(CommUserRank)                \
  X(CommCount)                   \
  X(GroupStart)                  \
  X(GroupEnd)                    \
  X(MemAlloc)                    \
  X(MemFree)                     \
  X(CommWindowRegister)          \
  X(CommWindowDeregister)        \
  X(DevCommCreate)               \
  X(DevCommDestroy)

struct NcclApi {
#define JAX_EP_NCCL_MEMBER(name) decltype(&::nccl##name) name = nullptr;
  JAX_EP_NCCL_FUNCTIONS(JAX_EP_NCCL_MEMBER)
#undef JAX_EP_NCCL_MEMBER
  // Optional (absent from the emulated NCCL): the last error's detail for a communicator.
  const char* (*GetLastError)(ncclComm_t) = nullptr;
  int version = 0;  // ncclGetVersion of the library (e.g. 23206 for 2.32.6)
};

}  // namespace nccl_host
}  // namespace jax_ep
