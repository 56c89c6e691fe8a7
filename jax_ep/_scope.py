"""`named(name)`: runs a public op under `jax.named_scope(name)`, so the HLO op_name
metadata of everything it emits (the EP custom calls, their operand preparation, and
the transposed calls of its gradient) carries the name, and profiles (XProf, Nsight
Systems via XLA's NVTX ranges) show which op an exchange belongs to."""
from __future__ import annotations

import functools

import jax


def named(name: str):
    def decorate(fn):
        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            with jax.named_scope(name):
                return fn(*args, **kwargs)

        return wrapped

    return decorate
