"""`named(name)`: runs a public op under `jax.named_scope(name)`, so the HLO op_name
metadata of everything it emits (the EP custom calls, their operand preparation, and
the transposed calls of its gradient) carries the name, and profiles (XProf, Nsight
Systems via XLA's NVTX ranges) show which op an exchange belongs to."""
from __future__ import annotations

import contextvars
import functools

import jax

from jax_ep._src import ordering as _order

# The public op being traced (innermost), for messages that name it; None outside one
# (a backward pass is traced after its op returned).
_current = contextvars.ContextVar("jax_ep_public_op", default=None)


def current_op():
    """The name of the public op being traced, e.g. 'jax_ep.dispatch', or None."""
    return _current.get()


def named(name: str):
    # A public op that communicates is put in program order as a whole
    # (jax_ep._src.ordering): its own calls sit in a custom_vjp body (a trace of their
    # own), and this chain orders the op against the calls around it.
    ordered = not name.endswith("get_dispatch_layout")

    def decorate(fn):
        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            token = _current.set(name)
            try:
                return _run(args, kwargs)
            finally:
                _current.reset(token)

        def _run(args, kwargs):
            with jax.named_scope(name):
                if not ordered:
                    return fn(*args, **kwargs)
                args, kwargs = _order.chain((args, kwargs))
                out = fn(*args, **kwargs)
                _order.record(out)
                return out

        return wrapped

    return decorate
