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
One module per kernel file (layout, intranode, copy_engine, low_latency, internode,
hierarchical, internode_ll, nccl_gin: the NCCL GIN transport) and one for the fabric set-up (fabric: the bootstrap's NVSHMEM environment,
the default-handle refusal, the LAG shim) and one for the virtual-rank harness's launch
code (harness: xla_ffi/cuda/cuda_handlers.cc); append to the module of the file you mutate; names are unique across all. A mutant that no
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


def _all():
    from . import (copy_engine, fabric, harness, hierarchical, internode, internode_ll, intranode,
                   layout, low_latency, nccl_gin)
    out = []
    for mod in (layout, intranode, copy_engine, low_latency, internode, hierarchical,
                internode_ll, nccl_gin, fabric, harness):
        out.extend(mod.MUTANTS)
    names = [m.name for m in out]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise ValueError(f"mutant names repeated: {sorted(dup)}")
    return out


MUTANTS = _all()
