// The CUDA backend's intranode and layout handlers, compiled for the emulated GPU: this
// translation unit includes the handler source itself, so the emulator runs the same
// argument checks, argument construction and launch sequences (LaunchPhases) as a GPU.
// Ops: the targets of JEP_CUDA_TARGETS without "jax_ep_" (layout, dispatch, ...).
#include "xla_ffi/cuda/cuda_handlers.cc"  // NOLINT(build/include): the handlers themselves
#include "xla_ffi/emu/emu_call.h"

namespace jax_ep {
JEP_EMU_REGISTER_TARGETS(JEP_CUDA_TARGETS)
}  // namespace jax_ep
