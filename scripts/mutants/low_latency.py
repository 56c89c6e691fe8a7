"""Planted mistakes in kernels/cuda/low_latency_kernels.cu (see scripts/mutants/__init__.py for the fields)."""
from __future__ import annotations

from . import Mutant
from ._paths import *  # noqa: F401,F403

FP8Q = "kernels/common/fp8_quant.h"
FP8W = "kernels/common/fp8_warp.cuh"
_BASIC = (T_LL, "-k", "test_ll_dispatch_combine and not full")
_WORD = "reinterpret_cast<uint64_t*>(ll_at(a, r, a.L.dispatch_word_off(half, e, a.me)))"

MUTANTS = [
    # ------------------------------------------------------------ low latency
    Mutant("ll_counts_zeroed", LL,
           "const int32_t rows = failed || skip ? 0 : (c < a.M ? c : a.M);",
           "const int32_t rows = 0;",
           _BASIC,
           "a count zeroed in the owner's arrival word"),
    Mutant("ll_recv_wrong_half", LL,
           "  const uint64_t n = ll_recv_epoch(a, h->seq_dispatch);\n  const int half = ll_half(n);",
           "  const uint64_t n = ll_recv_epoch(a, h->seq_dispatch);\n  const int half = ll_half(n + 1);",
           (T_LL, "-k", "two_sends or (test_ll_dispatch_combine and not full)"),
           "wrong half/parity: the receive half reads the other epoch's slots"),
    Mutant("ll_push_skipped_signal", LL,
           "      peer::signal(reinterpret_cast<uint64_t*>(ll_at(a, r, a.L.dispatch_word_off(half, e, a.me))),\n"
           "                   ll_count_word(n, rows));",
           "      (void)rows;",
           _BASIC,
           "skipped arrival word: owners time out"),
    Mutant("ll_credit_wait_too_strict", LL,
           "    if (threadIdx.x == 0 && n > 2)\n      ll_wait_credit(a, &h->credit_dispatch[half][r], n - 2,",
           "    if (threadIdx.x == 0 && n > 1)\n      ll_wait_credit(a, &h->credit_dispatch[half][r], n - 1,",
           (T_LL, "-k", "two_sends"),
           "wrong half in the credit rule: a second send in flight waits for the first's receive"),
    Mutant("ll_missing_credit_wait", LL,
           "    if (threadIdx.x == 0 && n > 2)\n      ll_wait_credit(a, &h->credit_dispatch[half][r], n - 2,",
           "    if (false)\n      ll_wait_credit(a, &h->credit_dispatch[half][r], n - 2,",
           (T_LL, "-k", "third_send"),
           "missing credit wait: a third send overwrites slots its owner has not read"),
    Mutant("ll_send_no_fence", LL,
           "    // Every thread orders its own rows before the pair's word.\n    peer::fence_data();\n",
           "",
           (T_LL, "-k", "one_run"),
           "removed fence: other threads' rows not ordered before the arrival word"),
    Mutant("ll_count_before_rows", LL,
           "    const int c = ll_number_block(a, g, &sh, [&](int base, int rows) {\n      if (skip) return;",
           "    const int c = ll_number_block(a, g, &sh, [&](int base, int rows) {\n"
           "      if (threadIdx.x == 0)\n"
           f"        peer::signal({_WORD}, ll_count_word(n, base + rows < a.M ? base + rows : a.M));\n"
           "      if (skip) return;",
           (T_LL, "-k", "one_run"),
           "count released before the rows: the owner reads slots not yet written"),
    Mutant("ll_combine_word_wrong_half", LL,
           "ll_at(a, d, a.L.combine_word_off(half, a.me, e))",
           "ll_at(a, d, a.L.combine_word_off(1 - half, a.me, e))",
           _BASIC,
           "combine arrival word in the wrong half: sources wait for the other epoch"),
    # ------------------------------------------------------------ combine's receive sum
    # kernels/cuda/ll_combine_sum.cuh, shared by the intranode and internode receive halves;
    # the intranode tests plant them (the internode ones would kill them the same way).
    Mutant("ll_combine_reduce_skips_last_slot", LLSUM,
           "    if (kg + u >= nb) row[u] = nullptr;",
           "    if (kg + u + 1 >= nb) row[u] = nullptr;",
           _BASIC,
           "off-by-one in the receive sum's slots: each token's last slot is never summed"),
    Mutant("ll_sum_batch_leaves_out_a_row", LLSUM,
           "                acc[c][j] = ll_weighted_add(acc[c][j], wk[u], elem_of<kKind>(v[u][c], j));",
           "                acc[c][j] = u == kLLSumRows - 1 ? acc[c][j]\n"
           "                                                : ll_weighted_add(acc[c][j], wk[u], elem_of<kKind>(v[u][c], j));",
           (T_LL, "-k", "past_one_batch"),
           "the last row of a batch of loads in flight loaded but left out of the sum "
           "(only tokens with more than kLLSumRows - 1 slots show it)"),
    Mutant("ll_sum_batch_adds_k_descending", LLSUM,
           "#pragma unroll\n"
           "        for (int u = 0; u < kLLSumRows; ++u)\n"
           "#pragma unroll\n"
           "          for (int c = 0; c < kLLSumCols; ++c)\n"
           "            if (row[u] != nullptr && first + 32 * c < units)\n"
           "#pragma unroll\n"
           "              for (int j = 0; j < kP; ++j)",
           "#pragma unroll\n"
           "        for (int u = kLLSumRows - 1; u >= 0; --u)\n"
           "#pragma unroll\n"
           "          for (int c = 0; c < kLLSumCols; ++c)\n"
           "            if (row[u] != nullptr && first + 32 * c < units)\n"
           "#pragma unroll\n"
           "              for (int j = 0; j < kP; ++j)",
           (T_LL, "-k", "past_one_batch and f32"),
           "a batch's rows added k descending: the same terms, another float32 rounding "
           "(the contract sums k ascending)"),
    Mutant("ll_sum_item_reads_first_chunk", LLSUM,
           "  const int64_t first = chunk * kLLSumChunk + lane;",
           "  const int64_t first = lane + 0 * chunk;",
           (T_LL, "-k", "past_one_batch"),
           "every item of a token sums and stores its first chunk: the row's later units "
           "are never written"),
    # ------------------------------------------------------------ FP8 cast in the send
    Mutant("ll_fp8_scale_wrong_slot", FP8W,
           "    if (sub == 0) store4(scales + b, s);",
           "    if (sub == 0) store4(scales + (b ^ 1) % nb, s);",
           (T_LL, "-k", "fp8_one_message and bf16"),
           "an FP8 block's scale written into the neighbouring block's slot"),
    Mutant("ll_fp8_amax_half_block", FP8W,
           "    for (int o = kLanesPerBlock / 2; o >= 1; o /= 2)",
           "    for (int o = kLanesPerBlock / 4; o >= 1; o /= 2)",
           (T_LL, "-k", "fp8_one_message and bf16"),
           "an FP8 scale from half of its block: the amax reduction stops at 4 of its 8 lanes"),
    Mutant("ll_fp8_subnormal_ties_up", FP8Q,
           "if (rem > half || (rem == half && (q & 1u))) ++q;",
           "if (rem >= half) ++q;",
           (T_LL, "-k", "fp8_one_message"),
           "FP8 subnormals rounded half up instead of to even (the rule both kernel sets share)"),
    Mutant("ll_fp8_normal_ties_down", FP8Q,
           "  const uint32_t r = a + 0x7ffffu + ((a >> 20) & 1u);",
           "  const uint32_t r = a + 0x7ffffu;",
           (T_LL, "-k", "fp8_one_message"),
           "FP8 normals' ties rounded down instead of to even"),
    Mutant("ll_fp8_recv_scales_wrong_row", LL,
           "        float* out = static_cast<float*>(a.recv_scales) + (row0 + j) * nb;",
           "        float* out = static_cast<float*>(a.recv_scales) + (row0 + (j ^ 1)) * nb;",
           (T_LL, "-k", "fp8_one_message and bf16"),
           "the receive half writes a message's scales into its neighbour's row"),
    Mutant("ll_fp8_source_row_stride", LL,
           "  const size_t x_row = a.fp8 != 0 ? static_cast<size_t>(a.H) * FloatKindBytes(a.kind) : a.row_bytes;",
           "  const size_t x_row = a.row_bytes;",
           (T_LL, "-k", "fp8_one_message and bf16"),
           "with fp8, x's rows read at the message's stride: tokens cast from the wrong rows"),
    Mutant("ll_handle_check_dropped", LL,
           "    if (f < 0 || c < 0 || f + c > RM) {",
           "    if (false) {",
           (T_LL, "-k", "foreign"),
           "a foreign combine handle is not caught: rows outside y are sent"),
    Mutant("ll_send_fence_gpu_scope", LL,
           "    // Every thread orders its own rows before the pair's word.\n    peer::fence_data();\n",
           "    // Every thread orders its own rows before the pair's word.\n    __threadfence();\n",
           (T_LL, "-k", "one_run"),
           "the send's fence at .gpu scope: other threads' rows not ordered before the "
           "arrival word as the owner GPU sees them"),
]
