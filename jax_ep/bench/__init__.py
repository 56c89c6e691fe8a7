"""Benchmarks: `python -m jax_ep.bench` (the console script `jax-ep-bench`).

  exchange     dispatch, combine and round trip per backend (the default)
  layer        `--layer` and `--train-step`: the Flax MoE layer and the demo's step
  low_latency  `--mode low_latency`: the decode mode
  launch, worker  `--processes N` and the internode modes: the launcher and each process
  overhead     `--dispatch-overhead`: host cost per step
  emulated     `--emulated`: counts on the emulated GPU; `perf_model` turns them into a
               roofline-style model of GPU time (a model, not a measurement)

Each mode lists its flags with `-h`.
"""


def main(argv=None):
    """The `python -m jax_ep.bench` command line; returns its report or exit status."""
    from jax_ep.bench.exchange import main as _main
    return _main(argv)
