"""Program order of the EP calls: no two EP calls of one rank may run at once.

The intranode and internode kernels keep per-op state on each GPU (epoch counters,
finish counters, one header slot per op kind), so two EP calls of one rank that XLA
runs at the same time (independent branches of a program; with
`--xla_gpu_command_buffer_scheduling_mode=CONCURRENT`, parallel branches of one CUDA
graph) would corrupt each other before the call-site check could catch it.

Each trace keeps its last EP call: the next EP call traced in the same trace takes its
operands through an optimization barrier together with one live result of that call
(`chain`), which XLA cannot reorder or drop, and its own results become the trace's last
call (`record`). It is a plain data dependency, so `jax.checkpoint` can still
rematerialize the calls (a side-effecting call could not be).

Scope: only values of the trace being built are used, never a tracer of another trace
(an outer or finished one), so nothing leaks between traces. Calls inside a nested
`jit`, `scan`, `cond` or `checkpoint` body are chained with the other calls of that body;
the body as a whole is ordered against the calls outside it through data only. One
result of a trace's last call is held (strongly: a tracer dropped by Python may still
feed later equations, so a weak reference could lose a live call) until that trace is
no longer being built, i.e. it is neither the current trace nor one of its parents; so
a call whose results are unused is still run, in order, when a later call follows it.
"""
from __future__ import annotations

import jax
import numpy as np

try:  # the current trace; internal, so every use below falls back to "no chaining"
    from jax._src import core as _core
except ImportError:  # pragma: no cover
    _core = None

# id(trace) -> (trace, one result tracer of the last EP call traced in it). Held only
# while the trace is being built (see _prune), so finished traces are released.
_last: dict[int, tuple] = {}


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


def _prune(current):
    """Drops the entries of traces that are neither `current` nor one of its parents:
    those traces are finished, and their tracers must not be kept or reused."""
    live = set()
    t = current
    while t is not None:
        live.add(id(t))
        t = getattr(t, "parent_trace", None)
    for k in [k for k in _last if k not in live]:
        del _last[k]


def last_call(trace=None):
    """A result (a tracer of `trace`, default the current one) of the last EP call
    traced in it, or None."""
    trace = _current_trace() if trace is None else trace
    _prune(trace)
    if trace is None:
        return None
    entry = _last.get(id(trace))
    if entry is None or entry[0] is not trace:
        return None
    return entry[1]


def _is_chainable(leaf) -> bool:
    if not isinstance(leaf, jax.Array):
        return False
    return jax.dtypes.issubdtype(leaf.dtype, np.number) or leaf.dtype == np.bool_


def chain(tree):
    """`tree` (a pytree) with every array leaf made to depend on the last EP call traced
    in the current trace; unchanged where there is none."""
    first = last_call()
    if first is None:
        return tree
    leaves, treedef = jax.tree.flatten(tree)
    idx = [i for i, leaf in enumerate(leaves) if _is_chainable(leaf)]
    if not idx:
        return tree
    _, moved = jax.lax.optimization_barrier((first, [leaves[i] for i in idx]))
    for i, v in zip(idx, moved):
        leaves[i] = v
    return jax.tree.unflatten(treedef, leaves)


def record(results):
    """Makes `results` (a pytree: an EP call's or a public op's outputs) the current
    trace's last EP call."""
    trace = _current_trace()
    if trace is None:
        return
    _prune(trace)
    mine = [leaf for leaf in jax.tree.leaves(results)
            if isinstance(leaf, _core.Tracer) and getattr(leaf, "_trace", None) is trace
            and _is_chainable(leaf)]
    if mine:
        _last[id(trace)] = (trace, mine[0])


def ordered(fn):
    """`fn(*args, **kwargs)`, chained after the current trace's last EP call and
    recorded as its new last one."""

    def wrapped(*args, **kwargs):
        args, kwargs = chain((args, kwargs))
        out = fn(*args, **kwargs)
        record(out)
        return out

    return wrapped
