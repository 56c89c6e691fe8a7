"""Call-site ids (jax_ep._src.common.next_call_site) agree across processes for the same
program point, whatever else each process traced first, and differ between the EP calls
of one program."""
from __future__ import annotations

import json
import os
import re
import sys

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import jax_ep
from jax_ep._src import common as _common
from mp_launch import run_workers, worker_env
from conftest import ep_mesh

HERE = os.path.dirname(os.path.abspath(__file__))
R, T, K, E, H = 8, 4, 2, 16, 8


def _sites(hlo: str) -> list[int]:
    return [int(m) for m in re.findall(r"call_site = (-?\d+)", hlo)]


def _inputs():
    return (jnp.ones((R * T, H), jnp.float32), jnp.zeros((R * T, K), jnp.int32),
            jnp.ones((R * T, K), jnp.float32))


def _layer(x, idx, w):
    rx, _, _, h = jax_ep.dispatch(x, idx, w, num_experts=E, axis_name="ep", backend="ffi")
    return jax_ep.combine(rx * 2.0, h, backend="ffi")


def _lower(f):
    g = jax.jit(jax.shard_map(f, mesh=ep_mesh(R), in_specs=P("ep"), out_specs=P("ep")))
    return _sites(g.lower(*_inputs()).as_text())


def _train(x, idx, w):
    for _ in range(3):
        x = _layer(x, idx, w)
    return x


def test_sites_are_distinct_in_one_program_and_in_int32_range():
    sites = _lower(_train)
    assert len(sites) == 6
    assert len(set(sites)) == 6, sites
    assert all(1 <= s < 2 ** 31 for s in sites)


def test_tracing_something_else_first_does_not_move_the_ids():
    first = _lower(_train)
    _lower(lambda x, i, w: _layer(x, i, w) * 3.0)  # an extra EP function in between
    jax.clear_caches()
    again = _lower(_train)
    assert again == first


def test_the_static_configuration_enters_the_id():
    # the same program point with other shapes or options is another call
    a = _lower(_train)
    b = _lower(lambda x, i, w: _train(x[:, :4], i, w))
    assert not set(a) & set(b)


def test_site_info_names_the_traced_function():
    sites = _lower(_train)
    info = _common.call_site_info(sites[0])
    assert info is not None and "_train" in info and "EP call #0" in info, info


def _run_two(tmp_path, extras):
    argvs = [[sys.executable, os.path.join(HERE, "mp_call_site_worker.py"), str(pid),
              "1" if extra else "0", str(tmp_path)] for pid, extra in enumerate(extras)]
    procs, hung, logs = run_workers(tmp_path, argvs, worker_env("30"), 240)
    assert not hung and all(p.returncode == 0 for p in procs), logs
    return [json.load(open(tmp_path / f"sites{pid}.json")) for pid in range(len(extras))]


@pytest.mark.slow
def test_two_processes_agree_when_one_traces_an_extra_ep_function(tmp_path):
    # process 0 lowers an evaluation with EP calls first (rank 0 only), then both lower
    # the same training step: their EP calls must carry the same ids
    p0, p1 = _run_two(tmp_path, [True, False])
    assert len(p0["eval"]) == 2 and p1["eval"] == []
    assert len(p0["train"]) == 4 and len(set(p0["train"])) == 4
    assert p0["train"] == p1["train"], (p0, p1)
    assert not set(p0["eval"]) & set(p0["train"])
