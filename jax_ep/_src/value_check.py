"""Value checks of the routing ids that every rank agrees on before it communicates.

A check of topk_idx's values can fail on some ranks and not on others. A rank that stops
(raises) while its peers go on into a collective leaves them waiting there for good: the
CPU rendezvous aborts the process after a while, processes of a `jax.distributed` job
hang. So each check here runs in three steps, all inside the program:

1. every rank computes a verdict of its own ids: int32[7] = (code, ep rank, group,
   token, slot, value, earlier slot); code 0 = fine, 1 = id outside [-1, E), 2 = an id
   repeated in one token's top-k (low-latency mode);
2. the verdicts are all-gathered over the EP axis and the other manual mesh axes (a
   collective every rank reaches), and every rank picks the same one: the failing rank
   first in (group, rank) order;
3. a host callback raises on every rank at once when that verdict is a failure, and the
   ids the op goes on with depend on the callback's result, so no rank starts the op's
   exchange before it has run.

A good call costs one tiny all-gather and no host round trip (the callback sits in the
false branch of a `lax.cond`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_ep._src.common import axis_names, concrete_mesh, ep_coords, group_axes

OK, OUT_OF_RANGE, REPEATED = 0, 1, 2
_FIELDS = 7  # code, rank, group, token, slot, value, earlier slot
_NO_FAILURE = np.iinfo(np.int32).max


def local_verdict(topk_idx, num_experts: int, repeats: bool):
    """int32[_FIELDS] of this rank's topk_idx[T, K] (rank and group left 0): the first
    failing slot in row-major order, or code 0."""
    K = topk_idx.shape[1]
    oor = (topk_idx < -1) | (topk_idx >= num_experts)
    bad = oor
    if repeats:
        eq = (topk_idx[:, :, None] == topk_idx[:, None, :]) & (topk_idx[:, :, None] >= 0)
        earlier = eq & jnp.tril(jnp.ones((K, K), bool), -1)[None]  # [t, k, j]: j < k
        bad = bad | jnp.any(earlier, axis=2)
    flat = jnp.argmax(bad.reshape(-1)).astype(jnp.int32)
    t, k = flat // K, flat % K
    any_bad = jnp.any(bad)
    code = jnp.where(oor[t, k], OUT_OF_RANGE, REPEATED)
    code = jnp.where(any_bad, code, OK).astype(jnp.int32)
    other = jnp.argmax(earlier[t, k]).astype(jnp.int32) if repeats else jnp.int32(-1)
    zero = jnp.zeros((), jnp.int32)
    return jnp.stack([code, zero, zero, t, k, topk_idx[t, k], other])


def _agree(verdict, axes):
    """The verdict every rank of `axes` (a tuple of mesh axis names) picks: the failing
    one first in (group, rank) order, or any good one."""
    if not axes:
        return verdict
    every = jax.lax.all_gather(verdict, axes)  # [N, _FIELDS]
    key = jnp.where(every[:, 0] != OK, every[:, 2] * (2 ** 15) + every[:, 1], _NO_FAILURE)
    return every[jnp.argmin(key)]


def _message(v, num_experts: int, where: str, grouped: bool, global_rows):
    code, rank, group, t, k, value, other = (int(a) for a in v)
    # grouped None: a check of the whole array, not of one rank's.
    at = "" if grouped is None else (
        f"on rank {rank}" + (f" of EP group {group}" if grouped else "") + ": ")
    tail = ""
    if global_rows is not None:
        tail = f" (row {global_rows(rank, group, t)} of the global topk_idx)"
    if code == OUT_OF_RANGE:
        return (f"jax_ep: {at}topk_idx[{t}, {k}] = {value} is outside "
                f"[-1, {num_experts}) (num_experts={num_experts}){tail}")
    return (f"jax_ep: {at}{where}: topk_idx[{t}] names expert {value} more than once "
            f"(duplicate ids in one token's top-k: topk_idx[{t}, {other}] and "
            f"topk_idx[{t}, {k}]){tail}")


def _raiser(num_experts, where, grouped, global_rows):
    def callback(verdicts, *_waited_for):
        for v in np.asarray(verdicts).reshape(-1, _FIELDS):
            if v[0] != OK:
                raise ValueError(_message(v, num_experts, where, grouped, global_rows))
        return np.zeros((), np.int32)

    return callback


def _depend(zero, topk_idx):
    """topk_idx, computed from `zero` (the callback's 0): an arithmetic dependency, which
    XLA keeps (it drops an optimization barrier's unused operand, and with it the
    callback)."""
    return topk_idx + zero.astype(topk_idx.dtype)


def _raise_if_bad(verdict, num_experts, where, grouped, global_rows=None, wait_for=()):
    """int32 scalar 0, produced by a host callback that raises when `verdict` is a
    failure; it runs only then, and not before the arrays `wait_for` exist (one element
    of each is its operand, a dependency XLA cannot drop)."""
    cb = _raiser(num_experts, where, grouped, global_rows)
    spec = jax.ShapeDtypeStruct((), jnp.int32)
    waited = tuple(a.reshape(-1)[:1] for a in wait_for if a.size)

    def fail(v, *w):
        # Under vmap the cond becomes a select and this runs for every call; the callback
        # itself tells good verdicts from bad ones.
        return jax.pure_callback(cb, spec, v, *w, vmap_method="broadcast_all")

    def fine(v, *w):
        return jnp.zeros((), jnp.int32)

    return jax.lax.cond(verdict[0] != OK, fail, fine, verdict, *waited)


def checked(topk_idx, num_experts: int, *, axis_name=None, groups=None, repeats=False,
            where="jax_ep", wait_for=()):
    """topk_idx[T, K], made to depend on an agreed value check (per shard, inside
    shard_map): ids in [-1, E), and with `repeats` no id twice in a token. Raises on every
    rank of the EP axis `axis_name` and of the other manual axes (`groups`, ((name,
    size), ...); None: those in context) when one rank's ids fail; the ops run their
    exchanges on the result, so no rank starts one before the check.

    With axis_name None (the layout, which has no EP axis) the ranks are numbered over
    every manual mesh axis in context. `wait_for`: arrays of an exchange that must be
    complete on this rank before it may raise (a check that comes after the exchange)."""
    if topk_idx.size == 0:
        return topk_idx
    if axis_name is None and not _manual_axes():
        return _whole(topk_idx, num_experts, repeats, where)
    verdict = local_verdict(topk_idx, num_experts, repeats)
    if axis_name is None:
        axes = _manual_axes()
        rank = jax.lax.axis_index(axes).astype(jnp.int32)
        group = jnp.int32(0)
        grouped = False
    else:
        if groups is None:
            groups = group_axes(axis_name)
        rank, group = ep_coords(axis_name, groups)
        axes = tuple(a for a, _ in groups) + axis_names(axis_name)
        grouped = bool(groups)
    verdict = verdict.at[1].set(rank).at[2].set(group)
    verdict = _agree(verdict, axes)
    return _depend(_raise_if_bad(verdict, num_experts, where, grouped, wait_for=wait_for),
                   topk_idx)


def _whole(topk_idx, num_experts, repeats, where):
    """The check of an array outside shard_map (the layout under plain jit). With a
    mesh of several devices in context it runs replicated on each of them inside a
    shard_map, so every device raises (a callback of a partitioned program runs on one
    device, and the others would wait for it in their next collective); with none, on
    the program's one device."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is not None and not mesh.empty and mesh.size > 1 and not _manual_axes():
        from jax.sharding import PartitionSpec as P

        def body(idx):
            v = local_verdict(idx, num_experts, repeats)
            # Every device holds the whole array: all reach the same verdict.
            return _depend(_raise_if_bad(v, num_experts, where, None), idx)

        return jax.shard_map(body, in_specs=P(), out_specs=P(), check_vma=False)(topk_idx)
    v = local_verdict(topk_idx, num_experts, repeats)
    return _depend(_raise_if_bad(v, num_experts, where, None), topk_idx)


def neutralized(topk_idx, num_experts: int, repeats=False):
    """topk_idx with every id the check rejects set to -1 (an unused slot), for an
    exchange that must complete before the ranks raise."""
    bad = (topk_idx < -1) | (topk_idx >= num_experts)
    if repeats:
        K = topk_idx.shape[1]
        eq = (topk_idx[:, :, None] == topk_idx[:, None, :]) & (topk_idx[:, :, None] >= 0)
        bad = bad | jnp.any(eq & jnp.tril(jnp.ones((K, K), bool), -1)[None], axis=2)
    return jnp.where(bad, -1, topk_idx)


def across_groups(axis_name, groups) -> bool:
    """Whether the ffi backend runs the agreed check before its CPU kernel: where the
    mesh axes other than the EP axis (`groups`, ((name, size), ...); None: those in
    context) make several EP groups. The CPU kernels raise a value error on every rank
    of their EP group only; the other groups would go on into the program's next
    collective across groups (a data-parallel psum) and wait there. Callers wrap the
    check in `on_cpu`: on GPUs the kernels carry the verdict in their own header
    exchange (every rank records the error and none stops), so no collective is added."""
    if groups is None:
        groups = group_axes(axis_name)
    return any(int(size) > 1 for _, size in groups)


def on_cpu(check, topk_idx):
    """`check(topk_idx)` in a program lowered for CPU, topk_idx unchanged in one lowered
    for any other platform. Decided when lowering, by the platform lowered for (not by
    this host's default backend), so a program exported for CUDA from a CPU host holds
    no collective or host callback of a CPU-only check."""
    return jax.lax.platform_dependent(topk_idx, cpu=check, default=lambda i: i)


def _manual_axes() -> tuple:
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty:
        return ()
    manual = getattr(mesh, "manual_axes", ())
    return tuple(a for a in mesh.axis_names if a in manual)


def global_check_needed(spec) -> bool:
    """Whether the global view runs `checked_global` before its op: always for the
    reference backend (whose per-shard check would be a host callback inside the
    partitioned body), for ffi where the mesh holds several EP groups (see
    `across_groups`; only in programs lowered for CPU, see `checked_global`)."""
    return spec.backend == "reference" or (spec.backend == "intranode"
                                           and across_groups(None, spec.group_axes))


def checked_global(topk_idx, spec, *, repeats=False, where="jax_ep"):
    """The global view's check: global topk_idx[N, K] (dim 0 over spec.token_axes), made
    to depend on the same agreed check, run per shard by a shard_map over the whole mesh
    in context before the partitioned op (a host callback inside a custom_partitioning
    body is not safe). The message names the shard's EP rank, its token and the global
    row."""
    if topk_idx.size == 0:
        return topk_idx
    from jax.sharding import PartitionSpec as P

    mesh = concrete_mesh()
    token_axes = tuple(spec.token_axes)
    batch = token_axes[:-1]
    R, T = spec.num_ranks, spec.tokens_per_shard
    E = spec.num_experts
    every = tuple(mesh.axis_names)

    def global_row(rank, group, t):
        return (group * R + rank) * T + t

    def body(idx):
        v = local_verdict(idx, E, repeats)
        rank = jax.lax.axis_index(spec.mesh_axis).astype(jnp.int32)
        group = (jax.lax.axis_index(batch).astype(jnp.int32) if batch
                 else jnp.zeros((), jnp.int32))
        v = _agree(v.at[1].set(rank).at[2].set(group), every)
        return _depend(_raise_if_bad(v, E, where, bool(batch), global_row), idx)

    def check(idx):
        return jax.shard_map(body, mesh=mesh, in_specs=P(token_axes),
                             out_specs=P(token_axes), check_vma=False)(idx)

    # The reference backend has no kernel exchange to carry the verdict: it checks on
    # every platform. The ffi kernels on GPUs carry it themselves (across_groups).
    return check(topk_idx) if spec.backend == "reference" else on_cpu(check, topk_idx)
