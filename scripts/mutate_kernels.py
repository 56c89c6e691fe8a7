"""Mutation tests on the real kernel sources: plants each mistake of
scripts/kernel_mutants.py, one at a time, in a scratch copy of the tree, rebuilds only the
emulated module there (cmake + ninja, target _jax_ep_emu), runs the emulated tests the
mutant names against that build, and reports it killed (a test failed) or survived.

    python scripts/mutate_kernels.py            # every mutant; summary `mutants: N, killed: K`
    python scripts/mutate_kernels.py --list     # the table
    python scripts/mutate_kernels.py --only NAME [--only NAME2]
    python scripts/mutate_kernels.py --scratch /tmp/mut   # keep/reuse a scratch directory
    python scripts/mutate_kernels.py --baseline   # first check the unmutated tests pass

The tests import the scratch copy's jax_ep (not the working tree an editable install
points at), so editing the working tree during a run does not change its verdicts.

Exit status 0 when every mutant run was killed. A survivor is either killed by a new test
or explained as equivalent in docs/emulator.md.
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
from kernel_mutants import MUTANTS, Mutant  # noqa: E402

EXCLUDE = {".venv", "build", ".git", "runs", "out", ".pytest_cache", ".hypothesis"}


def copy_tree(dst: Path):
    """The working tree (sources only) into dst."""
    def keep(info):
        top = info.name.split("/", 2)[1] if "/" in info.name else ""
        return None if top in EXCLUDE or "__pycache__" in info.name else info
    with tempfile.TemporaryFile() as f:
        with tarfile.open(fileobj=f, mode="w") as t:
            t.add(str(ROOT), arcname=".", filter=keep)
        f.seek(0)
        with tarfile.open(fileobj=f, mode="r") as t:
            t.extractall(dst, filter="fully_trusted")


def check_table(mutants):
    names = set()
    for m in mutants:
        if m.name in names:
            raise SystemExit(f"mutant {m.name}: the name is used twice")
        names.add(m.name)
        text = (ROOT / m.file).read_text()
        n = text.count(m.original)
        if n != 1:
            raise SystemExit(f"mutant {m.name}: its original snippet occurs {n} times in {m.file} "
                             "(it must occur exactly once; the source changed?)")


def run(cmd, cwd, env=None, timeout=None):
    """subprocess.run in a session of its own: on a timeout the whole group is killed, so
    a test's own child processes (the many-rank cases run in one) do not outlive it and
    slow every later mutant."""
    with subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, start_new_session=True) as p:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
            raise
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


def configure(src: Path, build: Path, py: str):
    env = dict(os.environ, PATH=f"{Path(py).parent}:{os.environ['PATH']}")
    r = run(["cmake", "-S", str(src), "-B", str(build), "-G", "Ninja", "-DJAX_EP_CUDA=OFF",
             f"-DPython_EXECUTABLE={py}", "-DCMAKE_BUILD_TYPE=Release",
             # the checked-in occupancy table: a mutant changes no launch size that matters
             "-DJAX_EP_EMU_OCCUPANCY=table"], src, env)
    if r.returncode != 0:
        raise SystemExit("cmake configure failed:\n" + r.stdout[-3000:] + r.stderr[-3000:])
    return env


def build(build_dir: Path, env) -> tuple[bool, str]:
    r = run(["ninja", "-C", str(build_dir), "_jax_ep_emu"], build_dir, env)
    return r.returncode == 0, (r.stdout + r.stderr)[-3000:]


# The tests import the scratch copy's `jax_ep`, not the one an editable install points at
# (the working tree, which may change during a long run: an edit there would fail every
# later mutant's tests for a reason of its own, a false kill). The editable install's
# import redirection is taken out and the scratch copy put first on the path; the
# compiled modules come from the installed package (see link_compiled).
_BOOT = ("import sys;"
         "sys.meta_path[:] = [f for f in sys.meta_path"
         " if not type(f).__name__.startswith('ScikitBuild')];"
         "sys.path.insert(0, sys.argv[1]);"
         "import jax_ep, os;"
         "assert os.path.realpath(jax_ep.__file__).startswith(os.path.realpath(sys.argv[1])),"
         " 'jax_ep imported from ' + jax_ep.__file__;"
         "import pytest; sys.exit(pytest.main(sys.argv[2:]))")


def link_compiled(src: Path, py: str):
    """Links the installed package's compiled modules (the CPU extension, ...) into the
    scratch copy's jax_ep/, which has the Python sources only."""
    r = run([py, "-c", "import importlib.util as u, os;"
             "print(os.path.dirname(u.find_spec('jax_ep._jax_ep_ext').origin))"], src)
    if r.returncode != 0:
        raise SystemExit("jax_ep is not installed in " + py + " (make install):\n" + r.stderr[-2000:])
    installed = Path(r.stdout.strip())
    for so in installed.glob("*.so"):
        dst = src / "jax_ep" / so.name
        if not dst.exists():
            dst.symlink_to(so)


def run_tests(src: Path, build_dir: Path, py: str, tests, timeout: int) -> tuple[bool, str]:
    """True if the tests pass (for a mutant's tests: the mutant survived)."""
    env = dict(os.environ, JAX_EP_EMU_MODULE_DIR=str(build_dir),
               XLA_FLAGS="--xla_force_host_platform_device_count=8")
    cmd = [py, "-c", _BOOT, str(src), "-q", "-x", "-p", "no:cacheprovider", "-W", "ignore"]
    cmd += list(tests)
    try:
        r = run(cmd, src, env, timeout)
    except subprocess.TimeoutExpired:
        return False, "timed out (counted as killed: the tests did not pass)"
    return r.returncode == 0, (r.stdout + r.stderr)[-1500:]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--list", action="store_true", help="print the mutants and exit")
    ap.add_argument("--only", action="append", default=[], help="run this mutant (repeatable)")
    ap.add_argument("--scratch", default=None, help="scratch directory (default: a temp dir)")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per mutant's tests")
    ap.add_argument("--python", default=str(ROOT / ".venv" / "bin" / "python"))
    ap.add_argument("--baseline", action="store_true",
                    help="first run every selected mutant's tests on the unmutated build "
                         "and stop if any fails (a failing test would kill every mutant "
                         "that names it)")
    a = ap.parse_args(argv)
    mutants = MUTANTS
    if a.only:
        unknown = set(a.only) - {m.name for m in MUTANTS}
        if unknown:
            raise SystemExit(f"--only: no mutant named {sorted(unknown)} (see --list)")
        mutants = [m for m in MUTANTS if m.name in a.only]
    if a.list:
        for m in mutants:
            print(f"{m.name:40s} {m.file}  [{' '.join(m.tests)}]\n    {m.why}")
        print(f"mutants: {len(mutants)}")
        return 0
    check_table(mutants)
    scratch = Path(a.scratch or tempfile.mkdtemp(prefix="jax_ep_mutants_"))
    src, bdir = scratch / "src", scratch / "build"
    if src.exists():
        shutil.rmtree(src)
    src.mkdir(parents=True)
    copy_tree(src)
    link_compiled(src, a.python)
    env = configure(src, bdir, a.python)
    ok, log = build(bdir, env)
    if not ok:
        raise SystemExit("the unmutated emulated module does not build:\n" + log)
    if a.baseline:
        for tests in dict.fromkeys(tuple(m.tests) for m in mutants):
            t0 = time.time()
            passed, detail = run_tests(src, bdir, a.python, tests, a.timeout)
            print(f"{'baseline':40s} {'passed' if passed else 'FAILED':28s} "
                  f"{time.time() - t0:6.0f}s  {' '.join(tests)[:120]}", flush=True)
            if not passed:
                raise SystemExit("the unmutated tests fail; every mutant naming them would "
                                 "count as killed:\n" + detail)
    killed, survived = [], []
    for m in mutants:
        t0 = time.time()
        path = src / m.file
        original = path.read_text()
        path.write_text(original.replace(m.original, m.replacement, 1))
        try:
            ok, log = build(bdir, env)
            if not ok:
                verdict, detail = "killed (does not compile)", log.splitlines()[-1:] 
            else:
                passed, detail = run_tests(src, bdir, a.python, m.tests, a.timeout)
                verdict = "SURVIVED" if passed else "killed"
                detail = detail.strip().splitlines()[-1:] if detail else []
        finally:
            path.write_text(original)
        (survived if verdict == "SURVIVED" else killed).append(m.name)
        print(f"{m.name:40s} {verdict:28s} {time.time() - t0:6.0f}s  {' '.join(detail)[:120]}",
              flush=True)
    build(bdir, env)  # leave the scratch build unmutated
    print(f"mutants: {len(mutants)}, killed: {len(killed)}")
    if survived:
        print("survived: " + ", ".join(survived))
    return 0 if not survived else 1


if __name__ == "__main__":
    sys.exit(main())
