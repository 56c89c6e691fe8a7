"""Grids that fit beside other work: a static check from `nvcc -Xptxas -v` that every
intranode launch preset (kernels/common/configs.h) fits the SM budget of a 132-SM GPU
(H100/H200) less the SMs left to other work, at the occupancy ptxas' register and shared
memory use allows, and that the runtime's cut to a `num_sms` budget (EpSmBudget,
FitPresetToSms) does what it says. Needs nvcc (no GPU)."""
from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NVCC = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc"
                                if os.path.exists("/usr/local/cuda/bin/nvcc") else None)
SMS = 132  # H100 SXM / H200
# sm_90 limits
REGS_PER_SM, REG_UNIT, MAX_THREADS_PER_SM, MAX_BLOCKS_PER_SM = 65536, 256, 2048, 32
SMEM_PER_SM, SMEM_PER_BLOCK_RESERVED = 233472, 1024

# kernel -> ("roles" | "dispatch" | "plan", extra dynamic smem: None, or "bulk" for the
# dispatch's bulk-copy pieces, intranode_buffer.h DispatchChannelSmemBytes).
# Channel kernels: num_sms blocks of their sending warps beside the receiving ones
# ("roles": combine's and gather's, intranode_buffer.h ChannelRoleThreads; "dispatch": a
# channel per block, DispatchRoleThreads).
KERNELS = {
    "dispatch_notify_kernel": ("plan", None),
    "dispatch_channel_kernel": ("dispatch", "bulk"),
    "combine_notify_kernel": ("plan", None),
    "combine_channel_kernel": ("roles", None),
    "gather_channel_kernel": ("roles", None),
}


def _read(rel):
    with open(os.path.join(ROOT, rel)) as f:
        return f.read()


def _const(text, name):
    return int(re.search(rf"\b{name}\s*=\s*(\d+)", text).group(1))


def configs():
    text = _read("kernels/common/configs.h")
    rows = re.findall(r'\{"(\w+)",\s*(\d+),\s*(\d+)\}', text)
    presets = [dict(name=n, max_ranks=int(m), num_sms=int(c)) for n, m, c in rows]
    return dict(presets=presets, reserved=_const(text, "kReservedSms"),
                channel_threads=_const(text, "kChannelThreads"),
                max_channel_threads=_const(text, "kMaxChannelThreads"),
                per_sm=_const(text, "kAssumedBlocksPerSm"),
                plan_threads=_const(text, "kPlanThreads"),
                smem_experts=_const(text, "kMaxSmemLocalExperts"),
                bulk_staging=_const(text, "kBulkStagingBytes"),
                bulk_piece=_const(text, "kBulkPieceBytes"),
                bulk_zero=_const(text, "kBulkZeroBytes"),
                max_ranks=_const(_read("kernels/cuda/intranode_buffer.h"), "kMaxRanks"),
                split_ranks=_const(_read("kernels/cuda/intranode_buffer.h"),
                                   "kMaxSplitSendRanks"))


def dispatch_bulk_smem(cfg: dict, R: int) -> int:
    """The dispatch channel kernel's dynamic shared memory at R ranks: zeros, two mbarriers
    and two bulk-copy pieces per rank (configs.h DispatchBulkPieceBytes)."""
    piece = min(cfg["bulk_piece"], (cfg["bulk_staging"] // (2 * R)) // 16 * 16)
    return cfg["bulk_zero"] + 16 * R + 2 * R * piece


def role_threads(cfg: dict, R: int) -> int:
    """Threads of a combine or gather channel block at R ranks: block 2ch + 1 holds half
    the sending warps (when R <= kMaxSplitSendRanks) and max(8, R) receiving ones."""
    send = (R + 1) // 2 if R <= cfg["split_ranks"] else 0
    return 32 * (send + max(cfg["channel_threads"] // 32, R))


def dispatch_threads(cfg: dict, R: int) -> int:
    """Threads of a dispatch channel block at R ranks: a sending warp per rank (when
    R <= kMaxSplitSendRanks; above it the receiving block has none) and max(8, R)
    receiving ones."""
    send = R if R <= cfg["split_ranks"] else 0
    return 32 * (send + max(cfg["channel_threads"] // 32, R))


def occupancy(regs: int, smem: int, threads: int) -> int:
    """Blocks of a kernel resident on one sm_90 SM."""
    warps = -(-threads // 32)
    per_warp = -(-regs * 32 // REG_UNIT) * REG_UNIT
    by_regs = REGS_PER_SM // (per_warp * warps) if regs else MAX_BLOCKS_PER_SM
    by_threads = MAX_THREADS_PER_SM // threads
    by_smem = SMEM_PER_SM // (smem + SMEM_PER_BLOCK_RESERVED)
    return min(by_regs, by_threads, by_smem, MAX_BLOCKS_PER_SM)


def parse_ptxas(text: str) -> dict:
    """{kernel: (registers, static smem bytes)}, the worst over a kernel's instances."""
    out, name = {}, None
    for line in text.splitlines():
        m = re.search(r"Compiling entry function '(\S+)'", line)
        if m:
            name = next((k for k in KERNELS if k in m.group(1)), None)
            continue
        m = re.search(r"Used (\d+) registers.*?(\d+) bytes smem", line)
        if m and name:
            regs, smem = int(m.group(1)), int(m.group(2))
            old = out.get(name, (0, 0))
            out[name] = (max(old[0], regs), max(old[1], smem))
            name = None
    return out


def problems(cfg: dict, usage: dict, sms: int = SMS) -> list[str]:
    """Every way a preset does not fit: a kernel below the assumed blocks per SM at its
    block size, or a grid larger than the budget holds."""
    out = []
    budget = (sms - cfg["reserved"]) * cfg["per_sm"]
    missing = sorted(set(KERNELS) - set(usage))
    if missing:
        out.append(f"no ptxas record for {missing}")
    for p in cfg["presets"]:
        for kernel, (role, dyn) in KERNELS.items():
            if kernel not in usage:
                continue
            regs, smem = usage[kernel]
            threads = {"plan": cfg["plan_threads"],
                       "roles": role_threads(cfg, p["max_ranks"]),
                       "dispatch": dispatch_threads(cfg, p["max_ranks"])}[role]
            if threads > cfg["max_channel_threads"]:
                out.append(f"{p['name']}: {kernel} needs {threads} threads per block")
            if dyn == "hist":
                smem += 4 * cfg["smem_experts"]
            elif dyn == "warps":
                smem += 4 * cfg["max_ranks"] * (threads // 32)
            elif dyn == "bulk":
                smem += dispatch_bulk_smem(cfg, p["max_ranks"])
            occ = occupancy(regs, smem, threads)
            need = 1 if role == "plan" else cfg["per_sm"]
            if occ < need:
                out.append(f"{p['name']}: {kernel} ({regs} registers, {smem} B smem) holds "
                           f"{occ} block(s) of {threads} threads per SM, {need} assumed")
            grid = 1 if role == "plan" else p["num_sms"]
            if grid > budget:
                out.append(f"{p['name']}: {kernel} launches {grid} blocks; {sms} SMs less "
                           f"{cfg['reserved']} for other work hold {budget}")
    return out


@pytest.fixture(scope="module")
def usage(tmp_path_factory):
    if NVCC is None:
        pytest.skip("nvcc not found")
    out = tmp_path_factory.mktemp("ptxas") / "intranode.o"
    r = subprocess.run([NVCC, "-std=c++17", "-arch=sm_90", f"-I{ROOT}", "-Xptxas", "-v",
                        "-c", os.path.join(ROOT, "kernels/cuda/intranode_kernels.cu"),
                        "-o", str(out)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return parse_ptxas(r.stderr + r.stdout)


def test_every_preset_fits_the_sm_budget(usage):
    assert problems(configs(), usage) == []


def test_the_check_fails_on_grids_or_registers_that_do_not_fit(usage):
    cfg = configs()
    assert cfg["presets"], "no preset rows parsed from configs.h"
    many = dict(cfg, presets=[dict(cfg["presets"][0], num_sms=130)])
    assert any("dispatch_channel_kernel launches 130" in p for p in problems(many, usage))
    assert any("gather_channel_kernel launches 130" in p for p in problems(many, usage))
    heavy = dict(usage, dispatch_channel_kernel=(130, 0))  # 130 registers at >= 256 threads
    assert any("dispatch_channel_kernel" in p and "0 block" in p
               for p in problems(cfg, heavy))
    heavy = dict(usage, gather_channel_kernel=(130, 0))
    assert any("gather_channel_kernel" in p and "0 block" in p for p in problems(cfg, heavy))
    staging = dict(cfg, bulk_staging=8 * 233472, bulk_piece=233472)  # pieces past an SM
    assert any("dispatch_channel_kernel" in p and "0 block" in p
               for p in problems(staging, usage))
    gone = {k: v for k, v in usage.items() if k != "gather_channel_kernel"}
    assert any("no ptxas record" in p and "gather_channel_kernel" in p
               for p in problems(cfg, gone))


def test_dispatch_bulk_smem_fits_without_an_opt_in(usage):
    """The dispatch channel kernel launches without cudaFuncSetAttribute, so its static
    plus dynamic shared memory (bulk-copy pieces, zeros, mbarriers) stays within the
    default 48 KiB at every rank count, and its pieces are 16-byte multiples."""
    cfg = configs()
    static = usage["dispatch_channel_kernel"][1]
    for R in range(1, cfg["max_ranks"] + 1):
        piece = min(cfg["bulk_piece"], (cfg["bulk_staging"] // (2 * R)) // 16 * 16)
        assert piece >= 16 and piece % 16 == 0, R
        assert static + dispatch_bulk_smem(cfg, R) <= 48 * 1024, R


def test_occupancy_model():
    assert occupancy(78, 32, 512) == 1   # 2560 registers per warp x 16 warps
    assert occupancy(32, 0, 512) == 4    # thread limit
    assert occupancy(64, 120_000, 256) == 1  # shared memory limit
    assert occupancy(255, 0, 1024) == 0


_PROBE = r"""
#include <cstdio>
#include "kernels/common/configs.h"
int main(int argc, char** argv) {
  const int sms = std::atoi(argv[1]);
  for (const auto& p : jax_ep::kIntranodePresets) {
    const jax_ep::IntranodePreset q = jax_ep::FitPresetToSms(p, jax_ep::EpSmBudget(sms));
    std::printf("%s %d\n", q.name, q.num_sms);
  }
}
"""


def _fitted(tmp_path, sms, num_sms=None):
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    src, exe = tmp_path / "probe.cc", tmp_path / "probe"
    if not exe.exists():
        src.write_text(_PROBE)
        subprocess.run([cxx, "-std=c++17", f"-I{ROOT}", str(src), "-o", str(exe)],
                       check=True, timeout=300)
    env = dict(os.environ)
    env.pop("JAX_EP_NUM_SMS", None)
    if num_sms is not None:
        env["JAX_EP_NUM_SMS"] = str(num_sms)
    out = subprocess.run([str(exe), str(sms)], env=env, capture_output=True, text=True,
                         check=True).stdout
    return {n: int(c) for n, c in (ln.split() for ln in out.splitlines())}


def test_num_sms_cuts_the_grids(tmp_path):
    cfg = configs()
    full = _fitted(tmp_path, SMS)
    # the presets fit a 132-SM GPU: nothing cut by default
    assert full == {p["name"]: p["num_sms"] for p in cfg["presets"]}
    assert full["ep8"] <= 24  # DeepEP's 20-24 SMs at 8 ranks
    assert _fitted(tmp_path, SMS, num_sms=20)["ep8"] == 20
    # an odd budget: the channel kernels keep whole channels (a send and a receive block)
    assert _fitted(tmp_path, SMS, num_sms=13)["ep8"] == 12
    assert _fitted(tmp_path, SMS, num_sms=1)["ep8"] == 2
    # a smaller GPU: at most its SMs less the reserve
    small = _fitted(tmp_path, 20)
    assert all(v <= (20 - cfg["reserved"]) * cfg["per_sm"] for v in small.values())
    assert _fitted(tmp_path, SMS, num_sms=1000)["ep32"] == 32  # never above presets


def test_set_num_sms_checks_its_argument(monkeypatch):
    from jax_ep.runtime import cuda
    monkeypatch.delenv("JAX_EP_NUM_SMS", raising=False)
    cuda.set_num_sms(24)
    assert os.environ["JAX_EP_NUM_SMS"] == "24"
    cuda.set_num_sms(None)
    assert "JAX_EP_NUM_SMS" not in os.environ
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="num_sms"):
            cuda.set_num_sms(bad)
