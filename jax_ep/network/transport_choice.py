"""Which internode transport carries the bytes: NVSHMEM (one process per GPU) or NCCL's
GPU-initiated networking (one process per GPU or per host). The setting `transport`
(JAX_EP_TRANSPORT=nvshmem|nccl|auto) picks one; `auto` follows `choose_transport`'s rule.
"""
from __future__ import annotations

import dataclasses

__all__ = ["TRANSPORTS", "TransportChoice", "choose_transport"]

TRANSPORTS = ("nvshmem", "nccl")


@dataclasses.dataclass(frozen=True)
class TransportChoice:
    """The internode transport chosen and why.

    transport: "nvshmem" | "nccl"; reason: why, in words; setting: the `transport`
    setting it came from ("nvshmem" | "nccl" | "auto")."""
    transport: str
    reason: str
    setting: str

    def to_json(self) -> dict:
        return {"transport": self.transport, "reason": self.reason, "setting": self.setting}


def _local_gpu_count() -> int:
    """GPUs this process drives (jax.local_devices() on the GPU platform); 0 without one."""
    try:
        import jax
        return len(jax.local_devices(backend="gpu"))
    except Exception:  # noqa: BLE001 - no GPU backend in this jaxlib or on this host
        return 0


def _fabric_class() -> str | None:
    """This node's fabric class (jax_ep.network.fabric.discover), None with JAX_EP_FABRIC=off."""
    from jax_ep import config
    from jax_ep.network import fabric
    cfg = config.current()
    if not cfg.fabric:
        return None
    return fabric.discover(cfg.sysfs, fabric._gpu_bus_id()).fabric_class


def _nvshmem_usable() -> tuple[bool, str]:
    from jax_ep._src import libraries
    info = libraries.nvshmem_library()
    return bool(info["available"] and info["built"]), str(info.get("why") or "")


def choose_transport(setting: str | None = None, *, local_gpus: int | None = None,
                     nvshmem_available: bool | None = None, fabric_class: str | None = None,
                     nvshmem_why: str = "") -> TransportChoice:
    """The internode transport for this process: `setting` ("nvshmem", "nccl" or "auto";
    None: jax_ep.config.transport, JAX_EP_TRANSPORT) chosen as is, or for "auto":

    - "nccl" when the process drives several GPUs (local_gpus > 1: NVSHMEM needs one
      process per GPU),
    - "nccl" when NVSHMEM is missing (its library or this build's module),
    - "nccl" on the `roce-lag` fabric class (NCCL sets each QP's LAG port affinity),
    - "nvshmem" otherwise.

    local_gpus (int >= 0), nvshmem_available (bool, with nvshmem_why: what is missing) and
    fabric_class (jax_ep.network.fabric.FABRIC_CLASSES, None: unknown) are detected when
    None: jax.local_devices(backend="gpu"), jax_ep._src.libraries.nvshmem_library,
    fabric discovery (skipped with JAX_EP_FABRIC=off). Detection is skipped for an
    explicit setting. Never checks that the chosen library is present (transport_report,
    jax_ep._src.libraries.require do)."""
    from jax_ep import config
    if setting is None:
        setting = config.current().transport
    setting = config.current().replace(transport=setting).transport  # checked, lower case
    if setting != "auto":
        return TransportChoice(setting, f"the transport setting (JAX_EP_TRANSPORT) is "
                               f"{setting!r}", setting)
    if local_gpus is None:
        local_gpus = _local_gpu_count()
    if local_gpus > 1:
        return TransportChoice("nccl", f"this process drives {local_gpus} GPUs; NVSHMEM "
                               f"needs one process per GPU", setting)
    if nvshmem_available is None:
        nvshmem_available, nvshmem_why = _nvshmem_usable()
    if not nvshmem_available:
        why = f" ({nvshmem_why})" if nvshmem_why else ""
        return TransportChoice("nccl", f"NVSHMEM is missing{why}", setting)
    if fabric_class is None:
        fabric_class = _fabric_class()
    if fabric_class == "roce-lag":
        return TransportChoice("nccl", "the fabric is roce-lag (one bonded RoCE device): NCCL "
                               "sets each QP's LAG port affinity itself", setting)
    fab = f"the fabric is {fabric_class}" if fabric_class else "the fabric is not known"
    return TransportChoice("nvshmem", f"one GPU per process, NVSHMEM present, {fab}",
                           setting)
