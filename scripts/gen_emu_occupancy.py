"""The emulated GPU's occupancy table: registers and static shared memory per kernel, as
`nvcc -Xptxas -v` reports them for sm_90, read by the emulated module
(kernels/emu/emu_scheduler.cc) to decide how many blocks of a kernel one virtual GPU holds.

    python scripts/gen_emu_occupancy.py --write     # regenerate kernels/emu/occupancy_table.inc
    python scripts/gen_emu_occupancy.py --check     # exit 1 when the checked-in table is stale
    python scripts/gen_emu_occupancy.py --source F --out frag.txt   # one .cu (the build)
    python scripts/gen_emu_occupancy.py --merge frag... --out table.inc

The build (cmake/emu.cmake) runs it on every kernel file when nvcc exists and uses the
checked-in table otherwise. A file nvcc cannot compile (no NVSHMEM headers, a kernel being
rewritten) is recorded as skipped, never fails the build: its kernels then take the
emulator's fallback limit, with a warning naming them. Rows are per kernel name (no
namespace, no template arguments), the worst (most registers, most shared memory) over a
name's instances and files. With relocatable device code (the internode kernels) ptxas
reports a kernel's own registers, before the device link adds its callees' (NVSHMEM).
"""
from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TABLE = os.path.join(ROOT, "kernels", "emu", "occupancy_table.inc")
KERNEL_DIRS = ("kernels/cuda", "kernels/internode")
ARCH = "sm_90"


def find_nvcc() -> str | None:
    for c in (shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if c and os.path.exists(c):
            return c
    return None


def nvshmem_include() -> str | None:
    try:
        import nvidia.nvshmem as m  # the nvidia-nvshmem-cu13 wheel
    except ImportError:
        return None
    base = os.path.dirname(m.__file__) if getattr(m, "__file__", None) else list(m.__path__)[0]
    inc = os.path.join(base, "include")
    return inc if os.path.exists(os.path.join(inc, "nvshmem.h")) else None


def kernel_sources() -> list[str]:
    """Every kernel file present now, relative to the project root."""
    out = []
    for d in KERNEL_DIRS:
        out += sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, d, "*.cu")))
    return out


def nvcc_version(nvcc: str) -> str:
    text = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    m = re.search(r"release ([\d.]+)", text)
    return m.group(1) if m else "unknown"


def base_name(demangled: str) -> str:
    """`void ns::(anonymous namespace)::Kernel<T>(args)` -> `Kernel`."""
    s = demangled
    depth, cut = 0, len(s)
    for i, ch in enumerate(s):  # the first top-level '(' starts the parameter list
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif ch == "(" and depth == 0 and not s.startswith("(anonymous", i):
            cut = i
            break
    s = s[:cut]
    s = re.sub(r"\(anonymous namespace\)", "anon", s)
    while "<" in s:  # template arguments, innermost first
        s = re.sub(r"<[^<>]*>", "", s)
    s = s.split(" ")[-1]
    return s.split("::")[-1]


def launch_bound_arg(demangled: str) -> int | None:
    """The last template argument of a kernel instance when it is an integer: the block
    size a kernel templated on its __launch_bounds__ was compiled for
    (`K<(ns::Kind)1, 384>(args)` -> 384). Such an instance gets a row `K@384` of its own
    beside the worst-of-all row `K`, and a launch that names its bound
    (launch.cuh JEP_LAUNCH_T) reads that row: the instances' registers differ with their
    bounds, and the worst of them at another instance's block size would not fit an SM."""
    depth, start, end = 0, None, None
    for i, ch in enumerate(demangled):
        if ch == "<":
            if depth == 0 and start is None:
                start = i + 1
            depth += 1
        elif ch == ">":
            depth -= 1
            if depth == 0 and start is not None:
                end = i
                break
        elif ch == "(" and depth == 0 and not demangled.startswith("(anonymous", i):
            break
    if start is None or end is None:
        return None
    args, depth, cut = demangled[start:end], 0, 0
    for i, ch in enumerate(args):
        if ch in "<(":
            depth += 1
        elif ch in ">)":
            depth -= 1
        elif ch == "," and depth == 0:
            cut = i + 1
    last = args[cut:].strip()
    return int(last) if re.fullmatch(r"\d+", last) else None


def demangle(names: list[str]) -> list[str]:
    if not names:
        return []
    filt = shutil.which("c++filt")
    if filt is None:
        raise SystemExit("gen_emu_occupancy: c++filt (binutils) not found")
    text = subprocess.run([filt], input="\n".join(names), capture_output=True, text=True,
                          check=True).stdout
    return text.splitlines()


def parse_ptxas(text: str) -> list[tuple[str, int, int]]:
    """[(mangled entry, registers, static smem bytes)] from ptxas -v output."""
    rows, entry = [], None
    for line in text.splitlines():
        m = re.search(r"Compiling entry function '(\S+)'", line)
        if m:
            entry = m.group(1)
            continue
        m = re.search(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?", line)
        if m and entry is not None:
            rows.append((entry, int(m.group(1)), int(m.group(2) or 0)))
            entry = None
    return rows


def measure(nvcc: str, source: str) -> tuple[dict, str | None]:
    """({kernel: (regs, smem)}, None) or ({}, why it was skipped)."""
    args = [nvcc, "-std=c++17", f"-arch={ARCH}", f"-I{ROOT}", "-Xptxas", "-v"]
    if source.startswith("kernels/internode/"):
        inc = nvshmem_include()
        if inc is None:
            return {}, "no NVSHMEM headers (nvidia-nvshmem-cu13)"
        args += ["-rdc=true", f"-I{inc}"]
    with tempfile.TemporaryDirectory() as tmp:
        r = subprocess.run(args + ["-c", os.path.join(ROOT, source), "-o",
                                   os.path.join(tmp, "k.o")],
                           capture_output=True, text=True)
    if r.returncode != 0:
        first = next((ln for ln in r.stderr.splitlines() if "error" in ln), "nvcc failed")
        return {}, "nvcc failed: " + first.strip()[:160]
    rows = parse_ptxas(r.stdout + r.stderr)
    # __nv_static_<n>__<hash>_<file>_<hash>_ prefixes a static kernel's mangled name under -rdc.
    mangled = [re.sub(r"^__nv_static_\d+__\w+?_(?=_Z)", "", e) for e, _, _ in rows]
    out: dict[str, tuple[int, int]] = {}
    for name, (_, regs, smem) in zip(demangle(mangled), rows):
        k = base_name(name)
        keys = [k]
        bound = launch_bound_arg(name)
        if bound is not None:
            keys.append(f"{k}@{bound}")
        for key in keys:
            old = out.get(key, (0, 0))
            out[key] = (max(old[0], regs), max(old[1], smem))
    return out, None


def fragment(nvcc: str, source: str) -> str:
    usage, skipped = measure(nvcc, source)
    lines = [f"file {source}"]
    if skipped:
        lines.append(f"skipped {skipped}")
    lines += [f"kernel {k} {r} {s}" for k, (r, s) in sorted(usage.items())]
    return "\n".join(lines) + "\n"


def checked_in_rows(path: str = TABLE) -> dict[str, list[tuple[str, int, int]]]:
    """{source: [(kernel, regs, smem)]} of the checked-in table."""
    rows: dict[str, list[tuple[str, int, int]]] = {}
    with open(path) as f:
        for m in re.finditer(r'JEP_EMU_OCC_ROW\("([^"]+)", (\d+), (\d+)\)  // (.*)', f.read()):
            for src in m.group(4).split(", "):
                rows.setdefault(src.strip(), []).append((m.group(1), int(m.group(2)), int(m.group(3))))
    return rows


def merge(fragments: list[str], version: str, fallback: dict | None = None) -> str:
    """The table from the fragments; a skipped file's rows come from `fallback` (the
    checked-in table's rows by source) when it has them."""
    files, kernels = [], {}
    for text in fragments:
        src = None
        for ln in text.splitlines():
            kind, _, rest = ln.partition(" ")
            if kind == "file":
                src = rest
                files.append([rest, ""])
            elif kind == "skipped":
                old_rows = (fallback or {}).get(src, [])
                files[-1][1] = rest + ("; rows from the checked-in table" if old_rows else "")
                for k, r, sm in old_rows:
                    old = kernels.get(k, (0, 0, []))
                    kernels[k] = (max(old[0], r), max(old[1], sm), old[2] + [src])
            elif kind == "kernel":
                k, r, s = rest.split()
                old = kernels.get(k, (0, 0, []))
                kernels[k] = (max(old[0], int(r)), max(old[1], int(s)), old[2] + [src])
    out = ["// Generated by scripts/gen_emu_occupancy.py from `nvcc -Xptxas -v` (do not edit).",
           f"// nvcc {version}, {ARCH}. Kernel name, registers per thread, static shared",
           "// memory bytes (the worst over the name's instances). Read by kernels/emu/emu_scheduler.cc.",
           f"JEP_EMU_OCC_NVCC(\"{version}\")"]
    for f, why in sorted(files):
        out.append(f"// {f}" + (f": skipped ({why})" if why else ""))
    for k in sorted(kernels):
        r, s, srcs = kernels[k]
        out.append(f"JEP_EMU_OCC_ROW(\"{k}\", {r}, {s})  // {', '.join(sorted(set(srcs)))}")
    return "\n".join(out) + "\n"


def generate(nvcc: str) -> str:
    return merge([fragment(nvcc, s) for s in kernel_sources()], nvcc_version(nvcc))


def checked_in_version(path: str = TABLE) -> str | None:
    with open(path) as f:
        m = re.search(r'JEP_EMU_OCC_NVCC\("([^"]*)"\)', f.read())
    return m.group(1) if m else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nvcc", default=None)
    ap.add_argument("--source", help="one kernel file (relative to the project root)")
    ap.add_argument("--merge", nargs="*", help="fragment files to merge")
    ap.add_argument("--version", default=None, help="nvcc version recorded by --merge")
    ap.add_argument("--out")
    ap.add_argument("--write", action="store_true", help="regenerate the checked-in table")
    ap.add_argument("--check", action="store_true", help="exit 1 when the checked-in table is stale")
    a = ap.parse_args(argv)
    nvcc = a.nvcc or find_nvcc()
    if a.merge is not None:
        texts = [open(p).read() for p in a.merge]
        # the build: a file ptxas could not measure here (no NVSHMEM headers yet) keeps the
        # checked-in table's rows rather than the emulator's fallback limit
        text = merge(texts, a.version or (nvcc_version(nvcc) if nvcc else "unknown"),
                     checked_in_rows())
        with open(a.out, "w") as f:
            f.write(text)
        return 0
    if nvcc is None:
        print("gen_emu_occupancy: nvcc not found", file=sys.stderr)
        return 2
    if a.source:
        with open(a.out, "w") as f:
            f.write(fragment(nvcc, a.source))
        return 0
    text = generate(nvcc)
    if a.check:
        with open(TABLE) as f:
            old = f.read()
        if old != text:
            print("kernels/emu/occupancy_table.inc is stale: run "
                  "`python scripts/gen_emu_occupancy.py --write`", file=sys.stderr)
            return 1
        return 0
    with open(a.out or TABLE, "w") as f:
        f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
