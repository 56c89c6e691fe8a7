// The CUDA backend's low-latency handlers, compiled for the emulated GPU by including the
// handler source itself. Ops: the targets of JEP_CUDA_LL_TARGETS without "jax_ep_"
// (ll_dispatch_send, ...: the real-rank send and receive halves; ll_harness_*).
#include "xla_ffi/cuda/low_latency_handlers.cc"  // NOLINT(build/include)
#include "xla_ffi/emu/emu_call.h"

namespace jax_ep {
JEP_EMU_REGISTER_TARGETS(JEP_CUDA_LL_TARGETS)
}  // namespace jax_ep
