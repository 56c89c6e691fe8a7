"""Inputs and the step shared by the multi-process global-view test and its worker."""
import numpy as np

E, K, H, N = 16, 2, 8, 64


def inputs():
    rng = np.random.default_rng(123)
    x = rng.standard_normal((N, H)).astype(np.float32)
    idx = rng.integers(-1, E, (N, K)).astype(np.int32)
    w = rng.random((N, K)).astype(np.float32)
    return x, idx, w


def global_step(sh, backend):
    import jax
    import jax.numpy as jnp

    def step(x, idx, w):
        def loss(x, w):
            rx, ri, rw, h = sh.dispatch(x, idx, w, num_experts=E, mesh_axis="expert",
                                        capacity=10, backend=backend)
            out = sh.combine(rx * jnp.sum(rw, 1, keepdims=True), h, backend=backend)
            return jnp.sum(out * out), (rx, h.num_recv, h.num_dropped, out)
        (l, (rx, nr, nd, out)), (gx, gw) = jax.value_and_grad(loss, argnums=(0, 1),
                                                               has_aux=True)(x, w)
        return rx, nr, nd, out, gx, gw
    return step
