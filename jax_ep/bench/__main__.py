"""`python -m jax_ep.bench`: see `jax_ep.bench`."""
from jax_ep.bench.exchange import main

main()
