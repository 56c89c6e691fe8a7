"""Planted mistakes in kernels/internode/hierarchical_kernels.cu (see scripts/mutants/__init__.py for the fields)."""
from __future__ import annotations

from . import Mutant
from ._paths import *  # noqa: F401,F403

MUTANTS = [
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
]
