"""jax_ep.Config: one typed configuration, read once from the environment; its table
(jax_ep/config.py's docstring, docs/settings.md) is what the code reads; no module outside
jax_ep/config.py reads a run-time JAX_EP_* variable, no kernel header reads the
environment; the kernel settings reach every loaded extension module's C++; backend names
and the handle's backend."""
from __future__ import annotations

import dataclasses
import os
import pathlib
import re
import subprocess
import sys
import warnings

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_ep
import jax_ep.low_latency as ll
from jax_ep import config, ops
from jax_ep._src.ext import require_ext
from conftest import ep_mesh

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _table(text: str, header: str) -> list[str]:
    lines = text.splitlines()
    i = next(k for k, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[i + 2:]:
        if not line.startswith("|"):
            break
        rows.append(line)
    return rows


def _runtime_rows(text: str) -> dict:
    """{variable: setting} of the run-time table."""
    out = {}
    for row in _table(text, "| variable | setting"):
        cells = [c.strip() for c in row.strip("|").split("|")]
        out[cells[0]] = cells[1]
    return out


# ----------------------------------------------------------------------------- the table

def test_table_lists_every_setting_and_its_variable():
    doc = config.__doc__
    rows = _runtime_rows(doc)
    assert rows == {v: k for k, v in config.ENV.items()}
    assert tuple(rows.values()) == tuple(f.name for f in dataclasses.fields(config.Config))
    # docs/settings.md has the same tables, row for row
    md = (ROOT / "docs" / "settings.md").read_text()
    for header in ("| variable | setting", "| variable | read by"):
        assert _table(md, header) == _table(doc, header), header


def _runtime_vars() -> set:
    return set(config.ENV.values())


# A read: os.environ.get("X"), os.environ["X"] (not assigned), os.getenv("X"),
# environ.get("X"), env.get("X").
READ = re.compile(r"""(?:\.get\(|getenv\(|environ\[)\s*["'](JAX_EP_[A-Z0-9_]+)["']\s*\]?(?!\s*=[^=])""")


def test_no_module_reads_a_runtime_variable_but_config():
    runtime = _runtime_vars()
    found = []
    for path in (ROOT / "jax_ep").rglob("*.py"):
        if path.name == "config.py" and path.parent.name == "jax_ep":
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            for var in READ.findall(line):
                if var in runtime:
                    found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not found, "read jax_ep.config instead:\n" + "\n".join(found)


def test_the_read_pattern_finds_reads():
    """The checker above can fail: it sees each form of a read, not a write."""
    for line in ('v = os.environ.get("JAX_EP_NUM_SMS")', 'os.environ["JAX_EP_NUM_SMS"]',
                 "x = os.getenv('JAX_EP_NUM_SMS', '')", 'env.get("JAX_EP_NUM_SMS", "")'):
        assert READ.findall(line) == ["JAX_EP_NUM_SMS"], line
    assert READ.findall('env["JAX_EP_NUM_SMS"] = "3"') == []


def test_no_kernel_reads_the_environment():
    getenv = re.compile(r"(?<![\w])(?:std::)?(?:secure_)?getenv\s*\(")
    found = []
    for sub in ("kernels/common", "kernels/cuda", "kernels/internode", "xla_ffi"):
        for path in (ROOT / sub).rglob("*"):
            if path.suffix not in (".h", ".cc", ".cu", ".cuh"):
                continue
            for n, line in enumerate(path.read_text().splitlines(), 1):
                code = line.split("//", 1)[0]
                if getenv.search(code):
                    found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not found, "kernels read kernels/common/settings.h, not the environment:\n" + \
        "\n".join(found)


# ----------------------------------------------------------------------------- the Config

def test_config_views():
    cfg = config.current()
    assert isinstance(cfg, jax_ep.Config) and cfg is config.current()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.num_sms = 3  # type: ignore[misc]
    assert config.collective_stream == cfg.collective_stream
    with config.override(num_sms=12, collective_stream=False) as inside:
        assert config.num_sms == 12 and inside is config.current()
        assert config.current().collective_stream is False
        config.update("ring_tokens", 9)  # an update inside the block stays after it
    assert config.current().num_sms == cfg.num_sms
    assert config.current().collective_stream == cfg.collective_stream
    assert config.ring_tokens == 9
    with pytest.raises(AttributeError, match="no setting 'nope'"):
        config.update("nope", 1)
    with pytest.raises(AttributeError):
        config.nope  # noqa: B018


@pytest.mark.parametrize("name,bad", [("ring_tokens", "many"), ("num_sms", 0),
                                      ("num_sms", 2.5), ("timeout_s", "soon"),
                                      ("timeout_s", -1), ("cuda_preset", "ep3"),
                                      ("internode_mode", "tree"), ("fabric", "maybe"),
                                      ("lag_affinity", "x"), ("gpus_per_node", "two")])
def test_bad_value_names_the_setting_and_the_variable(name, bad):
    with pytest.raises(ValueError, match=name):
        config.update(name, bad)
    var = config.ENV[name]
    with pytest.raises(ValueError, match=var):
        config.from_env({var: str(bad)})


def test_environment_is_read_at_import_and_reaches_cpp():
    env = dict(os.environ, JAX_EP_RING_TOKENS="9", JAX_EP_TIMEOUT_S="7.5",
               JAX_EP_FABRIC="off", JAX_PLATFORMS="cpu")
    code = ("import jax_ep; from jax_ep._src.ext import ext; c = jax_ep.config.current(); "
            "print(c.ring_tokens, c.timeout_s, c.fabric, ext.settings()['ring_tokens'], "
            "ext.settings()['timeout_s'], ext.intranode_ring_tokens())")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["9", "7.5", "False", "9", "7.5", "9"]
    env["JAX_EP_NUM_SMS"] = "lots"
    r = subprocess.run([sys.executable, "-c", "import jax_ep"], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "JAX_EP_NUM_SMS" in r.stderr, r.stderr[-2000:]


def test_settings_reach_cpp():
    ext = require_ext()
    before = ext.settings()
    assert before == {k: v for k, v in config.current().kernel_settings().items()}
    assert ext.settings_defaults()["timeout_s"] == 300.0 == config.Config().timeout_s
    want = dict(timeout_s=12.5, num_sms=5, ring_tokens=7, bulk_piece_bytes=48,
                cuda_preset="ep4", hier_source_blocks=3, hier_push_parts=2,
                hier_forward_columns=2, hier_dispatch_blocks=6, hier_combine_blocks=4,
                intranode_sms=10, hierarchical_sms=11, direct_sms=3, low_latency_sms=7,
                hardware_queues=16)
    with config.override(**want):
        assert ext.settings() == want
        assert ext.intranode_ring_tokens() == 7  # configs.h IntranodeRingTokens
        fitted = {p["name"]: p["num_sms"] for p in ext.intranode_fitted_presets(132)}
        assert fitted["ep8"] == 4  # EpSmBudget: num_sms = 5 cuts to whole channels
    assert ext.settings() == before
    with pytest.raises(ValueError, match="unknown setting"):
        ext.set_settings({"nope": 1})


def test_settings_reach_the_emulated_module():
    from jax_ep._src import emu
    try:
        mod = emu.module()
    except NotImplementedError:
        pytest.skip("no emulated module in this build")
    with config.override(ring_tokens=5, num_sms=3):
        assert mod.settings()["ring_tokens"] == 5 and mod.settings()["num_sms"] == 3
    assert mod.settings()["ring_tokens"] == config.current().ring_tokens


# ----------------------------------------------------------------------------- backends

R, T, H, K, E = 4, 6, 8, 2, 8


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((R * T, H)).astype(np.float32)
    idx = np.stack([rng.permutation(E)[:K] for _ in range(R * T)]).astype(np.int32)
    w = rng.random((R * T, K)).astype(np.float32)
    return x, idx, w


def test_backend_names_resolve():
    assert ops.resolve_backend("reference") == "reference"
    assert ops.resolve_backend("intranode") == "intranode"
    assert ops.resolve_backend(None) == ops.resolve_backend("auto") == "intranode"
    with pytest.raises(NotImplementedError, match="internode"):
        ops.resolve_backend("internode")  # no GPUs here
    with pytest.raises(ValueError, match="backend must be one of"):
        ops.resolve_backend("nccl")


def test_ffi_is_a_deprecated_alias_of_intranode(monkeypatch):
    monkeypatch.setattr(ops, "_warned_ffi", False)
    with pytest.warns(DeprecationWarning, match="'ffi' is a deprecated name of "
                                                "backend='intranode'"):
        assert ops.resolve_backend("ffi") == "intranode"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process
        assert ops.resolve_backend("ffi") == "intranode"


@pytest.mark.parametrize("backend,want", [("reference", "reference"), (None, "intranode"),
                                          ("ffi", "intranode"), ("intranode", "intranode")])
def test_handles_record_their_backend(backend, want):
    x, idx, w = _inputs()
    seen = {}

    def f(x, idx, w):
        rx, _, _, h = jax_ep.dispatch(x, idx, w, num_experts=E, axis_name="ep",
                                      backend=backend)
        seen["normal"] = h.backend
        _, _, lh = ll.dispatch(x, idx, num_experts=E, axis_name="ep", max_tokens_per_rank=T,
                               backend=backend)
        seen["low_latency"] = lh.backend
        return jax_ep.combine(rx, h)  # backend=None: the handle's

    g = jax.jit(jax.shard_map(f, mesh=ep_mesh(R), in_specs=P("ep"), out_specs=P("ep")))
    text = g.lower(x, idx, w).as_text()
    assert seen == {"normal": want, "low_latency": want}
    # combine followed the handle: the kernels' combine only where the handle says so
    assert ("jax_ep_combine" in text) == (want == "intranode"), want
    out = np.asarray(g(x, idx, w))
    assert out.shape == (R * T, H)
