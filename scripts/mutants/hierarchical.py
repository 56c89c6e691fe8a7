"""Planted mistakes in kernels/internode/hierarchical_kernels.cu (see scripts/mutants/__init__.py for the fields)."""
from __future__ import annotations

from . import Mutant
from ._paths import *  # noqa: F401,F403

MUTANTS = [
    # ---------------------------------------------------------- internode hierarchical
    Mutant("hier_credit_early", HIER,
           "      Tr::signal(v.credit + g.node, static_cast<uint64_t>(c + 1), SignalOp::kSet, s,",
           "      Tr::signal(v.credit + g.node, static_cast<uint64_t>(c + 2), SignalOp::kSet, s,",
           (T_HIER, "-k", "small_rings"),
           "credit returned early: the sender overwrites a ring slot not yet forwarded"),
    Mutant("hier_source_credit_early", HIER,
           "                                              : pos[k] / kRdmaChunkRows;",
           "                                              : (pos[k] + kRdmaChunkRows - 1) / kRdmaChunkRows;",
           (T_HIER, "-k", "small_rings"),
           "the combine source credits the chunk it is still reading: the forwarder "
           "overwrites partials not yet summed"),
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
    Mutant("hier_chunk_release_dropped", HIER,
           "    NvlFlush(&f);  // the chunk's rows: one release per ring, before the credit frees them\n",
           "",
           (T_HIER, "-k", "matches_reference or small_rings"),
           "the rail forwarder never publishes a chunk's NVLink rows (only a full ring is "
           "flushed): the receivers wait for rows already written"),
    Mutant("hier_push_release_one_row", HIER,
           "      if (lane == 0) StoreRel(tw, tl + cnt);",
           "      if (lane == 0) StoreRel(tw, tl + 1);",
           (T_HIER, "-k", "matches_reference or small_rings"),
           "the combine pusher's one release per batch publishes one row of the batch"),
    Mutant("hier_partial_not_rounded", HIER,
           "      for (int i = 0; i < V; ++i) a[i] += rounds ? RoundTo<E>(p[i]) : p[i];",
           "      for (int i = 0; i < V; ++i) a[i] += p[i];",
           (T_HIER, "-k", "partials_rounded or matches_reference"),
           "the source's own-node partial is not rounded to the row dtype (the other nodes' "
           "partials are): not the order of kernels/common/combine_order.h"),
    Mutant("hier_partial_rank_order_reversed", HIER,
           "    LoadF<E, V>(rp[k], x0, f);",
           "    LoadF<E, V>(rp[n - 1 - k], x0, f);",
           (T_HIER, "-k", "matches_reference or small_rings"),
           "the forwarder sums its node's rows in descending rank order"),
    # ---------------------------------------------- NVLink rings (weak visibility of peer stores)
    # The fences matter where lanes other than the releasing one copy a row's bytes: rows
    # of 64 payload bytes or more (partials_rounded, H = 32 bf16); with shorter rows the
    # lanes that copy are the lanes that release, and a release drains its own lane.
    Mutant("hier_nvl_flush_no_fence", HIER,
           "  if (!__any_sync(kFull, dirty)) return;\n  __threadfence_system();\n",
           "  if (!__any_sync(kFull, dirty)) return;\n",
           (T_HIER, "-k", "partials_rounded or matches_reference or small_rings"),
           "removed fence: the forwarder's lanes' row stores into a peer's NVLink ring are not "
           "ordered before the tail's release (only the releasing lane's are)"),
    Mutant("hier_push_no_fence", HIER,
           "      // the batch's rows, then one release of the tail (one fence per lane per batch)\n"
           "      __threadfence_system();\n",
           "      // the batch's rows, then one release of the tail (one fence per lane per batch)\n",
           (T_HIER, "-k", "partials_rounded or matches_reference or small_rings"),
           "removed fence: the combine pusher's row stores into the forwarder's ring are not "
           "ordered before the tail's release"),
    Mutant("hier_forward_slot_word_unordered", HIER,
           "      devcopy::CopyLanded(dst, row, g.stride, Lane(), 32);\n      __syncwarp();\n",
           "      devcopy::CopyLanded(dst, row, g.stride, Lane(), 32);\n",
           (T_HIER, "-k", "matches_reference or small_rings"),
           "dropped barrier: lane 0's slot word and the lane copying that part of the row race, "
           "the row's old word (-1) can land last"),
]
