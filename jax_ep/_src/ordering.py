"""Program order of the EP calls: no two EP calls of one rank may run at once.

The intranode and internode kernels keep per-op state on each GPU (epoch counters,
finish counters, one header slot per op kind), so two EP calls of one rank that XLA
runs at the same time (independent branches of a program; with
`--xla_gpu_command_buffer_scheduling_mode=CONCURRENT`, parallel branches of one CUDA
graph) would corrupt each other before the call-site check could catch it.

The order is threaded as values, through public JAX only (`jax.lax.optimization_barrier`):
each trace remembers one result of the last EP call traced in it; the next call's
operands pass an optimization barrier together with that result (`chain`), so they
depend on it, and its own results become the last call (`record`). XLA cannot reorder
or drop an optimization barrier, and the calls stay free of side effects, so
`jax.checkpoint` still rematerializes them and compiled programs keep JAX's C++ fast
path (no token argument, nothing of JAX patched).

Nested bodies (`jit`, `scan` / `while_loop`, `cond`, `checkpoint`, `custom_vjp` rules):
the first call of a body is chained to the last call of the nearest enclosing trace that
has one (the body closes over that value, so the body's operation as a whole waits for
it). A call after the body is ordered after the body's calls where it depends on the
body's results, as an MoE layer's next exchange does; a scan body's calls are ordered
against the next iteration's where the carry depends on them. Calls whose results
nobody uses are removed by XLA, the same way on every rank.

Bodies that XLA's partitioner traces (a custom_partitioning op's partition body:
`unordered`) chain their own calls only; the op around such a body is ordered in the
enclosing trace.
"""
from __future__ import annotations

import functools
import threading

import jax
import numpy as np

try:  # the current trace (read only); without it calls are ordered by data alone
    from jax._src import core as _core
except ImportError:  # pragma: no cover
    _core = None


def _current_trace():
    """The trace JAX is building now, or None when running eagerly (calls then run in
    dispatch order on one stream and need no chain)."""
    if _core is None:
        return None
    ctx = getattr(_core, "trace_ctx", None)
    trace = getattr(ctx, "trace", None)
    if trace is None or isinstance(trace, getattr(_core, "EvalTrace", ())):
        return None
    return trace


def _is_chainable(leaf) -> bool:
    if not isinstance(leaf, jax.Array):
        return False
    # An empty array orders nothing: XLA replaces every empty value by a constant before
    # scheduling, dropping its edges. In the barrier it also aborts XLA 0.12's CSE (an
    # empty constant given control predecessors cannot be removed).
    if leaf.size == 0:
        return False
    return jax.dtypes.issubdtype(leaf.dtype, np.number) or leaf.dtype == np.bool_


def _leaves(tree):
    leaves, treedef = jax.tree.flatten(tree)
    return leaves, treedef, [i for i, leaf in enumerate(leaves) if _is_chainable(leaf)]


_local = threading.local()


def unordered(fn):
    """`fn` run with no link to enclosing traces: for bodies that XLA's partitioner
    traces (a custom_partitioning op's partition body), whose enclosing user trace is
    finished by then; their own calls are still chained."""

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        prev = getattr(_local, "off", False)
        _local.off = True
        try:
            return fn(*args, **kwargs)
        finally:
            _local.off = prev

    return wrapped


# id(trace) -> (trace, one result tracer of the last EP call traced in it). Held only
# while the trace is being built (see _prune), so finished traces are released; held
# strongly, since a tracer dropped by Python may still feed later equations.
_last: dict[int, tuple] = {}


def _ancestors(trace):
    t = trace
    while t is not None:
        yield t
        t = getattr(t, "parent_trace", None)


def _finished(trace, live) -> bool:
    valid = getattr(trace, "is_valid", None)
    if valid is not None:
        return not valid()  # JAX invalidates a trace when its jaxpr is made
    return id(trace) not in live  # (older JAX) neither the current trace nor a parent


def _prune(current):
    """Drops the entries of finished traces: their tracers must not be kept or reused.
    (A trace beside the current one, such as a custom_vjp rule traced on its own, is not
    finished: its parents' entries stay.)"""
    live = {id(t) for t in _ancestors(current)}
    for k in [k for k, (t, _) in _last.items() if _finished(t, live)]:
        del _last[k]


def last_call(trace=None):
    """A result of the last EP call this trace must follow: the last one traced in
    `trace` (default: the current trace), else in its nearest enclosing trace that has
    one (the body then closes over it); None where there is none."""
    trace = _current_trace() if trace is None else trace
    if trace is None:
        return None
    _prune(trace)
    nested = not getattr(_local, "off", False)
    for t in _ancestors(trace):
        entry = _last.get(id(t))
        if entry is not None and entry[0] is t:
            return entry[1]
        if not nested:
            return None
    return None


# ---- the interface used by the ops ----

def chain(tree):
    """`tree` (a pytree: an EP call's operands) with every array leaf made to depend on
    the last EP call before it; unchanged when running eagerly or when there is none."""
    if _current_trace() is None:
        return tree
    leaves, treedef, idx = _leaves(tree)
    if not idx:
        return tree
    first = last_call()
    if first is None:
        return tree
    _, moved = jax.lax.optimization_barrier((first, [leaves[i] for i in idx]))
    for i, v in zip(idx, moved):
        leaves[i] = v
    return jax.tree.unflatten(treedef, leaves)


def record(results):
    """`results` (a pytree: an EP call's or a public op's outputs) made the last EP call
    of the current trace: every later EP call traced in it (or in its bodies) runs after
    it. Returns `results` unchanged."""
    trace = _current_trace()
    if trace is None:
        return results
    leaves, _, idx = _leaves(results)
    _prune(trace)
    mine = [leaves[i] for i in idx
            if isinstance(leaves[i], _core.Tracer)
            and getattr(leaves[i], "_trace", None) is trace]
    if mine:
        _last[id(trace)] = (trace, mine[0])
    return results


def ordered(fn):
    """`fn(*args, **kwargs)`, chained after the last EP call and recorded as the last."""

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        args, kwargs = chain((args, kwargs))
        return record(fn(*args, **kwargs))

    return wrapped
