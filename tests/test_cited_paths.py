"""Every repository path a comment or a document cites exists: a file moved or deleted
leaves no pointer behind. Paths are tokens that start with one of the tree's top folders
(kernels/, xla_ffi/, jax_ep/, tests/, docs/, scripts/, examples/, cmake/), taken from the
repository root or from the citing file's folder; a token followed by `*`, `{` or `<` is a
pattern, not a path."""
from __future__ import annotations

import os
import re
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOPS = ("kernels", "xla_ffi", "jax_ep", "tests", "docs", "scripts", "examples", "cmake")
PATH = re.compile(r"(?<![\w./-])((?:" + "|".join(TOPS) + r")/[\w./-]*\w)(?![\w*{<])(?!\.{)")
SUFFIXES = (".py", ".cc", ".h", ".cu", ".cuh", ".md", ".txt", ".cmake", ".sh", ".toml",
            ".map", ".inc")
# Tokens that look like paths and are not: the key-value store's keys, the build's
# placeholder examples.
NOT_PATHS = {"jax_ep/arrive", "jax_ep/cuda/ipc", "jax_ep/nvshmem", "jax_ep/nccl",
             "kernels/internode/foo.cu", "xla_ffi/emu/emu_foo.cc",
             "xla_ffi/internode/emu_foo.cc"}


def tracked():
    try:
        out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [f for f in out if f.endswith(SUFFIXES) and not f.startswith("tests/data/")
            and f != "tests/test_cited_paths.py"]  # its own examples are not citations


def missing_citations(files, root=ROOT):
    bad = []
    for f in files:
        try:
            with open(os.path.join(root, f), encoding="utf-8") as fh:
                text = fh.read()
        except (OSError, UnicodeDecodeError):
            continue
        for m in PATH.finditer(text):
            p = m.group(1).rstrip(".")
            if p in NOT_PATHS:
                continue
            if not any(os.path.exists(os.path.join(root, c))
                       for c in (p, os.path.join(os.path.dirname(f), p))):
                line = text.count("\n", 0, m.start()) + 1
                bad.append(f"{f}:{line}: {p}")
    return bad


def test_every_cited_path_exists():
    bad = missing_citations(tracked())
    assert not bad, "cited paths that do not exist:\n" + "\n".join(bad)


def test_a_stale_citation_is_caught(tmp_path):
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "a.h").write_text("// see kernels/a.h and kernels/gone.h\n"
                                              "// pattern kernels/*.h, kernels/b_{x,y}.h\n")
    assert missing_citations(["kernels/a.h"], root=str(tmp_path)) == \
        ["kernels/a.h:1: kernels/gone.h"]
