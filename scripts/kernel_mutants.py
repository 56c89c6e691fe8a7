"""Known mistakes planted in the kernel sources by scripts/mutate_kernels.py.

One Mutant per entry:
  name         unique id (--only NAME)
  file         path from the repository root
  original     an exact snippet that occurs exactly once in `file`
  replacement  what the snippet becomes in the mutant
  tests        pytest arguments (a tuple, one argument per item) whose tests must fail
               for the mutant to count as killed; they run against the mutant's emulated
               module (JAX_EP_EMU_MODULE_DIR)
  why          the mistake, in a few words
Append new entries at the end (internode kernels too); keep names unique. A mutant that no
test can kill is equivalent under the emulator's model: explain it in docs/emulator.md
instead of listing it here.
"""
from __future__ import annotations

from typing import NamedTuple


class Mutant(NamedTuple):
    name: str
    file: str
    original: str
    replacement: str
    tests: tuple
    why: str


INTRA = "kernels/cuda/intranode_kernels.cu"
LAYOUT = "kernels/cuda/layout_kernels.cu"
LL = "kernels/cuda/low_latency_kernels.cu"
T_INTRA = "tests/emu/test_intranode_emu.py"
T_LL = "tests/emu/test_low_latency_emu.py"
IN = "kernels/internode/internode_kernels.cu"
HIER = "kernels/internode/hierarchical_kernels.cu"
T_IN = "tests/emu/test_internode_emu.py"
T_HIER = "tests/emu/test_internode_hier_emu.py"
LLIN = "kernels/internode/low_latency_kernels.cu"
TRN = "kernels/internode/transport_nvshmem.cuh"
T_LLIN = "tests/emu/test_internode_ll_emu.py"

MUTANTS = [
    # ------------------------------------------------------------------ layout
    Mutant("layout_first_slot_bound", LAYOUT,
           "for (int j = 0; j < k && first; ++j)", "for (int j = 0; j <= k && first; ++j)",
           (T_INTRA, "-k", "test_layout"),
           "off-by-one in the loop bound: a slot compares with itself, no rank is counted"),
    Mutant("layout_bad_id_not_recorded", LAYOUT,
           "if (e != raw) record_error(", "if (false) record_error(",
           (T_INTRA, "-k", "test_layout_bad_id"),
           "an id outside [-1, E) is repaired but never reported"),
    # --------------------------------------------------------- intranode dispatch
    Mutant("dispatch_counts_zeroed", INTRA,
           "site == kSiteFailed ? 0 : hdr->my_counts[j]", "0",
           (T_INTRA, "-k", "test_dispatch_combine_gather and not full"),
           "a count zeroed: receivers see no rows from this source"),
    Mutant("dispatch_receiver_base_off_by_one", INTRA,
           "for (int s = 0; s < me; ++s) b += peer::load_volatile(&hdr->counts[s][r]);",
           "for (int s = 0; s <= me; ++s) b += peer::load_volatile(&hdr->counts[s][r]);",
           (T_INTRA, "-k", "test_dispatch_combine_gather and not full"),
           "off-by-one in an offset: send_row points past this source's rows"),
    Mutant("dispatch_credit_wait_one_epoch_short", INTRA,
           "wait_all(a.c, hdr->credit, s_n - 1, kOpDispatch);",
           "wait_all(a.c, hdr->credit, s_n - 2, kOpDispatch);",
           (T_INTRA, "-k", "pipelined"),
           "credit taken an epoch early: a push overwrites rows its receiver has not read"),
    Mutant("last_block_no_fence", INTRA,
           "  __shared__ bool s_last;\n  peer::fence_data();\n  __syncthreads();",
           "  __shared__ bool s_last;\n  __syncthreads();",
           (T_INTRA, "-k", "seeds_agree or pipelined or every_block"),
           "removed fence: other threads' row stores are not ordered before the signal"),
    Mutant("last_block_counter_bound", INTRA,
           "s_last = prev == gridDim.x - 1;", "s_last = prev == gridDim.x - 2;",
           (T_INTRA, "-k", "every_block or pipelined"),
           "off-by-one: the signal goes out before the last block wrote its rows"),
    # --------------------------------------------------------- intranode combine
    Mutant("combine_finish_no_wait", INTRA,
           "    s_fail = wait_and_check(a.c, hdr->arrive[kOpCombine], hdr->site_arr[kOpCombine], s_n,\n"
           "                            kOpCombine);",
           "    s_fail = false;",
           (T_INTRA, "-k", "test_dispatch_combine_gather or seeds_agree"),
           "skipped wait: rows are summed before they arrive"),
    Mutant("combine_request_lo_off_by_one", INTRA,
           "peer::store(&ph->req_lo[me], first);", "peer::store(&ph->req_lo[me], first + 1);",
           (T_INTRA, "-k", "test_dispatch_combine_gather and not full"),
           "off-by-one in the requested rows"),
    # --------------------------------------------------------- intranode gather
    Mutant("gather_request_slot_off_by_one", INTRA,
           "        j = pos[s];", "        j = pos[s] + 1;",
           (T_INTRA, "-k", "test_dispatch_combine_gather and not full"),
           "off-by-one in the request list: rows land one slot late"),
    Mutant("gather_skipped_signal", INTRA,
           "    for (int q = 0; q < R; ++q) peer::signal(&peer::header(a.c.peers, q)->arrive[kOpGather][me], s_n);",
           "",
           (T_INTRA, "-k", "test_dispatch_combine_gather and not full"),
           "skipped signal: receivers time out"),
    # ------------------------------------------------------------ low latency
    Mutant("ll_counts_zeroed", LL,
           "peer::store(&counts[e * R + a.me], c < a.M ? c : a.M);",
           "peer::store(&counts[e * R + a.me], 0);",
           (T_LL, "-k", "test_ll_dispatch_combine and not full"),
           "a count zeroed in the owner's half"),
    Mutant("ll_recv_wrong_half", LL,
           "  const uint64_t n = ll_recv_epoch(a, h->seq_dispatch);\n  const int half = ll_half(n);",
           "  const uint64_t n = ll_recv_epoch(a, h->seq_dispatch);\n  const int half = ll_half(n + 1);",
           (T_LL, "-k", "two_sends or (test_ll_dispatch_combine and not full)"),
           "wrong half/parity: the receive half reads the other epoch's slots"),
    Mutant("ll_push_skipped_signal", LL,
           "      store_volatile(&o->tag_dispatch[half][a.me], tag);\n      peer::signal(&o->arrive_dispatch[half][a.me], n);",
           "      store_volatile(&o->tag_dispatch[half][a.me], tag);",
           (T_LL, "-k", "test_ll_dispatch_combine and not full"),
           "skipped signal: owners time out"),
    Mutant("ll_credit_wait_too_strict", LL,
           "  if (n > 2)\n    for (int p = threadIdx.x; p < a.L.R; p += blockDim.x) ll_wait(a, &credit[p], n - 2, p, op);",
           "  if (n > 1)\n    for (int p = threadIdx.x; p < a.L.R; p += blockDim.x) ll_wait(a, &credit[p], n - 1, p, op);",
           (T_LL, "-k", "two_sends"),
           "wrong half in the credit rule: a second send in flight waits for the first's receive"),
    Mutant("ll_last_block_no_fence", LL,
           "  // cumulativity, which CUDA's __threadfence_system() does not promise.\n  peer::fence_data();\n  __syncthreads();",
           "  // cumulativity, which CUDA's __threadfence_system() does not promise.\n  __syncthreads();",
           (T_LL, "-k", "consecutive or test_ll_dispatch_combine"),
           "removed fence: rows not ordered before the arrival signal"),
    # ------------------------------------------------------ internode (NVSHMEM) direct
    Mutant("in_counts_zeroed_without_rows", IN,
           "out.counts[i] = failed ? -1 : LoadLanded(h.counts + i);",
           "out.counts[i] = total == 0 ? 0 : LoadLanded(h.counts + i);",
           (T_IN, "-k", "receives_nothing"),
           "count zeroed: a rank that receives no rows loses the matrix its combine needs"),
    Mutant("in_send_wrong_qp", IN,
           "                         static_cast<size_t>(chunk_size(s.bytes, j, g.chunk)), sig, 1,\n"
           "                         SignalOp::kAdd, peer, q);",
           "                         static_cast<size_t>(chunk_size(s.bytes, j, g.chunk)), sig, 1,\n"
           "                         SignalOp::kAdd, peer, (q + 1) % g.num_qps);",
           (T_IN, "-k", "transport_log and not full"),
           "wrong QP handle: SendKernel puts a chunk on another QP than the plan's"),
    Mutant("in_closing_signal_skipped", IN,
           "if (warp == 0 && lane == 0) T::signal(sig, 1, SignalOp::kAdd, peer, q);",
           "if (false) T::signal(sig, 1, SignalOp::kAdd, peer, q);",
           (T_IN, "-k", "basic"),
           "skipped signal: the receivers wait for a closing signal until the timeout"),
    Mutant("in_closing_signal_doubled", IN,
           "if (warp == 0 && lane == 0) T::signal(sig, 1, SignalOp::kAdd, peer, q);",
           "if (warp == 0 && lane == 0) T::signal(sig, 2, SignalOp::kAdd, peer, q);",
           (T_IN, "-k", "basic"),
           "doubled signal: a word ends past what the receiver expects"),
    Mutant("in_send_wrong_half", IN,
           "  char* half = heap + Parity() * half_bytes;",
           "  char* half = heap + (1 - Parity()) * half_bytes;",
           (T_IN, "-k", "basic"),
           "wrong half/parity: the rows go to the half the peers do not read in this call"),
    Mutant("in_signals_not_reset", IN,
           "  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) h.sigs[i] = 0;",
           "",
           (T_IN, "-k", "reuse_halves"),
           "signal words not reset: the half's next call sees this call's counts"),
    Mutant("in_stream_base_off_by_one", IN,
           "    const int64_t base = scratch[peer];  // rows of sources < rank at peer",
           "    const int64_t base = scratch[peer] + 1;  // rows of sources < rank at peer",
           (T_IN, "-k", "basic"),
           "off-by-one in an offset: rows land one row late on the receiver"),
    Mutant("in_source_of_row_bound", IN,
           "while (s + 1 < g.R && scratch[2 * g.R + s + 1] <= i) ++s;",
           "while (s + 1 < g.R && scratch[2 * g.R + s + 1] < i) ++s;",
           (T_IN, "-k", "basic"),
           "off-by-one in a bound: the first row of a source is credited to the one before"),
    Mutant("in_chunk_stride", IN,
           "for (int64_t j = channel; channel >= 0 && j < n; j += g.num_qps, ++k) {",
           "for (int64_t j = channel; channel >= 0 && j < n; j += g.num_qps + 1, ++k) {",
           (T_IN, "-k", "basic or bf16_odd"),
           "off-by-one in a loop stride: chunks skipped, their receivers time out"),
    Mutant("in_failed_outputs_zero", IN,
           "      if (failed)\n        NanBytes(xo, g.xrow, lane, 32);",
           "      if (false)\n        NanBytes(xo, g.xrow, lane, 32);",
           (T_IN, "-k", "bad_id"),
           "a failed call's rows silently zero instead of NaN"),
    Mutant("in_header_not_checked", IN,
           "    if (th.seq != my_seq || th.hash != g.hash || th.error != 0) {",
           "    if (th.seq != my_seq || th.error != 0) {",
           (T_IN, "-k", "mismatched"),
           "a peer in another call (other config) is not noticed"),
    # ---------------------------------------------------------- internode hierarchical
    Mutant("hier_credit_at_token_end", HIER,
           "              if (n > 0) {  // sum and credit what this piece holds before waiting",
           "              if (false) {  // sum and credit what this piece holds before waiting",
           (T_HIER, "-k", "small_rings and 2-4-4"),
           "credit only at the end of each token: the combine ring stalls with small rings"),
    Mutant("hier_credit_early", HIER,
           "      Tr::signal(v.credit + g.node, static_cast<uint64_t>(c + 1), SignalOp::kSet, s,",
           "      Tr::signal(v.credit + g.node, static_cast<uint64_t>(c + 2), SignalOp::kSet, s,",
           (T_HIER, "-k", "small_rings"),
           "credit returned early: the sender overwrites a ring slot not yet forwarded"),
    Mutant("hier_chunk_wrong_qp", HIER,
           "  const int q = ChunkQp(g, peer, c);\n  Tr::put_signal_warp(",
           "  const int q = ChunkQp(g, peer, c + 1);\n  Tr::put_signal_warp(",
           (T_HIER, "-k", "matches_reference or small_rings"),
           "wrong QP: a chunk signals the word of another QP than its reader waits on"),
    Mutant("hier_stream_words_not_reset", HIER,
           "      ok = 0;\n    }\n    *w = 0;",
           "      ok = 0;\n    }",
           (T_HIER, "-k", "small_rings"),
           "data words not reset by their reader: the next call of the half sees stale counts"),
    Mutant("hier_counts_zeroed", HIER,
           "      counts_out[i] = failed ? -1 : v.counts[(i / g.R) * cs + i % g.R];",
           "      counts_out[i] = 0;",
           (T_HIER, "-k", "matches_reference"),
           "count zeroed: the dispatch handle loses its count matrix"),
    # ------------------------------------------------------- internode low-latency
    Mutant("llin_dispatch_send_quiet_dropped", LLIN,
           "                        SignalOp::kAdd, r, q);\n  }\n  __syncwarp();\n"
           "  if (lane == 0) Tr::quiet();",
           "                        SignalOp::kAdd, r, q);\n  }\n  __syncwarp();",
           (T_LLIN, "-k", "consecutive or two_sends"),
           "dropped quiet at the end of a send: the next call packs the send stage while "
           "puts that read it at delivery are still queued"),
    Mutant("internode_fetch_without_acquire", TRN,
           "    return nvshmem_emu::load_acquire(sig);  // a poll: the emulated NIC delivers "
           "meanwhile\n#else\n    return peer::load_acquire(sig);",
           "    return nvshmem_signal_fetch(sig);\n#else\n    return nvshmem_signal_fetch(sig);",
           (T_HIER, "-k", "matches_reference and 2x2"),
           "a signal polled without acquire: the header or rows read after it are stale"),
]
