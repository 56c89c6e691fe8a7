"""Planted mistakes in kernels/internode/transport_nccl_gin.cuh, the NCCL GIN backend (see
scripts/mutants/__init__.py for the fields): the GIN rules the emulated NCCL enforces
(kernels/emu/nccl_emu.h) must catch each through the internode kernels' own tests."""
from __future__ import annotations

from . import Mutant
from ._paths import *  # noqa: F401,F403

MUTANTS = [
    Mutant("gin_signal_weak", GIN,
           "    gin.signal(ncclTeamWorld(comm()), pe,\n"
           "               ncclGin_StrongVASignalAdd{g_nccl_gin.win, off(s.word), delta(s)},",
           "    gin.signal(ncclTeamWorld(comm()), pe,\n"
           "               ncclGin_WeakVASignalAdd{g_nccl_gin.win, off(s.word), delta(s)},",
           (T_LLIN, "-k", "nccl and matches_reference"),
           "weak signal where a strong one is needed: a count signal settles none of the rows "
           "put before it, so the reader reads stale rows"),
    Mutant("gin_wrong_context", GIN,
           "  static __device__ __forceinline__ int ctx(int qp) { return g_nccl_gin.ctx_of_qp[qp]; }",
           "  static __device__ __forceinline__ int ctx(int qp) {\n"
           "    return g_nccl_gin.ctx_of_qp[(qp + 1) % g_nccl_gin.num_contexts];\n"
           "  }",
           (T_IN, "-k", "nccl and transport_log and not full"),
           "wrong context: every QP's traffic goes out on another context, so on another "
           "port than the plan binds it to"),
    Mutant("gin_set_without_prev", GIN,
           "    return s.op == SignalOp::kAdd ? s.value : s.value - s.prev;",
           "    return s.value;",
           (T_LLIN, "-k", "nccl and consecutive_calls"),
           "a SET sent as an ADD of its value: an epoch word that held n - 2 ends at 2n - 2, "
           "so the next wait passes before its signal"),
]
