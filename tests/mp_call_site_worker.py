"""One process of tests/test_call_site.py: lowers a training step with EP calls (ffi
backend, 4 CPU devices) and writes the call-site ids of its EP custom calls, in program
order, to OUT_DIR/sites<ID>.json. With EXTRA=1 it first traces and lowers an evaluation
function with EP calls of its own, as a rank-0-only evaluation would.

Run as: python tests/mp_call_site_worker.py PROCESS_ID EXTRA OUT_DIR
"""
from __future__ import annotations

import json
import os
import re
import sys

R, T, K, E, H = 4, 6, 2, 8, 8


def _sites(hlo: str) -> list[int]:
    return [int(m) for m in re.findall(r"call_site = (-?\d+)", hlo)]


def main(argv):
    pid, extra, out_dir = int(argv[1]), argv[2] == "1", argv[3]
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={R}"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    import jax_ep

    mesh = jax.make_mesh((R,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,))
    x = jnp.ones((R * T, H), jnp.float32)
    idx = jnp.zeros((R * T, K), jnp.int32)
    w = jnp.ones((R * T, K), jnp.float32)

    def layer(x, idx, w):
        rx, _, _, h = jax_ep.dispatch(x, idx, w, num_experts=E, axis_name="ep",
                                      backend="ffi")
        return jax_ep.combine(rx * 2.0, h, backend="ffi")

    def ep(f):
        return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))

    def evaluate(x, idx, w):
        return layer(x, idx, w) + 1.0

    def train(x, idx, w):
        for _ in range(2):  # two layers: one source line, two EP calls each
            x = layer(x, idx, w)
        return x

    eval_sites = []
    if extra:
        eval_sites = _sites(ep(evaluate).lower(x, idx, w).as_text())
    train_sites = _sites(ep(train).lower(x, idx, w).as_text())
    with open(os.path.join(out_dir, f"sites{pid}.json"), "w") as f:
        json.dump({"eval": eval_sites, "train": train_sites}, f)


if __name__ == "__main__":
    main(sys.argv)
