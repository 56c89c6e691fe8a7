"""jax-ep: expert-parallel dispatch and combine for JAX, as XLA FFI custom calls."""
from jax_ep import cuda, sharded
from jax_ep._ext import build_info
from jax_ep._types import DispatchHandle, DispatchLayout
from jax_ep.ops import combine, dispatch, get_dispatch_layout, resolve_backend
from jax_ep.transport import StripePlan, TransportConfig

__all__ = [
    "DispatchHandle",
    "DispatchLayout",
    "StripePlan",
    "TransportConfig",
    "build_info",
    "combine",
    "dispatch",
    "get_dispatch_layout",
    "resolve_backend",
]
__version__ = "0.1.0"
