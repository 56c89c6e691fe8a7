"""Program order of the EP calls: no two EP calls of one rank may run at once.

The intranode and internode kernels keep per-op state on each GPU (epoch counters,
finish counters, one header slot per op kind), so two EP calls of one rank that XLA
runs at the same time (independent branches of a program; with
`--xla_gpu_command_buffer_scheduling_mode=CONCURRENT`, parallel branches of one CUDA
graph) would corrupt each other before the call-site check could catch it.

One token orders every EP call of a program: `EPOrder` is an ordered JAX effect, so JAX
threads its token through the whole program, into and out of nested `jit`, `scan` /
`while_loop`, `cond`, `checkpoint` bodies and `custom_vjp` rules (as it does for ordered
`io_callback`s). Before an EP call its operands pass through an optimization barrier
together with the token (`chain`); after it the token passes through a barrier together
with the call's results (`record`). So each call's operands depend on the previous
call's results, in trace order, including the user's independent calls, a call inside a
scan body against the calls outside it, and one iteration's calls against the next's.
XLA cannot reorder or drop an optimization barrier, and the calls themselves stay free of
side effects, so `jax.checkpoint` can still rematerialize them (the effect is declared
allowed under remat, control flow and custom derivatives, and shardable, so programs over
many devices may carry it). Outside any trace (eager calls) nothing is chained: eager
calls run in dispatch order on one stream.
"""
from __future__ import annotations

import functools
import threading
import warnings

import jax
import numpy as np

try:  # internal APIs; without them EP calls are ordered by their data only (warned)
    from jax._src import core as _core
    from jax._src import effects as _effects
    from jax._src.interpreters import mlir as _mlir
    from jax._src.lib.mlir.dialects import hlo as _hlo
    from jax._src.interpreters import partial_eval as _pe
    from jax.interpreters import ad as _ad
    from jax.interpreters import batching as _batching
except ImportError:  # pragma: no cover
    _core = None


def _current_trace():
    """The trace JAX is building now, or None when running eagerly."""
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
    return jax.dtypes.issubdtype(leaf.dtype, np.number) or leaf.dtype == np.bool_


order_p = None
if _core is not None:
    try:
        class EPOrder(_effects.Effect):
            """The EP calls' program order (one token through the program)."""

            def __str__(self):
                return "EPOrder"

        _EFFECT = EPOrder()
        for _registry in ("ordered_effects", "shardable_ordered_effects", "lowerable_effects",
                          "control_flow_allowed_effects", "custom_derivatives_allowed_effects",
                          "remat_allowed_effects"):
            getattr(_effects, _registry).add_type(EPOrder)

        order_p = _core.Primitive("jax_ep_order")
        order_p.multiple_results = True
        order_p.def_impl(lambda *xs: list(xs))
        order_p.def_effectful_abstract_eval(lambda *avals: (list(avals), {_EFFECT}))

        def _lower(ctx, *xs):
            token = ctx.tokens_in.get(_EFFECT)
            # The token and the values leave one barrier together: what follows the
            # token waits for the values, and the values for the token.
            outs = _hlo.OptimizationBarrierOp([token, *xs]).results
            ctx.set_tokens_out(_mlir.TokenSet({_EFFECT: outs[0]}))
            return list(outs[1:])

        _mlir.register_lowering(order_p, _lower)

        def _jvp(primals, tangents):
            # Only the primal values carry the order; tangents pass untouched.
            return order_p.bind(*primals), list(tangents)

        _ad.primitive_jvps[order_p] = _jvp

        def _remat_rule(saveable, unks_in, inst_in, eqn):
            # Under jax.checkpoint an effectful equation would be run once and its outputs
            # saved, so the EP call before it would not be recomputed. The barrier is
            # free: it runs in the forward pass and again in the recomputation, where the
            # recomputed EP calls take their place in the backward pass's token order.
            res = [v for v, inst in zip(eqn.invars, inst_in)
                   if type(v) is _core.Var and not inst]
            n = len(eqn.outvars)
            if any(unks_in):
                return None, eqn, [True] * n, [True] * n, res
            return eqn, eqn, [False] * n, [True] * n, res

        _pe.partial_eval_jaxpr_custom_rules[order_p] = _remat_rule
        _batching.primitive_batchers[order_p] = lambda args, dims: (order_p.bind(*args), dims)
    except (AttributeError, TypeError) as e:  # pragma: no cover
        order_p = None
        warnings.warn(f"jax_ep: this JAX lacks what the EP call order needs ({e}); EP calls "
                      "are ordered by their data only", RuntimeWarning)


def _barrier(leaves):
    """The leaves, passed through one optimization barrier with the program's EP token."""
    return order_p.bind(*leaves)


_local = threading.local()


def unordered(fn):
    """`fn` run with no token binding: for bodies JAX lowers where it threads no token
    (a custom_partitioning op's partition body, lowered by XLA's partitioner); the op
    around such a body is ordered in the enclosing program instead."""

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        prev = getattr(_local, "off", False)
        _local.off = True
        try:
            return fn(*args, **kwargs)
        finally:
            _local.off = prev

    return wrapped


def _through_token(tree):
    if order_p is None or _current_trace() is None or getattr(_local, "off", False):
        return tree
    leaves, treedef = jax.tree.flatten(tree)
    idx = [i for i, leaf in enumerate(leaves) if _is_chainable(leaf)]
    if not idx:
        return tree
    moved = _barrier([leaves[i] for i in idx])
    for i, v in zip(idx, moved):
        leaves[i] = v
    return jax.tree.unflatten(treedef, leaves)


def chain(tree):
    """`tree` (a pytree: an EP call's operands) with every array leaf made to depend on
    the EP calls traced before it in this program; unchanged when running eagerly."""
    return _through_token(tree)


def record(results):
    """`results` (a pytree: an EP call's or a public op's outputs), with the program's
    EP token made to depend on them, so every later EP call runs after this one."""
    return _through_token(results)


def ordered(fn):
    """`fn(*args, **kwargs)`, chained after the EP calls traced before it and recorded
    as the last one."""

    def wrapped(*args, **kwargs):
        args, kwargs = chain((args, kwargs))
        return record(fn(*args, **kwargs))

    return wrapped
