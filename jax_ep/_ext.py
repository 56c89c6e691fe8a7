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
    "jax_ep_ll_combine_send", "jax_ep_ll_combine_recv",
    # internode: direct, hierarchical and low-latency
    "jax_ep_internode_dispatch", "jax_ep_internode_combine", "jax_ep_internode_gather",
    "jax_ep_internode_hier_dispatch", "jax_ep_internode_hier_combine",
    "jax_ep_internode_hier_gather",
    "jax_ep_internode_ll_dispatch_send", "jax_ep_internode_ll_dispatch_recv",
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


def require_ext():
    if ext is None:
        raise ImportError(
            "jax_ep's compiled extension is missing; reinstall with `pip install -e .` "
            f"(import error: {_IMPORT_ERROR})")
    return ext


def build_info() -> dict:
    """What this build contains: {'cpu', 'cuda', 'nvshmem', 'nvshmem_qp_api': bool,
    'cuda_archs': [str], 'jax': version string}."""
    info = {"cpu": False, "cuda": False, "nvshmem": False, "nvshmem_qp_api": False,
            "cuda_archs": []}
    if ext is not None:
        raw = dict(ext.build_info())
        info["cpu"] = bool(raw["cpu"])
        info["cuda"] = bool(raw["cuda"])
        info["nvshmem"] = bool(raw["nvshmem"])
        info["cuda_archs"] = [a for a in str(raw["cuda_archs"]).split(",") if a]
        # internode: whether NVSHMEM's QP API (explicit QP per planned QP) is usable here;
        # jax_ep.backends.internode.transport_report() has the details.
        info["nvshmem_qp_api"] = bool(getattr(ext, "nvshmem_qp_api_available", lambda: False)())
    info["jax"] = jax.__version__
    return info
