// What every GPU holds for the NCCL GIN transport: the device communicators,
// the symmetric window that is the internode heap, and the plan's QP -> GIN context map.
// Written by the host at start (kernels/internode/nccl_host.cc), read by the device
// transport (transport::NcclGin). A header of its own so the host side needs no device
// code and the device side no host code.
#pragma once

#if defined(JAX_EP_EMU)
#include "kernels/emu/nccl_emu.h"
#else
#include <nccl.h>
#include <nccl_device/host.h>  // ncclDevComm (complete), ncclDevCommRequirements
#endif

#include "kernels/common/striping_plan.h"
#include "kernels/cuda/launch.cuh"

namespace jax_ep {
namespace transport {

struct NcclGinState {
  ncclDevComm full;        // GIN connections to every rank (direct, low-latency modes)
  ncclDevComm rail;        // GIN connections to the same local GPU of other nodes (hierarchical)
  ncclWindow_t win;        // the symmetric window = the internode heap
  char* base;              // this GPU's address of the window (offset = p - base)
  int num_contexts;        // GIN contexts usable (>= the plan's QPs)
  int ctx_of_qp[kMaxQps];  // the plan's logical QP q -> GIN context index
};

// Defined with JEP_DEVICE_GLOBAL in kernels/internode/nccl_host.cc (one per GPU; the
// emulated GPU keeps one per virtual GPU).
JEP_DEVICE_EXTERN NcclGinState g_nccl_gin;

}  // namespace transport
}  // namespace jax_ep
