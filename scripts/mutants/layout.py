"""Planted mistakes in kernels/cuda/layout_kernels.cu (see scripts/mutants/__init__.py for the fields)."""
from __future__ import annotations

from . import Mutant
from ._paths import *  # noqa: F401,F403

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
]
