"""No register spills in the kernels that move the rows: `nvcc -Xptxas -v` for sm_90a on each
kernel file listed in FILES, and every instance of the kernels named there must report
0 bytes of spill stores and 0 of spill loads. A spill is a local-memory round trip per
access in the copy loops (the rows' 16-byte vectors in flight live in registers), so a
change that makes ptxas spill there (a larger unroll, a __launch_bounds__ above the block
size, which caps the registers at 65536 / bound) fails here, on any machine with nvcc (CI
has it; no GPU needed). Without nvcc the tests are skipped, saying so.

Add a kernel file by adding a row to FILES: (file, the kernels whose spills count). Files
under kernels/internode/ compile as relocatable device code against NVSHMEM's headers
(the nvidia-nvshmem-cu13 wheel), as the build does; without the headers they skip."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

from gen_emu_occupancy import nvshmem_include  # noqa: E402  (one place finds the headers)

NVCC = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc"
                                if os.path.exists("/usr/local/cuda/bin/nvcc") else None)
ARCH = ["-gencode=arch=compute_90a,code=sm_90a"]

# file -> kernels (base names, no namespace or template arguments) that must not spill.
FILES = {
    "kernels/cuda/intranode_kernels.cu": (
        "dispatch_channel_kernel", "combine_channel_kernel", "gather_channel_kernel"),
    # the hierarchical mode's cooperative kernels (every role's copies on the copy engine)
    # and its small set-up kernels
    "kernels/internode/hierarchical_kernels.cu": (
        "DispatchMain", "CombineMain", "DispatchFinish", "CountKernel", "ExchangeKernel",
        "AdvanceKernel"),
    # the intranode low-latency kernels that copy or sum rows (the receive sum's rows x
    # vectors in flight live in registers)
    "kernels/cuda/low_latency_kernels.cu": (
        "ll_dispatch_send", "ll_dispatch_recv", "ll_combine_send", "ll_combine_recv"),
    # the internode low-latency kernels that copy or sum rows, and their waits
    "kernels/internode/low_latency_kernels.cu": (
        "DispatchSendKernel", "DispatchUnpack", "CombineSendKernel", "CombineReduce",
        "RecvWait", "RecvFinish"),
    # the direct mode's packing, sending and unpacking
    "kernels/internode/internode_kernels.cu": (
        "PackKernel", "SendKernel", "UnpackKernel", "ReduceKernel", "GatherUnpackKernel"),
}


def parse_spills(text: str) -> list[tuple[str, int, int, int]]:
    """[(mangled entry, registers, spill store bytes, spill load bytes)] from ptxas -v.
    ptxas prints, per entry, 'Compiling entry function' then '... N bytes spill stores,
    M bytes spill loads' then 'Used R registers'."""
    rows, entry, spill = [], None, None
    for line in text.splitlines():
        m = re.search(r"Compiling entry function '(\S+)'", line)
        if m:
            entry, spill = m.group(1), None
            continue
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and entry is not None:
            spill = (int(m.group(1)), int(m.group(2)))
            continue
        m = re.search(r"Used (\d+) registers", line)
        if m and entry is not None:
            st, ld = spill if spill is not None else (0, 0)
            rows.append((entry, int(m.group(1)), st, ld))
            entry = None
    return rows


def demangle(names: list[str]) -> list[str]:
    filt = shutil.which("c++filt")
    if filt is None or not names:
        return names
    names = [re.sub(r"^__nv_static_\d+__\w+?_(?=_Z)", "", n) for n in names]  # -rdc statics
    return subprocess.run([filt], input="\n".join(names), capture_output=True, text=True,
                          check=True).stdout.splitlines()


def instance(demangled: str) -> str:
    """`void jax_ep::(anonymous namespace)::k<(jax_ep::FloatKind)1, 384>(jax_ep::X)` ->
    `k<(jax_ep::FloatKind)1, 384>` (the name without scope, its template arguments kept)."""
    s = demangled.replace("(anonymous namespace)::", "")
    if s.startswith("void "):
        s = s[len("void "):]
    depth = 0
    for i, ch in enumerate(s):
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif ch == "(" and depth == 0:
            s = s[:i]
            break
    name, _, args = s.partition("<")
    return name.split("::")[-1] + ("<" + args if args else "")


def compile_ptxas(source: str, tmp, extra=()) -> str:
    args = [NVCC, "-std=c++17", *ARCH, f"-I{ROOT}", "-Xptxas", "-v", *extra]
    if source.startswith("kernels/internode/"):
        inc = nvshmem_include()
        if inc is None:
            pytest.skip(f"{source}: no NVSHMEM headers (the nvidia-nvshmem-cu13 wheel)")
        args += ["-rdc=true", f"-I{inc}"]
    path = source if os.path.isabs(source) else os.path.join(ROOT, source)
    r = subprocess.run(args + ["-c", path, "-o", str(tmp / "k.o")], capture_output=True,
                       text=True, timeout=1200)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout + r.stderr


def spilling(text: str, kernels) -> list[str]:
    rows = parse_spills(text)
    out = []
    for (entry, regs, st, ld), name in zip(rows, demangle([e for e, *_ in rows])):
        inst = instance(name)
        base = inst.split("<")[0]
        if base in kernels and (st > 0 or ld > 0):
            out.append(f"{inst}: {regs} registers, {st} B spill stores, {ld} B spill loads")
    return out


@pytest.mark.parametrize("source", sorted(FILES))
def test_kernels_do_not_spill(source, tmp_path):
    if NVCC is None:
        pytest.skip("nvcc not found: ptxas' register report needs the CUDA toolkit")
    text = compile_ptxas(source, tmp_path)
    rows = parse_spills(text)
    names = {instance(n).split("<")[0] for n in demangle([e for e, *_ in rows])}
    missing = sorted(set(FILES[source]) - names)
    assert not missing, f"{source}: ptxas reported no entry for {missing}"
    assert spilling(text, FILES[source]) == []


def test_the_check_sees_a_spill(tmp_path):
    """A kernel that cannot fit its registers under its bound (32 live 16-byte vectors per
    thread, 64 registers at 1024 threads) is reported, through the same compile and parse."""
    if NVCC is None:
        pytest.skip("nvcc not found: ptxas' register report needs the CUDA toolkit")
    src = tmp_path / "spill.cu"
    src.write_text(
        "template <int kN> __global__ void __launch_bounds__(1024) spiller(const uint4* s, uint4* d) {\n"
        "  uint4 v[kN];\n"
        "#pragma unroll\n"
        "  for (int i = 0; i < kN; ++i) v[i] = __ldcg(s + threadIdx.x + i * 1024);\n"
        "#pragma unroll\n"
        "  for (int i = 0; i < kN; ++i) d[threadIdx.x + i * 1024] = v[kN - 1 - i];\n"
        "}\n"
        "template __global__ void spiller<32>(const uint4*, uint4*);\n"
        "template __global__ void spiller<2>(const uint4*, uint4*);\n")
    text = compile_ptxas(str(src), tmp_path)
    found = spilling(text, ("spiller",))
    assert len(found) == 1 and found[0].startswith("spiller<32>"), found
    assert spilling(text, ("other",)) == []


def test_parse_spills_reads_each_entry():
    text = ("ptxas info    : Compiling entry function '_Z1av' for 'sm_90a'\n"
            "ptxas info    : Function properties for _Z1av\n"
            "    8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads\n"
            "ptxas info    : Used 64 registers, used 1 barriers\n"
            "ptxas info    : Compiling entry function '_Z1bv' for 'sm_90a'\n"
            "ptxas info    : Used 20 registers\n")
    assert parse_spills(text) == [("_Z1av", 64, 4, 12), ("_Z1bv", 20, 0, 0)]
