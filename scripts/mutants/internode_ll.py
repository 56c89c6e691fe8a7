"""Planted mistakes in kernels/internode/low_latency_kernels.cu, its host side low_latency_host.cu and transport_nvshmem.cuh (see scripts/mutants/__init__.py for the fields)."""
from __future__ import annotations

from . import Mutant
from ._paths import *  # noqa: F401,F403

# DispatchSendKernel's puts of a token's rows, then the one fence and their counts.
_PUTS = (
    "    for (int k = 0; k < g.K; ++k) {\n"
    "      const int i = t * g.K + k;\n"
    "      const int32_t e = idx[i];\n"
    "      if (e < 0 || pos[i] < 0) continue;\n"
    "      const int r = e / g.el, le = e % g.el;\n"
    "      Tr::put_warp(g.area + llwire::drecv_row(g.A, b, le, g.rank, pos[i]), st,\n"
    "                   static_cast<size_t>(g.ds_put), r, llwire::expert_qp(r, le, g.P, g.Q));\n"
    "    }\n")
_COUNTS = (
    "    // The token's rows are posted: one fence orders them all before their counts (not a\n"
    "    // fence per row); an expert's count signal waits at most for this token's other rows.\n"
    "    if (lane == 0) {\n"
    "      __threadfence();\n"
    "      for (int k = 0; k < g.K; ++k) {\n"
    "        const int i = t * g.K + k;\n"
    "        const int32_t e = idx[i];\n"
    "        if (e < 0 || pos[i] < 0) continue;\n"
    "        const int r = e / g.el, le = e % g.el;\n"
    "        RowCounted(g, kD, b, r, le, done, e, counts[e], llwire::expert_qp(r, le, g.P, g.Q));\n"
    "      }\n"
    "    }\n"
    "    __syncwarp();\n")

MUTANTS = [
    # ------------------------------------------------------- internode low-latency
    Mutant("llin_count_signal_before_rows", LLIN,
           _PUTS + _COUNTS, _COUNTS + _PUTS,
           (T_LLIN, "-k", "consecutive or undelivered"),
           "a token's rows counted (and an expert's count signal sent) before its rows are "
           "put: the owner reads rows before they land"),
    Mutant("llin_count_after_first_row", LLIN,
           "  if (atomicAdd(done + i, 1) + 1 == rows) SignalCount(",
           "  if (atomicAdd(done + i, 1) == 0) SignalCount(",
           (T_LLIN, "-k", "consecutive or undelivered or sm_budget"),
           "the count signal sent by the warp of an expert's first row, not its last: the "
           "rows issued after it may land after the reader saw the count (the budget test's "
           "one block walks several tokens per warp, so later tokens' rows are put after "
           "the first token's counts)"),
    Mutant("llin_missing_count_for_empty_expert", LLIN,
           "    const int r = e / g.el, le = e % g.el;\n"
           "    SignalCount(g, kD, b, r, le, 0, llwire::expert_qp(r, le, g.P, g.Q));",
           "    const int r = e / g.el, le = e % g.el;\n"
           "    (void)r; (void)le;",
           (T_LLIN, "-k", "matches_reference or empty"),
           "no count signal for an expert without rows: its owner waits for it until the "
           "timeout"),
    Mutant("llin_stage_one_parity", LLIN,
           "    char* st = g.area + llwire::dstage_row(g.A, b, t);",
           "    char* st = g.area + llwire::dstage_row(g.A, 0, t);",
           (T_LLIN, "-k", "two_sends or undelivered or consecutive"),
           "one send stage for both parities: the next send rewrites the rows the previous "
           "one's puts (source read at delivery) have not sent yet"),
    Mutant("llin_unpack_wrong_parity", LLIN,
           "__global__ void DispatchUnpack(G g, const int32_t* token, DispatchRecvOut out) {\n"
           "  const int b = static_cast<int>(TokenEpoch(kD, token) & 1ull);",
           "__global__ void DispatchUnpack(G g, const int32_t* token, DispatchRecvOut out) {\n"
           "  const int b = static_cast<int>((TokenEpoch(kD, token) + 1) & 1ull);",
           (T_LLIN, "-k", "matches_reference or consecutive"),
           "the receive half reads the other parity's rows (last call's, or garbage)"),
    Mutant("llin_credit_wait_dropped", LLIN,
           "  if (n > 2 && ok) {\n"
           "    for (int r = threadIdx.x; r < g.R; r += blockDim.x)\n"
           "      if (!WaitWord(g, Credit(g, op, b, r), n - 2,",
           "  if (n > 2 && ok && false) {\n"
           "    for (int r = threadIdx.x; r < g.R; r += blockDim.x)\n"
           "      if (!WaitWord(g, Credit(g, op, b, r), n - 2,",
           (T_LLIN, "-k", "third_send or consecutive"),
           "a send that does not wait for the readers' credit: a third call in flight "
           "overwrites a parity still being read, silently"),
    Mutant("llin_plan_position_whole_ballot", LLIN,
           "      const int p = c + __popc(m & below);",
           "      const int p = c + __popc(m);",
           (T_LLIN, "-k", "matches_reference"),
           "a slot's position counts every hit of its ballot, not the lanes below it: rows "
           "land in the wrong slots (or past M, dropped)"),
    Mutant("llin_grid_not_cut_to_budget", LLIN_HOST,
           "  int64_t b = (warps + kWarps - 1) / kWarps;\n  if (b > cap) b = cap;",
           "  int64_t b = (warps + kWarps - 1) / kWarps;\n  (void)cap;",
           (T_LLIN, "-k", "sm_budget"),
           "grids sized by the work alone: more blocks than the SM budget holds resident"),
    Mutant("internode_fetch_without_acquire", TRN,
           "    return nvshmem_emu::load_acquire(sig);  // a poll: the emulated NIC delivers "
           "meanwhile\n#else\n    return peer::load_acquire(sig);",
           "    return nvshmem_signal_fetch(sig);\n#else\n    return nvshmem_signal_fetch(sig);",
           (T_HIER, "-k", "matches_reference and 2x2"),
           "a signal polled without acquire: the header or rows read after it are stale"),
    # ------------------------------------------------------- FP8 cast in the send
    Mutant("llin_fp8_round_scale_ignored", LLIN,
           "st, row, g.H, g.elem, g.fp8 == 2, lane,",
           "st, row, g.H, g.elem, false, lane,",
           (T_LLIN, "-k", "fp8_one_message"),
           "round_scale dropped on the way to the send kernel: scales not powers of two"),
    Mutant("llin_fp8_unpack_scales_wrong_row", LLIN,
           "        out.recv_scales[row * nb + j] = devcopy::LoadLanded(sc + j);",
           "        out.recv_scales[(row ^ 1) * nb + j] = devcopy::LoadLanded(sc + j);",
           (T_LLIN, "-k", "fp8_one_message"),
           "the receive half writes a message's scales into its neighbour's row"),
    Mutant("llin_fp8_put_values_only", LLIN_HOST,
           "      d.fp8 != 0 ? static_cast<int64_t>(ll_fp8_msg_bytes(d.H)) : d.H * d.elem_bytes;",
           "      d.fp8 != 0 ? d.H : d.H * d.elem_bytes;",
           (T_LLIN, "-k", "fp8_one_message"),
           "the FP8 message sized for its values only: the scales never reach the owner"),
]
