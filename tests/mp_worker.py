"""One process of the multi-process test (tests/test_multiprocess.py).

Run as: python tests/mp_worker.py PROCESS_ID NUM_PROCESSES PORT OUT_DIR
Each process has 4 CPU devices; together they form one 8-rank EP axis. The process runs
dispatch + combine with backend 'auto' on a deterministic global input and writes its
addressable shards of every output to OUT_DIR/proc<ID>.npz. Importing this module only
defines the inputs and the program, so the test can compute the 1-process result.
"""
from __future__ import annotations

import os
import sys

R, T, K, E, H, C = 8, 5, 2, 16, 3, 9  # C < the worst case: some rows are dropped
DEVICES_PER_PROCESS = 4


def global_inputs():
    import numpy as np

    rng = np.random.default_rng(1234)
    idx = rng.integers(-1, E, (R * T, K)).astype(np.int32)
    idx[: 2 * T, 0] = 0  # ranks 0-1 all also send to rank 0: overflow there
    return dict(x=rng.standard_normal((R * T, H)).astype(np.float32), idx=idx,
                w=rng.random((R * T, K)).astype(np.float32),
                y=rng.standard_normal((R * C, H)).astype(np.float32))


def program(mesh, backend):
    import jax
    from jax.sharding import PartitionSpec as P

    import jax_ep

    def f(x, idx, w, y):
        rx, ri, rw, h = jax_ep.dispatch(x, idx, w, num_experts=E, axis_name="ep",
                                        capacity=C, backend=backend)
        out = jax_ep.combine(y, h, backend=backend)
        # The round trip of the received rows too.
        back = jax_ep.combine(rx * 2.0, h, backend=backend)
        return dict(recv_x=rx, recv_idx=ri, recv_w=rw, num_recv=h.num_recv[None],
                    num_dropped=h.num_dropped[None], src_rank=h.src_rank,
                    src_index=h.src_index, send_row=h.send_row, out=out, back=back)

    return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))


def main(argv):
    pid, nproc, port, out_dir = int(argv[1]), int(argv[2]), int(argv[3]), argv[4]
    import mp_init

    jax = mp_init.start(pid, nproc, port, DEVICES_PER_PROCESS)
    import numpy as np

    import jax_ep

    assert jax.process_count() == nproc and len(jax.devices()) == R, jax.devices()
    resolved = jax_ep.resolve_backend("auto")
    try:
        jax_ep.resolve_backend("ffi")
        ffi_refused = False
    except NotImplementedError:
        ffi_refused = True

    mesh = jax.make_mesh((R,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("ep"))
    g = global_inputs()
    arrays = [jax.make_array_from_callback(g[k].shape, sharding, lambda i, a=g[k]: a[i])
              for k in ("x", "idx", "w", "y")]
    res = program(mesh, "auto")(*arrays)
    saved = {"resolved": np.array(resolved), "ffi_refused": np.array(ffi_refused)}
    for name, arr in res.items():
        for shard in arr.addressable_shards:
            start = shard.index[0].start or 0
            saved[f"{name}@{start}"] = np.asarray(shard.data)
    np.savez(os.path.join(out_dir, f"proc{pid}.npz"), **saved)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv)
