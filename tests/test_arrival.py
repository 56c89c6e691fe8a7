"""The arrival barrier's rounds (jax_ep/_src/arrival.py) against an in-memory key-value store
with the semantics of the jax.distributed one, one thread per device: a full round says
go, a missing device times every arrived one out naming it, a late one fails at once, a
different signature fails every device, and finished rounds leave no keys behind. The
multi-process runs are tests/test_multiprocess_arrival.py."""
from __future__ import annotations

import threading
import time
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_ep
from jax_ep._src import ext as _ext
import jax_ep.ops
from jax_ep._src import arrival as _arrival


class Store:
    """The calls the barrier makes on jax.distributed's client: keys are paths, a key
    is created once (allow_overwrite=False), a directory read or delete covers
    `key/...`."""

    def __init__(self):
        self.kv = {}
        self.cv = threading.Condition()

    def key_value_set(self, key, value, allow_overwrite=False):
        with self.cv:
            if key in self.kv and not allow_overwrite:
                raise RuntimeError(f"ALREADY_EXISTS: key {key} already exists.")
            self.kv[key] = value
            self.cv.notify_all()

    def key_value_dir_get(self, key):
        with self.cv:
            return [(k, v) for k, v in sorted(self.kv.items()) if k.startswith(key + "/")]

    def key_value_try_get(self, key):
        with self.cv:
            if key not in self.kv:
                raise RuntimeError(f"NOT_FOUND: {key}")
            return self.kv[key]

    def blocking_key_value_get(self, key, timeout_in_ms):
        with self.cv:
            if not self.cv.wait_for(lambda: key in self.kv, timeout_in_ms / 1000):
                raise RuntimeError(f"DEADLINE_EXCEEDED: {key}")
            return self.kv[key]

    def key_value_delete(self, key):
        with self.cv:
            for k in [k for k in self.kv if k == key or k.startswith(key + "/")]:
                del self.kv[k]


# Four devices on one EP axis, two per process.
WHERE = _arrival._Where(("ep",), (4,), [0, 0, 1, 1], [0, 1, 2, 3])


@pytest.fixture
def store(monkeypatch):
    s = Store()
    monkeypatch.setattr(_arrival, "_client", lambda: s)
    return s


def _barrier(site, signature="dispatch(float32[5,3])"):
    return _arrival._Barrier("jax_ep.dispatch", site, WHERE, signature)


def _round(barriers):
    """Runs barriers[i].wait(i) for each position i given, one thread each; returns
    {position: (seconds, the exception or None)}."""
    out = {}

    def run(i, b):
        t0 = time.monotonic()
        try:
            b.wait(i)
            out[i] = (time.monotonic() - t0, None)
        except Exception as e:  # noqa: BLE001 - what the barrier raised
            out[i] = (time.monotonic() - t0, e)

    threads = [threading.Thread(target=run, args=(i, b)) for i, b in barriers.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(out) == len(barriers), "a device never returned from the barrier"
    return out


def test_full_rounds_go_and_leave_one_round_of_keys(store):
    b = _barrier(11)
    for _ in range(5):
        got = _round({i: b for i in range(4)})
        assert all(e is None for _, e in got.values()), got
    # Each "go" deletes the round before it: the last round's 4 arrivals and decision.
    assert sorted(k.rsplit("/", 2)[-2] for k in store.kv) == ["5"] * 5, sorted(store.kv)


def test_missing_devices_time_out_late_ones_fail_at_once_next_round_meets(store,
                                                                         monkeypatch):
    jax_ep.config.update("timeout_s", "0.5")
    b = _barrier(12)
    got = _round({0: b, 1: b})  # process 1's devices (positions 2, 3) never come
    for secs, e in got.values():
        assert isinstance(e, _arrival.ArrivalError), e
        assert "timed out after JAX_EP_TIMEOUT_S = 0.5 s" in str(e)
        assert "did not arrive: process 1 (ep=2, ep=3)" in str(e)
        assert "arrived: process 0 (ep=0, ep=1)" in str(e)
        assert 0.5 <= secs < 5, secs

    got = _round({2: b, 3: b})  # they come later: that round was given up
    for secs, e in got.values():
        assert isinstance(e, _arrival.ArrivalError), e
        assert "reached the call after its peers had stopped waiting for it" in str(e)
        assert secs < 0.4, secs  # at once, not after a timeout of its own

    got = _round({i: b for i in range(4)})  # every device's next call meets
    assert all(e is None for _, e in got.values()), got
    assert {k.rsplit("/", 2)[-2] for k in store.kv} == {"2"}, sorted(store.kv)


def test_other_signature_fails_every_device(store):
    mine, other = _barrier(13), _barrier(13, "dispatch(float32[6,3])")
    got = _round({0: mine, 1: mine, 2: mine, 3: other})
    for _, e in got.values():
        assert isinstance(e, ValueError), e
        text = str(e)
        assert "made this call with different arguments" in text
        assert "dispatch(float32[5,3])" in text and "dispatch(float32[6,3])" in text
        assert "process 1 (ep=3): dispatch(float32[6,3])" in text, text
    # The next round meets (the signatures agree again).
    got = _round({i: mine for i in range(4)})
    assert all(e is None for _, e in got.values()), got


def test_no_barrier_on_one_process():
    """On one process the ops carry no barrier (its cost is the multi-process path's)."""
    assert jax.process_count() == 1
    assert not _arrival._on_path()
    x = jax.numpy.ones((4, 2))
    assert _arrival.arrive("dispatch", (x,)) == (x,)


@pytest.mark.parametrize("value,want", [("", 300.0), (None, 300.0), ("8", 8.0),
                                        ("0.5", 0.5), (2, 2.0)])
def test_timeout_reads_the_kernels_setting(value, want):
    jax_ep.config.update("timeout_s", value)
    assert _arrival.timeout_s() == want
    assert _ext.require_ext().settings()["timeout_s"] == want  # what the kernels read
    assert _ext.require_ext().settings_defaults()["timeout_s"] == 300.0


@pytest.mark.parametrize("value", ["-1", "soon", 0, "inf"])
def test_bad_timeout_names_the_setting(value):
    with pytest.raises(ValueError, match="timeout_s"):
        jax_ep.config.update("timeout_s", value)
    with pytest.raises(ValueError, match="JAX_EP_TIMEOUT_S"):
        jax_ep.config.from_env({"JAX_EP_TIMEOUT_S": str(value)})


# ----------------------------------------------------------------------------- placement

R, T, K, E, H, M = 8, 4, 2, 16, 128, 6


def _inputs():
    rng = np.random.default_rng(3)
    idx = np.stack([rng.permutation(E)[:K] for _ in range(R * T)]).astype(np.int32)
    return (rng.standard_normal((R * T, H)).astype(np.float32), idx,
            rng.random((R * T, K)).astype(np.float32))


@pytest.fixture
def traced_barriers(monkeypatch):
    """The ops as on the multi-process CPU path (the barrier's gate forced on, the mesh
    taken to span processes); returns the list of the barriers traced, by call name."""
    monkeypatch.setattr(_arrival, "_on_path", lambda: True)
    monkeypatch.setattr(_arrival._Where, "spans_processes", lambda self: True)
    made = []
    init = _arrival._Barrier.__init__

    def record(self, op, *args):
        made.append(op)
        init(self, op, *args)

    monkeypatch.setattr(_arrival._Barrier, "__init__", record)
    return made


def test_every_per_shard_call_and_its_gradient_has_a_barrier(traced_barriers):
    from jax_ep import low_latency as ll

    def f(x, idx, w):
        lay = jax_ep.get_dispatch_layout(idx, num_experts=E, num_ranks=R,
                                         backend="reference")

        def loss(x, w):
            rx, _, rw, h = jax_ep.dispatch(x, idx, w, num_experts=E, axis_name="ep",
                                           backend="reference")
            again = jax_ep.ops.cached_dispatch(x * 3.0, h, backend="reference")
            out = jax_ep.combine(rx * jnp.sum(rw, 1, keepdims=True) + again, h,
                                 backend="reference")
            return jnp.sum(out * out)

        gx, gw = jax.grad(loss, (0, 1))(x, w)
        lx, _, lh = ll.dispatch(x, idx, num_experts=E, axis_name="ep",
                                max_tokens_per_rank=M, backend="reference")
        lo = ll.combine(lx * 2.0, idx, w, lh, backend="reference")
        sent = ll.combine_send(lx, idx, w, lh, backend="reference")
        lo2 = ll.combine_recv(sent)
        return lay.num_tokens_per_rank[None], gx, gw, lo, lo2

    mesh = jax.make_mesh((R,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,))
    jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))).lower(
        *_inputs()).compile()
    assert Counter(traced_barriers) == {
        "jax_ep.get_dispatch_layout": 1,
        "jax_ep.dispatch": 1,
        "jax_ep.cached_dispatch (gather)": 1,
        "jax_ep.combine": 1,
        # combine's transpose gathers; cached_dispatch's and dispatch's (2) combine
        "gather (in a backward pass)": 1,
        "combine (in a backward pass)": 3,
        "jax_ep.low_latency.dispatch (low_latency.dispatch_send)": 1,
        # combine's receive half is covered by its send half's barrier ...
        "jax_ep.low_latency.combine (low_latency.combine_send)": 1,
        # ... the split API's halves are separate calls: one barrier each
        "jax_ep.low_latency.combine_send": 1,
        "jax_ep.low_latency.combine_recv": 1,
    }, traced_barriers


def test_every_global_view_call_and_its_gradient_has_one_barrier(traced_barriers):
    import jax_ep.sharded as sh

    def f(x, idx, w):
        lay = sh.get_dispatch_layout(idx, num_experts=E, mesh_axis="ep",
                                     backend="reference")

        def loss(x, w):
            rx, _, rw, h = sh.dispatch(x, idx, w, num_experts=E, mesh_axis="ep",
                                       backend="reference")
            out = sh.combine(rx * jnp.sum(rw, 1, keepdims=True), h, backend="reference")
            return jnp.sum(out * out)

        gx, gw = jax.grad(loss, (0, 1))(x, w)
        lx, _, lh = sh.low_latency.dispatch(x, idx, num_experts=E, mesh_axis="ep",
                                            max_tokens_per_rank=M, backend="reference")
        lo = sh.low_latency.combine(lx * 2.0, idx, w, lh, backend="reference")
        return lay.num_tokens_per_rank, gx, gw, lo

    mesh = jax.make_mesh((R,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,))
    with jax.set_mesh(mesh):
        # Compiled: the partitioned bodies are traced too, and hold no barrier of their own.
        jax.jit(f).lower(*_inputs()).compile()
    assert Counter(traced_barriers) == {
        "jax_ep.sharded.get_dispatch_layout": 1,
        "jax_ep.sharded.dispatch": 1,  # one for its value check and its exchange
        "jax_ep.sharded.combine": 1,
        "gather (in a backward pass)": 1,
        "combine (in a backward pass)": 2,
        "jax_ep.sharded.low_latency.dispatch": 1,
        "jax_ep.sharded.low_latency.combine": 1,
    }, traced_barriers
