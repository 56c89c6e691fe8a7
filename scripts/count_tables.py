#!/usr/bin/env python3
"""The before/after tables of docs/performance.md ("Counted by the emulated GPU" and
"Modelled H200 estimate"), regenerated in one command:

    python scripts/count_tables.py --write          # after = HEAD, before = stored JSON
    python scripts/count_tables.py --rebuild-before --write   # also recount 8ec4c50

"Before" is the kernels at commit 8ec4c50 (the start of the redesign) with today's
counting emulator (kernels/emu/, the copy-counting hook of
kernels/internode/device_copy.cuh and xla_ffi/emu/emu_module.cc copied over): a git
worktree of 8ec4c50 with those files, its own emulated module built with
-DJAX_EP_CUDA=OFF. Its counts are stored in docs/emulated_counts_before.json.gz (compact
JSON, gzip; `--rebuild-before` writes it anew), so a refresh of "after" does not rebuild
it. "After" is a worktree of HEAD (what is committed),
built the same way. Each side runs `python -m jax_ep.bench --emulated --model --json`
with JAX_EP_EMU_MODULE_DIR pointing at its module. The numbers are COUNTS of the emulated
GPU and a MODEL built on them, never measurements.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BEFORE_COMMIT = "8ec4c50"
BEFORE_JSON = os.path.join(ROOT, "docs", "emulated_counts_before.json.gz")
# What "before" takes from HEAD: the counting emulator and its copy hook.
OVERLAY = ["kernels/emu", "kernels/internode/device_copy.cuh", "xla_ffi/emu/emu_module.cc"]
MARKS = {"counts": ("<!-- counts:begin -->", "<!-- counts:end -->"),
         "model": ("<!-- model:begin -->", "<!-- model:end -->")}


def store_before(before):
    """Writes the "before" counts: compact JSON, gzip without a time stamp, so the same
    counts give the same bytes; no path of this machine in it."""
    import gzip
    before = dict(before, module="(a build of the before worktree: --rebuild-before)")
    data = json.dumps(before, separators=(",", ":"), sort_keys=True).encode()
    with open(BEFORE_JSON, "wb") as f:
        f.write(gzip.compress(data, 9, mtime=0))


def load_before():
    import gzip
    with gzip.open(BEFORE_JSON, "rt") as f:
        return json.load(f)


def sh(cmd, **kw):
    print("+ " + " ".join(cmd), file=sys.stderr)
    subprocess.run(cmd, check=True, **kw)


def worktree(path, commit):
    """A detached worktree of `commit` at `path`; an existing one is moved to `commit` (its
    build directory stays, so ninja rebuilds only what changed)."""
    if os.path.exists(os.path.join(path, ".git")):
        sh(["git", "-C", path, "checkout", "--quiet", "--force", "--detach", commit])
        sh(["git", "-C", path, "clean", "-fdq", "-e", "build/"])
    else:
        sh(["git", "-C", ROOT, "worktree", "add", "--detach", path, commit])


def build(src, jobs, extra_cxx=""):
    py = os.path.join(ROOT, ".venv", "bin", "python")
    env = dict(os.environ, PATH=os.path.join(ROOT, ".venv", "bin") + os.pathsep
               + os.environ.get("PATH", ""))
    b = os.path.join(src, "build", "emu")
    sh(["cmake", "-S", src, "-B", b, "-G", "Ninja", "-DJAX_EP_CUDA=OFF",
        f"-DPython_EXECUTABLE={py}", "-DCMAKE_BUILD_TYPE=Release"]
       + ([f"-DCMAKE_CXX_FLAGS={extra_cxx}"] if extra_cxx else []), env=env,
       stdout=subprocess.DEVNULL)
    sh(["nice", "ninja", f"-j{jobs}", "-C", b, "_jax_ep_emu"], env=env, stdout=subprocess.DEVNULL)
    return b


def count(module_dir, out_json, extra):
    """`--emulated --model` with the module of `module_dir` (extra: e.g. --model-from X to
    regroup and remodel saved counts without counting)."""
    env = dict(os.environ, JAX_EP_EMU_MODULE_DIR=module_dir)
    args = extra if extra else ["--emulated", "--model"]
    sh([os.path.join(ROOT, ".venv", "bin", "python"), "-m", "jax_ep.bench"] + args
       + ["--json", out_json], env=env, cwd=ROOT, stdout=subprocess.DEVNULL)
    with open(out_json) as f:
        return json.load(f)


def counts_markdown(before, after):
    sys.path.insert(0, ROOT)
    from jax_ep.bench.emulated import format_markdown
    out = []
    for label, rep in (("Before (kernels at 8ec4c50)", before), ("After (HEAD)", after)):
        shapes = {r["mode"]: r["shape"] for r in rep.get("results", [])}
        out.append(f"**{label}**: {rep.get('commit', '')}. Shapes (ranks, nodes, tokens per "
                   "rank, hidden, top-k, experts; bf16): " + "; ".join(
                       f"{m} {s}" for m, s in shapes.items()) + ".")
        out.append("")
        out.append(format_markdown(rep.get("results", [])))
        out.append("")
    return "\n".join(out).rstrip()


def model_markdown(before, after):
    from jax_ep.bench.emulated import verdict_words

    out = ["| target | op | before: model us | bound | SMs | NVLink frac | RDMA GB/s | "
           "after: model us | bound | SMs | NVLink frac | RDMA GB/s | target met (after) |",
           "|---|---|---:|---|---:|---:|---:|---:|---|---:|---:|---:|---|"]

    def cells(e, op):
        if e is None or "error" in e:
            return "not counted | | | | "
        o = e["ops"][op]
        return (f"{o['time_s'] * 1e6:.1f} | {o['bound']} | {o['sms']} | "
                f"{o['nvlink_fraction']:.2f} | {o['rdma_GBps']:.1f}")

    b = {e["target"]: e for e in before.get("model", {}).get("entries", [])}
    a = {e["target"]: e for e in after.get("model", {}).get("entries", [])}
    for t in list(dict.fromkeys(list(b) + list(a))):
        for op in ("dispatch", "combine"):
            ae = a.get(t)
            met = ("" if ae is None or "error" in ae else verdict_words(ae["verdict"], op))
            err = ""
            for side, e in (("before", b.get(t)), ("after", ae)):
                if e is not None and "error" in e and op == "dispatch":
                    err += f" ({side} not counted: {e['error'][:100]})"
            out.append(f"| {t} | {op} | {cells(b.get(t), op)} | {cells(ae, op)} | {met}{err} |")
    return "\n".join(out)


def write(path, key, text):
    with open(path) as f:
        doc = f.read()
    begin, end = MARKS[key]
    i, j = doc.find(begin), doc.find(end)
    if i < 0 or j < i:
        raise SystemExit(f"{path}: markers {begin} ... {end} not found")
    doc = doc[:i + len(begin)] + "\n" + text + "\n" + doc[j:]
    with open(path, "w") as f:
        f.write(doc)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rebuild-before", action="store_true",
                   help=f"recount the kernels of {BEFORE_COMMIT} (worktree + build)")
    p.add_argument("--after-module", help="use this emulated-module directory for 'after' "
                                          "instead of building a worktree of HEAD")
    p.add_argument("--before-json", help="store this earlier `--emulated --model --json` "
                                         f"output of the {BEFORE_COMMIT} kernels as the "
                                         "before counts instead of counting them")
    p.add_argument("--after-json", help="take 'after' from this earlier `--emulated --model "
                                        "--json` output (regrouped and remodelled) instead of "
                                        "counting it again (needs --after-module)")
    p.add_argument("--scratch", default="/tmp/jax_ep_count_tables", help="worktrees here")
    p.add_argument("--jobs", type=int, default=1, help="ninja -j (default 1)")
    p.add_argument("--write", action="store_true", help="update docs/performance.md")
    a = p.parse_args(argv)
    os.makedirs(a.scratch, exist_ok=True)
    head = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True, check=True).stdout.strip()
    if a.before_json:
        with open(a.before_json) as f:
            before = json.load(f)
        before["commit"] = f"{BEFORE_COMMIT} with the counting emulator of {head}"
        store_before(before)
    elif a.rebuild_before or not os.path.exists(BEFORE_JSON):
        wt = os.path.join(a.scratch, "before")
        worktree(wt, BEFORE_COMMIT)
        for rel in OVERLAY:
            src, dst = os.path.join(ROOT, rel), os.path.join(wt, rel)
            if os.path.isdir(src):
                shutil.copytree(src, dst, dirs_exist_ok=True)
            else:
                shutil.copy2(src, dst)
        # its low-latency FP8 went as two dispatches (no FP8 send op): bf16 dispatch; its
        # hierarchical kernels fail with more than 16 blocks resident (a row arrives out
        # of order), so they are counted with the 16 the emulator ran them with then
        # today's emulator reads the kernels' co-residency table through a definition
        # the older build files do not make: the checked-in table (rows of kernels the
        # older tree lacks go unused; its own kernels take the fallback limit)
        table = os.path.join(wt, "kernels", "emu", "occupancy_table.inc")
        before = count(build(wt, a.jobs, f'-DJEP_EMU_OCCUPANCY_TABLE=\\"{table}\\"'),
                       os.path.join(a.scratch, "before.json"),
                       ["--emulated", "--model", "--bf16-dispatch", "--resident-blocks", "16"])
        before["commit"] = f"{BEFORE_COMMIT} with the counting emulator of {head}"
        store_before(before)  # per-GPU counts and model points: --model-from
    stored = load_before()
    label = stored.get("commit", BEFORE_COMMIT)
    plain = os.path.join(a.scratch, "before_stored.json")  # --model-from reads plain JSON
    with open(plain, "w") as f:
        json.dump(stored, f)
    if a.after_module:
        mod = a.after_module
    else:
        wt = os.path.join(a.scratch, "after")
        worktree(wt, subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True,
                                    text=True, check=True).stdout.strip())
        mod = build(wt, a.jobs)
    # the stored counts, regrouped and modelled by today's code (no recount)
    before = count(mod, os.path.join(a.scratch, "before_now.json"), ["--model-from", plain])
    before["commit"] = label
    if a.after_json:
        if not a.after_module:
            p.error("--after-json needs --after-module (the module that counted it)")
        after = count(mod, os.path.join(a.scratch, "after_now.json"), ["--model-from", a.after_json])
    else:
        after = count(mod, os.path.join(a.scratch, "after.json"), [])
    wt_of_module = os.path.dirname(os.path.dirname(os.path.abspath(mod)))
    r = subprocess.run(["git", "-C", wt_of_module, "rev-parse", "--short", "HEAD"],
                       capture_output=True, text=True)
    after["commit"] = r.stdout.strip() if r.returncode == 0 else head
    c, m = counts_markdown(before, after), model_markdown(before, after)
    print(c)
    print()
    print(m)
    if a.write:
        doc = os.path.join(ROOT, "docs", "performance.md")
        write(doc, "counts", c)
        write(doc, "model", m)
        print(f"wrote {doc}", file=sys.stderr)


if __name__ == "__main__":
    main()
