"""The low-latency mode on CUDA real ranks with several processes on one GPU (buffers
shared through CUDA IPC, ranks at their own pace): split halves, the FP8 dispatch (cast
in the send kernel) and the gradients (one-slot staging), three steps in a row, bit-exact
against the reference backend on CPU devices. Marked `gpu` (skipped without one) and
`slow`; the worker and the comparison also run here with the reference backend on CPU
processes (gloo), so what a GPU run relies on is checked where no GPU is.

    python tests/runtime/test_cuda_low_latency_mp.py PID NPROC PORT OUT_DIR BACKEND

runs one worker process (BACKEND "ffi" on the GPU, "reference" on CPU).
"""
from __future__ import annotations

import os
import sys

T, M, H, K = 6, 8, 128, 3
STEPS = 3
LAUNCH_TIMEOUT_S = 120


def experts(nproc: int) -> int:
    return 2 * nproc


def global_inputs(nproc: int, step: int):
    """x[R*T, H], idx/w[R*T, K], y[R*E_local, R*M, H], g[R*T, H]; float32."""
    import numpy as np

    R, E = nproc, experts(nproc)
    rng = np.random.default_rng(1000 * step + R)
    idx = np.stack([rng.permutation(E)[:K] for _ in range(R * T)]).astype(np.int32)
    idx[rng.random(idx.shape) < 0.2] = -1
    if step == 1:
        idx[:T] = np.arange(K, dtype=np.int32)  # rank 0's tokens all name experts 0..K-1
    f = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    return dict(x=f(R * T, H), idx=idx, w=rng.random((R * T, K)).astype(np.float32),
                y=f(E, R * M, H), g=f(R * T, H))


def shard_fn(E: int, backend: str):
    import jax
    import jax.numpy as jnp

    from jax_ep import low_latency as ll

    kw = dict(num_experts=E, axis_name="ep", max_tokens_per_rank=M, backend=backend)

    def f(x, idx, w, y, g):
        recv, cnt, h = ll.dispatch_recv(ll.dispatch_send(x, idx, **kw))
        out = ll.combine_recv(ll.combine_send(y, idx, w, h, backend=backend))
        (q, s), _, _ = ll.dispatch_recv(ll.dispatch_send(x, idx, fp8=True, **kw))

        def loss(x, w):
            r, _, hh = ll.dispatch(x, idx, **kw)
            return jnp.sum(ll.combine(r * 2.0, idx, w, hh, backend=backend) * g)

        dx, dw = jax.grad(loss, argnums=(0, 1))(x, w)
        return dict(recv=recv, count=cnt, src_rank=h.src_rank, src_index=h.src_index,
                    first_row=h.first_row, row_count=h.row_count, out=out,
                    q=jax.lax.bitcast_convert_type(q, jnp.uint8), s=s, dx=dx, dw=dw)

    return f


def main(argv):
    pid, nproc, port, out_dir, backend = (int(argv[1]), int(argv[2]), int(argv[3]), argv[4],
                                          argv[5])
    from mp_cuda_worker import start_distributed  # beside this file

    jax = start_distributed(pid, nproc, port, backend)
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jax_ep

    R, E = nproc, experts(nproc)
    mesh = jax.make_mesh((R,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices())
    if backend == "ffi":
        jax_ep.cuda.setup(mesh, "ep", num_tokens=None, hidden=H, topk=K, dtype=np.float32,
                          max_tokens_per_rank=M, num_experts=E)
    sharding = NamedSharding(mesh, P("ep"))
    prog = jax.jit(jax.shard_map(shard_fn(E, backend), mesh=mesh, in_specs=P("ep"),
                                 out_specs=P("ep")))
    keys = ("x", "idx", "w", "y", "g")

    def args(step):
        inp = global_inputs(nproc, step)
        return [jax.make_array_from_callback(inp[k].shape, sharding,
                                             lambda index, a=inp[k]: a[index]) for k in keys]

    compiled = prog.lower(*args(0)).compile()
    from jax._src import distributed
    distributed.global_state.client.wait_at_barrier("ll_mp_compiled", 60_000)
    out = {}
    for step in range(STEPS):
        res = compiled(*args(step))
        jax.block_until_ready(res)
        if backend == "ffi":
            jax_ep.cuda.check_errors()
        for k, v in res.items():
            sh = v.addressable_shards[0]
            out[f"{k}@{step}@{sh.index[0].start or 0}"] = np.asarray(sh.data)
    np.savez(os.path.join(out_dir, f"proc{pid}.npz"), **out)
    print(f"process {pid}: done", flush=True)
    os._exit(0)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))))
    main(sys.argv)


# ----------------------------------------------------------------------------- tests

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jax_ep._src import ext as _ext  # noqa: E402
from mp_launch import free_port, run_workers, worker_env  # noqa: E402


def _gpus():
    try:
        return jax.devices("gpu")
    except RuntimeError:
        return []


pytestmark = [pytest.mark.slow]
needs_gpu = pytest.mark.skipif(
    not _gpus() or not _ext.build_info()["cuda"],
    reason="no NVIDIA GPU visible to JAX here; run it on a GPU machine")


def _launch(tmp_path, nproc, backend):
    port = free_port()
    argvs = [[sys.executable, os.path.abspath(__file__), str(pid), str(nproc), str(port),
              str(tmp_path), backend] for pid in range(nproc)]
    from mp_cuda_worker import mps_env  # each process's share of the GPU under MPS
    return run_workers(tmp_path, argvs, mps_env(worker_env("30"), nproc), LAUNCH_TIMEOUT_S)


def _oracle(nproc, step):
    """The per-shard program on nproc CPU devices with the reference backend."""
    cpu = jax.devices("cpu")
    if len(cpu) < nproc:
        pytest.skip(f"the oracle needs {nproc} CPU devices (XLA_FLAGS "
                    "--xla_force_host_platform_device_count)")
    mesh = jax.make_mesh((nproc,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=cpu[:nproc])
    prog = jax.jit(jax.shard_map(shard_fn(experts(nproc), "reference"), mesh=mesh,
                                 in_specs=P("ep"), out_specs=P("ep")))
    sh = jax.sharding.NamedSharding(mesh, P("ep"))
    inp = global_inputs(nproc, step)
    res = prog(*(jax.device_put(inp[k], sh) for k in ("x", "idx", "w", "y", "g")))
    return {k: np.asarray(v) for k, v in res.items()}


def _check(tmp_path, nproc, backend):
    procs, hung, logs = _launch(tmp_path, nproc, backend)
    assert not hung, f"processes {hung} still running after {LAUNCH_TIMEOUT_S} s\n{logs}"
    assert all(p.returncode == 0 for p in procs), logs
    parts = {}
    for pid in range(nproc):
        with np.load(tmp_path / f"proc{pid}.npz") as z:
            for key in z.files:
                name, step, start = key.split("@")
                parts.setdefault((name, int(step)), {})[int(start)] = z[key]
    for step in range(STEPS):
        want = _oracle(nproc, step)
        for name, v in want.items():
            chunks = parts[(name, step)]
            got = np.concatenate([chunks[r] for r in sorted(chunks)])
            assert got.dtype == v.dtype and got.shape == v.shape, (name, step)
            assert got.tobytes() == v.tobytes(), f"{backend} R={nproc} step {step}: {name}"


def test_worker_and_oracle_on_cpu_processes(tmp_path):
    _check(tmp_path, 2, "reference")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("nproc", [2, 4])
def test_processes_sharing_a_gpu_match_the_reference(tmp_path, nproc):
    _check(tmp_path, nproc, "ffi")
