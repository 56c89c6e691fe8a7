"""jax-ep: expert-parallel dispatch and combine for JAX, as XLA FFI custom calls.

Layout: `ops` (the per-shard contract) over `backends/` (reference, ffi, internode);
`sharded` (the global view); `flax` (the MoE layer); `runtime/` (CUDA and NVSHMEM
start-up); `network/` (striping plan and planning model); `bench` (benchmarks).
"""
from jax_ep import _arrival, config, cuda, nvshmem_bootstrap, sharded
from jax_ep._ext import build_info
from jax_ep.runtime.errors import EPError, check_errors
from jax_ep._types import DispatchHandle, DispatchLayout
from jax_ep.network.transport import StripePlan, TransportConfig
from jax_ep.ops import combine, dispatch, get_dispatch_layout, resolve_backend

__all__ = [
    "DispatchHandle",
    "DispatchLayout",
    "EPError",
    "StripePlan",
    "TransportConfig",
    "build_info",
    "check_errors",
    "combine",
    "dispatch",
    "get_dispatch_layout",
    "resolve_backend",
]
__version__ = "0.1.0"

# Multi-process CPU jobs: bound XLA's CPU collectives before JAX's backends start
# (jax_ep/_arrival.py says why).
_arrival.bound_cpu_collectives()
