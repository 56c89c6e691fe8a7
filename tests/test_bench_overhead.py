"""`python -m jax_ep.bench --dispatch-overhead`: runs, reports each program, and its count
of Python calls per call tells JAX's C++ fast path (the plain program) from its Python
path (the programs carrying the EP calls' ordering token). Times are not asserted."""
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
    # the instrument sees the two call paths: none or a few Python calls on the fast path,
    # many more where the ordering token keeps the program on JAX's Python path
    assert frames["plain"] < 20 and frames["plain+order"] > 5 * max(frames["plain"], 1)
    assert frames["ep"] >= frames["plain+order"]
    assert json.loads(out.read_text())["runs"] == 1
    assert "the ordering token alone" in capsys.readouterr().out


def test_dispatch_overhead_rejects_bad_arguments():
    with pytest.raises(SystemExit):
        bench.main(["--dispatch-overhead", "--calls", "0"])
