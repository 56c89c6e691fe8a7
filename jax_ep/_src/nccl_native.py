"""The one seam between Python and the native NCCL host side
(kernels/internode/nccl_host.{h,cc}, namespace jax_ep::nccl_host).

Every NCCL call Python makes goes through this module. It looks the bindings up by name on
an extension module and, where one is missing, raises `NcclNativeMissing` (a
NotImplementedError) naming the binding and the modules searched, so the Python side runs
(and is tested) before the bindings exist.

Bindings looked up (name: C++ function it wraps, Python types):

    nccl_available() -> (bool, str)           Available(&why): libnccl.so.2 found, >= 2.30
    nccl_version() -> str                     VersionString(): "2.32.6" or ""
    nccl_unique_id() -> bytes                 UniqueId(&out): 128 bytes, "" error -> raise
    nccl_start(ordinals: list[int], ranks: list[int], world: int, uid: bytes,
               heap_bytes: int, num_contexts: int, gpus_per_node: int) -> str
                                              Start(...): "" or the error
    nccl_finish(ordinals: list[int]) -> str   Finish(ordinals): "" or the error
    nccl_started() -> bool                    Started() on the current CUDA device
    nccl_rank() -> int, nccl_world() -> int   Rank(), World() of the current device

Modules searched, in order: one given to `use()` (tests, the emulated build's module),
`jax_ep._jax_ep_nccl` where built, `jax_ep._jax_ep_ext`, the NVSHMEM module
`jax_ep._jax_ep_nvshmem` if already loaded (never loaded from here).
"""
from __future__ import annotations

import importlib.util
from typing import Any

__all__ = ["BINDINGS", "NcclNativeMissing", "NcclNativeError", "use", "module",
           "has", "binding", "available", "version", "unique_id", "start", "finish",
           "started"]

UNIQUE_ID_BYTES = 128  # sizeof(ncclUniqueId)

BINDINGS = ("nccl_available", "nccl_version", "nccl_unique_id", "nccl_start",
            "nccl_finish", "nccl_started", "nccl_rank", "nccl_world")


class NcclNativeMissing(NotImplementedError):
    """A native NCCL binding this build does not have."""


class NcclNativeError(RuntimeError):
    """A native NCCL call reported an error (its text names the NCCL call)."""


_override: Any = None


def use(mod) -> None:
    """Makes `mod` (any object with the bindings; None: back to the search) the module
    every binding is looked up on first."""
    global _override
    _override = mod


def _candidates() -> list[tuple[str, Any]]:
    out = []
    if _override is not None:
        out.append((getattr(_override, "__name__", repr(_override)), _override))
    if importlib.util.find_spec("jax_ep._jax_ep_nccl") is not None:
        try:
            from jax_ep import _jax_ep_nccl  # type: ignore[attr-defined]
            out.append(("jax_ep._jax_ep_nccl", _jax_ep_nccl))
        except ImportError:
            pass
    from jax_ep._src import ext as _ext
    if _ext.ext is not None:
        out.append(("jax_ep._jax_ep_ext", _ext.ext))
    nv = _ext.nvshmem_ext(load=False)
    if nv is not None:
        out.append(("jax_ep._jax_ep_nvshmem", nv))
    return out


def module(name: str = "nccl_start"):
    """The first searched module that has binding `name`, or None."""
    for _, mod in _candidates():
        if hasattr(mod, name):
            return mod
    return None


def has(name: str) -> bool:
    """Whether binding `name` exists in a searched module."""
    return module(name) is not None


def binding(name: str):
    """The callable binding `name`; NcclNativeMissing naming it and the modules searched."""
    for _, mod in _candidates():
        fn = getattr(mod, name, None)
        if fn is not None:
            return fn
    searched = ", ".join(n for n, _ in _candidates()) or "no extension module loaded"
    raise NcclNativeMissing(
        f"this jax_ep build has no native NCCL binding `{name}` (searched: {searched}); "
        f"the NCCL transport needs a build with the bindings of "
        "kernels/internode/nccl_host.{h,cc} "
        f"(build_info()['nccl'] True)")


# --- the calls ---------------------------------------------------------------------------

def available() -> tuple[bool, str]:
    """(libnccl.so.2 found and >= 2.30, why not); NcclNativeMissing without the binding."""
    r = binding("nccl_available")()
    if isinstance(r, tuple):
        ok, why = r
        return bool(ok), str(why or "")
    return bool(r), ""


def version() -> str:
    """The loaded NCCL's version "2.32.6", or "" when unknown."""
    return str(binding("nccl_version")() or "")


def unique_id() -> bytes:
    """A fresh ncclUniqueId: 128 bytes."""
    uid = bytes(binding("nccl_unique_id")())
    if len(uid) != UNIQUE_ID_BYTES:
        raise NcclNativeError(f"ncclGetUniqueId gave {len(uid)} bytes, expected "
                              f"{UNIQUE_ID_BYTES}")
    return uid


def _checked(what: str, r) -> None:
    if r:  # the C++ side returns "" on success, else the error naming the NCCL call
        raise NcclNativeError(f"{what}: {r}")


def start(ordinals, ranks, world: int, uid: bytes, heap_bytes: int, num_contexts: int,
          gpus_per_node: int, low_latency=()) -> None:
    """Start(ordinals[i] -> world rank ranks[i], world, uid, heap_bytes, num_contexts,
    gpus_per_node): one communicator, window and device communicators per local GPU, and
    the internode runtime on each (low_latency: [max_tokens, row_bytes, topk, num_experts]
    of the low-latency area the window also holds).
    Collective over the world; NcclNativeError with the native error text."""
    _checked("NCCL start", binding("nccl_start")(
        [int(o) for o in ordinals], [int(r) for r in ranks], int(world), bytes(uid),
        int(heap_bytes), int(num_contexts), int(gpus_per_node),
        [int(v) for v in low_latency]))


def finish(ordinals) -> None:
    """Finish(ordinals): collective; frees every communicator, window and heap."""
    _checked("NCCL finish", binding("nccl_finish")([int(o) for o in ordinals]))


def started() -> bool:
    """Started() on the current CUDA device; False without the binding."""
    mod = module("nccl_started")
    return bool(mod.nccl_started()) if mod is not None else False
