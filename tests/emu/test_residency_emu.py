"""Co-residency on the emulated GPU: by default a virtual GPU holds as many blocks of a
kernel as 132 sm_90 SMs do at its launch configuration, from the registers and shared
memory `ptxas -v` reports (kernels/emu/occupancy_table.inc, regenerated at build time when
nvcc exists); a kernel the table lacks takes a fallback limit with a warning; a fixed
`resident_blocks` (the tests' small value, 2) overrides it; cooperative launches are
checked against the same limit. The occupancy rule itself is checked where it is stated
(static_asserts in kernels/emu/occupancy.h)."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from jax_ep._src.emu import Emulator, module

pytestmark = pytest.mark.emu

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TABLE = os.path.join(ROOT, "kernels", "emu", "occupancy_table.inc")
SMS = 132
ROW = re.compile(r'JEP_EMU_OCC_ROW\("(\w+)", (\d+), (\d+)\)')


def _rows(path=TABLE):
    with open(path) as f:
        return {k: (int(r), int(s)) for k, r, s in ROW.findall(f.read())}


def _built_table():
    """The table the emulated module under test was built with, when it measured one."""
    d = os.environ.get("JAX_EP_EMU_MODULE_DIR")
    cands = [os.path.join(d, "emu_occupancy", "occupancy_table.inc")] if d else []
    cands += [os.path.join(p, "emu_occupancy", "occupancy_table.inc")
              for p in sorted(
                  os.path.join(ROOT, "build", b) for b in os.listdir(os.path.join(ROOT, "build")))
              if os.path.isdir(p)] if not d and os.path.isdir(os.path.join(ROOT, "build")) else []
    return next((c for c in cands if os.path.exists(c)), None)


def test_the_table_lists_the_kernels_the_tests_launch():
    rows = _rows()
    for k in ("layout_kernel", "ll_dispatch_send", "ll_combine_recv", "SendKernel",
              "DispatchMain", "CombineMain"):
        assert k in rows, f"{k} missing from kernels/emu/occupancy_table.inc"
    m = module()
    Emulator(2, seed=1)
    assert m.occupancy_registers("layout_kernel") == rows["layout_kernel"][0]
    # Template arguments and namespaces are not part of the table's names.
    assert m.occupancy_registers("jax_ep::internode::SendKernel<Transport>") == rows["SendKernel"][0]
    assert m.occupancy_registers("NoSuchKernel") == -1


def test_default_limit_is_per_kernel_from_ptxas():
    m = module()
    Emulator(2, seed=1)
    rows = _rows(_built_table() or TABLE)  # the table the module was built with
    for k, (regs, smem) in rows.items():
        for threads in (32, 128, 256, 512, 1024):
            lim = m.resident_limit(k, threads)
            assert lim % SMS == 0 and 0 <= lim <= 32 * SMS, (k, threads, lim)
            if regs * threads > 65536:  # not even one block's registers fit an SM
                assert lim == 0, (k, threads, lim)
        # More threads per block never lets more blocks in.
        lims = [m.resident_limit(k, t) for t in (64, 256, 1024)]
        assert lims == sorted(lims, reverse=True), (k, lims)
    # A kernel of at most 32 registers and little shared memory: the thread limit at 1024
    # threads (2 per SM), the block limit at 64 threads (32 per SM).
    small = next(k for k, (r, s) in rows.items() if r <= 32 and s <= 1024)
    assert m.resident_limit(small, 1024) == 2 * SMS
    assert m.resident_limit(small, 64) == 32 * SMS
    # Dynamic shared memory at the launch counts: 120 KiB leaves one block per SM; more
    # than a block may use (227 KiB) cannot launch.
    assert m.resident_limit(small, 64, 120 * 1024) == SMS
    assert m.resident_limit(small, 64, 228 * 1024) == 0


def test_a_fixed_limit_overrides_the_table():
    m = module()
    Emulator(2, seed=1, resident_blocks=2)
    assert m.resident_limit("layout_kernel", 256) == 2
    assert m.resident_limit("NoSuchKernel", 256) == 2
    with pytest.raises(ValueError, match="resident_blocks"):
        Emulator(2, resident_blocks=0)


def test_a_kernel_missing_from_the_table_takes_the_fallback():
    m = module()
    Emulator(2, seed=1)
    assert m.resident_limit("KernelNotInTheTable", 256) == 8
    assert "KernelNotInTheTable" in m.occupancy_fallbacks()


def test_kernels_run_at_the_ptxas_limit():
    """The layout kernel on the default (per-kernel) limit gives the reference's result
    and no kernel of it took the fallback."""
    R, T, K, E = 2, 5, 2, 4
    emu = Emulator(R, seed=3)
    rng = np.random.default_rng(0)
    idx = rng.integers(-1, E, size=(R, T, K)).astype(np.int32)
    out = emu.layout(idx, num_experts=E)
    want = np.zeros((R, E), np.int64)
    for r in range(R):
        for e in range(E):
            want[r, e] = int((idx[r] == e).sum())
    got = out["per_expert"]
    assert (got == want).all()
    assert not [k for k in emu.m.occupancy_fallbacks() if k.startswith("layout")]


def test_the_checked_in_table_is_fresh():
    """The checked-in table equals the one measured from today's kernels: the build's
    (when it ran nvcc), else a fresh run of the generator (needs nvcc)."""
    built = _built_table()
    if built is None and os.environ.get("JAX_EP_EMU_MODULE_DIR"):
        pytest.skip("the module under test was built from the checked-in table "
                    "(-DJAX_EP_EMU_OCCUPANCY=table or no nvcc)")
    if built is not None:
        fresh = open(built).read()
    else:
        nvcc = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc"
                                        if os.path.exists("/usr/local/cuda/bin/nvcc") else None)
        if nvcc is None:
            pytest.skip("nvcc not found and the module was built from the checked-in table")
        r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "gen_emu_occupancy.py"),
                            "--check"], capture_output=True, text=True, timeout=1800)
        assert r.returncode == 0, r.stderr
        return
    version = re.search(r'JEP_EMU_OCC_NVCC\("([^"]*)"\)', fresh).group(1)
    old = open(TABLE).read()
    if version not in old:
        pytest.skip(f"the build used nvcc {version}, the checked-in table another release")
    # Rows only: a file the build could not measure (no NVSHMEM headers at its first
    # configure) keeps the checked-in rows and says so in a comment line.
    rows = lambda t: [ln for ln in t.splitlines() if ln.startswith("JEP_EMU_OCC_ROW")]  # noqa: E731
    assert rows(old) == rows(fresh), ("kernels/emu/occupancy_table.inc is stale: run "
                          "`python scripts/gen_emu_occupancy.py --write`")
