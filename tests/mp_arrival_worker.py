"""One process of tests/test_multiprocess_arrival.py: 2 processes x 4 CPU devices form
one 8-rank EP axis (backend 'auto' resolves to the reference there); every EP call waits
for the arrival barrier (jax_ep/_src/arrival.py) before its collectives.

Run as: python tests/mp_arrival_worker.py PROCESS_ID NUM_PROCESSES PORT OUT_DIR SCENARIO
SCENARIO:
  late      both make a good dispatch + combine; process 0 makes a second one, process 1
            skips it and sleeps past JAX_EP_TIMEOUT_S; process 1's next call finds that
            round given up and fails at once; then both make one more call, which works.
  mismatch  both make a good call; then process 1 calls with more tokens per rank than
            process 0; both fail with the mismatch named; then both make a good call.
Each process writes what it saw to OUT_DIR/arrival<ID>.json.
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback

R, K, E, H = 8, 2, 16, 3
DEVICES_PER_PROCESS = 4
GOOD_T, OTHER_T = 5, 6


def inputs(T):
    import numpy as np

    rng = np.random.default_rng(7)
    return dict(x=rng.standard_normal((R * T, H)).astype(np.float32),
                idx=rng.integers(-1, E, (R * T, K)).astype(np.int32),
                w=rng.random((R * T, K)).astype(np.float32))


def program(mesh):
    import jax
    from jax.sharding import PartitionSpec as P

    import jax_ep

    def step(x, idx, w):
        rx, _, _, h = jax_ep.dispatch(x, idx, w, num_experts=E, axis_name="ep")
        return jax_ep.combine(rx * 2.0, h)

    return jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))


def main(argv):
    pid, nproc, port, out_dir, scenario = (int(argv[1]), int(argv[2]), int(argv[3]),
                                           argv[4], argv[5])
    import mp_init

    jax = mp_init.start(pid, nproc, port, DEVICES_PER_PROCESS)
    import numpy as np

    import jax_ep  # noqa: F401  (before the CPU client exists: its thread pool)

    timeout = float(os.environ["JAX_EP_TIMEOUT_S"])
    mesh = jax.make_mesh((R,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("ep"))
    f = program(mesh)

    def args(T):
        g = inputs(T)
        return [jax.make_array_from_callback(g[k].shape, sharding, lambda i, a=g[k]: a[i])
                for k in ("x", "idx", "w")]

    # Compiled up front, so no call waits for a peer's compilation.
    Ts = (GOOD_T, OTHER_T) if scenario == "mismatch" and pid == 1 else (GOOD_T,)
    arrays = {T: args(T) for T in Ts}
    compiled = {T: f.lower(*arrays[T]).compile() for T in Ts}

    def local(out):
        return {s.index[0].start or 0: np.asarray(s.data) for s in out.addressable_shards}

    def call(T):
        """(seconds, None or the error's text, the result) of one call, waited for."""
        t0 = time.monotonic()
        try:
            out = compiled[T](*arrays[T])
            out.block_until_ready()
            return time.monotonic() - t0, None, out
        except Exception as e:  # noqa: BLE001 - the callback's error, wrapped by JAX
            return time.monotonic() - t0, f"{type(e).__name__}: {e}", None

    report = {"pid": pid}
    marker = os.path.join(out_dir, "p0_failed")
    secs, err, first = call(GOOD_T)
    report["first"] = {"secs": secs, "error": err}
    if scenario == "late":
        if pid == 0:
            secs, err, _ = call(GOOD_T)
            report["missed"] = {"secs": secs, "error": err}
            open(marker, "w").close()
        else:
            time.sleep(timeout + 2)  # alive, but never making that call
            for _ in range(600):  # and until process 0 has seen its error
                if os.path.exists(marker):
                    break
                time.sleep(0.1)
            secs, err, _ = call(GOOD_T)
            report["late"] = {"secs": secs, "error": err}
    elif scenario == "mismatch":
        secs, err, _ = call(OTHER_T if pid == 1 else GOOD_T)
        report["mismatch"] = {"secs": secs, "error": err}
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")
    secs, err, again = call(GOOD_T)
    report["after"] = {"secs": secs, "error": err}
    if first is not None and again is not None:
        a, b = local(first), local(again)
        report["after"]["same_result"] = (sorted(a) == sorted(b) and all(
            np.array_equal(a[k], b[k]) for k in a))
    with open(os.path.join(out_dir, f"arrival{pid}.json"), "w") as fh:
        json.dump(report, fh, indent=1)
    jax.distributed.shutdown()


if __name__ == "__main__":
    try:
        main(sys.argv)
    except BaseException:
        traceback.print_exc()
        raise
