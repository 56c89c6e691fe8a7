"""Planted mistakes in kernels/cuda/low_latency_kernels.cu (see scripts/mutants/__init__.py for the fields)."""
from __future__ import annotations

from . import Mutant
from ._paths import *  # noqa: F401,F403

MUTANTS = [
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
]
