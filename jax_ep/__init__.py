"""jax-ep: expert-parallel dispatch and combine for JAX, as XLA FFI custom calls.

Public modules: `ops` (the per-shard contract), `sharded` (the global view),
`low_latency` (the decode mode), `flax` (the MoE layer), `experts`, `fp8`, `config`,
`cuda`, `nvshmem_bootstrap` and `nccl_bootstrap` (GPU start-up of the two internode
transports; `transport_report()` says which one runs and why), `network` (striping plan,
fabric, planning models), `bench` (benchmarks, `python -m jax_ep.bench`), `plan` (`python -m jax_ep.plan`).
Internals live in `jax_ep._src` (backends, ordering, partitioning, value checks, the
extension loader); docs/architecture.md draws the layers.
"""
from jax_ep import config, cuda, nccl_bootstrap, nvshmem_bootstrap, sharded
from jax_ep.config import Config
from jax_ep._src import arrival as _arrival
from jax_ep._src import deprecated as _deprecated
from jax_ep._src.ext import build_info
from jax_ep._src.errors import EPError, check_errors
from jax_ep._src.types import DispatchHandle, DispatchLayout
from jax_ep.network.transport import StripePlan, TransportConfig
from jax_ep.ops import combine, dispatch, get_dispatch_layout, resolve_backend
from jax_ep._src.libraries import TransportUnavailableError
from jax_ep._src.transports import transport_report

__all__ = [
    "Config",
    "DispatchHandle",
    "DispatchLayout",
    "EPError",
    "StripePlan",
    "TransportConfig",
    "TransportUnavailableError",
    "build_info",
    "check_errors",
    "combine",
    "dispatch",
    "get_dispatch_layout",
    "resolve_backend",
    "transport_report",
]
__version__ = "0.1.0"

# Multi-process CPU jobs: bound XLA's CPU collectives before JAX's backends start
# (jax_ep/_src/arrival.py says why).
_arrival.bound_cpu_collectives()
_deprecated.install()
