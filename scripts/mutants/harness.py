"""Planted mistakes in the virtual-rank harness's launch code, xla_ffi/cuda/cuda_handlers.cc,
and in the emulator's hardware queues that the harness's tests rely on (see
scripts/mutants/__init__.py for the fields; docs/emulator.md, "Streams and hardware
queues")."""
from __future__ import annotations

from . import Mutant
from ._paths import *  # noqa: F401,F403

MUTANTS = [
    Mutant("harness_ranks_share_queues", HANDLERS,
           "  if (R > queues)\n    return Invalid(", "  if (false)\n    return Invalid(",
           (T_HARNESS, "-k", "more_ranks_than_queues"),
           "the check against CUDA_DEVICE_MAX_CONNECTIONS gone: with 8 queues, 16 ranks run "
           "and ranks r and r + 8 share a queue (their kernels wait on each other: a "
           "deadlock that ends in the kernels' timeout)"),
    Mutant("harness_joins_inside_launch_loop", HANDLERS,
           "      if (e == cudaSuccess) e = cudaEventRecord(st->join[r], st->s[r]);\n    }\n",
           "      if (e == cudaSuccess) e = cudaEventRecord(st->join[r], st->s[r]);\n"
           "      if (e == cudaSuccess) e = cudaStreamWaitEvent(stream, st->join[r], 0);\n    }\n",
           (T_HARNESS, "-k", "sharing_a_queue_with_xla_stream"),
           "XLA's stream waits for rank r before rank r + 1 is launched: the wait for rank 0 "
           "sits in the queue XLA's stream shares with rank 7, ahead of rank 7's kernels, "
           "which rank 0's wait for"),
    Mutant("harness_makes_32_streams", HANDLERS,
           "  for (int r = 0; r < R && e == cudaSuccess; ++r) {\n"
           "    e = cudaStreamCreateWithFlags(&st->s[r], cudaStreamNonBlocking);",
           "  for (int r = 0; r < kMaxRanks && e == cudaSuccess; ++r) {\n"
           "    e = cudaStreamCreateWithFlags(&st->s[r], cudaStreamNonBlocking);",
           (T_HARNESS, "-k", "creation_order"),
           "a stream for each of 32 possible ranks, as before: more streams than queues "
           "(and the count no longer says which ranks share one)"),
    Mutant("emu_hardware_queues_ignored", "kernels/emu/emu_scheduler.cc",
           "        if (!QueueFront(st, op)) break;  // behind another stream's command in its queue\n",
           "",
           (T_HARNESS, "-k", "sharing_8_queues or sharing_a_queue"),
           "the emulator's streams all concurrent again (no hardware queues): 16 ranks on 8 "
           "queues finish, so the harness's deadlock could not be shown"),
]
