"""A jitted training step in the global view: sharded parameters, sharded tokens,
`jax_ep.sharded` dispatch/combine, no shard_map. Run: python examples/global_view_step.py"""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402

import jax_ep.sharded as ep  # noqa: E402

mesh = jax.make_mesh((2, 4), ("data", "expert"), axis_types=(AxisType.Auto,) * 2)
E, H, F, N, K = 16, 64, 128, 512, 2
R = mesh.shape["expert"]
params = {
    "router": jax.random.normal(jax.random.key(2), (H, E)) * 0.1,
    "w_in": jax.random.normal(jax.random.key(0), (E, H, F)) * 0.05,   # experts over "expert"
    "w_out": jax.random.normal(jax.random.key(1), (E, F, H)) * 0.05,
}
shard = {"router": P(), "w_in": P("expert"), "w_out": P("expert")}
opt = optax.adam(1e-2)


def my_grouped_experts(params, recv_x, recv_idx, recv_w):
    """Dense stand-in for a grouped matmul: row n of block s belongs to EP rank s % R."""
    rows = recv_x.shape[0]
    capacity = rows // (mesh.shape["data"] * R)
    rank = (jnp.arange(rows) // capacity) % R
    global_id = jnp.where(recv_idx >= 0, rank[:, None] * (E // R) + recv_idx, -1)
    gate = jnp.sum(recv_w[:, :, None] * jax.nn.one_hot(global_id, E), axis=1)  # [rows, E]
    h = jax.nn.gelu(jnp.einsum("nh,ehf->nef", recv_x, params["w_in"]))
    return jnp.einsum("nef,efh,ne->nh", h, params["w_out"], gate)


def loss_fn(params, x):                                  # x[N, H], N sharded over (data, expert)
    probs = jax.nn.softmax(x @ params["router"])
    w, idx = jax.lax.top_k(probs, K)
    recv_x, recv_idx, recv_w, handle = ep.dispatch(x, idx.astype(jnp.int32), w,
                                                   num_experts=E, mesh_axis="expert")
    y = my_grouped_experts(params, recv_x, recv_idx, recv_w)          # [S * C, H]
    return jnp.mean((ep.combine(y, handle) - jnp.sin(x)) ** 2)


@jax.jit
def train_step(params, opt_state, x):
    loss, grads = jax.value_and_grad(loss_fn)(params, x)
    updates, opt_state = opt.update(grads, opt_state)
    return optax.apply_updates(params, updates), opt_state, loss


def main(steps=20):
    with jax.set_mesh(mesh):
        p = jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), params, shard)
        x = jax.device_put(jax.random.normal(jax.random.key(3), (N, H)),
                           NamedSharding(mesh, P(("data", "expert"))))
        state = opt.init(p)
        losses = []
        for _ in range(steps):
            p, state, loss = train_step(p, state, x)
            losses.append(float(loss))
    print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} in {steps} steps")
    return losses


if __name__ == "__main__":
    main()
