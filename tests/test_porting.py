"""docs/porting.md: every `python` block runs, in order, in one namespace (the page's
examples of DeepEP / TransformerEngine calls and their jax-ep counterparts)."""
from __future__ import annotations

import os
import re

import pytest

DOC = os.path.join(os.path.dirname(__file__), "..", "docs", "porting.md")


def _blocks():
    text = open(DOC).read()
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_porting_page_has_the_sections():
    text = open(DOC).read()
    for heading in ("## Layout", "## Dispatch", "## num_worst_tokens is capacity",
                    "## Cached dispatch through the handle", "## Combine, with bias",
                    "## FP8 dispatch", "## What has no counterpart"):
        assert heading in text, heading
    assert len(_blocks()) >= 9


def test_porting_examples_run():
    ns = {"__name__": "porting_doc"}
    for i, code in enumerate(_blocks()):
        try:
            exec(compile(code, f"docs/porting.md block {i}", "exec"), ns)
        except Exception as e:  # name the block that failed
            pytest.fail(f"docs/porting.md python block {i} failed: {type(e).__name__}: {e}"
                        f"\n{code}")
