"""Loads the compiled extension and registers its FFI targets with XLA, once."""
from __future__ import annotations

import functools

import jax

try:  # The extension is absent only in a broken or partial install.
    from jax_ep import _jax_ep_ext as ext
except ImportError as e:  # pragma: no cover - exercised only without a build
    ext = None
    _IMPORT_ERROR = e
else:
    _IMPORT_ERROR = None


# CUDA targets whose handlers never allocate or wait for the host (errors go to a sticky
# device record), so XLA may capture them in CUDA graphs. The handlers declare the same
# trait in C++; tests/test_registrations.py keeps the two lists equal.
_GRAPH_SAFE = (
    # intranode, normal and low-latency modes (real ranks; not the harness)
    "jax_ep_layout", "jax_ep_dispatch", "jax_ep_combine", "jax_ep_gather",
    "jax_ep_ll_dispatch_send", "jax_ep_ll_dispatch_recv",
    "jax_ep_ll_dispatch_send_fp8", "jax_ep_ll_dispatch_recv_fp8",
    "jax_ep_ll_combine_send", "jax_ep_ll_combine_recv",
    # internode: direct, hierarchical and low-latency
    "jax_ep_internode_dispatch", "jax_ep_internode_combine", "jax_ep_internode_gather",
    "jax_ep_internode_hier_dispatch", "jax_ep_internode_hier_combine",
    "jax_ep_internode_hier_gather",
    "jax_ep_internode_ll_dispatch_send", "jax_ep_internode_ll_dispatch_recv",
    "jax_ep_internode_ll_dispatch_send_fp8", "jax_ep_internode_ll_dispatch_recv_fp8",
    "jax_ep_internode_ll_combine_send", "jax_ep_internode_ll_combine_recv",
)


def _gpu_platform_present() -> bool:
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


@functools.cache
def registered_platforms() -> frozenset[str]:
    """Registers every compiled handler; returns the platforms that now have them."""
    if ext is None:
        return frozenset()
    platforms = set()
    for platform, targets in ext.registrations().items():
        if platform == "CUDA" and not _gpu_platform_present():
            continue  # XLA has no CUDA platform to register with in a CPU-only jaxlib.
        for name, capsule in targets.items():
            kwargs = {}
            if platform == "CUDA" and name in _GRAPH_SAFE:
                # No host sync inside these calls: XLA may capture them in CUDA graphs.
                from jaxlib import xla_client
                kwargs["traits"] = xla_client.CustomCallTargetTraits.COMMAND_BUFFER_COMPATIBLE
            jax.ffi.register_ffi_target(name, capsule, platform=platform, **kwargs)
        platforms.add("cpu" if platform == "cpu" else "gpu")
    return frozenset(platforms)


# Called with each extension module loaded after import (jax_ep.config registers the one
# that gives the module its copy of the kernel settings; this module imports no setting).
on_module_load: list = []


# The NVSHMEM module (_jax_ep_nvshmem: the internode backend's runtime and handlers) needs
# libnvshmem_host.so.3, so it is loaded only when the internode backend is first used
# (nvshmem_bootstrap.initialize), never by `import jax_ep`.
_nvshmem = None
_nvshmem_error: str | None = None


def nvshmem_built() -> bool:
    """Whether this build has the NVSHMEM module (without loading it)."""
    import importlib.util
    return importlib.util.find_spec("jax_ep._jax_ep_nvshmem") is not None


def nvshmem_ext(load: bool = True):
    """The module with the NVSHMEM runtime calls (nvshmem_init, internode_error, ...):
    `jax_ep._jax_ep_nvshmem`, loaded on first use (load=False: only if already loaded);
    None where the build has none or it cannot load (`nvshmem_import_error()` says why)."""
    global _nvshmem, _nvshmem_error
    if _nvshmem is not None or not load:
        return _nvshmem
    if _nvshmem_error is not None:
        return None
    try:
        from jax_ep import _jax_ep_nvshmem as mod  # type: ignore[attr-defined]
    except ImportError as e:
        _nvshmem_error = str(e)
        return None
    for hook in on_module_load:
        hook(mod)  # jax_ep.config: its own copy of the kernel settings
    _nvshmem = mod
    return _nvshmem


def nvshmem_import_error() -> str | None:
    """Why `nvshmem_ext()` returned None (a missing libnvshmem_host.so.3, no module in
    this build), or None."""
    if _nvshmem is None and _nvshmem_error is None and not nvshmem_built():
        return "this jax_ep build has no NVSHMEM module (_jax_ep_nvshmem)"
    return _nvshmem_error


@functools.cache
def register_nvshmem_targets() -> bool:
    """Registers the internode FFI targets of the NVSHMEM module with XLA (once); False
    where there is no GPU platform or no loadable module."""
    mod = nvshmem_ext()
    if mod is None or not _gpu_platform_present():
        return False
    from jaxlib import xla_client
    for name, capsule in mod.registrations().get("CUDA", {}).items():
        kwargs = {}
        if name in _GRAPH_SAFE:
            kwargs["traits"] = xla_client.CustomCallTargetTraits.COMMAND_BUFFER_COMPATIBLE
        jax.ffi.register_ffi_target(name, capsule, platform="CUDA", **kwargs)
    return True


def require_ext():
    if ext is None:
        raise ImportError(
            "jax_ep's compiled extension is missing; reinstall with `pip install -e .` "
            f"(import error: {_IMPORT_ERROR})")
    return ext


def build_info() -> dict:
    """What this build contains: {'cpu', 'cuda', 'nvshmem', 'nvshmem_qp_api': bool,
    'cuda_archs': [str], 'jax': version string}. 'nvshmem': the NVSHMEM module is built
    (it may still fail to load where libnvshmem_host.so.3 is missing: then
    'nvshmem_qp_api' is False and `nvshmem_import_error()` says why)."""
    info = {"cpu": False, "cuda": False, "nvshmem": False, "nvshmem_qp_api": False,
            "cuda_archs": []}
    if ext is not None:
        raw = dict(ext.build_info())
        info["cpu"] = bool(raw["cpu"])
        info["cuda"] = bool(raw["cuda"])
        info["nvshmem"] = bool(raw["nvshmem"]) or nvshmem_built()
        info["cuda_archs"] = [a for a in str(raw["cuda_archs"]).split(",") if a]
        # internode: whether NVSHMEM's QP API (explicit QP per planned QP) is usable here
        # (loads the NVSHMEM module where built and a GPU is present: never on a CPU-only
        # host); transport_report() has the details.
        mod = nvshmem_ext() if info["nvshmem"] and _gpu_platform_present() else None
        info["nvshmem_qp_api"] = bool(getattr(mod, "nvshmem_qp_api_available",
                                              lambda: False)())
    info["jax"] = jax.__version__
    return info
