// What every GPU's NCCL GIN transport reads (kernels/internode/transport_nccl_gin.cuh), as
// the host side (kernels/internode/nccl_host.cc) writes it at start-up: one per GPU.
#pragma once

#if defined(JAX_EP_EMU)
#include "kernels/emu/nccl_emu.h"  // the emulated GPU's NCCL (same API subset)
#else
#include <nccl.h>
#include <nccl_device.h>
#endif

#include "kernels/common/striping_plan.h"
#include "kernels/cuda/launch.cuh"

namespace jax_ep {
namespace transport {

struct NcclGinState {
  ncclDevComm full;        // GIN connections to every rank (direct, low-latency modes)
  ncclDevComm rail;        // to the same local GPU of every other node (hierarchical)
  ncclWindow_t win;        // the symmetric window: the internode heap
  char* base;              // this GPU's address of the window (offset = p - base)
  int num_contexts;        // GIN contexts usable (at least the plan's QPs)
  int ctx_of_qp[kMaxQps];  // the plan's logical QP -> GIN context
};

// Defined with JEP_DEVICE_GLOBAL in kernels/internode/nccl_host.cc.
JEP_DEVICE_EXTERN NcclGinState g_nccl_gin;

}  // namespace transport
}  // namespace jax_ep
