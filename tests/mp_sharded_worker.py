"""Worker for test_multiprocess_sharded: one of 2 processes x 4 CPU devices running the
global-view ops over an 8-way EP axis that spans both processes (backend auto)."""
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

try:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
except AttributeError:  # older/newer JAX picks gloo by default
    pass

import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402


def main():
    addr, pid, out_path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    jax.distributed.initialize(coordinator_address=addr, num_processes=2, process_id=pid,
                               initialization_timeout=60)
    import jax_ep.sharded as sh
    from tests_mp_inputs import E, inputs, global_step

    x_np, idx_np, w_np = inputs()
    mesh = jax.make_mesh((8,), ("expert",), axis_types=(AxisType.Auto,))
    sharding = NamedSharding(mesh, P("expert"))

    def put(a):
        return jax.make_array_from_callback(a.shape, sharding, lambda i: a[i])

    with jax.set_mesh(mesh):
        outs = jax.jit(global_step(sh, "auto"))(put(x_np), put(idx_np), put(w_np))
        outs = [multihost_utils.process_allgather(o, tiled=True) for o in outs]
    if pid == 0:
        np.savez(out_path, *[np.asarray(o) for o in outs])
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
