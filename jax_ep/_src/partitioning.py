"""Partitioning machinery of the global view, shared by `jax_ep.sharded` (normal mode)
and `jax_ep._src.sharded_low_latency`: the static call description, the meshes in context,
and `_partitioned`, which builds a `custom_partitioning` op whose operands and results
are all sharded on dim 0 over the token axes.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.custom_batching
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_ep import ops

from jax_ep._src import arrival as _arrival

from jax_ep._src import ordering as _order

from jax_ep._src import stream as _stream
from jax_ep._src.common import Cfg, concrete_mesh as _concrete_mesh


@dataclasses.dataclass(frozen=True)
class _Spec:
    """Static description of one sharded call."""
    num_experts: int
    num_ranks: int
    capacity: int
    mesh_axis: str
    token_axes: tuple
    num_shards: int       # S
    tokens_per_shard: int  # T
    backend: str
    group_axes: tuple      # ((name, size), ...) of the mesh axes other than mesh_axis

    @property
    def cfg(self):
        # Host callbacks cannot run inside a partitioned body: ids are checked on the
        # global array before the call instead (see dispatch).
        return Cfg(self.num_experts, self.num_ranks, self.capacity, self.mesh_axis,
                        self.backend, self.group_axes, check_ids=False)

    @property
    def experts_per_rank(self):
        return self.num_experts // self.num_ranks


def _context_mesh():
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty:
        from jax._src import mesh as mesh_lib  # `with mesh:` sets only this one
        physical = mesh_lib.thread_resources.env.physical_mesh
        if physical is not None and not physical.empty:
            return physical.abstract_mesh
        raise ValueError("jax_ep.sharded needs a mesh in context: wrap the call in "
                         "`with jax.set_mesh(mesh):` (or `with mesh:`)")
    return mesh


def _token_axes(mesh, mesh_axis, batch_axes) -> tuple:
    names = tuple(mesh.axis_names)
    if mesh_axis not in names:
        raise ValueError(f"mesh_axis {mesh_axis!r} is not an axis of the mesh {names}")
    if batch_axes is None:
        batch_axes = names[:names.index(mesh_axis)]
    elif isinstance(batch_axes, str):
        batch_axes = (batch_axes,)
    batch_axes = tuple(batch_axes)
    for a in batch_axes:
        if a not in names or a == mesh_axis:
            raise ValueError(f"batch_axes entry {a!r} must be a mesh axis other than "
                             f"mesh_axis; mesh axes are {names}")
    types = dict(zip(names, getattr(mesh, "axis_types", ())))
    explicit = [a for a in names if "Explicit" in str(types.get(a, ""))]
    if explicit:
        raise NotImplementedError(
            f"jax_ep.sharded works on meshes with Auto axes; axes {explicit} are Explicit. "
            "Create the mesh with axis_types=(jax.sharding.AxisType.Auto, ...), or call "
            "jax_ep.dispatch/combine inside jax.shard_map")
    return batch_axes + (mesh_axis,)


def _spec(x_rows, num_experts, mesh_axis, capacity, backend, batch_axes) -> _Spec:
    mesh = _context_mesh()
    token_axes = _token_axes(mesh, mesh_axis, batch_axes)
    R = int(mesh.shape[mesh_axis])
    S = math.prod(int(mesh.shape[a]) for a in token_axes)
    if x_rows % S != 0:
        raise ValueError(f"the token dimension ({x_rows}) must be divisible by the "
                         f"{S} shards of token axes {token_axes}")
    T = x_rows // S
    if num_experts % R != 0:
        raise ValueError(f"num_experts={num_experts} must be divisible by the size "
                         f"R={R} of mesh_axis {mesh_axis!r} (E % R != 0)")
    C = R * T if capacity is None else ops._static_int("capacity", capacity, 1)
    return _Spec(num_experts, R, C, mesh_axis, token_axes, S, T,
                 ops.resolve_backend(backend), _group_axes(mesh, mesh_axis))


def _group_axes(mesh, mesh_axis):
    # Inside a partitioned body the mesh is not in context, so name the group axes here.
    return tuple((a, int(mesh.shape[a])) for a in mesh.axis_names if a != mesh_axis)


def _shardings(mesh, spec: _Spec, n):
    return tuple(NamedSharding(mesh, P(spec.token_axes)) for _ in range(n))


def _without_barriers(body):
    """body, traced with no per-shard arrival barrier (a host callback inside a
    partitioned body is not safe; the op's own barrier runs before it)."""
    def traced(*args):
        with _arrival.partitioned_body():
            return body(*args)

    return traced


def _partitioned(spec: _Spec, body, abstract, rule, n_in, n_out, kind=None, **factors):
    """A custom_partitioning op whose every operand and result is sharded on dim 0 over
    the token axes; `body` is the per-shard function, `abstract` gives global shapes.
    `kind` names an op whose body communicates: on several processes (CPU) it waits for
    the arrival barrier first (jax_ep/_src/arrival.py); None: no barrier (no collective)."""
    op = custom_partitioning(abstract)
    # On GPU the op sits in a collective-stream region; the body, traced by the
    # partitioner inside it, emits plain EP calls (jax_ep._src.stream).
    partition_body = _stream.partitioned_body(_without_barriers(body))
    # XLA's partitioner traces the body after the user's trace is finished, so the body
    # chains its own calls only; the op itself is ordered in the enclosing trace
    # (jax_ep._src.ordering, through jax_ep._src.scope.named).
    partition_body = _order.unordered(partition_body)

    def out_shardings(mesh):
        outs = _shardings(mesh, spec, n_out)
        return outs[0] if n_out == 1 else outs

    def partition(mesh, arg_shapes, result_shape):
        return mesh, partition_body, out_shardings(mesh), _shardings(mesh, spec, n_in)

    def infer(mesh, arg_shapes, result_shape):
        return out_shardings(mesh)

    # Shardy wants replicated factors listed in the order they first appear in the rule.
    names = [c for c in rule if c.isalpha()]
    repl = tuple(sorted(factors.pop("need_replication_factors", ()), key=names.index))
    # Shardy propagates through `sharding_rule`; GSPMD needs the inference callback.
    gspmd = not jax.config.jax_use_shardy_partitioner
    op.def_partition(partition=partition, infer_sharding_from_operands=infer if gspmd else None,
                     sharding_rule=rule, need_replication_factors=repl, **factors)

    def make():
        def call(*args):
            mesh = _concrete_mesh()
            if mesh.size == 1:
                # XLA does not partition single-device programs (it would run `abstract`).
                return jax.shard_map(_without_barriers(body), mesh=mesh,
                                     in_specs=P(spec.token_axes),
                                     out_specs=P(spec.token_axes), check_vma=False)(*args)
            # Pin operands to the token sharding (one reshard if they arrive otherwise);
            # this also hands the partitioner the concrete mesh.
            sharding = NamedSharding(mesh, P(spec.token_axes))
            return _stream.region(op)(*[jax.lax.with_sharding_constraint(a, sharding)
                                        for a in args])

        # vmap over a leading batch axis: one exchange per batch element, in order.
        batched_call = jax.custom_batching.custom_vmap(call)

        @batched_call.def_vmap
        def _vmap_rule(axis_size, in_batched, *args):
            args = [a if b else jnp.broadcast_to(a, (axis_size,) + a.shape)
                    for a, b in zip(args, in_batched)]
            per_item = [call(*[a[i] for a in args]) for i in range(axis_size)]
            if n_out == 1:
                return jnp.stack(per_item), True
            outs = tuple(jnp.stack([p[j] for p in per_item]) for j in range(n_out))
            return outs, (True,) * n_out

        # Run eagerly, the op alone would evaluate `abstract` (zeros): a jit compiles it
        # with its partitioning. Under an outer jit it is inlined, so the program holds
        # the op itself rather than a call to a private function (which newer JAX may
        # share between two identical call sites).
        return jax.jit(batched_call, inline=True)

    # One traced program per collective-stream setting: a jit (and custom_vmap) keeps
    # its first trace, so a setting changed after the first call would otherwise not
    # take effect at the same shapes.
    made = {}

    def entry(*args):
        if kind is not None:
            # Here, not in the jit below: that one's trace is cached by types, and the
            # barrier's call-site id must come from this call's program point.
            args = _arrival.arrive_global(kind, args, spec.token_axes)
        key = _stream.mode()
        if key not in made:
            made[key] = make()
        return made[key](*args)

    return entry
