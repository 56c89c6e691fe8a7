"""The two internode transports' libraries: which are present, their versions, and the
error that names what to install.

NVSHMEM: the `nvidia-nvshmem-cu13` wheel (libnvshmem_host.so.3), used by the module
`_jax_ep_nvshmem`. NCCL: the `nvidia-nccl-cu13` wheel (libnccl.so.2, >= 2.30 for GPU-initiated
networking), used through the native bindings (jax_ep._src.nccl_native). Nothing here
loads either library: versions come from the installed packages' metadata
(importlib.metadata) and, where a library is already loaded in the process, from the
library itself.
"""
from __future__ import annotations

import ctypes
import importlib.metadata
import os
import re

__all__ = ["NVSHMEM_PACKAGE", "NCCL_PACKAGE", "NCCL_PIP", "NVSHMEM_PIP", "NCCL_MIN",
           "TransportUnavailableError", "package_version", "nvshmem_library",
           "nccl_library", "require", "build_flags"]

NVSHMEM_PACKAGE = "nvidia-nvshmem-cu13"
NCCL_PACKAGE = "nvidia-nccl-cu13"
NCCL_MIN = (2, 30)  # the device API with GIN contexts, rail connections, windows
NCCL_PIP = 'pip install "nvidia-nccl-cu13>=2.30,<3"'
NVSHMEM_PIP = 'pip install "nvidia-nvshmem-cu13>=3.8,<3.9"'
EXTRA_PIP = "pip install 'jax-ep[cuda]'"


class TransportUnavailableError(ImportError):
    """The selected internode transport cannot run here: its library or this build's
    support for it is missing (the text names what to install)."""


def package_version(package: str) -> str | None:
    """The installed version of distribution `package` ("2.32.6"), None when absent."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None
    except Exception:  # noqa: BLE001 - broken metadata counts as absent
        return None


def _release(version: str | None) -> tuple[int, ...] | None:
    """"2.32.6" / "2.30.3.post1" -> (2, 32, 6) / (2, 30, 3); None for None or junk."""
    if not version:
        return None
    m = re.match(r"\s*(\d+(?:\.\d+)*)", version)
    return tuple(int(p) for p in m.group(1).split(".")) if m else None


def _loaded_nccl_version() -> str | None:
    """The version of a libnccl.so.2 already loaded in this process (ncclGetVersion),
    None when none is loaded. Never loads it."""
    from jax_ep._src import nccl_native
    if nccl_native.has("nccl_version"):
        try:
            return nccl_native.version() or None
        except Exception:  # noqa: BLE001 - a binding that fails reports nothing
            return None
    noload = getattr(os, "RTLD_NOLOAD", None)
    if noload is None:
        return None
    try:
        lib = ctypes.CDLL("libnccl.so.2", mode=noload | getattr(os, "RTLD_LAZY", 1))
    except OSError:
        return None
    code = ctypes.c_int(0)
    try:
        if lib.ncclGetVersion(ctypes.byref(code)) != 0:
            return None
    except AttributeError:
        return None
    v = code.value  # >= 2.9: major * 10000 + minor * 100 + patch
    return f"{v // 10000}.{v // 100 % 100}.{v % 100}" if v >= 20900 else None


def _loaded_nvshmem_version() -> str | None:
    """The NVSHMEM host library's version where the NVSHMEM module is already loaded."""
    from jax_ep._src import ext as _ext
    mod = _ext.nvshmem_ext(load=False)
    if mod is None or not hasattr(mod, "nvshmem_info"):
        return None
    try:
        v = int(dict(mod.nvshmem_info()).get("runtime_version", -1))
    except Exception:  # noqa: BLE001
        return None
    return None if v < 0 else f"{v // 10000}.{v // 100 % 100}.{v % 100}"


def build_flags() -> dict:
    """jax_ep.build_info() with 'nccl' False where the extension does not say."""
    from jax_ep._src.ext import build_info
    info = dict(build_info())
    info.setdefault("nccl", False)
    return info


def nvshmem_library(build: dict | None = None) -> dict:
    """NVSHMEM here: {available: bool (the wheel installed, or its library loaded), version:
    str | None (the loaded library's, else the package's), package, package_version,
    library_version, built: bool (build_info()['nvshmem']), why: str | None (what is
    missing, with the command to install it)}."""
    build = build_flags() if build is None else build
    pkg = package_version(NVSHMEM_PACKAGE)
    lib = _loaded_nvshmem_version()
    available = pkg is not None or lib is not None
    built = bool(build.get("nvshmem", False))
    why = None
    if not available:
        why = (f"the NVSHMEM library is not installed (no {NVSHMEM_PACKAGE} package): "
               f"{NVSHMEM_PIP} (or {EXTRA_PIP})")
    if not built:
        rebuild = ("this jax_ep build has no NVSHMEM module (build_info()['nvshmem'] is "
                   f"False): rebuild where nvcc and {NVSHMEM_PACKAGE} are installed")
        why = rebuild if available else f"{why}; then {rebuild}"
    return {"available": available, "version": lib or pkg, "package": NVSHMEM_PACKAGE,
            "package_version": pkg, "library_version": lib, "built": built, "why": why}


def nccl_library(build: dict | None = None) -> dict:
    """NCCL here: {available: bool (libnccl.so.2 >= 2.30: the native check where bound,
    else the installed wheel or the loaded library), version, package, package_version,
    library_version, built: bool (build_info()['nccl'], False where the key is missing),
    why: str | None (what is missing, with the command to install it)}."""
    from jax_ep._src import nccl_native
    build = build_flags() if build is None else build
    pkg = package_version(NCCL_PACKAGE)
    lib = _loaded_nccl_version()
    version = lib or pkg
    rel = _release(version)
    why = None
    if nccl_native.has("nccl_available"):
        try:
            available, native_why = nccl_native.available()
        except Exception as e:  # noqa: BLE001
            available, native_why = False, f"{type(e).__name__}: {e}"
        if not available:
            why = (f"NCCL >= {NCCL_MIN[0]}.{NCCL_MIN[1]} is not usable"
                   f"{f' ({native_why})' if native_why else ''}: {NCCL_PIP} (or {EXTRA_PIP})")
    elif rel is None:
        available = False
        why = (f"the NCCL library is not installed (no {NCCL_PACKAGE} package): {NCCL_PIP} "
               f"(or {EXTRA_PIP})")
    else:
        available = rel[:2] >= NCCL_MIN
        if not available:
            why = (f"NCCL {version} is older than {NCCL_MIN[0]}.{NCCL_MIN[1]} (GPU-initiated "
                   f"networking): {NCCL_PIP} (or {EXTRA_PIP})")
    built = bool(build.get("nccl", False))
    if not built:
        rebuild = ("this jax_ep build has no NCCL transport (build_info()['nccl'] is False): "
                   "rebuild where nvcc is present, with the NCCL headers of "
                   f"{NCCL_PACKAGE}>=2.30 installed")
        why = rebuild if available else f"{why}; then {rebuild}"
    return {"available": bool(available), "version": version, "package": NCCL_PACKAGE,
            "package_version": pkg, "library_version": lib, "built": built, "why": why}


def require(transport: str, library: dict | None = None) -> dict:
    """Checks that `transport` ("nvshmem" | "nccl") can run here: its library present and
    this build supporting it. Returns its library dict; TransportUnavailableError naming
    the package to install (or the rebuild) otherwise."""
    if transport == "nccl":
        lib = nccl_library() if library is None else library
        name = "NCCL (GPU-initiated networking)"
    elif transport == "nvshmem":
        lib = nvshmem_library() if library is None else library
        name = "NVSHMEM"
    else:
        raise ValueError(f"transport must be 'nvshmem' or 'nccl', got {transport!r}")
    if not (lib["available"] and lib["built"]):
        raise TransportUnavailableError(
            f"the internode transport {transport!r} was selected but {name} cannot run "
            f"here: {lib['why']}. Or select the other transport with JAX_EP_TRANSPORT.")
    return lib
