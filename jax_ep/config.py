"""Library-wide settings of jax-ep: one frozen `Config`, read once from the environment
when jax_ep is imported.

Every `JAX_EP_*` variable the library reads at run time, and the one CUDA variable it
reads beside the driver (CUDA_DEVICE_MAX_CONNECTIONS):

| variable | setting | type | default | what it does |
| --- | --- | --- | --- | --- |
| JAX_EP_COLLECTIVE_STREAM | collective_stream | auto, 1/true/on, 0/false/off | auto | wrap every communicating EP custom call in a region on XLA's collective stream; auto: when lowering for a GPU platform |
| JAX_EP_TIMEOUT_S | timeout_s | float > 0 | 300 (kernels/common/settings.h) | seconds any backend waits for a peer before failing |
| JAX_EP_NUM_SMS | num_sms | int >= 1 | unset: the GPU's SMs less 16 | SMs the CUDA EP kernels may use (jax_ep.cuda.set_num_sms) |
| JAX_EP_RING_TOKENS | ring_tokens | int >= 1 | unset: 128 (at most 4096) | slots of each intranode (channel, peer) ring; keep it the same on every rank |
| JAX_EP_BULK_PIECE_BYTES | bulk_piece_bytes | int >= 1 | unset: by rank count | bytes of one bulk-copy piece of the intranode dispatch (a multiple of 16) |
| JAX_EP_CUDA_PRESET | cuda_preset | preset name | unset: by rank count | forces an intranode launch preset by name (jax_ep.cuda.presets()) |
| JAX_EP_HIER_SOURCE_BLOCKS | hier_source_blocks | int >= 1 | unset: 16, at most half of hierarchical_sms | blocks of the hierarchical combine's source role |
| JAX_EP_HIER_PUSH_PARTS | hier_push_parts | int >= 1 | unset: by warps | parts of a hierarchical combine pusher (at most 4) |
| JAX_EP_HIER_FORWARD_COLUMNS | hier_forward_columns | int >= 1 | unset: 1 | column parts of a hierarchical dispatch forwarder (at most 4) |
| JAX_EP_HIER_DISPATCH_BLOCKS | hier_dispatch_blocks | int >= 1 | unset: hierarchical_sms | blocks of the hierarchical dispatch |
| JAX_EP_HIER_COMBINE_BLOCKS | hier_combine_blocks | int >= 1 | unset: hierarchical_sms less the source blocks | role blocks of the hierarchical combine |
| JAX_EP_INTRANODE_SMS | intranode_sms | int >= 1 | unset: the intranode preset's (kernels/common/configs.h: 24 at 8 and 16 ranks) | SMs (blocks) the intranode kernels use; only lowers the preset's (the buffers are sized for it) |
| JAX_EP_HIERARCHICAL_SMS | hierarchical_sms | int >= 1 | unset: by ranks (configs.h kInternodeSmPresets: 12 up to 16 ranks) | SMs (blocks) of the hierarchical internode kernels; below what holds every role warp is an error |
| JAX_EP_DIRECT_SMS | direct_sms | int >= 1 | unset: by ranks (configs.h kInternodeSmPresets: 12 up to 32 ranks) | SMs (blocks) of the direct internode kernels: about half post RDMA, the rest copy over NVLink |
| JAX_EP_LOW_LATENCY_SMS | low_latency_sms | int >= 1 | unset: the whole EP budget (num_sms; 116 on a 132-SM GPU; configs.h kInternodeSmPresets) | SMs (blocks) of the internode low-latency kernels |
| JAX_EP_INTERNODE_MODE | internode_mode | direct, hierarchical, auto | unset: the caller's | internode mode of the NVSHMEM backend |
| JAX_EP_TRANSPORT | transport | nvshmem, nccl, auto | auto | internode transport: NVSHMEM (one process per GPU) or NCCL's GPU-initiated networking (one process per GPU or per host); auto: NCCL where a process drives several GPUs, NVSHMEM is missing or the fabric is roce-lag, else NVSHMEM (jax_ep.network.transport_choice.choose_transport) |
| JAX_EP_GPUS_PER_NODE | gpus_per_node | int >= 1 | unset: detected | GPUs (PEs) per node of the EP group; must divide the ranks |
| JAX_EP_NUM_PORTS | num_ports | int >= 1 | unset: TransportConfig's | NIC ports the internode traffic is striped over |
| JAX_EP_QPS_PER_PORT | qps_per_port | int >= 1 | unset: TransportConfig's | queue pairs per port and peer |
| JAX_EP_CHUNK_BYTES | chunk_bytes | int >= 1 | unset: TransportConfig's | bytes of one striping chunk |
| JAX_EP_FABRIC | fabric | on, off (0/none) | on | fabric discovery and NVSHMEM device selection at bootstrap |
| JAX_EP_LAG_AFFINITY | lag_affinity | alternate, none | alternate | LAG port affinity of the QPs on bonded RoCE |
| JAX_EP_SYSFS | sysfs | path | /sys | sysfs root fabric discovery reads |
| JAX_EP_ROUTE_TABLE | route_table | path | unset: /proc/net/route | routing table the bootstrap interface is chosen from |
| JAX_EP_GPU_PCI_BUS_ID | gpu_pci_bus_id | PCI bus id | unset: JAX's device | this process's GPU for fabric discovery |
| JAX_EP_LAG_SHIM | lag_shim | path | unset: the built shim | the LAG affinity shim library to load |
| CUDA_DEVICE_MAX_CONNECTIONS | hardware_queues | int in [1, 32] | 8 (the CUDA driver's default) | hardware queues the driver gives this process's streams (it reads the variable once, when CUDA starts: set it before); the virtual-rank harness runs at most this many ranks |

An empty variable is the same as an unset one; a bad value is a ValueError naming the
variable (at import). The kernels' settings (timeout_s, num_sms, ring_tokens,
bulk_piece_bytes, cuda_preset, hier_*, the SMs per mode *_sms) reach C++ through the bindings (`set_settings`,
kernels/common/settings.h) of every loaded extension module, at import and on every
change; the kernels read them when they launch. collective_stream is read when an op is
traced (a change applies to programs traced after it). The network settings are read when
NVSHMEM starts (jax_ep.nvshmem_bootstrap) or a plan is made; transport when the internode
transport is chosen (jax_ep.transport_report, jax_ep.nccl_bootstrap).

Build-time, test and emulator variables (not settings):

| variable | read by | what it does |
| --- | --- | --- |
| JAX_EP_CUDA, JAX_EP_NVSHMEM_ROOT | `pip install` (pyproject.toml, cmake/nvshmem.cmake) | build the CUDA backend (AUTO, ON, OFF); where NVSHMEM is |
| JAX_EP_EMU_MODULE_DIR | jax_ep/_src/emu.py | load the emulated module from a scratch build (make test-emu-asan) |
| JAX_EP_EMU_TLS_COPY | kernels/emu | the emulator copies __shared__ images instead of pointing at them |
| JAX_EP_COMPUTE_SANITIZER | scripts/gpu_check.sh | the compute-sanitizer binary |

Use `jax_ep.config.update("collective_stream", False)`, or `with
jax_ep.config.override(ring_tokens=2): ...` for a scope; read `jax_ep.config.ring_tokens`
or `jax_ep.config.current()` (the whole `Config`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from typing import Any, Callable, Mapping

__all__ = ["Config", "current", "update", "override", "from_env", "settings_for",
           "ENV", "KERNEL_SETTINGS"]

_TRUE = ("1", "true", "on", "yes")
_FALSE = ("0", "false", "off", "no")


def _kernel_defaults() -> dict:
    """Defaults C++ and Python share (kernels/common/settings.h, configs.h), through the
    bindings; {} where the extension is missing."""
    from jax_ep._src import ext as _ext
    if _ext.ext is None or not hasattr(_ext.ext, "settings_defaults"):
        return {}
    return dict(_ext.ext.settings_defaults())


_DEFAULTS = _kernel_defaults()


# ----------------------------------------------------------------------------- parsers
# Each takes (value, name) where name is the variable or setting the value came from, and
# returns the checked value or raises ValueError naming it.

def _unset(value) -> bool:
    return value is None or (isinstance(value, str) and value.strip() == "")


def _collective_stream(value, name):
    if value is None:
        return "auto"
    if isinstance(value, str):
        v = value.strip().lower()
        if v == "auto" or v == "":
            return "auto"
        if v in _TRUE:
            return True
        if v in _FALSE:
            return False
    elif isinstance(value, bool):
        return value
    raise ValueError(f"{name} must be 'auto', True or False, got {value!r}")


def _positive_float(default):
    def parse(value, name):
        if _unset(value):
            if default is None:
                raise ValueError(f"{name}: this build has no default (extension missing)")
            return float(default)
        try:
            v = float(value) if not isinstance(value, bool) else float("nan")
        except (TypeError, ValueError):
            raise ValueError(f"{name} must be a positive number, got {value!r}") from None
        if not v > 0 or v == float("inf"):
            raise ValueError(f"{name} must be a positive number, got {value!r}")
        return v
    return parse


def _positive_int_or_none(value, name):
    if _unset(value):
        return None
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    try:
        v = int(value.strip()) if isinstance(value, str) else int(value)
        if not isinstance(value, str) and v != value:
            raise ValueError
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a positive integer, got {value!r}") from None
    if v < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return v


def _choice_or_none(choices: Callable[[], tuple] | tuple):
    def parse(value, name):
        if _unset(value):
            return None
        allowed = choices() if callable(choices) else choices
        v = str(value).strip()
        key = v.lower() if all(c == c.lower() for c in allowed) else v
        if allowed and key not in allowed:
            raise ValueError(f"{name} must be one of {tuple(allowed)}, got {value!r}")
        return key
    return parse


def _choice(choices: tuple, default: str):
    inner = _choice_or_none(choices)

    def parse(value, name):
        v = inner(value, name)
        return default if v is None else v
    return parse


def _on_off(value, name):
    if _unset(value):
        return True
    if isinstance(value, bool):
        return value
    v = str(value).strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE or v == "none":
        return False
    raise ValueError(f"{name} must be on or off, got {value!r}")


def _str_or_none(value, name):
    if _unset(value):
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise ValueError(f"{name} must be a string, got {value!r}")
    return os.fspath(value).strip()


def _str(default: str):
    def parse(value, name):
        v = _str_or_none(value, name)
        return default if v is None else v
    return parse


def _cuda_presets() -> tuple:
    return tuple(_DEFAULTS.get("cuda_presets", ()))


def _int_in(lo: int, hi: int, default: int):
    def parse(value, name):
        if value is None or value == "":
            return default
        try:
            n = int(value)
        except (TypeError, ValueError):
            n = None
        if n is None or isinstance(value, bool) or not lo <= n <= hi or \
                (isinstance(value, float) and value != n):
            raise ValueError(f"{name} must be an integer in [{lo}, {hi}], got {value!r}")
        return n
    return parse


def _mode_sms(value, name):
    """A mode's SMs: unset (the mode's preset, kernels/common/configs.h) or an int in
    [1, max_mode_sms] (the bound from the same header, through the bindings)."""
    v = _positive_int_or_none(value, name)
    most = _DEFAULTS.get("max_mode_sms")
    if v is not None and most is not None and v > most:
        raise ValueError(f"{name} must be a positive integer at most {most}, got {value!r}")
    return v


# setting -> (environment variable, parser). The order is the table's.
_SPEC: dict[str, tuple[str, Callable[[Any, str], Any]]] = {
    "collective_stream": ("JAX_EP_COLLECTIVE_STREAM", _collective_stream),
    "timeout_s": ("JAX_EP_TIMEOUT_S", _positive_float(_DEFAULTS.get("timeout_s"))),
    "num_sms": ("JAX_EP_NUM_SMS", _positive_int_or_none),
    "ring_tokens": ("JAX_EP_RING_TOKENS", _positive_int_or_none),
    "bulk_piece_bytes": ("JAX_EP_BULK_PIECE_BYTES", _positive_int_or_none),
    "cuda_preset": ("JAX_EP_CUDA_PRESET", _choice_or_none(_cuda_presets)),
    "hier_source_blocks": ("JAX_EP_HIER_SOURCE_BLOCKS", _positive_int_or_none),
    "hier_push_parts": ("JAX_EP_HIER_PUSH_PARTS", _positive_int_or_none),
    "hier_forward_columns": ("JAX_EP_HIER_FORWARD_COLUMNS", _positive_int_or_none),
    "hier_dispatch_blocks": ("JAX_EP_HIER_DISPATCH_BLOCKS", _positive_int_or_none),
    "hier_combine_blocks": ("JAX_EP_HIER_COMBINE_BLOCKS", _positive_int_or_none),
    "intranode_sms": ("JAX_EP_INTRANODE_SMS", _mode_sms),
    "hierarchical_sms": ("JAX_EP_HIERARCHICAL_SMS", _mode_sms),
    "direct_sms": ("JAX_EP_DIRECT_SMS", _mode_sms),
    "low_latency_sms": ("JAX_EP_LOW_LATENCY_SMS", _mode_sms),
    "internode_mode": ("JAX_EP_INTERNODE_MODE",
                       _choice_or_none(("direct", "hierarchical", "auto"))),
    "transport": ("JAX_EP_TRANSPORT", _choice(("nvshmem", "nccl", "auto"), "auto")),
    "gpus_per_node": ("JAX_EP_GPUS_PER_NODE", _positive_int_or_none),
    "num_ports": ("JAX_EP_NUM_PORTS", _positive_int_or_none),
    "qps_per_port": ("JAX_EP_QPS_PER_PORT", _positive_int_or_none),
    "chunk_bytes": ("JAX_EP_CHUNK_BYTES", _positive_int_or_none),
    "fabric": ("JAX_EP_FABRIC", _on_off),
    "lag_affinity": ("JAX_EP_LAG_AFFINITY", _choice(("alternate", "none"), "alternate")),
    "sysfs": ("JAX_EP_SYSFS", _str("/sys")),
    "route_table": ("JAX_EP_ROUTE_TABLE", _str_or_none),
    "gpu_pci_bus_id": ("JAX_EP_GPU_PCI_BUS_ID", _str_or_none),
    "lag_shim": ("JAX_EP_LAG_SHIM", _str_or_none),
    "hardware_queues": ("CUDA_DEVICE_MAX_CONNECTIONS", _int_in(1, 32, 8)),
}

# setting -> its environment variable.
ENV = {k: v[0] for k, v in _SPEC.items()}
# The settings C++ reads (kernels/common/settings.h), pushed through `set_settings`.
KERNEL_SETTINGS = ("timeout_s", "num_sms", "ring_tokens", "bulk_piece_bytes", "cuda_preset",
                   "hier_source_blocks", "hier_push_parts", "hier_forward_columns",
                   "hier_dispatch_blocks", "hier_combine_blocks", "intranode_sms",
                   "hierarchical_sms", "direct_sms", "low_latency_sms", "hardware_queues")


@dataclasses.dataclass(frozen=True)
class Config:
    """Every library setting (the table in jax_ep/config.py's docstring). None: not set
    (the kernels' or the caller's own choice)."""
    collective_stream: str | bool = "auto"
    timeout_s: float = _DEFAULTS.get("timeout_s")  # type: ignore[assignment]
    num_sms: int | None = None
    ring_tokens: int | None = None
    bulk_piece_bytes: int | None = None
    cuda_preset: str | None = None
    hier_source_blocks: int | None = None
    hier_push_parts: int | None = None
    hier_forward_columns: int | None = None
    hier_dispatch_blocks: int | None = None
    hier_combine_blocks: int | None = None
    intranode_sms: int | None = None
    hierarchical_sms: int | None = None
    direct_sms: int | None = None
    low_latency_sms: int | None = None
    internode_mode: str | None = None
    transport: str = "auto"
    gpus_per_node: int | None = None
    num_ports: int | None = None
    qps_per_port: int | None = None
    chunk_bytes: int | None = None
    fabric: bool = True
    lag_affinity: str = "alternate"
    sysfs: str = "/sys"
    route_table: str | None = None
    gpu_pci_bus_id: str | None = None
    lag_shim: str | None = None
    hardware_queues: int = 8

    def replace(self, **settings) -> "Config":
        """This config with `settings` changed (each checked, naming the setting)."""
        return dataclasses.replace(self, **{k: _check(k, v) for k, v in settings.items()})

    def kernel_settings(self) -> dict:
        """The settings C++ reads, as `set_settings` takes them."""
        return {k: getattr(self, k) for k in KERNEL_SETTINGS}


assert tuple(f.name for f in dataclasses.fields(Config)) == tuple(_SPEC)


def _check(name: str, value):
    if name not in _SPEC:
        raise AttributeError(f"jax_ep.config has no setting {name!r}; settings: "
                             f"{', '.join(_SPEC)}")
    return _SPEC[name][1](value, name)


def from_env(environ: Mapping[str, str] | None = None) -> Config:
    """The Config the environment `environ` (default this process's) says; a bad value is
    a ValueError naming its variable."""
    env = os.environ if environ is None else environ
    return Config(**{k: parse(env.get(var), var) for k, (var, parse) in _SPEC.items()})


_lock = threading.RLock()
_current = from_env()


def current() -> Config:
    """The settings in force now."""
    return _current


def settings_for(environ: Mapping[str, str] | None) -> Config:
    """The settings for a caller that takes an explicit environment (the network planning
    functions, tests): current() for None or os.environ, else that mapping's Config."""
    if environ is None or environ is os.environ:
        return _current
    return from_env(environ)


# Extension modules that hold a copy of the kernel settings (set_settings), filled on
# every change; the emulated and NVSHMEM modules register when they load.
_modules: list = []


def _push(cfg: Config, modules=None) -> None:
    values = cfg.kernel_settings()
    if values["timeout_s"] is None:
        values.pop("timeout_s")
    for m in (_modules if modules is None else modules):
        m.set_settings(values)


def attach(module) -> None:
    """Registers an extension module with `set_settings` and fills it (jax_ep._src.ext,
    jax_ep._src.emu call it when they load one)."""
    if not hasattr(module, "set_settings"):
        return
    with _lock:
        if all(m is not module for m in _modules):
            _modules.append(module)
        _push(_current, [module])


def _set(cfg: Config) -> None:
    global _current
    with _lock:
        _push(cfg)
        _current = cfg


def update(name: str, value) -> None:
    """Sets one setting (process-wide)."""
    _set(_current.replace(**{name: value}))


@contextlib.contextmanager
def override(**settings):
    """Sets settings inside the block, then restores the ones before."""
    before = _current
    _set(_current.replace(**settings))
    try:
        yield _current
    finally:  # the overridden settings only: an update inside the block stays
        _set(dataclasses.replace(_current, **{k: getattr(before, k) for k in settings}))


def __getattr__(name: str):
    if name in _SPEC:
        return getattr(_current, name)
    raise AttributeError(f"module 'jax_ep.config' has no attribute {name!r}")


def _attach_loaded() -> None:
    from jax_ep._src import ext as _ext
    if _ext.ext is not None:
        attach(_ext.ext)
    if attach not in _ext.on_module_load:
        _ext.on_module_load.append(attach)  # modules loaded later (NVSHMEM)


_attach_loaded()
