"""One process of the GPU multi-process checks (tests/runtime/test_mp_cuda.py), several
of which share one GPU: real handlers, real concurrency between processes.

    python tests/runtime/mp_cuda_worker.py PID NPROC PORT OUT_DIR BACKEND MODE

BACKEND: "ffi" (intranode kernels; buffers shared through CUDA IPC on the one GPU),
"internode" (NVSHMEM, one PE per process) or "reference" (CPU, gloo: checks this
worker and its test on machines without a GPU). MODE: "ops" runs dispatch, combine and the
gradients twice and saves this process's shard of every result to OUT_DIR/procPID.npz;
"kill" runs one step, then the last process kills itself and the others run a second
step, which must end in the timeout error (OUT_DIR/procPID.json), not hang.

Importing this module only defines the shapes, the inputs and the per-shard program, so
the test can compute the same thing on CPU devices as the oracle.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time

T, H, K = 24, 64, 3
CAPACITY = 36  # below the worst case R * T: rank 0 drops rows


def mps_env(env: dict, nproc: int) -> dict:
    """`env` for nproc processes sharing one GPU (jax_ep._src.launch.mps_share)."""
    from jax_ep._src.launch import mps_share
    return mps_share(env, nproc)


def experts(nproc: int) -> int:
    return 4 * nproc


def global_inputs(nproc: int, seed: int = 20261202):
    """x[R*T, H], idx/w[R*T, K], y[R*C, H], g[R*T, H] (cotangent of combine's output),
    cw[R*C, K] (cotangent of recv_topk_weights); float32."""
    import numpy as np

    R, E, C = nproc, experts(nproc), CAPACITY
    rng = np.random.default_rng(seed + R)
    idx = np.stack([rng.choice(E, K, replace=False) for _ in range(R * T)]).astype(np.int32)
    idx[rng.random(idx.shape) < 0.2] = -1
    idx[: T // 2, 0] = 0                  # rank 0 receives more than C: some rows dropped
    if R > 2:
        idx[2 * T:3 * T] = -1             # rank 2 sends nothing (an empty rank)
    f = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    return dict(x=f(R * T, H), idx=idx, w=rng.random((R * T, K)).astype(np.float32),
                y=f(R * C, H), g=f(R * T, H), cw=f(R * C, K))


def shard_fn(E: int, C: int, backend: str):
    """Per-shard program: forward outputs and the gradients of a loss whose backward
    pass is pure EP data movement (no reductions XLA could order differently)."""
    import jax
    import jax.numpy as jnp

    import jax_ep

    def f(x, idx, w, y, g, cw):
        rx, ri, rw, h = jax_ep.dispatch(x, idx, w, num_experts=E, axis_name="ep",
                                        capacity=C, backend=backend)
        out = jax_ep.combine(y, h, backend=backend)

        def loss(x, w):
            rx2, _, rw2, h2 = jax_ep.dispatch(x, idx, w, num_experts=E, axis_name="ep",
                                              capacity=C, backend=backend)
            return (jnp.sum(jax_ep.combine(rx2, h2, backend=backend) * g)
                    + jnp.sum(rw2 * cw))

        dx, dw = jax.grad(loss, argnums=(0, 1))(x, w)
        return dict(recv_x=rx, recv_idx=ri, recv_w=rw, num_recv=h.num_recv[None],
                    num_dropped=h.num_dropped[None], src_rank=h.src_rank,
                    src_index=h.src_index, send_row=h.send_row, out=out, dx=dx, dw=dw)

    return f


def start_distributed(pid, nproc, port, backend):
    """jax.distributed for one worker: every process on GPU 0 (they share it), or, for the
    reference backend, CPU devices with gloo collectives. Returns the jax module."""
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    if backend == "reference":
        os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    if backend == "reference":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=nproc,
                               process_id=pid,
                               local_device_ids=None if backend == "reference" else [0],
                               initialization_timeout=60)
    return jax


def main(argv):
    pid, nproc, port, out_dir, backend, mode = (int(argv[1]), int(argv[2]), int(argv[3]),
                                               argv[4], argv[5], argv[6])
    t0 = time.monotonic()
    jax = start_distributed(pid, nproc, port, backend)
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jax_ep

    R, E, C = nproc, experts(nproc), CAPACITY
    mesh = jax.make_mesh((R,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices())
    if backend == "internode":
        jax_ep.nvshmem_bootstrap.initialize(max_tokens=T, hidden=H, topk=K, capacity=C,
                                            x_dtype="float32", y_dtype="float32")
    elif backend == "ffi":
        jax_ep.cuda.setup(mesh, "ep", num_tokens=T, hidden=H, topk=K, dtype=np.float32,
                          capacity=C)
    inputs = global_inputs(nproc)
    sharding = NamedSharding(mesh, P("ep"))

    def put(a):  # each process supplies the rows of its own shard, wherever it is
        return jax.make_array_from_callback(a.shape, sharding, lambda index: a[index])

    args = [put(inputs[k]) for k in ("x", "idx", "w", "y", "g", "cw")]
    prog = jax.jit(jax.shard_map(shard_fn(E, C, backend), mesh=mesh, in_specs=P("ep"),
                                 out_specs=P("ep")))

    # Compile everywhere first, so no process waits in a kernel for a peer still compiling.
    try:
        prog = prog.lower(*args).compile()
    except NotImplementedError as e:  # e.g. an internode mode the kernels do not have yet
        with open(os.path.join(out_dir, f"proc{pid}.json"), "w") as f:
            json.dump({"not_implemented": str(e)}, f)
        print(f"process {pid}: not implemented: {e}", flush=True)
        os._exit(3)
    from jax._src import distributed
    distributed.global_state.client.wait_at_barrier("mp_cuda_worker_compiled", 60_000)

    def step():
        """This process's shard of every result, keyed name@first global row."""
        res = prog(*args)
        jax.block_until_ready(res)
        out = {}
        for k, v in res.items():
            sh = v.addressable_shards[0]
            out[f"{k}@{sh.index[0].start or 0}"] = np.asarray(sh.data)
        return out

    def check():
        if backend == "internode":
            from jax_ep._src.backends import internode
            if hasattr(internode, "check_errors"):
                internode.check_errors()
        elif backend == "ffi":
            jax_ep.cuda.check_errors()

    first = step()
    check()
    if mode == "ops":
        second = step()  # epochs advance, buffers are reused
        check()
        same = all(np.array_equal(first[k].view(np.uint8), second[k].view(np.uint8))
                   for k in first)
        np.savez(os.path.join(out_dir, f"proc{pid}.npz"), repeat_identical=same, **second)
        print(f"process {pid}: done in {time.monotonic() - t0:.1f} s", flush=True)
        os._exit(0)  # the coordinator's shutdown barrier is not needed

    # mode == "kill": the last process dies between two steps; the others must fail.
    if pid == nproc - 1:
        print(f"process {pid}: killing itself after step 1", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(1.0)
    t1 = time.monotonic()
    step()
    msg = ""
    try:
        check()
    except RuntimeError as e:
        msg = str(e)
    with open(os.path.join(out_dir, f"proc{pid}.json"), "w") as f:
        json.dump({"error": msg, "step2_s": time.monotonic() - t1}, f)
    print(f"process {pid}: step 2 ended ({'error: ' + msg if msg else 'no error'})",
          flush=True)
    os._exit(0)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))))
    main(sys.argv)
