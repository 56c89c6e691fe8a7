"""Global view (jax_ep.sharded): equal to the per-shard ops bit for bit on 1-, 2- and
3-axis meshes, partitioned into the EP custom calls with no all-gather of tokens."""
import re

import jax
import jax.test_util  # noqa: F401  (check_grads)
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jax_ep
import jax_ep.sharded as sh

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (virtual) devices")

E, K, H = 16, 3, 8

MESHES = {
    "expert": ((8,), ("expert",)),
    "data_expert": ((2, 4), ("data", "expert")),
    "data_expert_tensor": ((2, 2, 2), ("data", "expert", "tensor")),
}


def _mesh(name, axis_type=AxisType.Auto):
    shape, names = MESHES[name]
    return jax.make_mesh(shape, names, axis_types=(axis_type,) * len(names))


def _inputs(n, seed=0, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((n, H)), dtype)
    idx = rng.integers(-1, E, (n, K)).astype(np.int32)
    idx[: n // 4, 0] = 0  # skew onto rank 0
    w = jnp.asarray(rng.random((n, K)), jnp.float32)
    return x, jnp.asarray(idx), w


def _token_spec(names):
    return P(tuple(a for a in names if a != "tensor"))


def _global_fn(backend, capacity):
    def f(x, idx, w):
        rx, ri, rw, h = sh.dispatch(x, idx, w, num_experts=E, mesh_axis="expert",
                                    capacity=capacity, backend=backend)
        out = sh.combine(rx * 2, h, backend=backend)
        return (rx, ri, rw, h.num_recv, h.num_dropped, h.src_rank, h.src_index,
                h.num_recv_tokens_per_expert, out)
    return f


def _per_shard_fn(backend, capacity):
    def f(x, idx, w):
        rx, ri, rw, h = jax_ep.dispatch(x, idx, w, num_experts=E, axis_name="expert",
                                        capacity=capacity, backend=backend)
        out = jax_ep.combine(rx * 2, h, backend=backend)
        return (rx, ri, rw, h.num_recv[None], h.num_dropped[None], h.src_rank, h.src_index,
                h.num_recv_tokens_per_expert, out)
    return f


@pytest.mark.parametrize("mesh_name", list(MESHES))
@pytest.mark.parametrize("backend", ["ffi", "reference"])
def test_global_equals_per_shard(mesh_name, backend):
    mesh = _mesh(mesh_name)
    spec = _token_spec(mesh.axis_names)
    x, idx, w = _inputs(64, seed=1)
    cap = 9  # small enough that some shards drop rows
    want = jax.jit(jax.shard_map(_per_shard_fn(backend, cap), mesh=mesh, in_specs=spec,
                                 out_specs=spec))(x, idx, w)
    with jax.set_mesh(mesh):
        got = jax.jit(_global_fn(backend, cap))(x, idx, w)
    for a, b in zip(want, got):
        assert a.shape == b.shape
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert int(jnp.sum(got[4])) > 0, "the case should overflow capacity somewhere"
    # Output shardings follow the token axes.
    assert got[0].sharding.is_equivalent_to(NamedSharding(mesh, spec), 2)


def test_backends_agree_globally():
    mesh = _mesh("data_expert")
    x, idx, w = _inputs(64, seed=2, dtype=jnp.bfloat16)
    with jax.set_mesh(mesh):
        a = jax.jit(_global_fn("ffi", None))(x, idx, w)
        b = jax.jit(_global_fn("reference", None))(x, idx, w)
    for u, v in zip(a, b):
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v))


def _loss(backend, capacity=12):
    def loss(x, w, idx):
        rx, ri, rw, h = sh.dispatch(x, idx, w, num_experts=E, mesh_axis="expert",
                                    capacity=capacity, backend=backend)
        y = rx * jnp.sum(rw, axis=1, keepdims=True)
        out = sh.combine(jnp.tanh(y), h, backend=backend)
        return jnp.sum(out * out)
    return loss


@pytest.mark.parametrize("mesh_name", ["expert", "data_expert_tensor"])
def test_gradients_match_reference(mesh_name):
    mesh = _mesh(mesh_name)
    x, idx, w = _inputs(64, seed=3)
    with jax.set_mesh(mesh):
        ga = jax.jit(jax.grad(_loss("ffi"), argnums=(0, 1)))(x, w, idx)
        gb = jax.jit(jax.grad(_loss("reference"), argnums=(0, 1)))(x, w, idx)
    for a, b in zip(ga, gb):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert float(jnp.abs(ga[0]).sum()) > 0 and float(jnp.abs(ga[1]).sum()) > 0


def test_gradients_numerically():
    mesh = _mesh("data_expert")
    x, idx, w = _inputs(32, seed=4)
    f = _loss("ffi", capacity=None)
    with jax.set_mesh(mesh):
        jax.test_util.check_grads(jax.jit(lambda x, w: f(x, w, idx)), (x, w), order=1,
                                  modes=("rev",), atol=2e-2, rtol=2e-2)


def _collectives(text):
    return {op: len(re.findall(rf"\b{op}(-start)?\(", text))
            for op in ("all-gather", "all-to-all", "all-reduce")}


def test_compiled_step_has_custom_calls_and_no_all_gather():
    """A jitted training step (forward and backward) on sharded parameters: the EP custom
    calls are there, and no collective gathers token tensors."""
    mesh = _mesh("data_expert")
    x, idx, w = _inputs(64, seed=5)
    rng = np.random.default_rng(0)
    params = jnp.asarray(rng.standard_normal((E // 4 * 4, H, H)) * 0.1, jnp.float32)

    def step(params, x, w, idx):
        def loss(params):
            # A layer before the MoE makes the dispatch input depend on parameters.
            x_in = jnp.tanh(x @ params[1])
            rx, ri, rw, h = sh.dispatch(x_in, idx, w, num_experts=E, mesh_axis="expert",
                                        backend="ffi")
            y = jnp.einsum("ch,hd->cd", rx, params[0]) * jnp.sum(rw, 1, keepdims=True)
            return jnp.mean(sh.combine(y, h, backend="ffi") ** 2)
        l, g = jax.value_and_grad(loss)(params)
        return l, params - 0.1 * g

    with jax.set_mesh(mesh):
        # The surrounding code suggests replicated tokens; the op must still not gather.
        xs = jax.device_put(x, NamedSharding(mesh, P()))
        ps = jax.device_put(params, NamedSharding(mesh, P("expert")))
        compiled = jax.jit(step).lower(ps, xs, w, idx).compile()
        text = compiled.as_text()
        l, _ = compiled(ps, xs, w, idx)
    targets = re.findall(r'custom_call_target="(jax_ep_\w+)"', text)
    assert "jax_ep_dispatch" in targets and "jax_ep_combine" in targets
    assert targets.count("jax_ep_combine") >= 2  # forward combine + dispatch's transpose
    assert "jax_ep_gather" in targets            # combine's transpose
    # No all-gather may touch a token-shaped tensor ([64, H] or [64, K] globally, or
    # their per-shard pieces).
    for line in text.splitlines():
        if re.search(r"\ball-gather(-start)?\(", line):
            assert not re.search(rf"\[(64|8),\s*({H}|{K})\]", line), line
    assert np.isfinite(float(l))


def test_mesh_required():
    x, idx, w = _inputs(16)
    with pytest.raises(ValueError, match="mesh in context"):
        sh.dispatch(x, idx, w, num_experts=E, mesh_axis="expert")


def test_explicit_axes_clear_error():
    mesh = _mesh("data_expert", AxisType.Explicit)
    x, idx, w = _inputs(64)
    with jax.set_mesh(mesh), pytest.raises(NotImplementedError, match="Auto"):
        jax.jit(_global_fn("ffi", None))(x, idx, w)


def test_bad_arguments():
    mesh = _mesh("data_expert")
    x, idx, w = _inputs(64)
    with jax.set_mesh(mesh):
        with pytest.raises(ValueError, match="mesh_axis"):
            sh.dispatch(x, idx, w, num_experts=E, mesh_axis="nope")
        with pytest.raises(ValueError, match="divisible"):
            sh.dispatch(x[:60], idx[:60], w[:60], num_experts=E, mesh_axis="expert")
        with pytest.raises(ValueError, match="E % R"):
            sh.dispatch(x, idx, w, num_experts=6, mesh_axis="expert")
        with pytest.raises(ValueError, match="capacity"):
            sh.dispatch(x, idx, w, num_experts=E, mesh_axis="expert", capacity=0)


def test_vmap_over_batch():
    """vmap over a leading batch axis runs one exchange per batch element."""
    mesh = _mesh("expert")
    xs, idxs, ws = zip(*[_inputs(32, seed=s) for s in (6, 7)])
    xb, ib, wb = jnp.stack(xs), jnp.stack(idxs), jnp.stack(ws)
    f = _global_fn("ffi", None)
    with jax.set_mesh(mesh):
        got = jax.jit(jax.vmap(f))(xb, ib, wb)
        for b in range(2):
            want = jax.jit(f)(xs[b], idxs[b], ws[b])
            for g, v in zip(got, want):
                np.testing.assert_array_equal(np.asarray(g[b]), np.asarray(v))


def test_single_device_mesh_is_not_zeros():
    mesh = jax.make_mesh((1,), ("expert",), axis_types=(AxisType.Auto,),
                         devices=jax.devices()[:1])
    x, idx, w = _inputs(8, seed=8)
    with jax.set_mesh(mesh):
        out = jax.jit(_global_fn("ffi", None))(x, idx, w)
    sent = np.asarray(jnp.any(idx >= 0, axis=1))
    np.testing.assert_array_equal(np.asarray(out[-1])[sent], 2 * np.asarray(x)[sent])


def test_readme_training_step_runs_and_learns():
    """examples/global_view_step.py is the global-view training step of docs/guide.md."""
    import importlib.util
    import os
    path = os.path.join(os.path.dirname(__file__), "..", "examples", "global_view_step.py")
    spec = importlib.util.spec_from_file_location("global_view_step", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    losses = mod.main(steps=8)
    assert losses[-1] < 0.8 * losses[0]


def test_legacy_mesh_context_manager():
    """`with mesh:` (deprecated in JAX, still common) gives the same results."""
    import warnings
    mesh = _mesh("data_expert")
    x, idx, w = _inputs(64, seed=9)
    with jax.set_mesh(mesh):
        want = jax.jit(_global_fn("ffi", None))(x, idx, w)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with mesh:
            got = jax.jit(_global_fn("ffi", None))(x, idx, w)
    for a, b in zip(want, got):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ----------------------------------------------------------------------------- layout, T == 0, bias

@pytest.mark.parametrize("mesh_name", ["expert", "data_expert"])
@pytest.mark.parametrize("backend", ["ffi", "reference"])
def test_global_layout_equals_per_shard_layouts(mesh_name, backend):
    """get_dispatch_layout in the global view (it once failed on every call: the layout
    rule gave Shardy no size for a factor used only in compound factors)."""
    mesh = _mesh(mesh_name)
    R = mesh.shape["expert"]
    S = mesh.size
    _, idx, _ = _inputs(64, seed=7)
    with jax.set_mesh(mesh):
        eager = sh.get_dispatch_layout(idx, num_experts=E, mesh_axis="expert",
                                       backend=backend)
        jitted = jax.jit(lambda i: sh.get_dispatch_layout(
            i, num_experts=E, mesh_axis="expert", backend=backend))(idx)
    T = 64 // S
    blocks = [jax_ep.get_dispatch_layout(idx[s * T:(s + 1) * T], num_experts=E, num_ranks=R,
                                         backend="reference") for s in range(S)]
    for lay in (eager, jitted):
        np.testing.assert_array_equal(
            np.asarray(lay.num_tokens_per_rank),
            np.concatenate([np.asarray(b.num_tokens_per_rank) for b in blocks]))
        np.testing.assert_array_equal(
            np.asarray(lay.num_tokens_per_expert),
            np.concatenate([np.asarray(b.num_tokens_per_expert) for b in blocks]))
        np.testing.assert_array_equal(
            np.asarray(lay.is_token_in_rank),
            np.concatenate([np.asarray(b.is_token_in_rank) for b in blocks]))


def test_global_layout_issue_reproducer():
    mesh = jax.make_mesh((8,), ("ep",), axis_types=(AxisType.Auto,))
    with jax.set_mesh(mesh):
        lay = sh.get_dispatch_layout(jnp.zeros((64, 2), jnp.int32), num_experts=16,
                                     mesh_axis="ep")
    np.testing.assert_array_equal(np.asarray(lay.num_tokens_per_rank).reshape(8, 8),
                                  np.tile([8, 0, 0, 0, 0, 0, 0, 0], (8, 1)))


@pytest.mark.parametrize("backend", ["ffi", "reference"])
def test_global_zero_tokens(backend):
    mesh = _mesh("expert")
    x = jnp.zeros((0, H), jnp.float32)
    idx, w = jnp.zeros((0, K), jnp.int32), jnp.zeros((0, K), jnp.float32)
    with jax.set_mesh(mesh):
        lay = sh.get_dispatch_layout(idx, num_experts=E, mesh_axis="expert",
                                     backend=backend)
        rx, ri, rw, h = sh.dispatch(x, idx, w, num_experts=E, mesh_axis="expert",
                                    capacity=3, backend=backend)
        out = sh.combine(rx + 1.0, h, backend=backend)
    np.testing.assert_array_equal(np.asarray(lay.num_tokens_per_rank), np.zeros(64))
    np.testing.assert_array_equal(np.asarray(rx), np.zeros((24, H)))
    np.testing.assert_array_equal(np.asarray(ri), -np.ones((24, K)))
    np.testing.assert_array_equal(np.asarray(h.num_recv), np.zeros(8))
    assert out.shape == (0, H)


@pytest.mark.parametrize("mesh_name", ["expert", "data_expert"])
@pytest.mark.parametrize("backend", ["ffi", "reference"])
def test_global_combine_bias_equals_per_shard(mesh_name, backend):
    mesh = _mesh(mesh_name)
    spec = _token_spec(mesh.axis_names)
    x, idx, w = _inputs(64, seed=8, dtype=jnp.bfloat16)
    rng = np.random.default_rng(8)
    b0 = jnp.asarray(rng.standard_normal((64, H)), jnp.float32)
    b1 = jnp.asarray(rng.standard_normal((64, H)), jnp.bfloat16)

    def per_shard(x, idx, w, b0, b1):
        rx, _, _, h = jax_ep.dispatch(x, idx, w, num_experts=E, axis_name="expert",
                                      capacity=9, backend=backend)
        return jax_ep.combine(rx * 2, h, bias=(b0, b1), backend=backend)

    def global_(x, idx, w, b0, b1):
        rx, _, _, h = sh.dispatch(x, idx, w, num_experts=E, mesh_axis="expert", capacity=9,
                                  backend=backend)
        return sh.combine(rx * 2, h, bias=(b0, b1), backend=backend)

    want = jax.jit(jax.shard_map(per_shard, mesh=mesh, in_specs=spec, out_specs=spec))(
        x, idx, w, b0, b1)
    with jax.set_mesh(mesh):
        got = jax.jit(global_)(x, idx, w, b0, b1)
        g = jax.jit(jax.grad(lambda b0: jnp.sum(global_(x, idx, w, b0, b1).astype(
            jnp.float32))))(b0)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(g), np.ones((64, H), np.float32))
