"""Runs the one-rank bad-input cases of tests/test_one_rank_errors.py in one process.

    python tests/one_rank_worker.py GROUP                      (8 CPU devices here)
    python tests/one_rank_worker.py GROUP PID NPROC PORT       (jax.distributed, 4 each)

For every case and every placement of the bad value (rank 0 only, the last rank only,
every rank) it runs a good call, the bad call, and the good call again, and prints one
line per step (flushed, so a hang or an abort shows where it happened):
    CASE <name> <placement> RAISED <seconds> | OK | FAIL <why>
and `DONE` at the end. The bad call must raise a jax_ep error naming the first failing
rank, token, slot and value; the good call after it must return the first good call's
results bit for bit.
"""
from __future__ import annotations

import os
import re
import sys
import time
import traceback

R, T, K, E, H = 8, 4, 2, 16, 8
PLACEMENTS = ("first", "last", "all")


def _ranks(placement):
    return {"first": [0], "last": [R - 1], "all": list(range(R))}[placement]


def _inputs():
    import numpy as np
    rng = np.random.default_rng(7)
    x = rng.standard_normal((R * T, H)).astype(np.float32)
    # Distinct experts per token (the low-latency mode rejects repeats).
    idx = np.stack([rng.permutation(E)[:K] for _ in range(R * T)]).astype(np.int32)
    idx[5, 1] = -1  # an unused slot is fine
    w = rng.random((R * T, K)).astype(np.float32)
    return x, idx, w


def _spoil(idx, ranks, kind, t=3, k=1):
    """idx with token t, slot k of each rank in `ranks` made bad: 'range' -> 21 (outside
    [-1, E)), 'repeat' -> slot 0's id again."""
    bad = idx.copy()
    for r in ranks:
        bad[r * T + t, k] = 21 if kind == "range" else bad[r * T + t, 0]
    return bad


def _pattern(kind, rank, t=3, k=1, group=None, value=None):
    at = f"rank {rank}" + (f" of EP group {group}" if group is not None else "")
    if kind == "range":
        return rf"jax_ep: on {at}: topk_idx\[{t}, {k}\] = 21 is outside \[-1, {E}\)"
    return (rf"jax_ep: on {at}: jax_ep.low_latency: topk_idx\[{t}\] names expert "
            rf"{value} more than once")


# ----------------------------------------------------------------------------- programs
# Each builder returns (run(idx, idx_combine) -> pytree, kind, uses_combine_idx).

def _shard_map(mesh, body):
    import jax
    from jax.sharding import PartitionSpec as P
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))


def per_shard_dispatch(mesh, backend):
    import jax_ep

    def body(x, i, w):
        rx, ri, rw, h = jax_ep.dispatch(x, i, w, num_experts=E, axis_name="ep",
                                        backend=backend)
        return rx, ri, jax_ep.combine(rx, h, backend=backend)
    return _shard_map(mesh, body)


def per_shard_layout(mesh, backend):
    import jax
    import jax_ep

    def body(x, i, w):
        lay = jax_ep.get_dispatch_layout(i, num_experts=E, num_ranks=R, backend=backend)
        # A collective after the op: every rank must reach it, or none.
        return jax.lax.psum(lay.num_tokens_per_expert, "ep")[None]
    return _shard_map(mesh, body)


def per_shard_ll(mesh, backend, bad_in_combine=False, halves=False):
    import jax_ep
    ll = jax_ep.low_latency

    def body(x, i, w, ic):
        kw = dict(num_experts=E, axis_name="ep", max_tokens_per_rank=T, backend=backend)
        if halves:
            rx, cnt, h = ll.dispatch_recv(ll.dispatch_send(x, i, **kw))
            state = ll.combine_send(rx, ic, w, h, backend=backend)
            return rx, cnt, ll.combine_recv(state)
        rx, cnt, h = ll.dispatch(x, i, **kw)
        return rx, cnt, ll.combine(rx, ic, w, h, backend=backend)
    return _shard_map(mesh, body)


def global_dispatch(mesh, backend):
    import jax
    import jax_ep

    def f(x, i, w):
        rx, ri, rw, h = jax_ep.sharded.dispatch(x, i, w, num_experts=E, mesh_axis="ep",
                                                backend=backend)
        return rx, jax_ep.sharded.combine(rx, h, backend=backend)
    return jax.jit(f)


def global_layout(mesh, backend):
    import jax
    import jax_ep

    def f(x, i, w):
        lay = jax_ep.sharded.get_dispatch_layout(i, num_experts=E, mesh_axis="ep",
                                                 backend=backend)
        return lay.num_tokens_per_expert, lay.is_token_in_rank
    return jax.jit(f)


def global_ll(mesh, backend):
    import jax
    import jax_ep
    sll = jax_ep._src.sharded_low_latency

    def f(x, i, w, ic):
        rx, cnt, h = sll.dispatch(x, i, num_experts=E, mesh_axis="ep", max_tokens_per_rank=T,
                                  backend=backend)
        return rx, sll.combine(rx, ic, w, h, backend=backend)
    return jax.jit(f)


def jit_layout(mesh, backend):
    """get_dispatch_layout on the global array under plain jit (no shard_map), the mesh
    in context."""
    import jax
    import jax_ep

    def f(x, i, w):
        return jax_ep.get_dispatch_layout(i, num_experts=E, num_ranks=R,
                                          backend=backend).num_tokens_per_expert
    return jax.jit(f)


# (name, builder, kwargs, kind, which index argument is spoiled, whole array checked:
# the error names the global row, not a rank)
CASES = {
    "shard": [
        ("dispatch", per_shard_dispatch, {}, "range", "idx", False),
        ("layout", per_shard_layout, {}, "range", "idx", False),
        ("ll_dispatch_range", per_shard_ll, {}, "range", "idx", False),
        ("ll_dispatch_repeat", per_shard_ll, {}, "repeat", "idx", False),
        ("ll_halves_repeat", per_shard_ll, dict(halves=True), "repeat", "idx", False),
        ("ll_combine_range", per_shard_ll, {}, "range", "combine_idx", False),
        ("ll_combine_repeat", per_shard_ll, dict(halves=True), "repeat", "combine_idx",
         False),
    ],
    "global": [
        ("sharded_dispatch", global_dispatch, {}, "range", "idx", True),
        ("sharded_layout", global_layout, {}, "range", "idx", True),
        ("sharded_ll_repeat", global_ll, {}, "repeat", "idx", True),
        ("sharded_ll_combine_range", global_ll, {}, "range", "combine_idx", True),
        ("jit_layout", jit_layout, {}, "range", "idx", "whole"),
    ],
}
# Across processes: the reference backend only (the CPU ffi transport is one process).
CASES["multiprocess"] = [CASES["shard"][0], CASES["shard"][1], CASES["shard"][3],
                         CASES["shard"][5], CASES["global"][0], CASES["global"][2],
                         CASES["global"][4]]


# ----------------------------------------------------------------------------- running

def _local(tree):
    """The process's shards of every output, as NumPy (comparable across calls)."""
    import jax
    import numpy as np
    out = []
    for a in jax.tree.leaves(tree):
        shards = sorted(a.addressable_shards, key=lambda s: str(s.index))
        out += [np.asarray(s.data) for s in shards]
    return out


def _same(a, b):
    import numpy as np
    return len(a) == len(b) and all(
        u.shape == v.shape and np.array_equal(u.view(np.uint8), v.view(np.uint8))
        for u, v in zip(a, b))


def run_group(group, backends, mesh, log):
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    sharding = NamedSharding(mesh, P("ep"))

    def put(a):
        return jax.make_array_from_callback(a.shape, sharding, lambda i: a[i])

    x, idx, w = _inputs()
    for name, builder, kw, kind, which, view in CASES[group]:
        for backend in backends:
            fn = builder(mesh, backend, **kw)
            ll = builder in (per_shard_ll, global_ll)

            def call(i, ic=idx):
                args = (put(x), put(i), put(w)) + ((put(ic),) if ll else ())
                with jax.set_mesh(mesh):
                    return _local(jax.block_until_ready(fn(*args)))

            want = call(idx)
            for placement in PLACEMENTS:
                label = f"CASE {name}[{backend}] {placement}"
                ranks = _ranks(placement)
                bad = _spoil(idx, ranks, kind)
                value = int(idx[ranks[0] * T + 3, 0])
                pattern = _pattern(kind, ranks[0], value=value)
                if view == "whole":
                    pattern = rf"jax_ep: topk_idx\[{ranks[0] * T + 3}, 1\] = 21 is outside"
                t0 = time.monotonic()
                try:
                    call(bad) if which == "idx" else call(idx, bad)
                    log(f"{label} FAIL no error")
                    continue
                except Exception as e:  # noqa: BLE001 - any error type, checked below
                    text = str(e)
                    if not re.search(pattern, text):
                        log(f"{label} FAIL message {text[-600:]!r} does not match "
                            f"{pattern!r}")
                        continue
                log(f"{label} RAISED {time.monotonic() - t0:.1f}")
                again = call(idx)
                log(f"{label} OK" if _same(again, want) else f"{label} FAIL next call differs")


def run_flax(log):
    """The Flax layer (2 EP groups of 4 on a (data, expert) mesh), its routing spoiled
    on the first shard, the last one, or all of them (through jax_ep.flax.route)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    import jax_ep.flax as jf

    auto = jax.sharding.AxisType.Auto
    mesh = jax.make_mesh((2, 4), ("data", "expert"), axis_types=(auto, auto))
    Ef, Tf, hidden = 8, 4, 16
    x = np.random.default_rng(3).standard_normal((2, 16, hidden)).astype(np.float32)
    real_route = jf.route
    spoil = {}

    def route(logits, top_k, **kw):
        # The layer routes each token shard apart (inside a shard_map over the token
        # axes): spoil row 3 of the chosen shards.
        idx, w, probs = real_route(logits, top_k, **kw)
        shards = spoil.get("shards")
        if shards is not None:
            me = jax.lax.axis_index(("data", "expert"))
            hit = jnp.any(me == jnp.asarray(shards))
            new = 21 if spoil["kind"] == "range" else idx[3, 0]
            idx = idx.at[3, 1].set(jnp.where(hit, new, idx[3, 1]))
        return idx, w, probs

    jf.route = route
    try:
        for mode, kind in (("normal", "range"), ("low_latency", "repeat")):
            for backend in ("reference", "ffi"):
                extra = dict(max_tokens_per_rank=Tf) if mode == "low_latency" else {}
                with jax.set_mesh(mesh):
                    moe = jf.MoE(hidden, 24, Ef, 2, backend=backend, mode=mode,
                                 rngs=nnx.Rngs(0), **extra)

                    graph, state = nnx.split(moe)

                    def call():
                        # The state goes in only: under nnx.jit the module's state would
                        # be replaced by the outputs of the failed program. A fresh trace
                        # each time: the spoiled rows are baked in.
                        y, aux = jax.jit(lambda s, v: nnx.merge(graph, s)(v))(state, x)
                        return [np.asarray(y), np.asarray(aux["tokens_per_expert"])]

                    spoil.clear()
                    want = call()
                    for placement, shards in (("first", [0]), ("last", [7]),
                                              ("all", list(range(8)))):
                        label = f"CASE flax_{mode}[{backend}] {placement}"
                        spoil.update(shards=shards, kind=kind)
                        rank, group = shards[0] % 4, shards[0] // 4
                        at = rf"on rank {rank}(?: of EP group {group})?: "
                        pattern = (at + r"topk_idx\[3, 1\] = 21 is outside" if kind == "range"
                                   else at + r"jax_ep.low_latency: topk_idx\[3\] names "
                                   r"expert \d+ more than once")
                        t0 = time.monotonic()
                        try:
                            call()
                            log(f"{label} FAIL no error")
                            continue
                        except Exception as e:  # noqa: BLE001 - checked below
                            if not re.search(pattern, str(e)):
                                log(f"{label} FAIL message {str(e)[-600:]!r} does not "
                                    f"match {pattern!r}")
                                continue
                        log(f"{label} RAISED {time.monotonic() - t0:.1f}")
                        spoil.clear()
                        again = call()
                        same = all(np.array_equal(a, b) for a, b in zip(again, want))
                        log(f"{label} OK" if same else f"{label} FAIL next call differs")
    finally:
        jf.route = real_route


def main(argv):
    group = argv[1]
    multi = len(argv) > 2
    if multi:
        pid, nproc, port = int(argv[2]), int(argv[3]), int(argv[4])
        os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
        os.environ["JAX_PLATFORMS"] = "cpu"
        import jax
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator_address=f"localhost:{port}",
                                   num_processes=nproc, process_id=pid,
                                   initialization_timeout=60)
    else:
        os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={R}"
    import jax_ep  # noqa: F401 - sizes XLA's CPU pool before JAX creates its client
    import jax

    mesh = jax.make_mesh((R,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,))
    backends = ("auto",) if multi else ("reference", "ffi")
    if multi:
        assert jax_ep.resolve_backend("auto") == "reference"

    def log(line):
        print(line, flush=True)

    try:
        if group == "flax":
            run_flax(log)
        else:
            run_group(group, backends, mesh, log)
    except Exception:  # noqa: BLE001 - reported to the test
        log("ERROR " + traceback.format_exc().replace("\n", " | "))
    log("DONE")
    if multi:
        jax.distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv)
