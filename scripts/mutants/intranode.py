"""Planted mistakes in kernels/cuda/intranode_kernels.cu (see scripts/mutants/__init__.py for the fields)."""
from __future__ import annotations

from . import Mutant
from ._paths import *  # noqa: F401,F403

MUTANTS = [
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
]
