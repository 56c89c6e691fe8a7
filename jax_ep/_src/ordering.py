"""Program order of the EP calls: no two EP calls of one rank may run at once.

The intranode and internode kernels keep per-op state on each GPU (epoch counters,
finish counters, one header slot per op kind), so two EP calls of one rank that XLA
runs at the same time (independent branches of a program; with
`--xla_gpu_command_buffer_scheduling_mode=CONCURRENT`, parallel branches of one CUDA
graph) would corrupt each other before the call-site check could catch it.

One token orders every EP call of a program: `EPOrder` is an ordered JAX effect, so JAX
threads its token through the whole program, into and out of nested `jit`, `scan` /
`while_loop`, `cond`, `checkpoint` bodies and `custom_vjp` rules. Before an EP call its
operands pass through an optimization barrier together with the token (`chain`); after
it the token passes through a barrier together with the call's results (`record`). So
each call's operands depend on the previous call's results in trace order: the user's
independent calls, a call inside a scan body against the calls outside it, one
iteration's calls against the next's. XLA cannot reorder or drop an optimization
barrier, and the calls themselves stay free of side effects, so `jax.checkpoint` still
rematerializes them (the barrier has its own remat rule; the effect is declared allowed
under remat, control flow and custom derivatives, and shardable).

Between executions: JAX normally feeds an ordered effect's output token into the next
execution. A failed EP call (a bad id, issue 25's checks) fails its execution and with
it that token, so every later execution would raise the same error. This effect's output
token is therefore never kept (`_hook_runtime_tokens`): each execution takes the fresh
token JAX made first. Order across executions needs no token: executions on one device
run in dispatch order and each one waits for all of its streams before it completes.
A program compiled ahead of time is called through JAX's Python path (`_hook_aot_calls`):
JAX's C++ fast path would drop the token argument from its second call on.

Fallback, where this JAX lacks an internal API the effect needs (warned once) and inside
bodies lowered without tokens (`unordered`: a custom_partitioning op's partition body):
each trace chains its own calls, the next call's operands passing an optimization
barrier with one result of the trace's last call; calls in a nested body are then
ordered against calls outside it only by data.
"""
from __future__ import annotations

import functools
import threading
import warnings

import jax
import numpy as np

try:  # the current trace; internal, so every use below falls back to "no chaining"
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
    # scheduling, dropping its edges (so a call whose operands are all empty is not
    # ordered by data). In the barrier it also aborts XLA 0.12's CSE (an empty constant
    # given control predecessors cannot be removed).
    if leaf.size == 0:
        return False
    return jax.dtypes.issubdtype(leaf.dtype, np.number) or leaf.dtype == np.bool_


def _leaves(tree):
    leaves, treedef = jax.tree.flatten(tree)
    return leaves, treedef, [i for i, leaf in enumerate(leaves) if _is_chainable(leaf)]


# ---- the effect: one token through the whole program ----

def _hook_runtime_tokens(effect_type):
    """Makes JAX drop an execution's output token of `effect_type` instead of passing it
    to the next execution (which would then fail with a failed call's error)."""
    from jax._src import dispatch
    cls = dispatch.RuntimeTokenSet
    keep = cls.set_token_result
    dropped = getattr(keep, "_jax_ep_dropped", None)
    if dropped is not None:  # hooked before (this module reloaded): one hook, more types
        dropped.append(effect_type)
        return
    # The input side stays as JAX has it: a fresh token, made once and, since no output
    # token replaces it, reused by every execution.
    if not callable(getattr(cls, "get_token_input", None)):
        raise AttributeError("RuntimeTokenSet.get_token_input")
    dropped = [effect_type]

    def set_token_result(self, eff, token):
        if isinstance(eff, tuple(dropped)):
            return
        keep(self, eff, token)

    set_token_result._jax_ep_dropped = dropped
    set_token_result._jax_ep_original = keep
    cls.set_token_result = set_token_result


def _hook_aot_calls(effect_type):
    """Keeps a compiled program (`jit(f).lower(...).compile()`) that carries the token on
    JAX's Python call path. JAX's C++ fast path for such programs checks only for
    unordered effects; from the second call on it would pass the arguments without the
    token, which XLA rejects and the runtime then crashes on (jax 0.10.2 and 0.12)."""
    from jax._src.interpreters import pxla
    cls = pxla.MeshExecutable
    make = getattr(cls, "create_cpp_call", None)
    if make is None:  # no C++ fast path for compiled programs in this JAX
        return
    types = getattr(make, "_jax_ep_types", None)
    if types is not None:  # hooked before (this module reloaded)
        types.append(effect_type)
        return
    types = [effect_type]

    def create_cpp_call(self, params):
        call = getattr(self, "unsafe_call", None)
        if any(isinstance(e, tuple(types))
               for e in getattr(call, "ordered_effects", None) or ()):
            return None  # JAX then calls the program through Compiled.call
        return make(self, params)

    create_cpp_call._jax_ep_types = types
    create_cpp_call._jax_ep_original = make
    cls.create_cpp_call = create_cpp_call


def _make_effect():
    """(effect, primitive) of the program-wide order; raises where an API is missing."""
    from jax._src import effects
    from jax._src.interpreters import mlir
    from jax._src.interpreters import partial_eval as pe
    from jax._src.lib.mlir.dialects import hlo
    from jax.interpreters import ad, batching

    class EPOrder(effects.Effect):
        """The EP calls' program order (one token through the program)."""

        def __str__(self):
            return "EPOrder"

    effect = EPOrder()
    registries = [getattr(effects, r) for r in (
        "ordered_effects", "shardable_ordered_effects", "lowerable_effects",
        "control_flow_allowed_effects", "custom_derivatives_allowed_effects",
        "remat_allowed_effects")]
    _hook_runtime_tokens(EPOrder)
    _hook_aot_calls(EPOrder)
    for registry in registries:
        registry.add_type(EPOrder)

    prim = _core.Primitive("jax_ep_order")
    prim.multiple_results = True
    prim.def_impl(lambda *xs: list(xs))
    prim.def_effectful_abstract_eval(lambda *avals: (list(avals), {effect}))

    def lower(ctx, *xs):
        # The token and the values leave one barrier together: what follows the token
        # waits for the values, and the values for the token.
        outs = hlo.OptimizationBarrierOp([ctx.tokens_in.get(effect), *xs]).results
        ctx.set_tokens_out(mlir.TokenSet({effect: outs[0]}))
        return list(outs[1:])

    mlir.register_lowering(prim, lower)

    def jvp(primals, tangents):
        # Only the primal values carry the order; tangents pass untouched.
        return prim.bind(*primals), list(tangents)

    ad.primitive_jvps[prim] = jvp

    def remat_rule(saveable, unks_in, inst_in, eqn):
        # Under jax.checkpoint an effectful equation would run once with its outputs
        # saved, so the EP call before it would not be recomputed. The barrier is free:
        # it runs in the forward pass and again in the recomputation, where the
        # recomputed EP calls take their place in the backward pass's token order.
        res = [v for v, inst in zip(eqn.invars, inst_in)
               if type(v) is _core.Var and not inst]
        n = len(eqn.outvars)
        if any(unks_in):
            return None, eqn, [True] * n, [True] * n, res
        return eqn, eqn, [False] * n, [True] * n, res

    pe.partial_eval_jaxpr_custom_rules[prim] = remat_rule
    batching.primitive_batchers[prim] = lambda args, dims: (prim.bind(*args), dims)
    return effect, prim


order_p = None
if _core is not None:
    try:
        _EFFECT, order_p = _make_effect()
    except (ImportError, AttributeError, TypeError) as e:  # pragma: no cover
        order_p = None
        warnings.warn(f"jax_ep: this JAX lacks what the program-wide EP call order needs "
                      f"({e}); EP calls are chained within each trace only (calls in "
                      "nested jit/scan/cond/checkpoint bodies are ordered against the "
                      "others by data only)", RuntimeWarning)


def _barrier(leaves):
    """The leaves, passed through one optimization barrier with the program's EP token."""
    return order_p.bind(*leaves)


_local = threading.local()


def unordered(fn):
    """`fn` run with no token binding: for bodies JAX lowers where it threads no token
    (a custom_partitioning op's partition body, lowered by XLA's partitioner); the op
    around such a body is ordered in the enclosing program, its calls are chained per
    trace."""

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        prev = getattr(_local, "off", False)
        _local.off = True
        try:
            return fn(*args, **kwargs)
        finally:
            _local.off = prev

    return wrapped


def _token_on() -> bool:
    return order_p is not None and not getattr(_local, "off", False)


# ---- the fallback: each trace chains its own calls ----

# id(trace) -> (trace, one result tracer of the last EP call traced in it). Held only
# while the trace is being built (see _prune), so finished traces are released; held
# strongly, since a tracer dropped by Python may still feed later equations.
_last: dict[int, tuple] = {}


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
    traced in it by the fallback chain, or None."""
    trace = _current_trace() if trace is None else trace
    _prune(trace)
    if trace is None:
        return None
    entry = _last.get(id(trace))
    if entry is None or entry[0] is not trace:
        return None
    return entry[1]


# ---- the interface used by the ops ----

def chain(tree):
    """`tree` (a pytree: an EP call's operands) with every array leaf made to depend on
    the EP calls traced before it; unchanged when running eagerly."""
    if _current_trace() is None:
        return tree
    leaves, treedef, idx = _leaves(tree)
    if not idx:
        return tree
    if _token_on():
        moved = _barrier([leaves[i] for i in idx])
    else:
        first = last_call()
        if first is None:
            return tree
        _, moved = jax.lax.optimization_barrier((first, [leaves[i] for i in idx]))
    for i, v in zip(idx, moved):
        leaves[i] = v
    return jax.tree.unflatten(treedef, leaves)


def record(results):
    """`results` (a pytree: an EP call's or a public op's outputs) made the last EP call:
    every later EP call runs after it. Returns the results to use from here on (the
    same values; a caller that keeps the originals loses nothing, the order holds)."""
    trace = _current_trace()
    if trace is None:
        return results
    leaves, treedef, idx = _leaves(results)
    if not idx:
        return results
    if _token_on():
        moved = _barrier([leaves[i] for i in idx])
        for i, v in zip(idx, moved):
            leaves[i] = v
        return jax.tree.unflatten(treedef, leaves)
    _prune(trace)
    mine = [leaves[i] for i in idx
            if isinstance(leaves[i], _core.Tracer)
            and getattr(leaves[i], "_trace", None) is trace]
    if mine:
        _last[id(trace)] = (trace, mine[0])
    return results


def ordered(fn):
    """`fn(*args, **kwargs)`, chained after the EP calls traced before it and recorded
    as the last one."""

    def wrapped(*args, **kwargs):
        args, kwargs = chain((args, kwargs))
        return record(fn(*args, **kwargs))

    return wrapped
