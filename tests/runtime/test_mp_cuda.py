"""Several processes on one GPU (scripts/gpu_check.sh stages 3 and 4; marked `gpu`,
skipped without a GPU): the real handlers with real concurrency between processes,
bit-exact against the CPU ffi backend run here on CPU devices, and a killed process
whose peers end in the timeout error instead of hanging.

Stage 3 (intranode, "ffi"): buffers shared through CUDA IPC between processes on the
same GPU (under CUDA MPS when gpu_check.sh could start it). Stage 4 ("internode"): one
NVSHMEM PE per process, several PEs on the one GPU; skipped when the build has no NVSHMEM.
"""
from __future__ import annotations

import json
import os
import sys

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jax_ep._src import ext as _ext

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import mp_cuda_worker as W  # noqa: E402
from mp_launch import free_port, run_workers, worker_env  # noqa: E402

LAUNCH_TIMEOUT_S = 90


def _gpus():
    try:
        return jax.devices("gpu")
    except RuntimeError:
        return []


NO_GPU = "no NVIDIA GPU visible to JAX here; scripts/gpu_check.sh runs this on a GPU machine"
needs_gpu = pytest.mark.skipif(not _gpus() or not _ext.build_info()["cuda"], reason=NO_GPU)
needs_nvshmem = pytest.mark.skipif(
    not _ext.build_info()["nvshmem"],
    reason="this build has no NVSHMEM internode backend (build_info()['nvshmem'] is False)")
pytestmark = [pytest.mark.slow]
gpu = pytest.mark.gpu


def _launch(tmp_path, nproc, backend, mode, timeout_s="30", internode_mode=None):
    port = free_port()
    env = W.mps_env(worker_env(timeout_s), nproc)
    if backend == "internode":
        env.setdefault("NVSHMEM_REMOTE_TRANSPORT", "none")  # one node: peer-to-peer only
        if internode_mode:
            env["JAX_EP_INTERNODE_MODE"] = internode_mode
        if internode_mode == "hierarchical":
            env["JAX_EP_GPUS_PER_NODE"] = "2"  # virtual nodes of 2 PEs on the one GPU
    argvs = [[sys.executable, os.path.join(HERE, "mp_cuda_worker.py"), str(pid), str(nproc),
              str(port), str(tmp_path), backend, mode] for pid in range(nproc)]
    return run_workers(tmp_path, argvs, env, LAUNCH_TIMEOUT_S)


def _cpu_oracle(nproc):
    """The same per-shard program on nproc CPU devices with the CPU ffi backend."""
    R, E, C = nproc, W.experts(nproc), W.CAPACITY
    cpu = jax.devices("cpu")
    if len(cpu) < R:
        pytest.skip(f"the CPU oracle needs {R} CPU devices (XLA_FLAGS "
                    f"--xla_force_host_platform_device_count)")
    mesh = jax.make_mesh((R,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=cpu[:R])
    inp = W.global_inputs(nproc)
    prog = jax.jit(jax.shard_map(W.shard_fn(E, C, "ffi"), mesh=mesh, in_specs=P("ep"),
                                 out_specs=P("ep")))
    sh = jax.sharding.NamedSharding(mesh, P("ep"))
    res = prog(*(jax.device_put(inp[k], sh) for k in ("x", "idx", "w", "y", "g", "cw")))
    return {k: np.asarray(v) for k, v in res.items()}


def _gathered(tmp_path, nproc):
    parts, repeat_ok = {}, []
    for pid in range(nproc):
        with np.load(tmp_path / f"proc{pid}.npz") as z:
            repeat_ok.append(bool(z["repeat_identical"]))
            for key in z.files:
                if "@" in key:
                    name, start = key.split("@")
                    parts.setdefault(name, {})[int(start)] = z[key]
    return {n: np.concatenate([c[r] for r in sorted(c)]) for n, c in parts.items()}, repeat_ok


def _check_against_oracle(tmp_path, nproc, backend, internode_mode=None):
    procs, hung, logs = _launch(tmp_path, nproc, backend, "ops", internode_mode=internode_mode)
    assert not hung, f"processes {hung} still running after {LAUNCH_TIMEOUT_S} s\n{logs}"
    if all(p.returncode == 3 for p in procs):
        with open(tmp_path / "proc0.json") as f:
            pytest.skip(f"{backend} mode {internode_mode}: {json.load(f)['not_implemented']}")
    assert all(p.returncode == 0 for p in procs), logs
    got, repeat_ok = _gathered(tmp_path, nproc)
    assert all(repeat_ok), f"a second run differed from the first: {repeat_ok}\n{logs}"
    want = _cpu_oracle(nproc)
    assert set(got) == set(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
        bad = np.flatnonzero(got[k].view(np.uint8) != want[k].view(np.uint8))
        assert bad.size == 0, f"{backend} R={nproc}: {k} differs from the CPU oracle\n{logs}"


def test_worker_and_oracle_on_cpu(tmp_path):
    """The worker, its launch and the comparison, with the reference backend on CPU
    processes (gloo): what the GPU stages rely on, checked where no GPU is."""
    _check_against_oracle(tmp_path, 2, "reference")


@gpu
@needs_gpu
@pytest.mark.parametrize("nproc", [2, 4])
def test_processes_sharing_a_gpu_match_the_cpu_oracle(tmp_path, nproc):
    _check_against_oracle(tmp_path, nproc, "ffi")


@gpu
@needs_gpu
def test_killed_process_ends_in_timeout_not_hang(tmp_path):
    nproc = 3
    procs, hung, logs = _launch(tmp_path, nproc, "ffi", "kill", timeout_s="5")
    assert not hung, f"processes {hung} hung after a peer died\n{logs}"
    for pid in range(nproc - 1):
        assert procs[pid].returncode == 0, logs
        with open(tmp_path / f"proc{pid}.json") as f:
            res = json.load(f)
        assert "timed out" in res["error"] or "had an error" in res["error"], (res, logs)


@gpu
@needs_gpu
@needs_nvshmem
@pytest.mark.parametrize("nproc,mode", [(2, "direct"), (4, "direct"), (4, "hierarchical")])
def test_internode_pes_sharing_a_gpu_match_the_cpu_oracle(tmp_path, nproc, mode):
    """Every internode mode (JAX_EP_INTERNODE_MODE); one the kernels do not have is
    skipped with the library's NotImplementedError message."""
    _check_against_oracle(tmp_path, nproc, "internode", internode_mode=mode)
