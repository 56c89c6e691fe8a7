"""Grids that fit beside other work: a static check from `nvcc -Xptxas -v` that every
intranode launch preset (kernels/common/configs.h) fits the SM budget of a 132-SM GPU
(H100/H200) less the SMs left to other work, at the occupancy ptxas' register and shared
memory use allows, and that the runtime's cut to a `num_sms` budget (EpSmBudget,
FitPresetToSms) does what it says. The presets and the channel blocks' threads and shared
memory come from the headers through the extension. The ptxas check needs nvcc (no GPU)."""
from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest

import jax_ep

from jax_ep._src.ext import require_ext

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


def configs() -> dict:
    """The intranode presets and constants (kernels/common/configs.h,
    kernels/cuda/intranode_buffer.h) through the extension, each preset with its channel
    blocks at its max_ranks: threads of a combine or gather block (ChannelRoleThreads: half
    the sending warps when split, beside max(8, R) receiving ones), of a dispatch block
    (DispatchRoleThreads: a sending warp per rank when split) and the dispatch block's
    dynamic shared memory (DispatchChannelSmemBytes: zeros, two mbarriers and two
    bulk-copy pieces per rank)."""
    ext = require_ext()
    c = ext.intranode_constants()
    presets = [dict(p, **ext.intranode_channel_block(p["max_ranks"])) for p in c["presets"]]
    return dict(presets=presets, reserved=c["reserved_sms"], per_sm=c["blocks_per_sm"],
                plan_threads=c["plan_threads"], max_channel_threads=c["max_channel_threads"],
                max_ranks=c["max_ranks"])


def occupancy(regs: int, smem: int, threads: int) -> int:
    """Blocks of a kernel resident on one sm_90 SM."""
    warps = -(-threads // 32)
    per_warp = -(-regs * 32 // REG_UNIT) * REG_UNIT
    by_regs = REGS_PER_SM // (per_warp * warps) if regs else MAX_BLOCKS_PER_SM
    by_threads = MAX_THREADS_PER_SM // threads
    by_smem = SMEM_PER_SM // (smem + SMEM_PER_BLOCK_RESERVED)
    return min(by_regs, by_threads, by_smem, MAX_BLOCKS_PER_SM)


def parse_ptxas(text: str) -> dict:
    """{kernel: (registers, static smem bytes)}, the worst over a kernel's instances, and
    {kernel@bound: ...} per instance of a kernel templated on its __launch_bounds__ (its
    last template argument an int: `...ILi384EE` in the mangled name)."""
    out, keys = {}, None
    for line in text.splitlines():
        m = re.search(r"Compiling entry function '(\S+)'", line)
        if m:
            name = next((k for k in KERNELS if k in m.group(1)), None)
            keys = [name] if name else None
            b = re.search(r"Li(\d+)EEEv", m.group(1))
            if keys and b:
                keys.append(f"{name}@{b.group(1)}")
            continue
        m = re.search(r"Used (\d+) registers.*?(\d+) bytes smem", line)
        if m and keys:
            regs, smem = int(m.group(1)), int(m.group(2))
            for k in keys:
                old = out.get(k, (0, 0))
                out[k] = (max(old[0], regs), max(old[1], smem))
            keys = None
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
            threads = {"plan": cfg["plan_threads"], "roles": p["role_threads"],
                       "dispatch": p["dispatch_threads"]}[role]
            # a preset's block is an instance's bound (intranode_kernels.cu BoundRanks)
            regs, smem = usage.get(f"{kernel}@{threads}", usage[kernel])
            if threads > cfg["max_channel_threads"]:
                out.append(f"{p['name']}: {kernel} needs {threads} threads per block")
            if dyn == "bulk":
                smem += p["dispatch_smem_bytes"]
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


def test_each_preset_block_has_its_own_launch_bound(usage):
    """Every preset's channel block is the __launch_bounds__ of an instance of its
    kernel, so ptxas sized that instance's registers for the block it runs with (one
    bound of 1024 capped every block at 64 registers, and the kernels spilled)."""
    cfg = configs()
    for p in cfg["presets"]:
        for kernel, (role, _) in KERNELS.items():
            if role == "plan":
                continue
            threads = p["dispatch_threads"] if role == "dispatch" else p["role_threads"]
            assert f"{kernel}@{threads}" in usage, (p["name"], kernel, threads, sorted(usage))
            regs = usage[f"{kernel}@{threads}"][0]
            assert regs * threads <= REGS_PER_SM, (p["name"], kernel, regs, threads)


def test_the_check_fails_on_grids_or_registers_that_do_not_fit(usage):
    cfg = configs()
    assert cfg["presets"], "no presets from configs.h"
    many = dict(cfg, presets=[dict(cfg["presets"][0], num_sms=130)])
    assert any("dispatch_channel_kernel launches 130" in p for p in problems(many, usage))
    assert any("gather_channel_kernel launches 130" in p for p in problems(many, usage))
    def heavy_rows(kernel):  # 130 registers at >= 256 threads, in every instance's row
        return {k: ((130, 0) if k.split("@")[0] == kernel else v) for k, v in usage.items()}
    heavy = heavy_rows("dispatch_channel_kernel")
    assert any("dispatch_channel_kernel" in p and "0 block" in p
               for p in problems(cfg, heavy))
    heavy = heavy_rows("gather_channel_kernel")
    assert any("gather_channel_kernel" in p and "0 block" in p for p in problems(cfg, heavy))
    staging = dict(cfg, presets=[dict(p, dispatch_smem_bytes=2 * SMEM_PER_SM)  # past an SM
                                 for p in cfg["presets"]])
    assert any("dispatch_channel_kernel" in p and "0 block" in p
               for p in problems(staging, usage))
    gone = {k: v for k, v in usage.items() if k.split("@")[0] != "gather_channel_kernel"}
    assert any("no ptxas record" in p and "gather_channel_kernel" in p
               for p in problems(cfg, gone))


def test_dispatch_bulk_smem_fits_without_an_opt_in(usage):
    """The dispatch channel kernel launches without cudaFuncSetAttribute, so its static
    plus dynamic shared memory (bulk-copy pieces, zeros, mbarriers) stays within the
    default 48 KiB at every rank count, and its pieces are 16-byte multiples."""
    cfg = configs()
    static = usage["dispatch_channel_kernel"][1]
    for R in range(1, cfg["max_ranks"] + 1):
        blk = require_ext().intranode_channel_block(R)
        assert blk["bulk_piece_bytes"] >= 16 and blk["bulk_piece_bytes"] % 16 == 0, R
        assert static + blk["dispatch_smem_bytes"] <= 48 * 1024, R


def test_channel_blocks_hand_checked():
    ext = require_ext()
    # 8 ranks: combine/gather blocks hold 4 sending warps (to half the ranks) and 8
    # receiving ones, dispatch blocks 8 and 8; a piece is 32 KiB / (2 x 8) = 2 KiB, and the
    # dispatch block's shared memory 2 KiB of zeros, 8 x 16 B of mbarriers, 2 pieces a rank
    assert ext.intranode_channel_block(8) == dict(
        role_threads=32 * 12, dispatch_threads=32 * 16, bulk_piece_bytes=2048,
        dispatch_smem_bytes=2048 + 8 * 16 + 2 * 8 * 2048)
    # 32 ranks: no split, a receiving warp per source; pieces of 32 KiB / 64 = 512 B
    assert ext.intranode_channel_block(32) == dict(
        role_threads=32 * 32, dispatch_threads=32 * 32, bulk_piece_bytes=512,
        dispatch_smem_bytes=2048 + 32 * 16 + 2 * 32 * 512)
    # 3 ranks: pieces of 32 KiB / 6 = 5461 -> 5456 B, capped at 2 KiB
    assert ext.intranode_channel_block(3)["bulk_piece_bytes"] == 2048
    assert ext.intranode_channel_block(3)["role_threads"] == 32 * (2 + 8)


def test_occupancy_model():
    assert occupancy(78, 32, 512) == 1   # 2560 registers per warp x 16 warps
    assert occupancy(32, 0, 512) == 4    # thread limit
    assert occupancy(64, 120_000, 256) == 1  # shared memory limit
    assert occupancy(255, 0, 1024) == 0


def _fitted(monkeypatch, sms, num_sms=None):
    """{preset: channel-kernel blocks} as a launch on a GPU of `sms` SMs runs them
    (FitPresetToSms(p, EpSmBudget(sms)), reading JAX_EP_NUM_SMS)."""
    if num_sms is None:
        jax_ep.config.update("num_sms", None)
    else:
        jax_ep.config.update("num_sms", str(num_sms))
    return {p["name"]: p["num_sms"] for p in require_ext().intranode_fitted_presets(sms)}


def test_num_sms_cuts_the_grids(monkeypatch):
    cfg = configs()
    full = _fitted(monkeypatch, SMS)
    # the presets fit a 132-SM GPU: nothing cut by default
    assert full == {p["name"]: p["num_sms"] for p in cfg["presets"]}
    assert full["ep8"] <= 24  # DeepEP's 20-24 SMs at 8 ranks
    assert _fitted(monkeypatch, SMS, num_sms=20)["ep8"] == 20
    # an odd budget: the channel kernels keep whole channels (a send and a receive block)
    assert _fitted(monkeypatch, SMS, num_sms=13)["ep8"] == 12
    assert _fitted(monkeypatch, SMS, num_sms=1)["ep8"] == 2
    # a smaller GPU: at most its SMs less the reserve
    small = _fitted(monkeypatch, 20)
    assert all(v <= (20 - cfg["reserved"]) * cfg["per_sm"] for v in small.values())
    assert _fitted(monkeypatch, SMS, num_sms=1000)["ep32"] == 32  # never above presets


def test_set_num_sms_checks_its_argument(monkeypatch):
    from jax_ep import cuda
    jax_ep.config.update("num_sms", None)
    cuda.set_num_sms(24)
    assert jax_ep.config.num_sms == 24
    assert require_ext().settings()["num_sms"] == 24  # the kernels' copy
    cuda.set_num_sms(None)
    assert jax_ep.config.num_sms is None and require_ext().settings()["num_sms"] is None
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="num_sms"):
            cuda.set_num_sms(bad)
