"""jax_ep.check_errors(): one check over every GPU backend's device error records,
raising EPError with the rank, the step and the call sites. The records are replaced by
stand-ins here (no GPU)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import jax_ep
from jax_ep import nvshmem_bootstrap
from jax_ep._src import common as _common
from jax_ep.network.transport import TransportConfig
from jax_ep._src import errors


def _sources(cuda=(), internode=()):
    seen = []

    def cuda_fn(clear):
        seen.append(("cuda", clear))
        return list(cuda)

    def inter_fn(clear):
        seen.append(("internode", clear))
        return list(internode)
    return {"cuda": cuda_fn, "internode": inter_fn}, seen


def test_quiet_without_errors_and_on_this_build():
    src, seen = _sources()
    jax_ep.check_errors(step=3, sources=src)
    assert seen == [("cuda", True), ("internode", True)]  # every backend is asked
    jax_ep.check_errors()  # the real records of this (GPU-less) process: nothing


def test_every_backend_in_one_error_with_rank_and_steps(monkeypatch):
    monkeypatch.setattr(errors, "_last_step", None)
    st = nvshmem_bootstrap.BootstrapState(rank=3, world=4, heap_bytes=1 << 30,
                                          config=TransportConfig(), env={})
    monkeypatch.setattr(nvshmem_bootstrap, "_state", st)
    src, _ = _sources()
    jax_ep.check_errors(step=100, sources=src)  # clean at step 100
    src, seen = _sources(
        cuda=["dispatch: rank 1 is in another EP call [GPU 0, rank 2]"],
        internode=["jax_ep internode: dispatch timed out waiting for rank 2"])
    with pytest.raises(jax_ep.EPError) as e:
        jax_ep.check_errors(step=200, sources=src, clear=False)
    err = e.value
    assert seen == [("cuda", False), ("internode", False)]
    assert err.rank == 3 and err.process == jax.process_index()
    assert (err.step, err.since_step) == (200, 100)
    assert err.backends == ["cuda", "internode"]
    text = str(err)
    assert "EP rank 3" in text and "after step 100, at or before step 200" in text
    assert "[cuda] dispatch: rank 1" in text and "[internode] jax_ep internode" in text


def test_call_sites_in_the_records_are_named(monkeypatch):
    monkeypatch.setattr(errors, "_last_step", None)
    mesh = jax.make_mesh((8,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:8])

    def step_fn(x, i, w):
        return jax_ep.dispatch(x, i, w, num_experts=8, axis_name="ep", backend="ffi")[0]

    hlo = jax.jit(jax.shard_map(step_fn, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))) \
        .lower(jnp.ones((16, 4)), jnp.zeros((16, 2), jnp.int32), jnp.ones((16, 2))).as_text()
    import re
    site = int(re.search(r"call_site = (\d+)", hlo).group(1))
    msg = (f"jax_ep internode: dispatch: rank 1 is in another call: this rank seq 4 "
           f"(op=dispatch, call_site={site}), rank 1 seq 4 (op=dispatch, call_site=77)")
    src, _ = _sources(internode=[msg])
    with pytest.raises(jax_ep.EPError) as e:
        jax_ep.check_errors(sources=src)
    assert site in e.value.call_sites and 77 in e.value.call_sites
    assert "step_fn" in e.value.call_sites[site]
    assert e.value.call_sites[77] is None  # another program point: not traced here
    assert re.search(rf"call site {site}: EP call #0 of \S*step_fn@", str(e.value))
    assert "before this check" in str(e.value)


_EXAMPLE_SHIM = r"""
import json, runpy, sys
import jax_ep
from jax_ep._src import errors

calls = []
LOG, FAIL_AT = sys.argv[1], int(sys.argv[2])

def check_errors(step=None, **kw):
    calls.append(step)
    with open(LOG, "w") as f:
        json.dump(calls, f)
    if step == FAIL_AT:  # a GPU EP call failed before this step's check
        raise errors.EPError(["planted"], ["cuda"], rank=0, process=0, step=step,
                             since_step=None, call_sites={})

jax_ep.check_errors = check_errors
sys.argv = [sys.argv[3]] + sys.argv[4:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.slow
def test_flax_example_checks_every_n_steps_and_before_checkpoints(tmp_path):
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    shim = tmp_path / "shim.py"
    shim.write_text(_EXAMPLE_SHIM)
    log = tmp_path / "calls.json"
    out = tmp_path / "run"
    args = ["--batch", "8", "--seq", "16", "--layers", "1", "--hidden", "32", "--heads", "2",
            "--ffn", "32", "--experts", "8", "--top-k", "2", "--eval-every", "100",
            "--eval-batches", "1", "--no-progress", "--steps", "6", "--ckpt-every", "2",
            "--check-every", "3", "--out", str(out)]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    r = subprocess.run([sys.executable, str(shim), str(log), "4",
                        os.path.join(root, "examples", "train_moe.py"), *args],
                       env=env, capture_output=True, text=True, timeout=600)
    # checks at 2 (checkpoint), 3 (every 3), 4 (checkpoint: the planted error stops it)
    assert json.loads(log.read_text()) == [2, 3, 4], r.stdout[-2000:] + r.stderr[-2000:]
    assert r.returncode != 0 and "planted" in r.stderr
    saved = sorted(int(p.name) for p in (out / "ckpt").iterdir() if p.name.isdigit())
    assert saved == [2], saved  # no checkpoint of a state a failed call touched
