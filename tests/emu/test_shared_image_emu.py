"""How a change of block gives the running block its __shared__ variables (docs/emulator.md):
by pointing this thread's TLS entry for the emulated module at the block's own image, or,
with JAX_EP_EMU_TLS_COPY set (and under AddressSanitizer), by copying the image in and
out. Either way a run is the same run: the same steps, virtual time and bits."""
from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jax_ep._src.emu import Emulator

from emu_intranode_util import routing, rows

pytestmark = pytest.mark.emu

HERE = Path(__file__).resolve().parent
T, H, K, E = 8, 16, 2, 8


def run_case(R: int, seed: int, preempt: float):
    """Dispatch, combine and gather at R ranks: (outputs by name, counters, by pointer?)."""
    rng = np.random.default_rng(seed)
    idx = routing("random", R, T, K, E, rng)
    x = rows("bf16", (R, T, H), rng)
    w = rng.standard_normal((R, T, K)).astype(np.float32)
    emu = Emulator(R, seed=seed, preempt_prob=preempt, preempt_ns=20000.0 if preempt else 0.0)
    emu.setup(tokens=T, capacity=2 * T, row_bytes=H * 2, topk=K)
    emu.reset_counters()
    d = emu.dispatch(x, idx, w, num_experts=E, capacity=2 * T)
    d["combined"] = emu.combine(d["recv_x"], d["send_row"])
    d["gathered"] = emu.gather(x, d["src_rank"], d["src_index"])
    assert emu.check_errors() == []
    return {k: v.tobytes() for k, v in d.items()}, emu.counters(), emu.m.shared_by_pointer()


def _under_asan() -> bool:
    return "libasan" in os.environ.get("LD_PRELOAD", "")


@pytest.mark.parametrize("R,seed,preempt", [(4, 3, 0.0), (4, 5, 0.002)])
def test_by_pointer_and_by_copy_are_the_same_run(R, seed, preempt, tmp_path):
    here = run_case(R, seed, preempt)
    out = tmp_path / "copy.pkl"
    code = (f"import pickle, sys; sys.path.insert(0, {str(HERE)!r}); "
            f"from test_shared_image_emu import run_case; "
            f"pickle.dump(run_case({R}, {seed}, {preempt}), open({str(out)!r}, 'wb'))")
    env = dict(os.environ, JAX_EP_EMU_TLS_COPY="1")
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=600)
    (a, ca, by_pointer), (b, cb, copied) = here, pickle.loads(out.read_bytes())
    assert not copied
    # The pointer way where the build allows it (x86-64 glibc, no AddressSanitizer).
    assert by_pointer == (not _under_asan()), by_pointer
    assert ca == cb, {k: (ca.get(k), cb.get(k)) for k in set(ca) | set(cb)
                      if ca.get(k) != cb.get(k)}
    assert a.keys() == b.keys()
    for k in a:
        assert a[k] == b[k], k
