"""Every EP call of a program is ordered after the one traced before it, the user's
independent calls too (jax_ep._order): two EP calls of one rank must never run at once
(they share per-op state on the GPU), also when XLA runs independent branches of a CUDA
graph concurrently (--xla_gpu_command_buffer_scheduling_mode=CONCURRENT). Checked on the
program exported for CUDA: the later call's operands reach the earlier call's results."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import jax_ep
from jax_ep import low_latency as ll
from conftest import ep_mesh

R, T, H, K, E, M = 4, 6, 8, 2, 8, 8
_TARGETS = ["jax_ep_dispatch", "jax_ep_combine", "jax_ep_gather"] + [
    f"jax_ep_ll_{a}_{b}" for a in ("dispatch", "combine") for b in ("send", "recv")]
_EP = re.compile(r"custom_call @(jax_ep_\w+)\(")
_DEF = re.compile(r"^\s*(%[\w#:, %]+?)\s*=\s*(.*)$")
_NAME = re.compile(r"%[\w]+")


def _export_cuda(f, *args) -> str:
    g = jax.jit(jax.shard_map(f, mesh=ep_mesh(R), in_specs=P("ep"), out_specs=P("ep")))
    checks = [jax.export.DisabledSafetyCheck.custom_call(t) for t in _TARGETS]
    return jax.export.export(g, platforms=["cuda"], disabled_checks=checks)(*args) \
        .mlir_module()


def _inputs():
    x = jnp.ones((R * T, H), jnp.float32)
    idx = jnp.tile(jnp.arange(K, dtype=jnp.int32) * 3, (R * T, 1))
    w = jnp.ones((R * T, K), jnp.float32)
    return x, idx, w


def ep_calls_with_deps(text: str) -> list[dict]:
    """The EP custom calls of the function holding them, in program order, each with the
    set of earlier EP calls its operands depend on (transitively, through any op)."""
    deps: dict[str, set] = {}   # SSA name -> EP calls it depends on
    calls = []
    for line in text.splitlines():
        if line.lstrip().startswith("func.func"):
            deps = {}
            calls_in_func = []
            calls.append(calls_in_func)
            continue
        m = _DEF.match(line)
        if not m:
            continue
        outs = [n.split("#")[0] for n in _NAME.findall(m.group(1))]
        rhs = m.group(2)
        used = set()
        for n in _NAME.findall(rhs):
            used |= deps.get(n, set())
        t = _EP.search(rhs)
        if t:
            name = outs[0]
            calls[-1].append({"name": name, "target": t.group(1), "after": set(used)})
            used = used | {name}
        for o in outs:
            deps[o] = used
    return max(calls, key=len) if calls else []


def assert_chained(calls):
    assert len(calls) >= 2
    for i, c in enumerate(calls[1:], 1):
        assert calls[i - 1]["name"] in c["after"], \
            f"{c['target']} {c['name']} does not depend on {calls[i - 1]['name']}"


def _two_dispatches(x, idx, w):
    # Two independent dispatches of different tokens: nothing but the chain orders them.
    a = jax_ep.dispatch(x, idx, w, num_experts=E, axis_name="ep", backend="ffi")[0]
    b = jax_ep.dispatch(x * 2, idx, w, num_experts=E, axis_name="ep", backend="ffi")[0]
    return (a[:T] + b[:T])


def test_two_independent_dispatches_are_chained():
    calls = ep_calls_with_deps(_export_cuda(_two_dispatches, *_inputs()))
    assert [c["target"] for c in calls] == ["jax_ep_dispatch"] * 2
    assert_chained(calls)


def test_the_check_fails_without_the_chain(monkeypatch):
    from jax_ep import _order
    monkeypatch.setattr(_order, "last_call", lambda trace=None: None)
    calls = ep_calls_with_deps(_export_cuda(_two_dispatches, *_inputs()))
    assert len(calls) == 2
    with pytest.raises(AssertionError, match="does not depend"):
        assert_chained(calls)


def test_dispatch_combine_pairs_and_gradients_are_chained():
    def f(x, idx, w):
        def loss(x):
            outs = []
            for scale in (1.0, 3.0):  # two independent MoE branches
                rx, _, _, h = jax_ep.dispatch(x * scale, idx, w, num_experts=E,
                                              axis_name="ep", backend="ffi")
                outs.append(jax_ep.combine(jnp.tanh(rx), h, backend="ffi"))
            return jnp.sum(outs[0] * outs[1])
        return jax.grad(loss)(x)

    calls = ep_calls_with_deps(_export_cuda(f, *_inputs()))
    assert len(calls) >= 8  # 2 x (dispatch, combine) forward, their transposes
    assert_chained(calls)


def test_low_latency_calls_are_chained():
    def f(x, idx, w):
        kw = dict(num_experts=E, axis_name="ep", max_tokens_per_rank=M, backend="ffi")
        r1, _, h1 = ll.dispatch(x, idx, **kw)
        r2, _, h2 = ll.dispatch(x + 1, idx, **kw)
        return (ll.combine(r1, idx, w, h1, backend="ffi")
                + ll.combine(r2, idx, w, h2, backend="ffi"))

    calls = ep_calls_with_deps(_export_cuda(f, *_inputs()))
    assert len(calls) == 8
    assert_chained(calls)


def test_chain_stays_inside_its_trace():
    """A nested jit body and a scan body chain their own calls, never using a tracer of
    the enclosing trace (which would leak); the program still traces and exports."""
    def f(x, idx, w):
        a = jax_ep.dispatch(x, idx, w, num_experts=E, axis_name="ep", backend="ffi")[0]

        @jax.jit
        def inner(x):
            b = jax_ep.dispatch(x, idx, w, num_experts=E, axis_name="ep", backend="ffi")[0]
            c = jax_ep.dispatch(x * 2, idx, w, num_experts=E, axis_name="ep",
                                backend="ffi")[0]
            return b + c

        def body(carry, _):
            d = jax_ep.dispatch(carry, idx, w, num_experts=E, axis_name="ep",
                                backend="ffi")[0]
            return carry + d[:T], None

        y, _ = jax.lax.scan(body, x, None, length=2)
        return a[:T] + inner(x)[:T] + jax.checkpoint(inner)(y)[:T]

    text = _export_cuda(f, *_inputs())
    assert text.count("custom_call @jax_ep_dispatch(") >= 4


def test_exports_under_concurrent_command_buffer_scheduling():
    """The flag only affects XLA:GPU's compile; the chain is in the program itself, so
    the exported program under it carries the same dependencies."""
    code = (
        "import sys; sys.path.insert(0, 'tests');"
        "import test_call_order as t;"
        "calls = t.ep_calls_with_deps(t._export_cuda(t._two_dispatches, *t._inputs()));"
        "t.assert_chained(calls); print('CHAINED', len(calls))")
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                        " --xla_gpu_command_buffer_scheduling_mode=CONCURRENT").strip()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-c", code], cwd=root, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "CHAINED 2" in r.stdout
