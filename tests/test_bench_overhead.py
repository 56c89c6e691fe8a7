"""`python -m jax_ep.bench --dispatch-overhead`: runs, reports each program, and its count
of Python calls per call tells JAX's C++ fast path from its Python path: every program,
the EP one included, runs on the fast path; a program with an ordered effect (a planted
ordered io_callback) is seen on the Python path. Times are not asserted."""
from __future__ import annotations

import json

import jax
import pytest

from jax_ep.bench import exchange as bench


@pytest.mark.skipif(len(jax.devices()) < 4, reason="needs 4 devices")
def test_dispatch_overhead_reports_and_tells_the_paths_apart(tmp_path, capsys):
    out = tmp_path / "o.json"
    res = bench.main(["--dispatch-overhead", "--ranks", "4", "--experts", "8", "--calls",
                      "3", "--runs", "1", "--json", str(out)])
    assert set(res["median"]) == {"plain", "plain+order", "ep"}
    frames = res["python_calls_per_step"]
    # none or a few Python calls per call on JAX's C++ fast path: the EP program too
    assert max(frames.values()) < 20, frames
    assert json.loads(out.read_text())["runs"] == 1
    assert "the call order alone" in capsys.readouterr().out


@pytest.mark.skipif(len(jax.devices()) < 4, reason="needs 4 devices")
def test_the_count_sees_a_program_on_jax_python_path():
    """The instrument can say no: an ordered effect (an ordered io_callback) sends a
    program through JAX's Python path, hundreds of Python calls per call."""
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import io_callback
    from jax.sharding import NamedSharding, PartitionSpec as P

    from jax_ep.bench.overhead import _python_calls
    mesh = jax.make_mesh((4,), ("ep",), devices=jax.devices()[:4],
                         axis_types=(jax.sharding.AxisType.Auto,))
    x = jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh, P("ep")))
    plain = jax.jit(lambda v: v * 2)
    effect = jax.jit(lambda v: io_callback(lambda a: a, jax.ShapeDtypeStruct((), np.float32),
                                           jnp.float32(1), ordered=True) * v)
    for f in (plain, effect):
        jax.block_until_ready(f(x))
        jax.block_until_ready(f(x))
    assert _python_calls(plain, (x,)) < 20
    assert _python_calls(effect, (x,)) > 50


def test_dispatch_overhead_rejects_bad_arguments():
    with pytest.raises(SystemExit):
        bench.main(["--dispatch-overhead", "--calls", "0"])
