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

That roofline charges bytes at fixed per-SM rates whatever an SM keeps in flight. The
latency-aware model (device_time_latency, below; docs/performance.md "Latency-aware
model") replaces those rates by what the emulator counts of each thread's and warp's
rounds and bytes in flight: max(link, issue, bytes / (in flight / latency), the longest
chain of round trips) + launches. Both are computed from the same counts.
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
    # ---- the latency-aware model (device_time_latency; docs/performance.md, "Latency-aware
    # model"). Each is an order of magnitude from public microbenchmarks or specs, not a
    # measurement of this project's kernels; the first GPU run measures them (docs).
    # A load from this GPU's HBM, under load. Pointer-chase microbenchmarks of Hopper put an
    # unloaded global-memory (HBM) access at several hundred core cycles, about 0.3-0.5 us
    # at 1.7-2 GHz (Luo et al., "Benchmarking and Dissecting the Nvidia Hopper GPU
    # Architecture", arXiv:2402.13499, https://arxiv.org/abs/2402.13499; Chips and Cheese,
    # "Nvidia's H100: Funny L2, and Tons of Bandwidth",
    # https://chipsandcheese.com/p/nvidias-h100-funny-l2-and-tons-of-bandwidth); loaded
    # latency is higher.
    hbm_latency_s: float = 0.5e-6
    # A load from a peer GPU over NVLink 4 (through NVSwitch), or a store's completion seen
    # by a fence: about 1 us (../shared/ANCHORS.md, "Speed facts": ~1 us NVLink/peer
    # latency; an H100 interconnect survey lists NVLink at ~1-2 us,
    # https://fridayswithfaraday.com/posts/gpu-hw-nvlink-nvswitch-interconnect).
    nvlink_latency_s: float = 1.0e-6
    # A GPU-initiated RDMA write with its signal, from the posting thread to the poll that
    # sees it on the other node: InfiniBand/RoCE at ~1-5 us in the same survey, plus the
    # PCIe hops at both ends; an atomic after writes waits a further round trip on
    # multi-path NICs (DeepEP PR #437, https://github.com/deepseek-ai/DeepEP/pull/437).
    rdma_latency_s: float = 3.0e-6
    # Work requests one NIC executes per second: ConnectX-7 advertises a message rate in the
    # hundreds of millions per second (https://docs.nvidia.com/networking/display/
    # ConnectX7VPI/Introduction); GPU-posted WQEs (IBGDA) each carry a doorbell, so this
    # takes the low end.
    nic_wr_per_s: float = 200e6
    # The per-SM issue limit of loads and stores by the threads: a warp-wide access of width
    # w moves 32 w bytes, and an SM's L1/shared-memory data path moves 128 bytes per clock
    # (32 banks of 4 bytes; CUDA C++ Programming Guide, "Shared Memory" for compute
    # capability 9.0, https://docs.nvidia.com/cuda/cuda-c-programming-guide/), so an SM
    # moves min(32 w, 128) bytes per clock; at the H100/H200 SXM maximum boost clock of
    # 1.98 GHz (NVIDIA H100 datasheet) that is 253 GB/s at 4 bytes and wider.
    sm_clock_hz: float = 1.98e9
    sm_bytes_per_clk: int = 128
    # Warps resident on one SM at most (compute capability 9.0: 64; CUDA C++ Programming
    # Guide, "Technical Specifications per Compute Capability").
    sm_max_warps: int = 64

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


# ----------------------------------------------------------------------------- latency-aware

SPACES = ("local", "peer", "rdma")
# The emulator counts rounds in millirounds (kernels/emu/emu_counters.cc, "Rounds"): a bulk
# load's wait retires a share of a round. "m" is the SI prefix, not a constant of its own.
MILLI = 1e-3


def latency_s(k: Constants) -> dict[str, float]:
    """One round's latency in each space of the emulator's rounds."""
    return {"local": k.hbm_latency_s, "peer": k.nvlink_latency_s, "rdma": k.rdma_latency_s}


def _kernels(c: dict) -> dict[str, dict]:
    kernels: dict[str, dict] = {}
    for name, v in c.items():
        if name.startswith("kernel:"):  # kernel:<name, maybe with "::">:<field>
            kname, field = name[len("kernel:"):].rsplit(":", 1)
            kernels.setdefault(kname, {})[field] = v
        elif name.startswith("warp_mrounds:"):  # warp_mrounds:<space>:<kernel name>
            _, space, kname = name.split(":", 2)
            kernels.setdefault(kname, {})[f"warp_mrounds:{space}"] = v
    return kernels


def issue_Bps(k: Constants, width: int) -> float:
    """One SM's rate for the threads' accesses of `width` bytes (the issue limit)."""
    return k.sm_clock_hz * min(32 * width, k.sm_bytes_per_clk)


def device_time_latency(c: dict[str, float], k: Constants = H200) -> dict[str, Any]:
    """The latency-aware model for one virtual GPU's counters of one op:

      link     = max(NVLink bytes / NVLINK, RDMA bytes / RDMA, local bytes / HBM,
                     RDMA work requests / the NIC's rate)
      issue    = the threads' bytes at each width over the SMs' issue limit (min(32 w, 128)
                 bytes per clock per SM, over the SMs of the widest launch), at least the
                 busiest block's accesses over one SM's; bulk copies (TMA) at their per-SM
                 rate beside them (tma_overlaps) or after them
      inflight = per kernel and launch, the average warp's data rounds times the latency of
                 each round's space (Little's law: bytes / (bytes in flight / latency), with
                 in flight = what its warps' loads keep outstanding per round; every warp of
                 a launch resident at once, at most sm_max_warps per SM)
      chain    = the longest thread's rounds (loads, polls, fences waiting for writes,
                 bulk-load waits) times their latencies, plus its work requests * WR
      time     = max(link, issue, inflight, chain) + launches * LAUNCH

    Counters: "warp_mrounds:<space>:<kernel>", "round_bytes:<space>", "longest:mrounds:
    <space>" (data rounds, fitted in T and T H) and "chain:mrounds:<space>" (polls and write
    waits, fitted in T like every "chain:" counter) from the emulator
    (kernels/emu/emu_counters.cc, "Rounds")."""
    base = device_time(c, k)  # the byte counts and launch geometry, shared with the roofline
    lat = latency_s(k)
    ld = {sp: {w: float(c.get(f"load_bytes:{sp}:{w}", 0)) + float(c.get(f"store_bytes:{sp}:{w}", 0))
               for w in WIDTHS} for sp in ("local", "peer")}
    wrs = sum(float(c.get(f"wrs:{sp}", 0)) for sp in ("peer", "rdma"))
    link_s = max(base["link_s"], float(c.get("wrs:rdma", 0)) / k.nic_wr_per_s)
    kernels = _kernels(c)
    sms_used = max(1, min(base["sms"], k.num_sms))
    issue_s = sum(ld[sp][w] / issue_Bps(k, w) for sp in ld for w in WIDTHS) / sms_used
    tma = base["tma_bytes"] / k.sm_tma_Bps / sms_used
    busiest = max(float(c.get(f"block_max:accesses:{sp}", 0)) for sp in ("local", "peer")) \
        * 16 / issue_Bps(k, 16)
    busiest_tma = float(c.get("block_max:tma_bytes", 0)) / k.sm_tma_Bps
    if k.tma_overlaps:
        issue_s, busiest = max(issue_s, tma), max(busiest, busiest_tma)
    else:
        issue_s, busiest = issue_s + tma, busiest + busiest_tma
    issue_s = max(issue_s, busiest)
    inflight_s = 0.0
    warp_rounds = {sp: 0.0 for sp in SPACES}
    for kv in kernels.values():
        launches = kv.get("launches", 0)
        warps = kv.get("warps", 0)
        if not launches or not warps:
            continue
        # warps that cannot be resident at once wait for a turn: the launch takes waves
        waves = max(1.0, warps / launches / (k.num_sms * k.sm_max_warps))
        for sp in SPACES:
            r = float(kv.get(f"warp_mrounds:{sp}", 0)) * MILLI
            warp_rounds[sp] += r
            inflight_s += launches * (r / warps) * lat[sp] * waves
    round_bytes = {sp: float(c.get(f"round_bytes:{sp}", 0)) for sp in SPACES}
    inflight_B = {sp: round_bytes[sp] / warp_rounds[sp] if warp_rounds[sp] else 0.0
                  for sp in SPACES}
    # the longest thread's data rounds plus its polls and write waits (each the longest on
    # its own: an upper bound of one thread's sum)
    longest = {sp: (float(c.get(f"longest:mrounds:{sp}", 0))
                    + float(c.get(f"chain:mrounds:{sp}", 0))) * MILLI for sp in SPACES}
    chain_s = sum(longest[sp] * lat[sp] for sp in SPACES) + float(c.get("chain:wrs", 0)) * k.wr_s
    terms = {"link": link_s, "issue": issue_s, "inflight": inflight_s, "chain": chain_s}
    bound = max(terms, key=terms.get)
    t = terms[bound] + base["launches"] * k.launch_s
    return {"time_s": t, **{f"{n}_s": v for n, v in terms.items()}, "bound": bound,
            "sms": base["sms"], "launches": base["launches"],
            "nvlink_bytes": base["nvlink_bytes"], "rdma_bytes": base["rdma_bytes"],
            "local_bytes": base["local_bytes"], "tma_bytes": base["tma_bytes"],
            "rdma_wrs": wrs, "warp_rounds": warp_rounds, "inflight_bytes_per_warp": inflight_B,
            "longest_rounds": longest,
            "nvlink_fraction": base["nvlink_bytes"] / t / k.nvlink_Bps if t > 0 else 0.0,
            "nvlink_GBps": base["nvlink_bytes"] / t / 1e9 if t > 0 else 0.0,
            "rdma_GBps": base["rdma_bytes"] / t / 1e9 if t > 0 else 0.0,
            "latency_aware": True}


def op_time_latency(per_device: list[dict], k: Constants = H200) -> dict[str, Any]:
    """The latency-aware model's op time: its slowest GPU's."""
    rows = [device_time_latency(c, k) for c in per_device]
    worst = max(rows, key=lambda r: r["time_s"])
    return dict(worst, gpus=len(rows))
