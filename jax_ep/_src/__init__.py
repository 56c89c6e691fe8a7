"""jax-ep's internals: no stable API. Public names are re-exported by the modules of
`jax_ep` itself."""
