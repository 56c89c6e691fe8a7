"""`jax_ep.cuda` is `jax_ep.runtime.cuda` (the CUDA intranode runtime: buffers, peer
access, the virtual-rank harness); both names are one module object."""
import sys

from jax_ep.runtime import cuda as _module

sys.modules[__name__] = _module
