"""The 0.1 package `jax_ep.runtime` (deprecated): its modules are `jax_ep.cuda`,
`jax_ep.nvshmem_bootstrap` and `jax_ep._src.errors`."""
__path__: list = []  # a package, so `jax_ep.runtime.cuda` resolves through the finder
