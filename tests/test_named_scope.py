"""Traces name the exchange: each public op runs under `jax.named_scope` (jax_ep.dispatch,
jax_ep.combine, jax_ep.low_latency.dispatch_send, jax_ep.sharded.dispatch, ...), so the
op_name metadata of its EP custom calls in the compiled program (what XProf and XLA's
NVTX ranges show) names it, forward and backward; and the NVTX header of the CUDA
launchers (kernels/common/nvtx.h) compiles with NVTX and without it."""
from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jax_ep.low_latency as ll
import jax_ep.sharded as sh
from jax_ep import ops
from conftest import ep_mesh

R, T, H, K, E, M = 4, 6, 8, 2, 8, 8
ROOT = pathlib.Path(__file__).resolve().parents[1]


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((R * T, H)).astype(np.float32)
    idx = np.stack([rng.permutation(E)[:K] for _ in range(R * T)]).astype(np.int32)
    w = rng.random((R * T, K)).astype(np.float32)
    return x, idx, w


def ep_op_names(hlo: str) -> list:
    """[(custom call target, op_name)] of the jax_ep custom calls of compiled HLO text."""
    out = []
    for line in hlo.splitlines():
        t = re.search(r'custom_call_target="(jax_ep_\w+)"', line)
        if t:
            n = re.search(r'op_name="([^"]*)"', line)
            out.append((t.group(1), n.group(1) if n else ""))
    return out


def _compiled_per_shard(f, *args) -> str:
    g = jax.jit(jax.shard_map(f, mesh=ep_mesh(R), in_specs=P("ep"), out_specs=P("ep"),
                              check_vma=False))
    return g.lower(*args).compile().as_text()


def _normal(x, idx, w):
    def loss(x):
        rx, _, rw, h = ops.dispatch(x, idx, w, num_experts=E, axis_name="ep", backend="ffi")
        again = ops.cached_dispatch(jnp.sin(x), h, backend="ffi")
        return jnp.sum(ops.combine(rx * 2.0 + again, h, backend="ffi") ** 2)
    layout = ops.get_dispatch_layout(idx, num_experts=E, num_ranks=R, backend="ffi")
    return jax.grad(loss)(x) + jnp.sum(layout.num_tokens_per_rank).astype(jnp.float32)


def _low_latency(x, idx, w):
    kw = dict(num_experts=E, axis_name="ep", max_tokens_per_rank=M, backend="ffi")
    st = ll.dispatch_send(x, idx, **kw)
    recv, _, h = ll.dispatch_recv(st)
    split = ll.combine_recv(ll.combine_send(recv * 2.0, idx, w, h, backend="ffi"))
    recv, _, h = ll.dispatch(x, idx, **kw)
    return split + ll.combine(recv, idx, w, h, backend="ffi")


def test_per_shard_ops_name_their_custom_calls():
    names = ep_op_names(_compiled_per_shard(_normal, *_inputs()))
    by_target = {}
    for target, name in names:
        by_target.setdefault(target, []).append(name)
    assert any("jax_ep.dispatch" in n for n in by_target["jax_ep_dispatch"])
    assert any("jax_ep.get_dispatch_layout" in n for n in by_target["jax_ep_layout"])
    # Forward combine, and the combines of dispatch's and cached dispatch's transposes.
    combines = by_target["jax_ep_combine"]
    assert any(re.search(r"(?<!transpose\()jax_ep\.combine", n) for n in combines)
    assert any("transpose(jvp(jax_ep.dispatch))" in n for n in combines), combines
    assert any("jax_ep.cached_dispatch" in n for n in combines), combines
    gathers = by_target["jax_ep_gather"]
    assert any("transpose(jvp(jax_ep.combine))" in n for n in gathers), gathers
    assert any("jvp(jax_ep.cached_dispatch)" in n for n in gathers), gathers
    for target, name in names:
        assert "jax_ep." in name, (target, name)


def test_low_latency_halves_are_named():
    names = ep_op_names(_compiled_per_shard(_low_latency, *_inputs(1)))
    got = {n.split("/")[-2] for _, n in names if "/" in n}
    # The split halves by their own name; the fused ops name both of their halves.
    for half in ("dispatch_send", "dispatch_recv", "combine_send", "combine_recv"):
        assert f"jax_ep.low_latency.{half}" in got, got
    assert any(n.endswith("jax_ep.low_latency.dispatch/ffi_call") or
               "jax_ep.low_latency.dispatch/" in n for _, n in names), names
    assert any("jax_ep.low_latency.combine/" in n for _, n in names), names


def test_global_view_ops_are_named():
    mesh = jax.make_mesh((8,), ("expert",), axis_types=(AxisType.Auto,))
    x, idx, w = (np.concatenate([a, a]) for a in _inputs(2))

    def f(x):
        rx, _, _, h = sh.dispatch(x, idx, w, num_experts=2 * E, mesh_axis="expert",
                                  backend="ffi")
        return sh.combine(rx * 3.0, h, backend="ffi")

    with jax.set_mesh(mesh):
        xs = jax.device_put(x, NamedSharding(mesh, P("expert")))
        names = ep_op_names(jax.jit(f).lower(xs).compile().as_text())
    assert any(t == "jax_ep_dispatch" and "jax_ep.sharded.dispatch" in n for t, n in names)
    assert any(t == "jax_ep_combine" and "jax_ep.sharded.combine" in n for t, n in names)


def test_the_name_reader_sees_an_unnamed_call():
    line = ('%c = f32[4]{0} custom-call(%a), custom_call_target="jax_ep_combine", '
            'metadata={op_name="jit(f)/shard_map/ffi_call"}')
    assert ep_op_names(line) == [("jax_ep_combine", "jit(f)/shard_map/ffi_call")]
    assert "jax_ep." not in ep_op_names(line)[0][1]


# ----------------------------------------------------------------------------- NVTX header

_NVTX_PROGRAM = r"""
#include <cstdio>
#include "kernels/common/nvtx.h"

static int phase(int n) {
  JEP_NVTX_RANGE("jax_ep.dispatch/phase");
  if (n > 1) return n;  // an early return pops the range too
  return n + 1;
}

int main() {
  JEP_NVTX_RANGE("jax_ep.dispatch");
  int s = 0;
  for (int i = 0; i < 3; ++i) s += phase(i);
  std::printf("enabled=%d sum=%d\n", JEP_NVTX_ENABLED, s);
  return 0;
}
"""


def _cuda_include():
    for base in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if base and (pathlib.Path(base) / "include" / "nvtx3" / "nvToolsExt.h").exists():
            return str(pathlib.Path(base) / "include")
    nvcc = shutil.which("nvcc")
    if nvcc:
        inc = pathlib.Path(nvcc).resolve().parents[1] / "include"
        if (inc / "nvtx3" / "nvToolsExt.h").exists():
            return str(inc)
    return None


def _build_and_run(tmp_path, name, flags):
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no host C++ compiler")
    src = tmp_path / "nvtx_check.cc"
    src.write_text(_NVTX_PROGRAM)
    exe = tmp_path / name
    r = subprocess.run([cxx, "-std=c++17", "-Wall", "-Werror", f"-I{ROOT}", *flags,
                        str(src), "-o", str(exe), "-ldl"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    return run.stdout.strip()


def test_nvtx_header_with_nvtx(tmp_path):
    inc = _cuda_include()
    if inc is None:
        pytest.skip("no CUDA toolkit with NVTX v3 headers here")
    # With no profiler attached the ranges are no-ops: the program runs as without.
    assert _build_and_run(tmp_path, "with", [f"-I{inc}"]) == "enabled=1 sum=5"


def test_nvtx_header_compiled_out(tmp_path):
    inc = _cuda_include()
    flags = ["-DJAX_EP_NO_NVTX"] + ([f"-I{inc}"] if inc else [])
    assert _build_and_run(tmp_path, "without", flags) == "enabled=0 sum=5"


def test_nvtx_header_without_the_headers(tmp_path):
    # No NVTX on the include path (a build without the CUDA toolkit): compiled out.
    assert _build_and_run(tmp_path, "plain", []) == "enabled=0 sum=5"


def test_nvtx_header_under_nvcc(tmp_path):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("no nvcc")
    src = tmp_path / "nvtx_check.cu"
    src.write_text(_NVTX_PROGRAM + "\n__global__ void k(int* p) { *p = 1; }\n")
    r = subprocess.run([nvcc, "-std=c++17", f"-I{ROOT}", "-c", str(src), "-o",
                        str(tmp_path / "nvtx_check.o")],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr


def test_cuda_handlers_push_their_nvtx_ranges():
    """Every CUDA and NVSHMEM FFI handler opens a range named after its op (read back
    from the built extensions, so a handler that loses its range fails here)."""
    from jax_ep._src import ext as _ext
    info = _ext.build_info()
    if not info["cuda"]:
        pytest.skip("CPU-only build: no CUDA handlers")
    pkg = pathlib.Path(_ext.ext.__file__).parent
    blobs = b"".join(p.read_bytes() for p in pkg.glob("_jax_ep_*.so")
                     if "_emu" not in p.name)
    if b"NvtxDomain" not in blobs:
        pytest.skip("built without the NVTX headers: ranges compiled out")
    names = ["jax_ep.layout", "jax_ep.dispatch", "jax_ep.combine", "jax_ep.gather",
             "jax_ep.low_latency.dispatch_send", "jax_ep.low_latency.combine_recv"]
    if info["nvshmem"]:
        names += ["jax_ep.internode.dispatch", "jax_ep.internode.hierarchical.combine",
                  "jax_ep.internode.low_latency.dispatch_recv"]
    missing = [n for n in names if n.encode() + b"\0" not in blobs]
    assert not missing, f"handlers without their NVTX range: {missing}"
