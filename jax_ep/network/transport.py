"""Inter-node transport configuration: striping over NIC ports and the NVSHMEM settings.

`TransportConfig` says how many ports each NIC has, how many RC queue pairs (QPs) go
to every peer through each port, and how large the chunks are that the bytes for one
peer are cut into. The mapping from (peer, channel, chunk) to (QP, port) is the one in
`kernels/common/striping_plan.h`, which the kernels use: `qp_for` calls it through its
binding.

`nvshmem_env()` returns the NVSHMEM variables the library sets itself before NVSHMEM
starts (GPU-initiated RDMA, QPs per PE, multi-port). `JAX_EP_*` environment variables
override the config: see `TransportConfig.resolve`.
Which transport carries the bytes (NVSHMEM or NCCL's GPU-initiated networking) is
`jax_ep.network.transport_choice.choose_transport`.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Mapping

import numpy as np

__all__ = ["TransportConfig", "StripePlan", "ENV_VARS", "REMOVED_ENV_VARS", "LAG_MODES",
           "MAX_QPS"]

# JAX_EP_* variable -> TransportConfig field.
ENV_VARS = {
    "JAX_EP_NUM_PORTS": "num_ports",
    "JAX_EP_QPS_PER_PORT": "qps_per_port",
    "JAX_EP_CHUNK_BYTES": "chunk_bytes",
}
# Variables that used to mean something and now are an error, with why.
REMOVED_ENV_VARS = {
    "JAX_EP_NUM_CHANNELS": "the internode kernels send with one channel (CUDA block) per "
                           "QP, so channels = num_ports * qps_per_port always; set "
                           "JAX_EP_QPS_PER_PORT instead",
}
LAG_MODES = ("multiport", "bond")


@functools.cache
def _max_qps() -> int:
    """Most QPs per peer, num_ports * qps_per_port (kMaxQps, kernels/common/striping_plan.h)."""
    from jax_ep._src.ext import require_ext
    return int(require_ext().internode_protocol()["max_qps"])


def __getattr__(name: str):
    # MAX_QPS comes from the extension on first use, not at import: `import jax_ep` (and
    # build_info(), which says what is missing) must work in an install without it.
    if name == "MAX_QPS":
        return _max_qps()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _qp_for_arrays(peer, channel, chunk, num_ports, qps_per_port):
    """(qp, port) int64 arrays of the broadcast shape of the (peer, channel, chunk) arrays:
    kernels/common/striping_plan.h qp_for, element by element, through its binding."""
    from jax_ep._src.ext import require_ext

    shape = np.broadcast(np.asarray(peer), np.asarray(channel), np.asarray(chunk)).shape
    peer, channel, chunk = (np.ascontiguousarray(a, dtype=np.int64).ravel()
                            for a in np.broadcast_arrays(peer, channel, chunk))
    qp = np.empty(peer.shape, np.int64)
    port = np.empty(peer.shape, np.int64)
    require_ext().striping_qp_for_array(peer, channel, chunk, int(num_ports),
                                        int(qps_per_port), qp, port)
    return qp.reshape(shape), port.reshape(shape)


def _positive_int(name: str, value) -> int:
    try:
        v = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be an integer, got {value!r}") from None
    if v < 1:
        raise ValueError(f"{name} must be >= 1, got {v}")
    return v


@dataclasses.dataclass(frozen=True)
class StripePlan:
    """Where the bytes of one dispatch go. Arrays are indexed by peer (row)."""

    bytes_per_peer: np.ndarray  # [peers] int64
    chunks_per_peer: np.ndarray  # [peers] int64
    port_bytes: np.ndarray  # [peers, num_ports] int64
    qp_bytes: np.ndarray  # [peers, num_ports * qps_per_port] int64
    channel_bytes: np.ndarray  # [peers, num_channels] int64
    chunk_bytes: int

    @property
    def port_imbalance_bytes(self) -> np.ndarray:
        """max - min bytes over the ports, per peer (at most one chunk)."""
        return self.port_bytes.max(axis=1) - self.port_bytes.min(axis=1)


@dataclasses.dataclass(frozen=True)
class TransportConfig:
    """Striping of inter-node traffic over the ports of each NIC.

    num_ports: ports per NIC (2 for a dual-port or 2-member bonded NIC).
    qps_per_port: RC QPs per peer on each port; a peer gets num_ports * qps_per_port QPs.
    chunk_bytes: the unit of striping; for every peer the ports differ by at most one.
    num_channels: CUDA blocks that send; always num_ports * qps_per_port (one per QP,
        which the kernels assume); any other value is an error.
    lag: how the ports are presented: "multiport" (one RDMA device per port, NVSHMEM
        multi-port on, so NVSHMEM_IBGDA_NUM_RC_PER_PE counts QPs per device: qps_per_port)
        or "bond" (one bonded device, multi-port off, num_ports * qps_per_port QPs on it).
    """

    num_ports: int = 2
    qps_per_port: int = 4
    chunk_bytes: int = 64 * 1024
    num_channels: int | None = None
    lag: str = "multiport"
    # internode mode (network/topology.py): "direct", "hierarchical" or "auto"
    mode: str = "auto"

    def __post_init__(self):
        object.__setattr__(self, "num_ports", _positive_int("num_ports", self.num_ports))
        object.__setattr__(self, "qps_per_port", _positive_int("qps_per_port", self.qps_per_port))
        object.__setattr__(self, "chunk_bytes", _positive_int("chunk_bytes", self.chunk_bytes))
        nq = self.num_ports * self.qps_per_port
        if self.num_channels is not None and _positive_int(
                "num_channels", self.num_channels) != nq:
            raise ValueError(
                f"num_channels must equal num_ports * qps_per_port ({nq}): the internode "
                f"kernels send with one channel per QP; got {self.num_channels}")
        object.__setattr__(self, "num_channels", nq)
        if nq > _max_qps():
            raise ValueError(f"num_ports * qps_per_port must be <= {_max_qps()} (signal "
                             f"words reserved per source), got {nq}")
        if self.lag not in LAG_MODES:
            raise ValueError(f"lag must be one of {LAG_MODES}, got {self.lag!r}")
        if self.mode not in ("direct", "hierarchical", "auto"):  # network/topology.py
            raise ValueError(f"mode must be 'direct', 'hierarchical' or 'auto', got "
                             f"{self.mode!r}")

    @property
    def num_qps(self) -> int:
        """RC QPs per peer (= NVSHMEM_IBGDA_NUM_RC_PER_PE)."""
        return self.num_ports * self.qps_per_port

    def resolve(self, environ: Mapping[str, str] | None = None) -> "TransportConfig":
        """This config with every set `JAX_EP_*` variable (see ENV_VARS) taking precedence.

        The library resolves its config this way before NVSHMEM starts; a bad value is an
        error naming the variable.
        """
        from jax_ep import config
        env = os.environ if environ is None else environ
        for var, why in REMOVED_ENV_VARS.items():
            if (env.get(var) or "").strip():
                raise ValueError(f"{var} is no longer read: {why}")
        settings = config.settings_for(environ)  # jax_ep.config: num_ports, ...
        updates = {}
        for var, field in ENV_VARS.items():
            v = getattr(settings, field)
            if v is not None:
                updates[field] = v
        if settings.internode_mode is not None:  # network/topology.py
            updates["mode"] = settings.internode_mode
        if not updates:
            return self
        updates["num_channels"] = None  # one channel per QP
        return dataclasses.replace(self, **updates)

    def single_port(self) -> "TransportConfig":
        """This config on one port (the fallback without NVSHMEM's QP API): same QPs per
        port, no striping across ports."""
        return dataclasses.replace(self, num_ports=1, num_channels=None)

    @property
    def qps_per_device(self) -> int:
        """NVSHMEM_IBGDA_NUM_RC_PER_PE: NVSHMEM counts RC QPs per RDMA device, so with
        multi-port (one device per port) it is qps_per_port, under a bond (one device)
        num_ports * qps_per_port."""
        if self.lag == "multiport" and self.num_ports > 1:
            return self.qps_per_port
        return self.num_qps

    # --- the striping plan -----------------------------------------------------------

    def start_port(self, peer: int) -> int:
        """First port of the stream to `peer` (rotates across peers)."""
        return int(_qp_for_arrays(peer, 0, 0, self.num_ports, self.qps_per_port)[1])

    def qp_for(self, peer: int, channel: int, chunk: int) -> tuple[int, int]:
        """(qp, port) of chunk `chunk` to `peer` sent by channel `channel`."""
        qp, port = _qp_for_arrays(peer, channel, chunk, self.num_ports, self.qps_per_port)
        return int(qp), int(port)

    def channel_for(self, chunk: int) -> int:
        """Channel that sends chunk `chunk` of a stream."""
        from jax_ep._src.ext import require_ext
        return int(require_ext().striping_channel_for_chunk(int(chunk), self.num_channels))

    def stripe(self, bytes_per_peer) -> StripePlan:
        """Split `bytes_per_peer[peer]` bytes into chunks and say which port/QP carries them.

        Peer i of the array is peer index i (its rank). Each chunk is counted once, on
        the QP and port `qp_for(peer, channel_for(chunk), chunk)` returns (the kernels'
        plan, kernels/common/striping_plan.h, through its binding).
        """
        from jax_ep._src.ext import require_ext

        b = np.ascontiguousarray(np.asarray(bytes_per_peer, dtype=np.int64).reshape(-1))
        if np.any(b < 0):
            raise ValueError("bytes_per_peer must be >= 0")
        peers = len(b)
        n_chunks = np.empty(peers, np.int64)
        port_bytes = np.empty((peers, self.num_ports), np.int64)
        qp_bytes = np.empty((peers, self.num_qps), np.int64)
        ch_bytes = np.empty((peers, self.num_channels), np.int64)
        require_ext().striping_stripe(b, self.chunk_bytes, self.num_ports, self.qps_per_port,
                                      self.num_channels, n_chunks, port_bytes, qp_bytes,
                                      ch_bytes)
        return StripePlan(bytes_per_peer=b, chunks_per_peer=n_chunks, port_bytes=port_bytes,
                          qp_bytes=qp_bytes, channel_bytes=ch_bytes, chunk_bytes=self.chunk_bytes)

    # --- NVSHMEM -----------------------------------------------------------------------

    def nvshmem_env(self, version: str | None = None) -> dict[str, str]:
        """NVSHMEM variables the library sets before NVSHMEM starts.

        version: "3.8" (current names), "3.7" (the older IBGDA-specific names) or None
        (both sets; each NVSHMEM version reads its own and ignores the other).
        """
        if version not in (None, "3.7", "3.8"):
            raise ValueError(f"version must be None, '3.7' or '3.8', got {version!r}")
        multi = "1" if (self.num_ports > 1 and self.lag == "multiport") else "0"
        env = {
            "NVSHMEM_IB_ENABLE_IBGDA": "1",  # GPU-initiated RDMA, no CPU proxy
            # Per RDMA device: with multi-port the P devices hold P * this per peer.
            "NVSHMEM_IBGDA_NUM_RC_PER_PE": str(self.qps_per_device),
            # Fallback without QP handles: CTA (= logical QP) i uses RC QP i % NUM_RC.
            "NVSHMEM_IBGDA_RC_MAP_BY": "cta",
            "NVSHMEM_DISABLE_NVLS": "1",  # no NVLink SHARP multicast objects are needed
        }
        if version in (None, "3.8"):
            env["NVSHMEM_ENABLE_MULTI_PORT"] = multi
        if version in (None, "3.7"):
            env["NVSHMEM_IBGDA_ENABLE_MULTI_PORT"] = multi
        return env
