"""One module per backend, each with the same functions and signatures:

    layout(topk_idx, cfg) -> DispatchLayout
    dispatch(x, topk_idx, topk_weights, cfg) -> (recv_x, recv_topk_idx, recv_topk_weights,
                                                 DispatchHandle)
    combine(y, handle, cfg) -> out[T, H]
    gather(g, handle, cfg) -> rows[C, H]        (combine's transpose)

with cfg a `jax_ep._src.common.Cfg`. `jax_ep.ops` owns the checks, the choice among them
(`resolve_backend`) and autodiff; no backend imports it.
"""
from __future__ import annotations

from jax_ep._src.backends import ffi, internode, reference

# Canonical backend name -> module ("intranode": the FFI kernels of jax_ep/_src/backends/
# ffi.py; jax_ep.ops.resolve_backend maps the deprecated name "ffi" to it).
MODULES = {"reference": reference, "intranode": ffi, "internode": internode}


def get(name: str):
    """The backend module for a resolved backend name."""
    try:
        return MODULES[name]
    except KeyError:
        raise ValueError(f"no backend named {name!r}; backends are {tuple(MODULES)}") from None
