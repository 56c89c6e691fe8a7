"""Planted mistakes in the copy engine (kernels/cuda/copy_engine.cuh) and in how the
intranode channels publish what it copied (see scripts/mutants/__init__.py for the fields)."""
from __future__ import annotations

from . import Mutant
from ._paths import *  # noqa: F401,F403

QUICK = (T_INTRA, "-k", "test_dispatch_combine_gather and not full")
PIECES = (T_INTRA, "-k", "several_copy_engine_pieces")
RINGS = (T_INTRA, "-k", "rings or several_copy_engine_pieces")

MUTANTS = [
    Mutant("engine_last_piece_skipped", ENGINE,
           "first < nv; first += kUnroll * stride) {",
           "first + (kUnroll - 1) * stride < nv; first += kUnroll * stride) {",
           (T_INTRA, "-k", "test_dispatch_combine_gather and not full or several_copy_engine_pieces"),
           "a copy's last, partial piece skipped (only pieces where every lane has all its "
           "vectors are copied): rows shorter than a piece, and the end of longer ones, "
           "never arrive"),
    Mutant("engine_middle_piece_skipped", ENGINE,
           "first < nv; first += kUnroll * stride) {",
           "first < nv; first += (first < kUnroll * stride ? 2 : 1) * kUnroll * stride) {",
           PIECES,
           "a copy's second piece skipped: rows of more than two pieces miss bytes in the "
           "middle, short rows are exact"),
    Mutant("engine_fence_before_last_store_of_chunk", INTRA,
           "    group_copy<CopySrc::kReadOnly, kU>(warp_group(), rbase + (k % Q) * stride,\n"
           "                                       y + static_cast<int64_t>(lo + j) * a.row_bytes, a.row_bytes);\n"
           "    if (k + 1 - published >= chunk) {\n"
           "      publish_tail(tail, k + 1);",
           "    if (k + 1 - published >= chunk) peer::fence_data();\n"
           "    group_copy<CopySrc::kReadOnly, kU>(warp_group(), rbase + (k % Q) * stride,\n"
           "                                       y + static_cast<int64_t>(lo + j) * a.row_bytes, a.row_bytes);\n"
           "    if (k + 1 - published >= chunk) {\n"
           "      __syncwarp();\n"
           "      if (lane == 0) peer::signal(tail, k + 1);\n"
           "      __syncwarp();",
           RINGS,
           "the combine sender's fence moved before the chunk's last row: that row's stores "
           "(all lanes but the releasing one) may reach the token owner after the tail"),
    Mutant("engine_peer_written_load_nc", ENGINE,
           "  else return peer::load_cg16(p);",
           "  else return peer::load_nc16(p);",
           RINGS,
           "peer-written data (ring slots) read through the non-coherent path: a slot reused "
           "by a later row may return the line of the earlier one (combine's sums, gather's "
           "received rows)"),
]
