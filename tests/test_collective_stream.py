"""The communicating EP custom calls run on XLA's collective stream (jax_ep.config
.collective_stream): in programs exported for CUDA on this CPU host, every EP call of
the per-shard ops (normal, cached, low-latency; forward and backward) sits in a region
whose call carries `_xla_stream_annotation = "collective"`, and the expert matmuls do
not; the global view's op sits in such a region and keeps it through SPMD partitioning.
With the setting off (or "auto" off a GPU, or a JAX without the region form) the calls
are plain; results are the same either way."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jax_ep
import jax_ep.low_latency as ll
import jax_ep.sharded as sh
from jax_ep import config, ops
from jax_ep._src import stream as _stream
from conftest import ep_mesh

R, T, H, K, E, M = 4, 6, 8, 2, 8, 8
EP_CALL = re.compile(r"stablehlo\.custom_call @(jax_ep_(?!layout)\w+|CustomSPMDPartitioning)\(")
FUNC = re.compile(r"^\s*func\.func (?:public |private )?@([\w.$-]+)\(")
CALL = re.compile(r"(?<![\w.])(?:func\.)?call @([\w.$-]+)\(")
STREAM_ATTR = '_xla_stream_annotation = "collective"'

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (virtual) devices")


# ----------------------------------------------------------------------------- checker

def _functions(text: str) -> dict:
    """{function name: [its lines]} of a StableHLO module's text."""
    funcs, name = {}, None
    for line in text.splitlines():
        m = FUNC.match(line)
        if m:
            name = m.group(1)
            funcs[name] = []
        elif name is not None:
            funcs[name].append(line)
    return funcs


def region_report(text: str) -> dict:
    """Where the EP calls and the matmuls of a module are: {'ep_in', 'ep_out', 'dot_in',
    'dot_out'} counts, 'in' meaning inside a function reached only through calls that
    carry the collective-stream annotation."""
    funcs = _functions(text)
    sites = {}  # callee -> [annotated?] per call site
    calls = {}  # caller -> callees
    for caller, lines in funcs.items():
        for line in lines:
            for callee in CALL.findall(line):
                sites.setdefault(callee, []).append(STREAM_ATTR in line)
                calls.setdefault(caller, set()).add(callee)
    stream = {f for f, s in sites.items() if s and all(s)}
    todo = list(stream)
    while todo:  # what a stream function calls runs in its region too
        for callee in calls.get(todo.pop(), ()):
            if callee not in stream:
                stream.add(callee)
                todo.append(callee)
    out = dict(ep_in=0, ep_out=0, dot_in=0, dot_out=0)
    for name, lines in funcs.items():
        where = "in" if name in stream else "out"
        for line in lines:
            out[f"ep_{where}"] += bool(EP_CALL.search(line))
            out[f"dot_{where}"] += "stablehlo.dot_general" in line
    return out


def _export_cuda(f, *args) -> str:
    g = jax.jit(jax.shard_map(f, mesh=ep_mesh(R), in_specs=P("ep"), out_specs=P("ep")))
    targets = ["jax_ep_dispatch", "jax_ep_combine", "jax_ep_gather"] + [
        f"jax_ep_ll_{a}_{b}" for a in ("dispatch", "combine") for b in ("send", "recv")]
    checks = [jax.export.DisabledSafetyCheck.custom_call(t) for t in targets]
    exp = jax.export.export(g, platforms=["cuda"], disabled_checks=checks)(*args)
    return exp.mlir_module()


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((R * T, H)).astype(np.float32)
    idx = np.stack([rng.permutation(E)[:K] for _ in range(R * T)]).astype(np.int32)
    w = rng.random((R * T, K)).astype(np.float32)
    return x, idx, w


# ----------------------------------------------------------------------------- programs

def _normal(x, idx, w):
    """Dispatch, an expert matmul, combine, a cached dispatch; value and gradients."""
    kw = dict(backend="ffi")

    def loss(x, w):
        rx, _, rw, h = jax_ep.dispatch(x, idx, w, num_experts=E, axis_name="ep",
                                       capacity=R * T, **kw)
        y = (rx @ jnp.eye(H, dtype=rx.dtype) * 0.5) * jnp.sum(rw, 1, keepdims=True)
        again = ops.cached_dispatch(jnp.tanh(x), h, **kw)
        return jnp.sum(jax_ep.combine(y + again, h, **kw) ** 2)

    v, (gx, gw) = jax.value_and_grad(loss, argnums=(0, 1))(x, w)
    return gx * v, gw


def _low_latency(x, idx, w):
    """Fused and split low-latency ops around expert matmuls, with gradients."""
    kw = dict(num_experts=E, axis_name="ep", max_tokens_per_rank=M, backend="ffi")

    def loss(x, w):
        recv, _, h = ll.dispatch(x, idx, **kw)
        y = jnp.tanh(recv @ jnp.eye(H, dtype=recv.dtype))
        return jnp.sum(ll.combine(y, idx, w, h, backend="ffi") ** 2)

    gx, gw = jax.grad(loss, argnums=(0, 1))(x, w)
    st = ll.dispatch_send(x, idx, **kw)
    recv, _, h = ll.dispatch_recv(st)
    out = ll.combine_recv(ll.combine_send(recv @ jnp.eye(H), idx, w, h, backend="ffi"))
    return gx + out, gw


PROGRAMS = {"normal": (_normal, 7), "low_latency": (_low_latency, 14)}


# ----------------------------------------------------------------------------- tests

@pytest.mark.parametrize("program", list(PROGRAMS))
def test_cuda_export_puts_every_ep_call_in_a_collective_region(program):
    f, n_calls = PROGRAMS[program]
    with config.override(collective_stream=True):
        text = _export_cuda(f, *_inputs())
    rep = region_report(text)
    assert rep["ep_out"] == 0, rep
    assert rep["ep_in"] == n_calls, rep
    assert rep["dot_out"] >= 2 and rep["dot_in"] == 0, rep  # the matmuls stay outside
    # Each region holds one EP call and nothing that computes.
    for name, lines in _functions(text).items():
        if any(EP_CALL.search(ln) for ln in lines):
            ops = [ln for ln in lines if re.search(r"= (stablehlo|chlo|func)\.", ln)]
            assert len(ops) == 1, (name, ops)


def test_plain_calls_when_off():
    assert jax.default_backend() == "cpu"
    with config.override(collective_stream=False):
        text = _export_cuda(_normal, *_inputs())
    rep = region_report(text)
    assert rep["ep_in"] == 0 and rep["ep_out"] == 7, rep
    assert STREAM_ATTR not in text


def _export(f, platforms, *args) -> str:
    g = jax.jit(jax.shard_map(f, mesh=ep_mesh(R), in_specs=P("ep"), out_specs=P("ep")))
    checks = [jax.export.DisabledSafetyCheck.custom_call(t) for t in (
        "jax_ep_dispatch", "jax_ep_combine", "jax_ep_gather")]
    return jax.export.export(g, platforms=platforms, disabled_checks=checks)(
        *args).mlir_module()


@pytest.mark.parametrize("program", list(PROGRAMS))
def test_auto_decides_by_the_platform_lowered_for(program):
    """The default ("auto") on this CPU host: a program exported for CUDA carries the
    collective-stream annotation on every EP call; the same program lowered for CPU
    (exported, or jitted here) has none."""
    assert jax.default_backend() == "cpu" and config.collective_stream == "auto"
    f, n_calls = PROGRAMS[program]
    cuda = _export_cuda(f, *_inputs())
    rep = region_report(cuda)
    assert rep["ep_in"] == n_calls and rep["ep_out"] == 0, rep
    assert rep["dot_in"] == 0, rep
    if program == "normal":
        cpu = _export(f, ["cpu"], *_inputs())
        assert STREAM_ATTR not in cpu
        assert region_report(cpu)["ep_out"] == n_calls
    g = jax.jit(jax.shard_map(f, mesh=ep_mesh(R), in_specs=P("ep"), out_specs=P("ep")))
    assert STREAM_ATTR not in g.lower(*_inputs()).as_text()


def test_the_checker_sees_a_call_outside_its_region():
    with config.override(collective_stream=True):
        text = _export_cuda(_normal, *_inputs())
    # Drop the annotation from one region's call site: its EP call is then outside.
    broken = text.replace(STREAM_ATTR, '_xla_stream_annotation = "0"', 1)
    assert region_report(broken)["ep_out"] == 1
    # A matmul moved into a region is seen too.
    region = next(n for n, lines in _functions(text).items()
                  if any(EP_CALL.search(ln) for ln in lines))
    planted = text.replace(f"func.func private @{region}(",
                           f"func.func private @{region}(", 1)
    dot = next(ln for ln in text.splitlines() if "stablehlo.dot_general" in ln)
    lines = planted.splitlines()
    start = next(i for i, ln in enumerate(lines) if f"@{region}(" in ln and "func.func" in ln)
    lines.insert(start + 1, dot)
    assert region_report("\n".join(lines))["dot_in"] == 1


@pytest.mark.parametrize("program", list(PROGRAMS))
def test_results_equal_with_and_without_the_region(program):
    """The region changes where the calls run, not what they compute (CPU runs it)."""
    f = PROGRAMS[program][0]
    args = _inputs(3)

    def run(setting):
        with config.override(collective_stream=setting):
            g = jax.jit(jax.shard_map(lambda *a: f(*a), mesh=ep_mesh(R), in_specs=P("ep"),
                                      out_specs=P("ep")))
            return [np.asarray(o) for o in g(*args)]

    for a, b in zip(run(False), run(True)):
        np.testing.assert_array_equal(a, b)


def test_global_view_op_sits_in_a_region_before_partitioning():
    mesh = jax.make_mesh((8,), ("expert",), axis_types=(AxisType.Auto,))
    x, idx, w = (np.concatenate([a, a]) for a in _inputs(4))

    def f(x, idx, w):
        def loss(x):
            rx, _, _, h = sh.dispatch(x, idx, w, num_experts=2 * E, mesh_axis="expert",
                                      backend="ffi")
            return jnp.sum(sh.combine(rx @ jnp.eye(H), h, backend="ffi"))
        return jax.value_and_grad(loss)(x)

    with jax.set_mesh(mesh), config.override(collective_stream=True):
        xs = jax.device_put(x, NamedSharding(mesh, P("expert")))
        text = jax.jit(f).trace(xs, idx, w).lower(lowering_platforms=("cuda",)).as_text()
    rep = region_report(text)
    assert rep["ep_out"] == 0 and rep["ep_in"] >= 3, rep  # dispatch, combine, transposes
    assert rep["dot_out"] >= 2 and rep["dot_in"] == 0, rep


def test_global_view_setting_changed_after_a_first_trace():
    """The global-view op traced first with the setting off, then on, at the same shapes:
    the second program has the region (the op keeps one trace per setting)."""
    mesh = jax.make_mesh((8,), ("expert",), axis_types=(AxisType.Auto,))
    x, idx, w = (np.concatenate([a, a]) for a in _inputs(4))

    def make():  # a new function each time: JAX keeps the trace of a jitted function
        def f(x):
            rx, _, _, h = sh.dispatch(x, idx, w, num_experts=2 * E, mesh_axis="expert",
                                      backend="ffi")
            return sh.combine(rx * 2.0, h, backend="ffi")
        return jax.jit(f)

    reports = []
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, NamedSharding(mesh, P("expert")))
        for on in (False, True, False):
            with config.override(collective_stream=on):
                text = make().trace(xs).lower(lowering_platforms=("cuda",)).as_text()
            reports.append(region_report(text))
    off, on, off_again = reports
    assert off["ep_in"] == 0 and off["ep_out"] >= 2, off
    assert on["ep_out"] == 0 and on["ep_in"] >= 2, on
    assert off_again == off


_GLOBAL_SCRIPT = textwrap.dedent("""
    import glob, re, sys
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    import jax_ep, jax_ep.sharded as sh
    E, K, H = 16, 3, 8
    mesh = jax.make_mesh((8,), ("expert",), axis_types=(AxisType.Auto,))
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((64, H)), jnp.float32)
    idx = jnp.asarray(rng.integers(-1, E, (64, K)).astype(np.int32))
    w = jnp.asarray(rng.random((64, K)), jnp.float32)
    def make(backend):
        def f(x):
            rx, _, _, h = sh.dispatch(x, idx, w, num_experts=E, mesh_axis="expert",
                                      backend=backend)
            return sh.combine(rx * 3.0, h, backend=backend)
        return jax.jit(f)
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, NamedSharding(mesh, P("expert")))
        ref = make("reference")(xs)
        jax_ep.config.update("collective_stream", True)
        out = make("ffi")(xs)
    np.testing.assert_array_equal(np.asarray(ref), np.asarray(out))
    # The partitioned program: each EP call inside a computation called with the
    # annotation.
    path = [p for p in glob.glob(sys.argv[1] + "/*jit_f*after_spmd-partitioning*")]
    text = open(path[-1]).read()
    comps = re.split(r"\\n(?=\\S)", text)
    annotated = set(re.findall(r'call\\([^)]*\\), to_apply=%([\\w.-]+)[^\\n]*'
                               r'_xla_stream_annotation="collective"', text))
    homes = [c.split(" ", 1)[0].lstrip("%") for c in comps
             if "custom_call_target=\\"jax_ep_" in c]
    print("HOMES", homes, "ANNOTATED", sorted(annotated))
    assert homes and all(h in annotated for h in homes), (homes, annotated)
""")


def test_global_view_region_survives_partitioning_and_compiles(tmp_path):
    """Compiled on CPU with the setting forced on: the partitioned program keeps each EP
    call in an annotated region, compiles (no placement annotation left behind) and
    equals the reference."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8 "
               f"--xla_dump_to={tmp_path} --xla_dump_hlo_pass_re=spmd-partitioning",
               JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-c", _GLOBAL_SCRIPT, str(tmp_path)], env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


def test_fallback_without_the_region_form(monkeypatch):
    """A JAX without the region form: the calls stay plain, with a warning when the
    setting asks for the stream explicitly."""
    monkeypatch.setattr(_stream, "region_compute_on", lambda: None)
    _stream._warn_unavailable.cache_clear()
    with config.override(collective_stream=True), warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        text = _export_cuda(_normal, *_inputs())
    assert region_report(text)["ep_in"] == 0
    assert any("no region form of compute_on" in str(m.message) for m in w)


def test_region_form_is_found_on_this_jax():
    fn = _stream.region_compute_on()
    assert fn is not None, jax.__version__
    assert fn.__name__ in ("compute_on2", "compute_on")


def test_setting_is_checked_and_restored():
    before = config.collective_stream
    with pytest.raises(ValueError, match="collective_stream"):
        config.update("collective_stream", "sometimes")
    with pytest.raises(AttributeError, match="no setting"):
        config.update("collective_steam", True)
    with config.override(collective_stream="off"):
        assert config.collective_stream is False
    assert config.collective_stream == before
    assert config._collective_stream("ON", "x") is True


def test_region_form_detection_across_jax_versions(monkeypatch):
    """JAX 0.10 names the region form compute_on2 (beside the older context manager);
    later JAX names it compute_on; older JAX has only the context manager."""
    import contextlib
    import types

    import jax.experimental

    def region(f=None, *, compute_type, out_memory_spaces, compiler_options=None):
        return f

    @contextlib.contextmanager
    def context_manager(compute_type):
        yield

    cases = {"jax_0_10": (dict(compute_on=context_manager, compute_on2=region), region),
             "later": (dict(compute_on=region), region),
             "older": (dict(compute_on=context_manager), None)}
    for name, (attrs, want) in cases.items():
        fake = types.ModuleType("jax.experimental.compute_on")
        fake.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, "jax.experimental.compute_on", fake)
        monkeypatch.setattr(jax.experimental, "compute_on", fake, raising=False)
        _stream.region_compute_on.cache_clear()
        assert _stream.region_compute_on() is want, name
    monkeypatch.undo()
    _stream.region_compute_on.cache_clear()
    assert _stream.region_compute_on() is not None


# ----------------------------------------------------------------------------- on a GPU

def _gpus():
    try:
        return jax.devices("gpu")
    except RuntimeError:
        return []


def async_ep_calls(hlo: str) -> dict:
    """{EP target: whether it runs inside an async pair} of compiled HLO text: the call
    sits in a computation reached from an async-start / call-start instruction."""
    comps, name = {}, None
    for line in hlo.splitlines():
        m = re.match(r"^(?:ENTRY )?%?([\w.-]+) ", line)
        if m and line.rstrip().endswith("{"):
            name = m.group(1)
            comps[name] = []
        elif name is not None:
            comps[name].append(line)
    called = lambda ln: re.findall(r"=%([\w.-]+)", ln)  # calls=, to_apply=, body=, ...
    inside, todo = set(), []
    for lines in comps.values():
        for ln in lines:
            if re.search(r"\b(async|call)-start\(", ln):
                todo += called(ln)
    while todo:
        c = todo.pop()
        if c in inside or c not in comps:
            continue
        inside.add(c)
        for ln in comps[c]:
            todo += called(ln)
    out = {}
    for c, lines in comps.items():
        for ln in lines:
            t = re.search(r'custom_call_target="(jax_ep_(?!layout)\w+)"', ln)
            if t:
                out[t.group(1)] = out.get(t.group(1), False) or c in inside
    return out


def test_the_async_reader_needs_a_start():
    plain = ('ENTRY %main (p: f32[4]) -> f32[4] {\n'
             '  %c = f32[4]{0} custom-call(%p), custom_call_target="jax_ep_combine"\n}\n')
    assert async_ep_calls(plain) == {"jax_ep_combine": False}
    wrapped = ('%wrapped (p: f32[4]) -> f32[4] {\n'
               '  %c = f32[4]{0} custom-call(%p), custom_call_target="jax_ep_combine"\n}\n'
               'ENTRY %main (p: f32[4]) -> f32[4] {\n'
               '  %s = ((f32[4]), f32[4]) call-start(%p), to_apply=%wrapped\n'
               '  ROOT %d = f32[4]{0} call-done(%s)\n}\n')
    assert async_ep_calls(wrapped) == {"jax_ep_combine": True}


@pytest.mark.gpu
@pytest.mark.skipif(not _gpus(), reason="needs a GPU")
def test_on_a_gpu_the_calls_run_async_and_agree():
    """The first GPU check of this setting: compiled by XLA:GPU with the default ("auto"
    = on), each EP call sits in an async pair, and the results equal those with it off."""
    import jax_ep.cuda as jcuda

    mesh = jax.make_mesh((1,), ("ep",), devices=_gpus()[:1])
    jcuda.setup(mesh, "ep", num_tokens=T, hidden=H, topk=K, dtype=jnp.float32)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((T, H)).astype(np.float32)
    idx = np.stack([rng.permutation(E)[:K] for _ in range(T)]).astype(np.int32)
    w = rng.random((T, K)).astype(np.float32)

    def f(x, idx, w):
        rx, _, rw, h = ops.dispatch(x, idx, w, num_experts=E, axis_name="ep", backend="ffi")
        y = (rx @ jnp.eye(H, dtype=rx.dtype)) * jnp.sum(rw, 1, keepdims=True)
        return ops.combine(y, h, backend="ffi")

    def build():
        return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))

    assert config.collective_stream == "auto" and _stream.active()
    compiled = build().lower(x, idx, w).compile()
    where = async_ep_calls(compiled.as_text())
    on = np.asarray(compiled(x, idx, w))
    with config.override(collective_stream=False):
        off = np.asarray(build()(x, idx, w))
    np.testing.assert_array_equal(on, off)
    assert where and all(where.values()), where
