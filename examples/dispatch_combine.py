"""Route random tokens across 8 CPU devices with jax_ep.dispatch / jax_ep.combine.

Run with `make demo`, or:
  XLA_FLAGS=--xla_force_host_platform_device_count=8 python examples/dispatch_combine.py

Each rank draws tokens and a skewed top-k routing (a few experts are popular), sends each
token to the ranks holding its experts, and brings them back. The table shows, per rank,
what it sent and received, what did not fit in the capacity, and the load of its local
experts. The round trip combine(recv_x) must give each token times the number of ranks
that kept it; the ffi and reference backends must agree bit for bit.
"""
from __future__ import annotations

import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_ep  # noqa: E402

R = 8            # ranks on the EP axis
T = 64           # tokens per rank
H = 32           # hidden size
K = 2            # experts per token
E = 32           # experts in all (4 per rank)
CAPACITY = 96    # rows each rank can receive (the worst case would be R * T = 512)


def route(rng):
    """topk_idx[R*T, K]: K distinct experts per token, popular ones more often; a few
    tokens use only one slot."""
    popularity = 1.0 / np.arange(1, E + 1) ** 0.8
    p = rng.permutation(popularity) / popularity.sum()
    idx = np.stack([rng.choice(E, size=K, replace=False, p=p) for _ in range(R * T)])
    idx[rng.random(R * T) < 0.1, K - 1] = -1
    return idx.astype(np.int32)


def build(mesh, backend):
    def per_rank(x, idx, w):
        layout = jax_ep.get_dispatch_layout(idx, num_experts=E, num_ranks=R, backend=backend)
        rx, ri, rw, h = jax_ep.dispatch(x, idx, w, num_experts=E, axis_name="ep",
                                        capacity=CAPACITY, backend=backend)
        back = jax_ep.combine(rx, h, backend=backend)
        kept = jnp.sum(h.send_row >= 0, axis=1)  # ranks that kept each token
        return dict(sent=jnp.sum(layout.num_tokens_per_rank)[None], num_recv=h.num_recv[None],
                    num_dropped=h.num_dropped[None],
                    load=h.num_recv_tokens_per_expert[None], back=back, kept=kept,
                    recv_x=rx)

    return jax.jit(jax.shard_map(per_rank, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))


def main():
    mesh = jax.make_mesh((R,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((R * T, H)).astype(np.float32)
    idx = route(rng)
    w = rng.random((R * T, K)).astype(np.float32)

    backend = jax_ep.resolve_backend("auto")
    print(f"jax-ep {jax_ep.__version__}  build {jax_ep.build_info()}")
    print(f"{R} ranks on {jax.devices()[0].platform}, T={T} tokens/rank, H={H}, K={K}, "
          f"E={E} ({E // R}/rank), capacity={CAPACITY}, backend auto -> {backend}\n")
    res = {k: np.asarray(v) for k, v in build(mesh, backend)(x, idx, w).items()}

    el = E // R
    head = (f"{'rank':>4} | {'sent':>5} | {'received':>8} | {'dropped':>7} | "
            f"local expert load (experts {el}r .. {el}r+{el - 1})")
    print(head)
    print("-" * len(head))
    for r in range(R):
        load = " ".join(f"{v:4d}" for v in res["load"][r])
        print(f"{r:>4} | {res['sent'][r]:>5} | {res['num_recv'][r]:>8} | "
              f"{res['num_dropped'][r]:>7} | {load}")
    print("-" * len(head))
    print(f" all | {res['sent'].sum():>5} | {res['num_recv'].sum():>8} | "
          f"{res['num_dropped'].sum():>7} | {res['load'].sum():4d} slots kept")

    # combine(recv_x) sums each token's kept copies: x times the number of keepers.
    want = x * res["kept"][:, None].astype(np.float32)
    err = float(np.max(np.abs(res["back"] - want)))
    print(f"\nround trip combine(dispatch(x)) vs x * (ranks that kept it): "
          f"max abs error {err:.3g}")
    tokens_lost = int(np.sum(res["kept"] == 0) - np.sum(np.all(idx < 0, axis=1)))
    print(f"tokens routed somewhere but kept nowhere (capacity): {tokens_lost}")

    other = "reference" if backend == "ffi" else None
    if other:
        ref = {k: np.asarray(v) for k, v in build(mesh, other)(x, idx, w).items()}
        same = all(np.array_equal(res[k], ref[k]) for k in res)
        print(f"{backend} vs {other}: {'bit for bit equal' if same else 'DIFFERENT'}")
        if not same:
            raise SystemExit(1)
    if err != 0.0:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
