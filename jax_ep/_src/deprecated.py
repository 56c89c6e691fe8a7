"""Module paths of jax-ep 0.1 that moved in the package layout of 0.2: importing an old
path still works for one release, with a DeprecationWarning naming the new one."""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

# old module -> new module
MOVED = {
    "jax_ep.backends": "jax_ep._src.backends",
    "jax_ep.backends.ffi": "jax_ep._src.backends.ffi",
    "jax_ep.backends.internode": "jax_ep._src.backends.internode",
    "jax_ep.backends.reference": "jax_ep._src.backends.reference",
    "jax_ep.runtime": "jax_ep._src.runtime_compat",
    "jax_ep.runtime.cuda": "jax_ep.cuda",
    "jax_ep.runtime.nvshmem": "jax_ep.nvshmem_bootstrap",
    "jax_ep.runtime.errors": "jax_ep._src.errors",
    "jax_ep.model": "jax_ep.bench.perf_model",
    "jax_ep.emulator": "jax_ep._src.emu",
    "jax_ep.sharded_low_latency": "jax_ep._src.sharded_low_latency",
    "jax_ep.bench_layer": "jax_ep.bench.layer",
    "jax_ep.bench_low_latency": "jax_ep.bench.low_latency",
    "jax_ep.bench_emulated": "jax_ep.bench.emulated",
    "jax_ep.bench_launch": "jax_ep.bench.launch",
    "jax_ep.bench_worker": "jax_ep.bench.worker",
    "jax_ep.bench_overhead": "jax_ep.bench.overhead",
}


class _Loader(importlib.abc.Loader):
    def __init__(self, old: str, new: str):
        self.old, self.new = old, new

    def create_module(self, spec):
        warnings.warn(f"{self.old} is deprecated and will be removed in the next release; "
                      f"import {self.new}", DeprecationWarning, stacklevel=3)
        return importlib.import_module(self.new)

    def exec_module(self, module):
        pass  # the new module is already executed


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        new = MOVED.get(name)
        if new is None:
            return None
        return importlib.util.spec_from_loader(name, _Loader(name, new))


def install() -> None:
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
