"""Loads the compiled extension and registers its FFI targets with XLA, once; the FFI
targets' signatures (operands, results, attributes, traits), read from the C++ tables
(xla_ffi/common/op_tables.h), and the `ffi_call` that builds a call from them."""
from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np

try:  # The extension is absent only in a broken or partial install.
    from jax_ep import _jax_ep_ext as ext
except ImportError as e:  # pragma: no cover - exercised only without a build
    ext = None
    _IMPORT_ERROR = e
else:
    _IMPORT_ERROR = None


def _gpu_platform_present() -> bool:
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


def _register(name: str, capsule, platform: str):
    """Registers one handler with XLA, with the traits its table row names (on CUDA:
    COMMAND_BUFFER_COMPATIBLE where the handler never allocates or waits for the host, so
    XLA may capture it in CUDA graphs)."""
    kwargs = {}
    if platform == "CUDA" and ffi_signature(name, platform).graph_safe:
        from jaxlib import xla_client
        kwargs["traits"] = xla_client.CustomCallTargetTraits.COMMAND_BUFFER_COMPATIBLE
    jax.ffi.register_ffi_target(name, capsule, platform=platform, **kwargs)


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
            _register(name, capsule, platform)
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
    for name, capsule in mod.registrations().get("CUDA", {}).items():
        _register(name, capsule, "CUDA")
    return True


def require_ext():
    if ext is None:
        raise ImportError(
            "jax_ep's compiled extension is missing; reinstall with `pip install -e .` "
            f"(import error: {_IMPORT_ERROR})")
    return ext


def build_info() -> dict:
    """What this build contains: {'cpu', 'cuda', 'nvshmem', 'nvshmem_qp_api', 'nccl': bool,
    'nccl_version': int, 'cuda_archs': [str], 'jax': version string}. 'nvshmem': the
    NVSHMEM module is built (it may still fail to load where libnvshmem_host.so.3 is
    missing: then 'nvshmem_qp_api' is False and `nvshmem_import_error()` says why).
    'nccl': the NCCL GIN transport's host side is built (against NCCL's headers, whose
    NCCL_VERSION_CODE is 'nccl_version', 0 without); libnccl.so.2 itself is looked up
    only when the transport starts."""
    info = {"cpu": False, "cuda": False, "nvshmem": False, "nvshmem_qp_api": False,
            "nccl": False, "nccl_version": 0, "cuda_archs": []}
    if ext is not None:
        raw = dict(ext.build_info())
        info["cpu"] = bool(raw["cpu"])
        info["cuda"] = bool(raw["cuda"])
        info["nvshmem"] = bool(raw["nvshmem"]) or nvshmem_built()
        info["cuda_archs"] = [a for a in str(raw["cuda_archs"]).split(",") if a]
        info["nccl"] = bool(raw.get("nccl", False))
        info["nccl_version"] = int(raw.get("nccl_version", 0))
        # internode: whether NVSHMEM's QP API (explicit QP per planned QP) is usable here
        # (loads the NVSHMEM module where built and a GPU is present: never on a CPU-only
        # host); transport_report() has the details.
        mod = nvshmem_ext() if info["nvshmem"] and _gpu_platform_present() else None
        info["nvshmem_qp_api"] = bool(getattr(mod, "nvshmem_qp_api_available",
                                              lambda: False)())
    info["jax"] = jax.__version__
    return info


# ---- FFI signatures: one table per op in C++ (xla_ffi/common/op_tables.h) ----

@dataclasses.dataclass(frozen=True)
class FfiSignature:
    """One FFI target's signature on one platform, as its handler decodes it (read from
    the extension: `_jax_ep_ext.ffi_signatures()`, made from xla_ffi/common/op_tables.h)."""
    target: str
    platform: str  # 'cpu' or 'CUDA', as in registrations()
    operands: tuple[str, ...]
    operand_types: tuple[str, ...]
    variadic: str | None  # the name of any trailing operands the handler also takes
    results: tuple[str, ...]
    result_types: tuple[str, ...]
    attrs: tuple[tuple[str, str, bool], ...]  # (name, 'i64' or 'i64s', required)
    traits: tuple[str, ...]  # e.g. ('COMMAND_BUFFER_COMPATIBLE',)

    @property
    def graph_safe(self) -> bool:
        return "COMMAND_BUFFER_COMPATIBLE" in self.traits


@functools.cache
def ffi_signatures() -> dict[str, dict[str, FfiSignature]]:
    """{platform: {target: FfiSignature}} for every target of the C++ tables (built into
    this extension or not)."""
    raw = require_ext().ffi_signatures()
    return {platform: {name: FfiSignature(
                target=name, platform=platform, operands=tuple(d["operands"]),
                operand_types=tuple(d["operand_types"]), variadic=d["variadic"],
                results=tuple(d["results"]), result_types=tuple(d["result_types"]),
                attrs=tuple((str(a), str(t), bool(r)) for a, t, r in d["attrs"]),
                traits=tuple(d["traits"]))
            for name, d in targets.items()}
            for platform, targets in raw.items()}


def _platform() -> str:
    return "cpu" if jax.default_backend() == "cpu" else "CUDA"


def ffi_signature(target: str, platform: str | None = None) -> FfiSignature:
    """The signature of `target` on `platform` ('cpu' or 'CUDA'; default: the platform of
    jax's default backend, else the one platform that has the target)."""
    sigs = ffi_signatures()
    platform = platform or _platform()
    if target in sigs.get(platform, {}):
        return sigs[platform][target]
    others = [p for p, t in sigs.items() if target in t]
    if not others:
        raise ValueError(f"{target!r} is no jax_ep FFI target (xla_ffi/common/op_tables.h "
                         f"has {sorted(set().union(*map(set, sigs.values())))})")
    return sigs[others[0]][target]


def ffi_arguments(target: str, named: dict, platform: str | None = None):
    """(operands, attributes) of a call of `target` from its operands and attributes
    given by name: operands in the handler's order (the variadic one, a sequence, last),
    attributes as the typed values XLA passes (int64 scalars, int64 arrays). A name the
    table does not have, or an operand or required attribute left out, is a TypeError
    naming the target."""
    sig = ffi_signature(target, platform)
    attrs = {name: (kind, required) for name, kind, required in sig.attrs}
    known = set(sig.operands) | set(attrs) | ({sig.variadic} if sig.variadic else set())
    unknown = sorted(set(named) - known)
    missing = [n for n in sig.operands if n not in named]
    missing += [n for n, (_, required) in attrs.items() if required and n not in named]
    if unknown or missing:
        problems = ([f"missing {', '.join(missing)}"] if missing else []) + (
            [f"no operand or attribute {', '.join(unknown)}"] if unknown else [])
        raise TypeError(
            f"jax_ep FFI target {target} ({sig.platform}): {'; '.join(problems)}. It takes "
            f"operands ({', '.join(sig.operands)}"
            f"{', *' + sig.variadic if sig.variadic else ''}) and attributes "
            f"({', '.join(n + ('' if r else '?') for n, _, r in sig.attrs)}) "
            "(xla_ffi/common/op_tables.h)")
    operands = [named[n] for n in sig.operands]
    if sig.variadic:
        operands += list(named.get(sig.variadic, ()))
    out = {}
    for name, (kind, _) in attrs.items():
        if name in named:
            v = named[name]
            out[name] = (np.asarray(v, np.int64) if kind == "i64s" else np.int64(v))
    return operands, out


def ffi_call(target: str, results, *, vmap_method: str | None = None,
             platform: str | None = None, bind: bool = True):
    """`jax.ffi.ffi_call(target, results, vmap_method=...)`, its results' count checked
    against the target's signature; the call takes its operands and attributes by name
    (`ffi_arguments`), or with bind=False as `jax.ffi.ffi_call`'s does."""
    sig = ffi_signature(target, platform)
    n = len(results) if isinstance(results, (tuple, list)) else 1
    if n != len(sig.results):
        raise TypeError(f"jax_ep FFI target {target} ({sig.platform}) returns "
                        f"{len(sig.results)} results ({', '.join(sig.results)}), the call "
                        f"types {n}")
    call = jax.ffi.ffi_call(target, results, vmap_method=vmap_method)
    if not bind:
        return call

    def named_call(**named):
        operands, attrs = ffi_arguments(target, named, sig.platform)
        return call(*operands, **attrs)
    return named_call
