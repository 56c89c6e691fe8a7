"""How a bond that hashes queue pairs onto ports spreads them: the statistics both
planning models (`plan` and `modes`) use. Arithmetic, not a measurement."""
from __future__ import annotations

import functools
import math

import numpy as np


@functools.lru_cache(maxsize=4096)
def expected_max_count(num_qps: int, num_ports: int, *, samples: int = 4000,
                       seed: int = 0) -> float:
    """E[max over ports of the number of QPs] when `num_qps` QPs are hashed onto
    `num_ports` ports independently and uniformly. Exact for 1 or 2 ports; a seeded
    Monte Carlo estimate otherwise."""
    m, p = int(num_qps), int(num_ports)
    if m <= 0:
        return 0.0
    if p == 1:
        return float(m)
    if p == 2:
        x = np.arange(m + 1)
        # log C(m, i) by cumulative log ratios, then the binomial(m, 1/2) pmf
        logc = np.concatenate([[0.0], np.cumsum(np.log((m - x[1:] + 1) / x[1:]))])
        pmf = np.exp(logc - m * math.log(2.0))
        return float(np.sum(pmf * np.maximum(x, m - x)))
    rng = np.random.default_rng(seed)
    counts = rng.multinomial(m, [1.0 / p] * p, size=samples)
    return float(counts.max(axis=1).mean())
