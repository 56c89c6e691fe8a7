"""`python -m jax_ep.plan`: the planning model of `jax_ep.network.plan` (a model, not a
measurement). Imported, this name is that module."""
import sys

from jax_ep.network import plan as _plan

if __name__ == "__main__":
    sys.exit(_plan.main())
sys.modules[__name__] = _plan
