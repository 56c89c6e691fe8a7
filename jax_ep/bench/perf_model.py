"""A roofline-style MODEL of the kernels' time on an H200, computed from the emulated GPU's
counters (jax_ep._src.emu; docs/performance.md, "Modelled H200 estimate"). It is a model,
not a measurement: no kernel of this project has run on a GPU. Every constant is stated
below; change them with `Constants(...)`.

Per virtual GPU and per op (dispatch or combine), from its counters:
  link time  = max(NVLink bytes / NVLINK, RDMA bytes / RDMA, local bytes / HBM)
               (NVLink bytes: loads + stores that touch another GPU's memory, plus puts to
               a PE of the same node; RDMA bytes: puts to another node, as sent; local
               bytes include the bulk copies')
  SM time    = sum over spaces and widths of bytes / (per-SM rate at 16 bytes of that
               space * width / 16) / SMs, where SMs = the most blocks one kernel of the op
               launched on that GPU (at most 132): a narrower access moves fewer bytes per
               instruction at the same instruction rate; and at least the busiest
               block's own time, its accesses ("block_max:accesses:*", each space's
               maximum over the blocks, added over the launches) times 16 bytes over the
               per-SM rate of that space: work the kernel leaves on a few blocks does not
               spread over the others. The bulk copies (TMA: "tma_bytes:*", the busiest
               block's "block_max:tma_bytes") take their bytes over the per-SM bulk rate,
               beside the warps' accesses (the larger of the two times, for all blocks
               and for the busiest), or after them with TMA_OVERLAPS off (the sum)
  fixed time = launches * LAUNCH + the longest per-thread chains (counted per launch and
               added over the launches: "chain:*" counters; at each counted shape the
               longest over the op's GPUs, see op_chains) of system fences * FENCE_SYS,
               GPU fences * FENCE_GPU, release stores * RELEASE and work requests * WR
               (a thread's fences serialize; different threads' overlap)
  time       = max(link time, SM time) + fixed time
The op's time is the slowest GPU's. Fractions of bandwidth are the GPU's NVLink (or RDMA)
bytes over its time, over NVLINK (or RDMA).
"""
from __future__ import annotations

import dataclasses
from typing import Any

WIDTHS = (1, 2, 4, 8, 16)


@dataclasses.dataclass(frozen=True)
class Constants:
    """The model's H200 constants (bytes/s and seconds). Sources: NVLink 4 of H100/H200,
    900 GB/s bidirectional = 450 GB/s per direction; one ConnectX-7 NIC of 2 x 200 Gb/s
    per GPU (DeepEP's test machines); HBM3e 4.8 TB/s. The per-SM copy rates and the fixed
    costs are assumptions of this model, not measured here: an SM keeps a limited number
    of 16-byte accesses in flight, which caps it at about NVLink's latency-bound rate of
    one SM for remote accesses and higher for local ones. Bulk copies (the TMA) keep whole
    pieces in flight without the warps' registers; their per-SM rate is an assumption
    too: HBM's rate over the 24 SMs of the intranode target (4.8 TB/s / 24), bytes
    loaded plus bytes stored. An SM's bulk copies run on its TMA unit beside its warps'
    loads and stores (tma_overlaps; an assumption: the peer stores are bound by the
    accesses a warp keeps in flight, not by the SM's port to L2)."""
    nvlink_Bps: float = 450e9            # per direction, per GPU
    rdma_Bps: float = 2 * 200e9 / 8      # one NIC of 2 x 200 Gb/s per GPU = 50 GB/s
    hbm_Bps: float = 4.8e12
    num_sms: int = 132
    sm_peer_Bps_16: float = 25e9         # one SM, 16-byte accesses to a peer over NVLink
    sm_local_Bps_16: float = 100e9       # one SM, 16-byte accesses to its own HBM
    sm_tma_Bps: float = 200e9            # one SM, bulk copies (TMA), loads + stores
    tma_overlaps: bool = True            # bulk copies beside the warps' accesses (max, not sum)
    launch_s: float = 3e-6               # per kernel launch in a stream (launch + tail)
    fence_sys_s: float = 0.8e-6          # __threadfence_system
    fence_gpu_s: float = 0.3e-6          # __threadfence
    release_s: float = 0.5e-6            # release store at system scope
    wr_s: float = 0.1e-6                 # one RDMA work request posted by a GPU thread

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


H200 = Constants()

# Targets of issue 22 item 6 (DeepEP's published numbers for its kernels on H800/H20
# class machines, as the issue quotes them).
TARGETS = {
    "intranode": "NVLink fraction >= 0.80 with <= 24 SMs",
    "hierarchical": "RDMA GB/s per GPU >= 43/1.3 = 33.1 (DeepEP: 43-58 GB/s)",
    "low_latency": "dispatch <= 1.5 x 118 us = 177 us, combine <= 1.5 x 195 us = 292.5 us "
                   "(DeepEP, EP16)",
}


def _bytes(c: dict, prefix: str, space: str) -> dict[int, int]:
    return {w: int(c.get(f"{prefix}:{space}:{w}", 0)) for w in WIDTHS}


def device_time(c: dict[str, int], k: Constants = H200) -> dict[str, Any]:
    """The model for one virtual GPU's counters of one op (flat names, as
    jax_ep._src.emu.counters(device) returns them)."""
    ld_l, st_l = _bytes(c, "load_bytes", "local"), _bytes(c, "store_bytes", "local")
    ld_p, st_p = _bytes(c, "load_bytes", "peer"), _bytes(c, "store_bytes", "peer")
    put_peer, put_rdma = int(c.get("put_bytes:peer", 0)), int(c.get("put_bytes:rdma", 0))
    tma_l = int(c.get("tma_bytes:load:local", 0)) + int(c.get("tma_bytes:store:local", 0))
    tma_p = int(c.get("tma_bytes:load:peer", 0)) + int(c.get("tma_bytes:store:peer", 0))
    local = sum(ld_l.values()) + sum(st_l.values()) + tma_l
    nvlink = sum(ld_p.values()) + sum(st_p.values()) + put_peer + tma_p
    kernels = {}
    for name, v in c.items():
        if name.startswith("kernel:"):  # kernel:<name, maybe with "::">:<field>
            kname, field = name[len("kernel:"):].rsplit(":", 1)
            kernels.setdefault(kname, {})[field] = v
    launches = sum(kv.get("launches", 0) for kv in kernels.values())
    # blocks per launch of each kernel; the op's SMs: the widest kernel
    sms = max([kv.get("blocks", 0) // max(kv.get("launches", 1), 1) for kv in kernels.values()]
              or [1])
    sms_used = max(1, min(sms, k.num_sms))
    link_s = max(nvlink / k.nvlink_Bps, put_rdma / k.rdma_Bps, local / k.hbm_Bps)
    sm_s = 0.0
    for w in WIDTHS:
        sm_s += (ld_p[w] + st_p[w]) / (k.sm_peer_Bps_16 * w / 16)
        sm_s += (ld_l[w] + st_l[w]) / (k.sm_local_Bps_16 * w / 16)
    sm_s /= sms_used
    tma_s = (tma_l + tma_p) / k.sm_tma_Bps / sms_used
    busiest_s = max(c.get("block_max:accesses:peer", 0) * 16 / k.sm_peer_Bps_16,
                    c.get("block_max:accesses:local", 0) * 16 / k.sm_local_Bps_16)
    busiest_tma_s = c.get("block_max:tma_bytes", 0) / k.sm_tma_Bps
    if k.tma_overlaps:
        sm_s, busiest_s = max(sm_s, tma_s), max(busiest_s, busiest_tma_s)
    else:
        sm_s, busiest_s = sm_s + tma_s, busiest_s + busiest_tma_s
    sm_s = max(sm_s, busiest_s)
    fixed_s = launches * k.launch_s + (
        c.get("chain:fences:system", 0) * k.fence_sys_s
        + c.get("chain:fences:gpu", 0) * k.fence_gpu_s
        + c.get("chain:release_stores", 0) * k.release_s + c.get("chain:wrs", 0) * k.wr_s)
    t = max(link_s, sm_s) + fixed_s
    return {"time_s": t, "link_s": link_s, "sm_s": sm_s, "busiest_block_s": busiest_s,
            "fixed_s": fixed_s,
            "sms": sms, "launches": launches, "nvlink_bytes": nvlink, "rdma_bytes": put_rdma,
            "local_bytes": local, "tma_bytes": tma_l + tma_p, "bound": "fixed" if fixed_s > max(link_s, sm_s) else
            ("link" if link_s >= sm_s else "sm"),
            "nvlink_fraction": nvlink / t / k.nvlink_Bps if t > 0 else 0.0,
            "rdma_GBps": put_rdma / t / 1e9 if t > 0 else 0.0}


def op_time(per_device: list[dict[str, int]], k: Constants = H200) -> dict[str, Any]:
    """The op's modelled time: its slowest GPU's (per_device: each GPU's counters)."""
    rows = [device_time(c, k) for c in per_device]
    worst = max(rows, key=lambda r: r["time_s"])
    return dict(worst, gpus=len(rows))


def scale_counters(points: list[tuple[dict, dict[str, int]]], target: dict) -> dict[str, float]:
    """Counters at a target shape from counts at small shapes, linearly: each counter is
    fitted as a + b*T + c*T*H (T tokens per rank, H hidden) by least squares over the
    points [(shape {"tokens", "hidden"}, counters)]; a counter that does not grow (launches,
    blocks) keeps its constant. The chains ("chain:*") are fitted as a + b*T: the kernels
    synchronize per row, per chunk of rows or per call, never per byte, so a difference
    between H and 2H at the same T is the emulated interleaving, not a law, and scaled by
    T*H it would turn a one-release difference into thousands. The scaling is part of
    the model, not a count."""
    import numpy as np

    keys = sorted({k for _, c in points for k in c})
    A = np.array([[1.0, s["tokens"], s["tokens"] * s["hidden"]] for s, _ in points])
    t = np.array([1.0, target["tokens"], target["tokens"] * target["hidden"]])
    out = {}
    for key in keys:
        y = np.array([float(c.get(key, 0)) for _, c in points])
        if key.startswith("kernel:") and not key.endswith(":threads"):
            out[key] = float(y.max())  # launch geometry: the same at every T
            continue
        a, tt = (A[:, :2], t[:2]) if key.startswith("chain:") else (A, t)
        coef, *_ = np.linalg.lstsq(a, y, rcond=None)
        out[key] = max(0.0, float(tt @ coef))
    return out


def op_chains(per_device: list[dict[str, int]]) -> list[dict[str, int]]:
    """The GPUs' counters of one op at one shape with each chain ("chain:*") replaced by
    its longest over the GPUs. Which thread of which GPU the emulated scheduler holds up
    changes a GPU's chain by a release or two from one shape to the next, and a linear
    fit carries that difference to the target; the longest over the GPUs is the op's
    serial path (the op waits for its slowest GPU) and does not depend on that choice."""
    keys = {k for c in per_device for k in c if k.startswith("chain:")}
    top = {k: max(c.get(k, 0) for c in per_device) for k in keys}
    return [dict(c, **top) for c in per_device]
