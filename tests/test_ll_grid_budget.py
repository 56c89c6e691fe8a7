"""Low-latency grids that fit beside other work: a static check from `nvcc -Xptxas -v`
that each intranode low-latency kernel (kernels/cuda/low_latency_kernels.cu) holds at
least kLLBlocksPerSm blocks of kLLThreads threads per sm_90 SM, so that a grid cut to the
SM budget (EpSmBudget x kLLBlocksPerSm, in the handlers) is resident at once. The grid cut
itself is counted on the emulated GPU (tests/emu/test_low_latency_emu.py). Needs nvcc."""
from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest

from test_grid_budget import NVCC, ROOT, occupancy

KERNELS = ("ll_dispatch_send", "ll_dispatch_recv", "ll_combine_send", "ll_combine_recv_plan",
           "ll_combine_recv")


def ll_constants() -> dict:
    text = open(os.path.join(ROOT, "kernels/cuda/low_latency_kernels.h")).read()
    get = lambda n: int(re.search(rf"\b{n}\s*=\s*(\d+)", text).group(1))  # noqa: E731
    return dict(threads=get("kLLThreads"), per_sm=get("kLLBlocksPerSm"),
                default_blocks=get("kLLDefaultBlocks"))


def parse(text: str) -> dict:
    """{kernel: (registers, static smem bytes)} from ptxas' report."""
    out, name = {}, None
    for line in text.splitlines():
        m = re.search(r"Compiling entry function '(\S+)'", line)
        if m:
            # the longest name that matches (ll_combine_recv_plan before ll_combine_recv)
            hits = [k for k in KERNELS if re.search(rf"\d{k}E", m.group(1))]
            name = max(hits, key=len) if hits else None
            continue
        m = re.search(r"Used (\d+) registers.*?(\d+) bytes smem", line)
        if m and name:
            out[name] = (int(m.group(1)), int(m.group(2)))
            name = None
    return out


def problems(usage: dict, c: dict) -> list[str]:
    out = [f"no ptxas record for {k}" for k in KERNELS if k not in usage]
    for k, (regs, smem) in usage.items():
        occ = occupancy(regs, smem, c["threads"])
        if occ < c["per_sm"]:
            out.append(f"{k} ({regs} registers, {smem} B smem) holds {occ} block(s) of "
                       f"{c['threads']} threads per SM, {c['per_sm']} assumed")
    # the default cap (no budget set) must fit a 132-SM GPU less the default reserve
    if c["default_blocks"] > (132 - 16) * c["per_sm"]:
        out.append(f"kLLDefaultBlocks={c['default_blocks']} exceeds 116 SMs")
    return out


@pytest.fixture(scope="module")
def usage(tmp_path_factory):
    if NVCC is None or shutil.which(NVCC) is None and not os.path.exists(NVCC):
        pytest.skip("nvcc not found")
    out = tmp_path_factory.mktemp("ptxas_ll") / "ll.o"
    r = subprocess.run([NVCC, "-std=c++17", "-arch=sm_90", f"-I{ROOT}", "-Xptxas", "-v", "-c",
                        os.path.join(ROOT, "kernels/cuda/low_latency_kernels.cu"), "-o",
                        str(out)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return parse(r.stderr + r.stdout)


def test_every_low_latency_kernel_fits_its_blocks_per_sm(usage):
    assert problems(usage, ll_constants()) == []


def test_the_check_fails_on_kernels_that_do_not_fit(usage):
    c = ll_constants()
    heavy = dict(usage, ll_dispatch_send=(255, 0))  # 255 registers: 1 block of 256 at most
    assert any("ll_dispatch_send" in p for p in problems(heavy, dict(c, per_sm=2)))
    missing = {k: v for k, v in usage.items() if k != "ll_combine_recv"}
    assert any("no ptxas record for ll_combine_recv" in p for p in problems(missing, c))
