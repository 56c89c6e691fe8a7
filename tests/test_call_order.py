"""Every EP call of a program is ordered after the one traced before it, the user's
independent calls too (jax_ep._src.ordering): two EP calls of one rank must never run at once
(they share per-op state on the GPU), also when XLA runs independent branches of a CUDA
graph concurrently (--xla_gpu_command_buffer_scheduling_mode=CONCURRENT). Checked on the
program exported for CUDA: the later call's operands reach the earlier call's results,
and a nested jit, scan, cond or checkpoint body's calls reach the calls traced before
the body. The order is threaded as values: no effect, no token, so compiled programs
keep JAX's C++ fast path and a failed execution does not fail the next one."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
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
    """The program exported for CUDA, with the EP calls inline (collective-stream regions
    off, so the checkers read one function; the regions change no dependency)."""
    g = jax.jit(jax.shard_map(f, mesh=ep_mesh(R), in_specs=P("ep"), out_specs=P("ep")))
    checks = [jax.export.DisabledSafetyCheck.custom_call(t) for t in _TARGETS]
    with jax_ep.config.override(collective_stream=False):
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
    from jax_ep._src import ordering as _order
    monkeypatch.setattr(_order, "last_call", lambda trace=None: None)
    calls = ep_calls_with_deps(_export_cuda(_two_dispatches, *_inputs()))
    assert len(calls) == 2
    with pytest.raises(AssertionError, match="does not depend"):
        assert_chained(calls)


def _unused_dispatch(x, idx, w):
    jax_ep.dispatch(x * 2, idx, w, num_experts=E, axis_name="ep", backend="ffi")
    return x + 1


def test_a_call_with_unused_results_is_dropped_on_every_rank():
    """Nothing keeps a call whose results nobody reads: JAX drops it from the program
    (the same program on every rank, so no rank waits for a peer that skipped it)."""
    text = _export_cuda(_unused_dispatch, *_inputs())
    assert text.count("custom_call @jax_ep_dispatch(") == 0
    assert "jax.token" not in text and "!stablehlo.token" not in text


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


def test_nested_bodies_trace_and_export():
    """Calls in a nested jit body, a scan body and a checkpointed jit: no tracer of one
    trace is used in another (which would leak); the program traces and exports."""
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


# ---- across nested bodies: a dataflow over the whole exported module ----
_FUNC = re.compile(r"^\s*func\.func \w+ @([\w.$-]+)\((.*)$")
_FCALL = re.compile(r"(?:func\.)?call @([\w.$-]+)\(([^)]*)\)")
_WHILE = re.compile(r"stablehlo\.while\((.*?)\)\s*:")
_MANUAL = re.compile(r"sdy\.manual_computation\(([^)]*)\).*?\((%arg\d+:.*)\)\s*\{\s*$")


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _funcs(text: str) -> dict:
    """name -> (argument names, body lines)."""
    out, lines = {}, text.splitlines()
    for i, line in enumerate(lines):
        m = _FUNC.match(line)
        if not m:
            continue
        w = _indent(line)
        j = next(k for k in range(i + 1, len(lines))
                 if _indent(lines[k]) == w and lines[k].strip().startswith("}"))
        out[m.group(1)] = (re.findall(r"(%arg\d+):", m.group(2)), lines[i + 1:j])
    return out


class ModuleFlow:
    """Which EP calls each EP call's operands depend on, through any op, nested function
    calls (inlined per call), while loops (loop-carried values to a fixpoint, so a body's
    call in one iteration is seen against the next) and shard_map regions. Each EP call
    instance is one entry of `calls`: {'target', 'after': set of call ids}."""

    def __init__(self, text: str):
        self.funcs = _funcs(text)
        self.calls: dict[str, dict] = {}

    def run(self, fname="main", args=None):
        names, lines = self.funcs[fname]
        deps = dict(zip(names, args or [set()] * len(names)))
        return self._block(lines, deps, fname)

    def _names(self, s):
        return [n.split("#")[0] for n in _NAME.findall(s)]

    def _used(self, deps, s):
        out = set()
        for n in self._names(s):
            out |= deps.get(n, set())
        return out

    def _block(self, lines, deps, prefix):
        """Runs `lines` (one region); returns the deps of its return's operands (one set)."""
        i, ret = 0, set()
        while i < len(lines):
            line = lines[i]
            w = _indent(line)
            stripped = line.strip()
            if stripped.startswith(("return", "stablehlo.return", "sdy.return")):
                ret |= self._used(deps, stripped.split(":")[0])
                i += 1
                continue
            m = _DEF.match(line)
            if m and '"stablehlo.case"(' in line:  # cond: regions see the outer values
                end = next(k for k in range(i + 1, len(lines))
                           if _indent(lines[k]) == w and lines[k].strip().startswith("})"))
                starts = [i] + [k for k in range(i + 1, end)
                                if _indent(lines[k]) == w and lines[k].strip() == "}, {"]
                result = self._used(deps, line.split("(", 1)[1].split(")")[0])
                for n, (a, b) in enumerate(zip(starts, starts[1:] + [end])):
                    result |= self._block(lines[a + 1:b], dict(deps), prefix + f"@{i}b{n}")
                for o in self._names(m.group(1)):
                    deps[o] = result
                i = end + 1
                continue
            wm = _WHILE.search(line)
            mm = _MANUAL.search(line)
            if m and (wm or mm):
                end = next(k for k in range(i + 1, len(lines))
                           if _indent(lines[k]) == w and lines[k].strip().startswith("}")
                           and "do {" not in lines[k])
                region = lines[i + 1:end]
                outs = self._names(m.group(1))
                if wm:
                    pairs = [p.split("=") for p in wm.group(1).split(",")]
                    carried = {a.strip(): self._used(deps, b) for a, b in pairs}
                    do = next(k for k, ln in enumerate(region) if "} do {" in ln)
                    for _ in range(4):  # loop-carried values to a fixpoint
                        inner = dict(deps, **carried)
                        self._block(region[:do], dict(inner), prefix + f"@{i}c")
                        back = self._block(region[do + 1:], dict(inner), prefix + f"@{i}w")
                        if back <= set().union(*carried.values()):
                            break
                        carried = {a: v | back for a, v in carried.items()}
                    result = set().union(*carried.values()) | back
                else:
                    operands = mm.group(1)
                    inner = dict(deps)
                    for a in re.findall(r"(%arg\d+):", mm.group(2)):
                        inner[a] = self._used(deps, operands)
                    result = self._block(region, inner, prefix + f"@{i}m")
                for o in outs:
                    deps[o] = result
                i = end + 1
                continue
            if not m:
                i += 1
                continue
            outs = self._names(m.group(1))
            rhs = m.group(2)
            used = self._used(deps, rhs)
            c = _FCALL.search(rhs)
            t = _EP.search(rhs)
            if c and c.group(1) in self.funcs:
                args = [self._used(deps, a) for a in c.group(2).split(",")]
                used = self._call(c.group(1), args, prefix + f"@{i}")
            elif t:
                cid = f"{prefix}:{outs[0]}"
                entry = self.calls.setdefault(cid, {"target": t.group(1), "after": set()})
                entry["after"] |= used
                used = used | {cid}
            for o in outs:
                deps[o] = used
            i += 1
        return ret

    def _call(self, fname, args, prefix):
        names, lines = self.funcs[fname]
        return self._block(lines, dict(zip(names, args)), prefix + "/" + fname)


def assert_all_pairs_ordered(calls: dict):
    """Every two EP calls are ordered by a dependency, and a call in a loop body is
    ordered against itself in the next iteration."""
    ids = sorted(calls)
    for a in ids:
        for b in ids:
            if a < b:
                assert a in calls[b]["after"] or b in calls[a]["after"], \
                    f"{calls[a]['target']} {a} and {calls[b]['target']} {b} are not ordered"
    for a in ids:
        if re.search(r"@\d+w", a):  # inside a while body
            assert a in calls[a]["after"], f"{a} is not ordered against its next iteration"



def _nested_program(x, idx, w):
    """One call first, then calls in a scan body (two, independent), a nested jit, a
    checkpoint region and a cond branch: only the call order relates them to the first."""
    def disp(v):
        return jax_ep.dispatch(v, idx, w, num_experts=E, axis_name="ep",
                               backend="ffi")[0][:T]

    def body(carry, _):
        return carry + disp(carry) + disp(carry * 2), None

    first = disp(x * 3)
    y, _ = jax.lax.scan(body, x, None, length=2)
    nested = jax.jit(disp)(x * 5)
    remat = jax.checkpoint(disp)(x * 7)
    branch = jax.lax.cond(jnp.sum(x) > 0, disp, lambda v: v * 2, x * 11)
    return y + first + nested + remat + branch


def _layers_program(x, idx, w):
    """An MoE model's shape: each layer's input is the last one's output, layers in a
    scan body, a nested jit, a checkpoint region and a cond branch."""
    def layer(v):
        rx, _, _, h = jax_ep.dispatch(v, idx, w, num_experts=E, axis_name="ep",
                                      backend="ffi")
        return jax_ep.combine(jnp.tanh(rx), h, backend="ffi") + v

    y, _ = jax.lax.scan(lambda c, _: (layer(c), None), layer(x), None, length=2)
    y = jax.jit(layer)(y)
    y = jax.checkpoint(layer)(y)
    return jax.lax.cond(jnp.sum(y) > 0, layer, lambda v: v * 2, y)


def _flow(f):
    flow = ModuleFlow(_export_cuda(f, *_inputs()))
    flow.run()
    return flow.calls


def assert_after_the_first(calls: dict):
    """Every call depends on the program's first call (the one call that depends on
    none)."""
    first = sorted((c for c, v in calls.items() if not v["after"]), key=len)
    assert len(first) == 1, f"{first[1:]} is not ordered after {first[:1]}"
    for c, v in calls.items():
        if c != first[0]:
            assert first[0] in v["after"], f"{v['target']} {c} is not ordered after {first[0]}"


def test_calls_in_nested_bodies_follow_the_calls_before_them():
    calls = _flow(_nested_program)
    assert len(calls) == 6  # first, scan body 2, nested jit, checkpoint, cond branch
    assert_after_the_first(calls)
    body = [c for c in calls if re.search(r"@\d+w", c)]
    assert len(body) == 2 and body[0] in calls[body[1]]["after"] or \
        body[1] in calls[body[0]]["after"], body


def test_layers_in_nested_bodies_are_ordered_against_all_others():
    calls = _flow(_layers_program)
    assert len(calls) == 10  # 5 layers x (dispatch, combine)
    assert_all_pairs_ordered(calls)


def test_the_module_check_fails_without_the_link_to_enclosing_traces(monkeypatch):
    """Chaining each trace's own calls only (no link to the enclosing trace's last call)
    leaves the nested bodies' calls unordered against the first: the check sees it."""
    from jax_ep._src import ordering as _order
    monkeypatch.setattr(_order, "_ancestors", lambda trace: iter([trace]))
    calls = _flow(_nested_program)
    assert len(calls) == 6
    with pytest.raises(AssertionError, match="is not ordered after"):
        assert_after_the_first(calls)


def test_the_module_check_sees_a_cond_branch_left_out(monkeypatch):
    """Without the chain around the cond branch's call only, the check names that call."""
    from jax_ep._src import ordering as _order

    def f(x, idx, w):
        a = jax_ep.dispatch(x, idx, w, num_experts=E, axis_name="ep", backend="ffi")[0]

        def yes(v):
            with monkeypatch.context() as m:
                m.setattr(_order, "last_call", lambda trace=None: None)
                return jax_ep.dispatch(v, idx, w, num_experts=E, axis_name="ep",
                                       backend="ffi")[0][:T]

        return a[:T] + jax.lax.cond(jnp.sum(x) > 0, yes, lambda v: v * 2, x * 5)

    calls = _flow(f)
    assert len(calls) == 2
    with pytest.raises(AssertionError, match=r"@\d+b1"):
        assert_all_pairs_ordered(calls)


def test_rematerialized_calls_are_ordered():
    """The backward pass of a checkpointed MoE layer inside a scan over layers: the
    recomputed forward calls and the transposed ones are ordered with every other."""
    def f(x, idx, w):
        @jax.checkpoint
        def layer(h):
            rx, _, _, hd = jax_ep.dispatch(h, idx, w, num_experts=E, axis_name="ep",
                                           backend="ffi")
            return jax_ep.combine(jnp.tanh(rx), hd, backend="ffi") + h

        def loss(x):
            y, _ = jax.lax.scan(lambda c, _: (layer(c), None), x, None, length=2)
            return jnp.sum(y * y)

        return jax.grad(loss)(x)

    calls = _flow(f)
    targets = [c["target"] for c in calls.values()]
    # forward dispatch + combine, recomputed in the backward pass, and the transposes
    assert targets.count("jax_ep_dispatch") >= 2 and "jax_ep_combine" in targets, targets
    assert_all_pairs_ordered(calls)


def test_nested_order_under_concurrent_command_buffer_scheduling():
    """The same check on the nested program traced with the CONCURRENT command-buffer
    flag set (the flag changes XLA:GPU's schedule, never the program's dependencies)."""
    code = (
        "import sys; sys.path.insert(0, 'tests');"
        "import test_call_order as t;"
        "calls = t._flow(t._layers_program);"
        "t.assert_all_pairs_ordered(calls); print('ORDERED', len(calls))")
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                        " --xla_gpu_command_buffer_scheduling_mode=CONCURRENT").strip()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-c", code], cwd=root, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "ORDERED 10" in r.stdout


# ---- between executions: a failed execution does not fail the next one ----

def _failing_then_good():
    """Runs a jitted EP program that fails at run time (a token naming one expert twice),
    then the same program with good ids; returns the good one's results."""
    def f(x, idx):
        recv, cnt, _ = ll.dispatch(x, idx, num_experts=E, axis_name="ep",
                                   max_tokens_per_rank=M, backend="ffi")
        return recv[None], cnt[None]

    g = jax.jit(jax.shard_map(f, mesh=ep_mesh(R), in_specs=P("ep"), out_specs=P("ep")))
    x, idx, _ = _inputs()
    bad = idx.at[1].set(5)  # rank 0's token 1 names expert 5 twice
    with pytest.raises(Exception, match="names expert 5 more than once"):
        jax.block_until_ready(g(x, bad))
    return jax.block_until_ready(g(x, idx))


def test_a_failed_execution_does_not_fail_the_next():
    recv, cnt = _failing_then_good()
    # every token goes to experts 0 and 3, each rank's experts 2r, 2r+1: rank 0 gets
    # all T tokens of every rank for expert 0, rank 1 for expert 3
    np.testing.assert_array_equal(np.asarray(cnt)[:2], [[R * T, 0], [0, R * T]])
    assert np.isfinite(np.asarray(recv)).all()


# ---- programs compiled ahead of time, and JAX's C++ fast path ----

_AOT = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import PartitionSpec as P
import jax_ep
from conftest import ep_mesh
R, T, H, K, E = 4, 6, 8, 2, 8
def f(x, idx, w):
    return jax_ep.dispatch(x, idx, w, num_experts=E, axis_name="ep", backend="ffi")[0]
g = jax.jit(jax.shard_map(f, mesh=ep_mesh(R), in_specs=P("ep"), out_specs=P("ep")))
x = jnp.arange(R * T * H, dtype=jnp.float32).reshape(R * T, H)
idx = jnp.tile(jnp.arange(K, dtype=jnp.int32) * 3, (R * T, 1))
w = jnp.ones((R * T, K), jnp.float32)
c = g.lower(x, idx, w).compile()
want = np.asarray(g(x, idx, w))
for i in range(3):  # the C++ fast path takes over from the second call
    np.testing.assert_array_equal(np.asarray(c(x + i, idx, w)),
                                  np.asarray(g(x + i, idx, w)))
print("AOT OK")
"""


def test_a_compiled_program_called_again_and_again():
    """`jit(f).lower(...).compile()` called again and again (what jax_ep.bench does)
    gives the jitted function's results."""
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ)
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    r = subprocess.run([sys.executable, "-c", _AOT], cwd=here, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "AOT OK" in r.stdout


def test_ep_programs_keep_jax_fast_path():
    """A jitted program with EP calls is called like a plain jit: from the second call
    on, JAX's C++ fast path runs it and no Python function runs per call (an ordered
    effect would send every call through JAX's Python path, hundreds of calls)."""
    from jax_ep.bench.overhead import _python_calls

    def f(x, idx, w):
        rx, _, _, h = jax_ep.dispatch(x, idx, w, num_experts=E, axis_name="ep",
                                      backend="ffi")
        return jax_ep.combine(rx, h, backend="ffi")

    mesh = ep_mesh(R)
    g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
    # inputs already laid out as the program wants them (no resharding per call)
    args = [jax.device_put(a, jax.sharding.NamedSharding(mesh, P("ep"))) for a in _inputs()]
    jax.block_until_ready(g(*args))
    jax.block_until_ready(g(*args))
    assert _python_calls(g, args) <= 5


def _all_eqns(jaxpr):
    for e in jaxpr.eqns:
        yield e
        for p in e.params.values():
            for sub in p if isinstance(p, (list, tuple)) else (p,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _all_eqns(inner)


@pytest.mark.parametrize("backend", ["ffi", "reference"])
def test_empty_operands_stay_out_of_the_order_barrier(backend):
    """With T == 0 the order's barriers get no empty array (nothing to order; XLA 0.12's
    CSE aborts the compile on an empty constant inside it), and the combine is still
    ordered after the dispatch by its non-empty results."""
    def f(x, idx, w):
        rx, _, _, h = jax_ep.dispatch(x, idx, w, num_experts=E, axis_name="ep",
                                      capacity=4, backend=backend)
        return jax_ep.combine(rx + 1.0, h, backend=backend)

    g = jax.shard_map(f, mesh=ep_mesh(R), in_specs=P("ep"), out_specs=P("ep"))
    x = jnp.zeros((0, H), jnp.float32)
    idx, w = jnp.zeros((0, K), jnp.int32), jnp.zeros((0, K), jnp.float32)
    barriers = [e for e in _all_eqns(jax.make_jaxpr(g)(x, idx, w).jaxpr)
                if e.primitive.name == "optimization_barrier"]
    assert barriers, "no EP call was ordered"
    empty = [v.aval for e in barriers for v in e.invars if v.aval.size == 0]
    assert not empty, f"empty operands in the order barrier: {empty}"
    out = jax.jit(g)(x, idx, w)
    assert out.shape == (0, H)
