"""Packaging of the NVSHMEM code: the main extension needs no NVSHMEM library, the
NVSHMEM module finds the wheel's host library relative to the installed package, and
`import jax_ep` (and CPU work) never loads it."""
from __future__ import annotations

import importlib.util
import os
import pathlib
import re
import shutil
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _dynamic(so: str) -> str:
    readelf = shutil.which("readelf")
    if readelf is None:
        pytest.skip("no readelf")
    return subprocess.run([readelf, "-d", so], capture_output=True, text=True,
                          check=True).stdout


def _origin(name):
    spec = importlib.util.find_spec(f"jax_ep.{name}")
    return None if spec is None else spec.origin


def test_main_extension_needs_no_nvshmem():
    so = _origin("_jax_ep_ext")
    assert so is not None, "the extension is not built"
    needed = re.findall(r"\(NEEDED\).*\[(.+?)\]", _dynamic(so))
    assert needed, "readelf listed no NEEDED entries"
    assert not [n for n in needed if "nvshmem" in n], needed


def test_nvshmem_module_runpath_is_relative_to_the_package():
    import jax_ep
    so = _origin("_jax_ep_nvshmem")
    if so is None:
        assert not jax_ep.build_info()["nvshmem"]
        pytest.skip("this build has no NVSHMEM module")
    dyn = _dynamic(so)
    assert re.search(r"\(NEEDED\).*libnvshmem_host\.so\.3", dyn), dyn
    runpath = re.search(r"\((?:RUNPATH|RPATH)\).*\[(.+?)\]", dyn).group(1).split(":")
    assert runpath[0] == "$ORIGIN/../nvidia/nvshmem/lib", runpath
    if not os.environ.get("JAX_EP_NVSHMEM_ROOT"):
        # no build-directory or venv path baked in (with NCCL's headers, the nccl wheel's
        # lib/ too: libnccl.so.2 is found by name there, cmake/nccl.cmake)
        want = ["$ORIGIN/../nvidia/nvshmem/lib"]
        if jax_ep.build_info().get("nccl"):
            want.append("$ORIGIN/../nvidia/nccl/lib")
        assert runpath == want, runpath
    # ... and that path does hold the wheel's host library in this install
    lib = pathlib.Path(so).parent / "../nvidia/nvshmem/lib/libnvshmem_host.so.3"
    assert lib.resolve().exists(), lib


_NO_NVSHMEM = textwrap.dedent(r"""
    import sys
    # NVSHMEM made unimportable: the wheel's package and jax_ep's NVSHMEM module
    sys.modules["nvidia.nvshmem"] = None
    sys.modules["jax_ep._jax_ep_nvshmem"] = None
    import jax, jax.numpy as jnp, numpy as np
    import jax_ep
    from jax_ep import nvshmem_bootstrap
    from jax_ep._src import ext as _ext
    info = jax_ep.build_info()
    x = jnp.ones((8, 4), jnp.float32)
    idx = jnp.zeros((8, 2), jnp.int32)
    w = jnp.ones((8, 2), jnp.float32)
    from jax.sharding import PartitionSpec as P
    mesh = jax.make_mesh((1,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,))
    f = jax.jit(jax.shard_map(
        lambda x, i, w: jax_ep.dispatch(x, i, w, num_experts=2, axis_name="ep")[0],
        mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
    out = f(x, idx, w)
    assert out.shape[1] == 4
    try:
        nvshmem_bootstrap.ExtensionRuntime()
        print("RUNTIME-STARTED")
    except nvshmem_bootstrap.NvshmemBootstrapError as e:
        print("REFUSED:", e)
    maps = open("/proc/self/maps").read()
    print("LOADED-NVSHMEM" if "libnvshmem_host" in maps else "NO-NVSHMEM-LOADED")
    print("NVSHMEM-MODULE" if sys.modules.get("jax_ep._jax_ep_nvshmem") else "NO-MODULE")
    print("OK", info["cpu"])
""")


def test_import_and_cpu_work_without_nvshmem(tmp_path):
    script = tmp_path / "no_nvshmem.py"
    script.write_text(_NO_NVSHMEM)
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "LD_LIBRARY_PATH")}
    env["JAX_PLATFORMS"] = "cpu"
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                       env=env, timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    out = r.stdout
    assert "OK True" in out, out
    assert "NO-NVSHMEM-LOADED" in out and "NO-MODULE" in out, out
    assert "REFUSED:" in out and "nvidia-nvshmem-cu13" in out, out


def test_import_jax_ep_does_not_load_the_nvshmem_module(tmp_path):
    # neither import nor build_info() on a CPU-only host loads it
    code = ("import sys, jax_ep; jax_ep.build_info(); "
            "print('LOADED' if 'jax_ep._jax_ep_nvshmem' in sys.modules else 'NOT', "
            "'LIB' if 'libnvshmem_host' in open('/proc/self/maps').read() else 'NOLIB')")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env=env, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["NOT", "NOLIB"], r.stdout


def test_nvshmem_wheel_pinned_to_the_linked_release():
    text = (ROOT / "pyproject.toml").read_text()
    m = re.search(r'"nvidia-nvshmem-cu13([^"]*)"', text)
    assert m, "the cuda extra does not list nvidia-nvshmem-cu13"
    assert m.group(1).replace(" ", "") == ">=3.8,<3.9", m.group(1)
