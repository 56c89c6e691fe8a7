"""`named(name)`: runs a public op under `jax.named_scope(name)`, so the HLO op_name
metadata of everything it emits (the EP custom calls, their operand preparation, and
the transposed calls of its gradient) carries the name, and profiles (XProf, Nsight
Systems via XLA's NVTX ranges) show which op an exchange belongs to."""
from __future__ import annotations

import functools

import jax

from jax_ep import _order


def named(name: str):
    # A public op that communicates is also put in program order after the EP calls
    # traced before it in the same trace (jax_ep._order); its own calls run inside a
    # custom_vjp body, a trace of their own, so the chain is made here.
    ordered = not name.endswith("get_dispatch_layout")

    def decorate(fn):
        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            with jax.named_scope(name):
                if not ordered:
                    return fn(*args, **kwargs)
                args, kwargs = _order.chain((args, kwargs))
                out = fn(*args, **kwargs)
                _order.record(out)
                return out

        return wrapped

    return decorate
