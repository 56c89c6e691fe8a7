"""The global view across 2 processes x 4 CPU devices (jax.distributed, gloo) equals the
single-process 8-device result, forward and gradients."""
import os
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import AxisType

import jax_ep.sharded as sh

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from tests_mp_inputs import global_step, inputs  # noqa: E402

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (virtual) devices")]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_global_view(tmp_path):
    out = tmp_path / "mp.npz"
    addr = f"127.0.0.1:{_free_port()}"
    env = dict(os.environ)
    env["PYTHONPATH"] = HERE + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("XLA_FLAGS", None)
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "mp_sharded_worker.py"),
                               addr, str(pid), str(out)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for pid in (0, 1)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=240)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-3000:]

    x, idx, w = inputs()
    mesh = jax.make_mesh((8,), ("expert",), axis_types=(AxisType.Auto,))
    with jax.set_mesh(mesh):
        want = jax.jit(global_step(sh, "ffi"))(x, idx, w)
    got = np.load(out)
    for i, v in enumerate(want):
        np.testing.assert_array_equal(got[f"arr_{i}"], np.asarray(v))
    assert got["arr_2"].sum() > 0  # the capacity cut dropped rows somewhere
