"""The planted-mistake table (scripts/mutants/) against today's kernel sources: every
mutant's snippet occurs exactly once in its file, so `scripts/mutate_kernels.py` can plant
it, and each one changes the source. A kernel edit that moves a snippet fails here, in
seconds, instead of at the start of an hour-long mutation run."""
from __future__ import annotations

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

from mutants import MUTANTS  # noqa: E402

_SOURCES = {}


def _source(rel):
    if rel not in _SOURCES:
        with open(os.path.join(ROOT, rel)) as f:
            _SOURCES[rel] = f.read()
    return _SOURCES[rel]


@pytest.mark.parametrize("m", MUTANTS, ids=[m.name for m in MUTANTS])
def test_mutant_snippet_occurs_once_and_changes_the_source(m):
    text = _source(m.file)
    assert text.count(m.original) == 1, f"{m.name}: snippet occurs {text.count(m.original)} times in {m.file}"
    assert m.replacement != m.original, m.name
    assert text.replace(m.original, m.replacement, 1) != text, m.name
    assert m.tests and all(isinstance(a, str) for a in m.tests), m.name


def test_mutant_names_are_unique():
    names = [m.name for m in MUTANTS]
    assert len(names) == len(set(names))
