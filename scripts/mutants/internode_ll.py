"""Planted mistakes in kernels/internode/low_latency_kernels.cu and transport_nvshmem.cuh (see scripts/mutants/__init__.py for the fields)."""
from __future__ import annotations

from . import Mutant
from ._paths import *  # noqa: F401,F403

MUTANTS = [
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
