"""`jax_ep.nvshmem_bootstrap` is `jax_ep.runtime.nvshmem` (starting NVSHMEM for the
internode transport); both names are one module object."""
import sys

from jax_ep.runtime import nvshmem as _module

sys.modules[__name__] = _module
