"""Planted mistakes in kernels/cuda/intranode_kernels.cu (see scripts/mutants/__init__.py for the fields)."""
from __future__ import annotations

from . import Mutant
from ._paths import *  # noqa: F401,F403

QUICK = (T_INTRA, "-k", "test_dispatch_combine_gather and not full")
RINGS = (T_INTRA, "-k", "rings")

MUTANTS = [
    # --------------------------------------------------------- intranode dispatch
    Mutant("dispatch_counts_zeroed", INTRA,
           "site == kSiteFailed ? 0 : s_run[j]", "0", QUICK,
           "a count zeroed: receivers see no rows from this source"),
    Mutant("dispatch_receiver_base_off_by_one", INTRA,
           "for (int s = 0; s < me; ++s) b += peer::load_volatile(&hdr->counts[s][threadIdx.x]);",
           "for (int s = 0; s <= me; ++s) b += peer::load_volatile(&hdr->counts[s][threadIdx.x]);",
           QUICK, "off-by-one in an offset: send_row points past this source's rows"),
    Mutant("dispatch_credit_wait_one_epoch_short", INTRA,
           "wait_all(a.c, hdr->credit, s_n - 1, kOpDispatch);",
           "wait_all(a.c, hdr->credit, s_n - 2, kOpDispatch);",
           (T_INTRA, "-k", "pipelined or rings"),
           "credit taken an epoch early: a sender starts the next epoch while its receiver "
           "still reads this one's counts and rings"),
    Mutant("last_block_no_fence", INTRA,
           "__device__ bool last_block_done(const CommonArgs& c, int counter) {\n"
           "  __shared__ bool s_last;\n  peer::fence_data();\n  __syncthreads();",
           "__device__ bool last_block_done(const CommonArgs& c, int counter) {\n"
           "  __shared__ bool s_last;\n  __syncthreads();",
           (T_INTRA, "-k", "seeds_agree or every_block or test_dispatch_combine_gather"),
           "removed fence: other threads' gather row stores are not ordered before the signal"),
    Mutant("last_block_counter_bound", INTRA,
           "    s_last = prev == gridDim.x - 1;\n    if (s_last) {\n      h->done[counter] = 0;\n"
           "      peer::fence_data();\n    }\n  }\n  __syncthreads();\n  return s_last;\n}",
           "    s_last = prev == gridDim.x - 2;\n    if (s_last) {\n      h->done[counter] = 0;\n"
           "      peer::fence_data();\n    }\n  }\n  __syncthreads();\n  return s_last;\n}",
           (T_INTRA, "-k", "one_channel or every_block or pipelined or rings"),
           "off-by-one: the dispatch credit goes out before the last block is done"),
    # --------------------------------------------------------- intranode combine
    Mutant("combine_row_wait_skipped", INTRA,
           "  if (peer::load_acquire(tail) > pos) return true;\n"
           "  if (peer::wait_geq(tail, pos + 1, c.timeout_ns, &g_intranode_stop)) return true;",
           "  return true;\n  if (peer::wait_geq(tail, pos + 1, c.timeout_ns, &g_intranode_stop)) return true;",
           (T_INTRA, "-k", "test_dispatch_combine_gather or seeds_agree or rings"),
           "skipped wait: rows are summed before they arrive"),
    Mutant("combine_request_lo_off_by_one", INTRA,
           "peer::store(&ph->c_req_lo[ch][me], first);", "peer::store(&ph->c_req_lo[ch][me], first + 1);",
           QUICK, "off-by-one in the requested rows"),
    # --------------------------------------------------------- rings (dispatch and combine)
    Mutant("dispatch_early_credit", INTRA,
           "    if (lane == 0) peer::signal(head, k);",
           "    if (lane == 0) peer::signal(head, k + chunk);",
           RINGS, "early credit: a chunk of slots handed back before they are read (the sender "
           "overwrites rows the receiver reads next)"),
    Mutant("ring_tail_published_before_data", INTRA,
           "  peer::fence_data();\n  __syncwarp();\n  if ((threadIdx.x & 31) == 0) peer::signal(tail, k);",
           "  __syncwarp();\n  if ((threadIdx.x & 31) == 0) peer::signal(tail, k);",
           (T_INTRA, "-k", "rings or seeds_agree or test_dispatch_combine_gather"),
           "tail published before the lanes' rows are fenced: the receiver reads stale slots"),
    Mutant("dispatch_wrong_ring_slot", INTRA,
           "      const uint64_t slot = k % Q;\n      warp_copy_row<true>",
           "      const uint64_t slot = (k + 1) % Q;\n      warp_copy_row<true>",
           RINGS, "wrong ring slot: the sender writes the slot after the one the receiver reads"),
    Mutant("combine_wrong_ring_slot", INTRA,
           "off[lane] = lane * rb + (pos % Q) * stride;",
           "off[lane] = lane * rb + ((pos + 1) % Q) * stride;",
           RINGS, "wrong ring slot: the token owner sums the next slot's row"),
    Mutant("combine_early_credit", INTRA,
           "const uint64_t h = s_base[threadIdx.x] + static_cast<uint64_t>(s_used[threadIdx.x]);",
           "const uint64_t h = s_base[threadIdx.x] + static_cast<uint64_t>(s_used[threadIdx.x]) + 1;",
           RINGS, "early credit: one slot more handed back than the chunk consumed"),
    Mutant("combine_send_ignores_credit", INTRA,
           "      if (!warp_wait_counter(a.c, &hdr->ring[1].head[ch][d], k - Q + 1, d, kOpCombine, &credit)) break;",
           "      credit = k - Q + 1;",
           RINGS, "a full ring not waited for: the sender overwrites rows not yet summed"),
    # --------------------------------------------------------- intranode gather
    Mutant("gather_request_slot_off_by_one", INTRA,
           "        j = pos[s];", "        j = pos[s] + 1;", QUICK,
           "off-by-one in the request list: rows land one slot late"),
    Mutant("gather_skipped_signal", INTRA,
           "    for (int q = 0; q < R; ++q) peer::signal(&peer::header(a.c.peers, q)->arrive[kOpGather][me], s_n);",
           "", QUICK, "skipped signal: receivers time out"),
]
