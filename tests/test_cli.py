"""The command-line tools say what they can do: `python -m jax_ep.plan --help` lists its
subcommands, `python -m jax_ep.bench --help` its alternative benchmarks (`--layer`,
`--mode`, `--fp8`), each run as a subprocess the way a user runs it."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest


def _run(*args, timeout=300):
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # the tools set their own device count
    r = subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True,
                       env=env, timeout=timeout)
    return r.returncode, r.stdout + r.stderr


def _listed_options(help_text: str) -> set:
    return set(re.findall(r"^\s+(--[\w-]+)", help_text, flags=re.M))


def test_plan_help_lists_its_subcommands():
    rc, out = _run("jax_ep.plan", "--help")
    assert rc == 0, out
    assert "subcommands:" in out
    assert re.search(r"^\s+modes\s+\S", out, flags=re.M), out
    assert "[modes ...]" in out.splitlines()[0]
    # and the subcommand it names answers --help itself
    rc, sub = _run("jax_ep.plan", "modes", "--help")
    assert rc == 0 and "usage: python -m jax_ep.plan modes" in sub, sub


@pytest.mark.parametrize("flag", ["--layer", "--mode", "--fp8", "--train-step"])
def test_bench_help_lists_the_alternative_benchmarks(flag):
    rc, out = _run("jax_ep.bench", "--help")
    assert rc == 0, out
    assert flag in _listed_options(out), out


def test_bench_help_names_the_low_latency_mode_value():
    rc, out = _run("jax_ep.bench", "--help")
    assert rc == 0, out
    assert re.search(r"--mode \{normal,low_latency[,}]", out), out


@pytest.mark.parametrize("args, prog", [
    (["--layer", "--help"], "jax_ep.bench --layer"),
    (["--mode", "low_latency", "--help"], "jax_ep.bench --mode low_latency"),
    (["--mode=low_latency", "--help"], "jax_ep.bench --mode low_latency"),
    (["--fp8", "--help"], "jax_ep.bench --fp8"),
    (["--train-step", "--help"], "jax_ep.bench --train-step"),
])
def test_each_alternative_has_its_own_help(args, prog):
    rc, out = _run("jax_ep.bench", *args)
    assert rc == 0, out
    assert f"usage: python -m {prog}" in out, out


def test_bench_rejects_an_unknown_mode():
    rc, out = _run("jax_ep.bench", "--mode", "fast")
    assert rc != 0
    assert "--mode must be 'normal' or 'low_latency'" in out, out


def test_the_option_reader_sees_a_missing_flag():
    assert "--fp8" not in _listed_options("options:\n  --layer  the layer\n")
