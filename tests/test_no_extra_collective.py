"""Programs exported for CUDA on this CPU host: an EP op on the ffi (intranode) backend lowers to its
custom calls and no XLA collective or host callback of its own. The value check's
agreement (an all-gather of verdicts, jax_ep/_src/value_check.py) is there only where no
kernel exchange carries the verdict: CPU programs across EP groups, and the reference
backend on every platform. Both sides are checked, so the scan below can say no."""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import jax_ep
from jax_ep import low_latency as ll
from jax_ep import sharded

T, H, E, K, M = 8, 16, 16, 2, 8
COLLECTIVE = re.compile(r"stablehlo\.(all_gather|all_reduce|all_to_all|collective_permute|"
                        r"collective_broadcast|reduce_scatter)\b")
CUSTOM = re.compile(r"custom_call @(\w+)")
# What XLA itself adds around sharded programs: not communication.
BENIGN = {"CustomSPMDPartitioning", "annotate_device_placement", "Sharding", "SPMDFullToShardShape",
          "SPMDShardToFullShape", "xla_python_cpu_callback", "xla_ffi_python_cpu_callback"}
TARGETS = ["jax_ep_layout", "jax_ep_dispatch", "jax_ep_combine", "jax_ep_gather"] + [
    f"jax_ep_ll_{a}_{b}" for a in ("dispatch", "combine") for b in ("send", "recv")]


def _mesh(groups):
    devs = np.array(jax.devices()[:groups * 4]).reshape(groups, 4)
    return Mesh(devs, ("data", "ep"))


def _inputs(groups, seed=0):
    rng = np.random.default_rng(seed)
    n = groups * 4 * T
    x = rng.standard_normal((n, H)).astype(np.float32)
    idx = np.stack([rng.permutation(E)[:K] for _ in range(n)]).astype(np.int32)
    w = rng.random((n, K)).astype(np.float32)
    return x, idx, w


def _normal(backend):
    def f(x, idx, w):
        lay = jax_ep.get_dispatch_layout(idx, num_experts=E, num_ranks=4, backend=backend)
        rx, _, rw, h = jax_ep.dispatch(x, idx, w, num_experts=E, axis_name="ep",
                                       backend=backend)
        out = jax_ep.combine(rx * jnp.sum(rw, 1, keepdims=True), h, backend=backend)
        return out + lay.num_tokens_per_rank.sum().astype(out.dtype)
    return f


def _low_latency(backend):
    def f(x, idx, w):
        recv, _, h = ll.dispatch(x, idx, num_experts=E, axis_name="ep",
                                 max_tokens_per_rank=M, backend=backend)
        return ll.combine(recv, idx, w, h, backend=backend)
    return f


def _export(fn, groups, platform):
    mesh = _mesh(groups)
    spec = P(("data", "ep"))
    g = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=spec, out_specs=spec))
    checks = [jax.export.DisabledSafetyCheck.custom_call(t) for t in TARGETS]
    return jax.export.export(g, platforms=[platform], disabled_checks=checks)(
        *_inputs(groups)).mlir_module()


def _lower_here(fn, groups):
    """The program lowered for this CPU host (a host callback cannot be exported)."""
    spec = P(("data", "ep"))
    g = jax.jit(jax.shard_map(fn, mesh=_mesh(groups), in_specs=spec, out_specs=spec))
    return g.lower(*_inputs(groups)).as_text()


def _extra(text):
    """(collective ops, custom-call targets that are neither EP calls nor XLA's own)."""
    coll = COLLECTIVE.findall(text)
    other = sorted({t for t in CUSTOM.findall(text)
                    if not t.startswith("jax_ep_") and t not in BENIGN})
    callbacks = [t for t in CUSTOM.findall(text) if "callback" in t]
    return coll, other + callbacks


@pytest.mark.parametrize("groups", [1, 2], ids=["one_group", "two_groups"])
@pytest.mark.parametrize("program", ["normal", "low_latency"])
def test_ffi_lowered_for_cuda_has_no_collective_of_its_own(program, groups):
    make = {"normal": _normal, "low_latency": _low_latency}[program]
    text = _export(make("intranode"), groups, "cuda")
    coll, other = _extra(text)
    assert coll == [] and other == [], (coll, other)
    assert re.search(r"custom_call @jax_ep_(ll_)?dispatch", text)


@pytest.mark.parametrize("program", ["normal", "low_latency"])
def test_the_scan_sees_the_agreement_where_it_stays(program):
    """Where no kernel exchange carries the verdict, the check's all-gather and callback
    are in the program: the reference backend (on every platform; a host callback cannot
    be lowered for CUDA on a CPU host, so it is lowered for this host here), and ffi on
    CPU across groups."""
    assert jax.default_backend() == "cpu"
    make = {"normal": _normal, "low_latency": _low_latency}[program]
    coll, other = _extra(_lower_here(make("reference"), 1))
    assert "all_gather" in coll and any("callback" in t for t in other), (coll, other)
    coll, other = _extra(_lower_here(make("intranode"), 2))
    assert "all_gather" in coll and any("callback" in t for t in other), (coll, other)


def test_global_view_lowered_for_cuda_has_no_collective_of_its_own():
    mesh = _mesh(2)
    x, idx, w = _inputs(2)

    def f(x, idx, w):
        rx, _, rw, h = sharded.dispatch(x, idx, w, num_experts=E, mesh_axis="ep",
                                        backend="intranode")
        return sharded.combine(rx * jnp.sum(rw, 1, keepdims=True), h, backend="intranode")

    spec = jax.sharding.NamedSharding(mesh, P(("data", "ep")))
    with jax.set_mesh(mesh):
        g = jax.jit(f, in_shardings=(spec, spec, spec))
        # Lowered, not exported: custom_partitioning does not serialize.
        cuda = g.trace(x, idx, w).lower(lowering_platforms=("cuda",)).as_text()
        cpu = g.lower(x, idx, w).as_text()
    coll, other = _extra(cuda)
    assert coll == [] and other == [], (coll, other)
    assert "all_gather" in _extra(cpu)[0]
