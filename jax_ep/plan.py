"""`python -m jax_ep.plan`: the planning model of `jax_ep.network.plan` (a model, not a
measurement). Import `jax_ep.network.plan` for its functions."""
import sys
import warnings


def main(argv=None):
    from jax_ep.network.plan import main as _main
    return _main(argv)


def __getattr__(name):
    # `jax_ep.plan.<function>` was the module `jax_ep.network.plan` until 0.1.
    from jax_ep.network import plan as _plan
    if not hasattr(_plan, name):
        raise AttributeError(f"module 'jax_ep.plan' has no attribute {name!r}")
    warnings.warn(f"jax_ep.plan.{name} is deprecated; use jax_ep.network.plan.{name}",
                  DeprecationWarning, stacklevel=2)
    return getattr(_plan, name)


if __name__ == "__main__":
    sys.exit(main())
