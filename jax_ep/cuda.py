"""CUDA backend support: communication buffers, device error checks, launch presets and
the virtual-rank harness.

On GPUs the ``"ffi"`` backend moves rows through a communication buffer that every GPU
allocates once and shares with the peers of its EP group: through peer access when one
process drives several GPUs (JAX's usual single-host setup), through CUDA IPC handles
exchanged over ``jax.distributed``'s key-value store when each process drives one GPU.
Call :func:`setup` once, before jitting programs that use the EP ops::

    jax_ep.cuda.setup(mesh, "expert", num_tokens=4096, hidden=7168, topk=8)

The low-latency mode (:mod:`jax_ep.low_latency`, ``backend='ffi'``) needs its own area,
sized once from (R, M, H, K, E) and never from a call's token count; ask for it with
``max_tokens_per_rank`` and ``num_experts`` (``num_tokens`` may then be None to reserve
nothing for the normal mode)::

    jax_ep.cuda.setup(mesh, "expert", num_tokens=None, hidden=7168, topk=8,
                      max_tokens_per_rank=128, num_experts=256)

Checks that need values run on the GPU and are recorded in a per-GPU error record that
:func:`check_errors` reads (it waits for the GPUs this process uses and raises):

- ids outside ``[-1, E)`` and handles from another call: the bad entries are treated as
  unused and the call completes;
- protocol errors: a peer that never came (every wait is bounded by ``JAX_EP_TIMEOUT_S``),
  a peer in another EP call (each call carries its call-site id, and every rank checks
  its peers'), a rank/group that differs from :func:`setup`'s, or a peer that reported
  one of these. From then on the kernels on that GPU keep the exchange going, so no rank
  falls out of step, but move no data: outputs are empty (zero rows, -1 ids, zero
  counts), peers learn of it and skip too, and once a timeout is recorded later waits
  end at once. :func:`reset` (every process together) clears this without a restart.

Handlers never fail on the host because of an earlier device error (XLA may replay them
from a CUDA graph without calling them, and ranks would see it at different calls), so
call :func:`check_errors` after a step to learn of one.

The virtual-rank harness (:func:`harness_dispatch`, :func:`harness_combine`,
:func:`harness_gather`) runs the same kernels for R ranks whose buffers all live on one
GPU, on stacked per-rank inputs. Each rank's kernels run on their own stream with small
grids (one channel), at the same time as the others', so the waits are real: the channel
kernels of all three ops wait on each other and could not run one rank after another, so
``concurrent=False`` is refused. Streams share the GPU's CUDA_DEVICE_MAX_CONNECTIONS
hardware queues (default 8), and two ranks on one queue deadlock: the harness refuses more
ranks than queues. Set CUDA_DEVICE_MAX_CONNECTIONS (up to 32) before jax starts its GPU
backend to run more (the tests and scripts/gpu_check.sh set 32).
"""
from __future__ import annotations

import atexit
import dataclasses
import functools
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jax_ep._src import ext as _ext
from jax_ep._src.common import axis_names as _axis_names
from jax_ep.nvshmem_bootstrap import _kv_client

__all__ = [
    "available", "buffer_bytes", "channels", "dispatch_channels", "ring_tokens", "low_latency_layout", "low_latency_area", "setup",
    "check_errors", "reset", "presets", "set_num_sms", "HarnessDispatch", "harness_dispatch",
    "harness_combine", "harness_gather",
]

# Legacy CUDA peer access (cudaDeviceEnablePeerAccess, and CUDA IPC between GPUs) reaches
# at most 8 other GPUs; more ranks fit only where several share a GPU (the harness, or
# several processes on one GPU).
MAX_PEER_GPUS = 8
# setup() and reset() are collective: every process calls them equally often, so these
# counters name the same key-value-store keys and barriers on every process.
_setup_calls = itertools.count()
HARNESS_CALL_SITE = 1  # the harness's default call-site id (every rank the same)
_reset_calls = itertools.count()
# The low-latency area of the last setup (dict of its shapes), None before one asked for it.
_ll_area: dict | None = None


@functools.cache
def _consts() -> dict:
    """The intranode buffer's and launch presets' constants (kernels/cuda/intranode_buffer.h,
    kernels/common/configs.h) from the extension's intranode_constants()."""
    return dict(_ext.require_ext().intranode_constants())


def __getattr__(name: str):
    # MAX_RANKS (ranks of one intranode group, kMaxRanks: a 32-bit mask per token) comes
    # from the extension on first use, not at import: `import jax_ep` (and build_info(),
    # which says what is missing) must work in an install without it.
    if name == "MAX_RANKS":
        return _consts()["max_ranks"]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _gpus():
    try:
        return jax.devices("gpu")
    except RuntimeError:
        return []


def available() -> bool:
    """True when this build has the CUDA backend and JAX sees a GPU."""
    return bool(_ext.build_info()["cuda"]) and bool(_gpus())


def _bindings():
    ext = _ext.require_ext()
    if not hasattr(ext, "cuda_alloc_buffer"):
        raise RuntimeError(
            "jax_ep: this build has no CUDA host functions (built: "
            f"{_ext.build_info()}); rebuild with nvcc available (JAX_EP_CUDA=ON)")
    return ext


def set_num_sms(num_sms: int | None) -> None:
    """SMs the intranode kernels may use (as DeepEP's ``Buffer.set_num_sms``): the
    dispatch/combine channel kernels run the largest even block count within it (at least
    2: a sending and a receiving block per channel; default 24 at 8 ranks, see
    docs/intranode.md; gather's channel kernel the same), at one resident block per SM, so
    they fit beside other work (compute, an NCCL kernel, another MPS client).
    None: the GPU's SMs less 16 (kernels/common/configs.h kReservedSms). The setting
    ``jax_ep.config.num_sms`` (``JAX_EP_NUM_SMS``), read at each launch: set it before the
    program is compiled or captured."""
    from jax_ep import config
    if num_sms is None:
        config.update("num_sms", None)
        return
    if isinstance(num_sms, bool) or not isinstance(num_sms, (int, np.integer)) or num_sms < 1:
        raise ValueError(f"num_sms must be a positive int, got {num_sms!r}")
    config.update("num_sms", int(num_sms))


def presets() -> list[dict]:
    """The intranode launch presets compiled in (kernels/common/configs.h): name, max_ranks,
    num_sms (blocks of the dispatch/combine/gather channel kernels). JAX_EP_CUDA_PRESET=<name>
    forces one."""
    return [dict(p) for p in _bindings().cuda_presets()]


# ----------------------------------------------------------------------------- sizes

def _align(v: int) -> int:
    """v rounded up to the buffer's area alignment (kAreaAlign)."""
    a = _consts()["area_align"]
    return (v + a - 1) // a * a


def low_latency_layout(num_ranks: int, max_tokens_per_rank: int, row_bytes: int, topk: int,
                       num_experts: int) -> dict:
    """Offsets and size in bytes of the low-latency area for these shapes (LowLatencyLayout,
    kernels/cuda/low_latency_layout.h, through its binding): header, then two halves each
    of slots [E_local][R][M] rows, their source tokens and arrival words (uint64,
    [E_local][R] dispatch + [R][E_local] combine), two
    position scratches [M * K], expert offsets [E], and two halves of the combine stage
    [R][M * min(K, E_local)] rows. Offsets are of half 0; *_half is the size of one half."""
    return dict(_ext.require_ext().intranode_ll_layout(
        int(num_ranks), int(max_tokens_per_rank), int(row_bytes), int(topk), int(num_experts)))


def _check_ll_shapes(R, max_tokens_per_rank, num_experts, topk, hidden):
    if num_experts is None:
        raise ValueError("max_tokens_per_rank (the low-latency area) needs num_experts")
    M, E = int(max_tokens_per_rank), int(num_experts)
    if M < 1:
        raise ValueError(f"max_tokens_per_rank must be >= 1, got {M}")
    if E < R or E % R != 0:
        raise ValueError(f"num_experts={E} must be a positive multiple of the {R} ranks")
    if E > 1024:
        raise ValueError(f"num_experts={E}: the GPU low-latency path supports at most 1024")
    if int(topk) < 1 or int(hidden) < 1:
        raise ValueError("topk and hidden must be >= 1")
    return M, E


def channels(num_ranks: int) -> int:
    """Channels of the dispatch/combine/gather kernels a group of `num_ranks` is set up for (its
    preset's num_sms / 2; JAX_EP_CUDA_PRESET forces a row). A launch cut to a smaller SM
    budget (set_num_sms) runs fewer in the same buffers. (kernels/cuda/intranode_buffer.h
    SetupChannels.)"""
    return int(_ext.require_ext().intranode_channels(int(num_ranks)))


def dispatch_channels(num_ranks: int) -> int:
    """Channels of the dispatch kernel (kernels/cuda/intranode_buffer.h DispatchChannels):
    up to 16 ranks every block of the channel kernel is a channel of its own (2 x
    channels(num_ranks)), above that two blocks share one."""
    return int(_ext.require_ext().intranode_dispatch_channels(int(num_ranks)))


def ring_tokens() -> int:
    """Slots of each (channel, peer) ring: the setting ``jax_ep.config.ring_tokens``
    (JAX_EP_RING_TOKENS; read at setup and at each launch; keep it the same on every
    rank) when set, else 128; within [1, 4096] (kernels/common/configs.h
    IntranodeRingTokens)."""
    return int(_ext.require_ext().intranode_ring_tokens())


def buffer_bytes(num_ranks: int, num_tokens: int | None, hidden: int, topk: int,
                 dtype=jnp.bfloat16, capacity: int | None = None, *,
                 max_tokens_per_rank: int | None = None,
                 num_experts: int | None = None) -> dict:
    """Bytes of communication buffer each op kind needs on every GPU for these per-rank
    shapes (kernels/cuda/intranode_buffer.h's, through its bindings). Dispatch, combine
    and gather (combine's transpose, cached dispatch) stage rows in channels x ranks rings
    of ring_tokens() slots (dispatch: dispatch_channels() x ranks): their bytes depend on
    the ranks, the row size and topk, not on num_tokens or capacity ("channels",
    "dispatch_channels" and "ring_tokens" report the settings).
    num_tokens=None: no normal-mode areas (zero bytes). With max_tokens_per_rank and num_experts, also the
    "low_latency" area: a function of (R, M, H, K, E) and dtype only, holding any call of
    at most M tokens per rank, top-K routing and rows of at most H elements of dtype."""
    R, H, K = int(num_ranks), int(hidden), int(topk)
    max_ranks = _consts()["max_ranks"]
    if not 1 <= R <= max_ranks:
        raise ValueError(f"num_ranks must be in [1, {max_ranks}] on the intranode GPU path")
    row = H * jnp.dtype(dtype).itemsize
    if num_tokens is None:
        out = {"dispatch": 0, "combine": 0, "gather": 0, "header": _consts()["header_bytes"]}
    else:
        ring_tokens()  # a bad JAX_EP_RING_TOKENS is an error
        out = dict(_ext.require_ext().intranode_area_bytes(R, row, K))
    if max_tokens_per_rank is not None:
        M, E = _check_ll_shapes(R, max_tokens_per_rank, num_experts, K, H)
        out["low_latency"] = _align(low_latency_layout(R, M, row, K, E)["bytes"])
    return out


def low_latency_area() -> dict | None:
    """Shapes of the low-latency area the last :func:`setup` allocated (num_ranks,
    max_tokens_per_rank, num_experts, topk, row_bytes, bytes), or None if none did."""
    return None if _ll_area is None else dict(_ll_area)


# ----------------------------------------------------------------------------- setup

@dataclasses.dataclass(frozen=True)
class _Member:
    device: object
    rank: int
    group: int


def _group_members(mesh, axis_name):
    """{group id: [device of rank 0, 1, ...]} and each device's (rank, group), numbered
    like jax_ep.ops (rank: row-major over the EP axes; group: over the other axes)."""
    names = list(mesh.axis_names)
    ep = _axis_names(axis_name)
    for a in ep:
        if a not in names:
            raise ValueError(f"axis {a!r} is not an axis of the mesh {names}")
    devs = np.asarray(mesh.devices)
    shape = dict(zip(names, devs.shape))
    others = [a for a in names if a not in ep]
    groups: dict[int, dict[int, object]] = {}
    members = []
    for pos in np.ndindex(devs.shape):
        coord = dict(zip(names, pos))
        rank = 0
        for a in ep:
            rank = rank * shape[a] + coord[a]
        group = 0
        for a in others:
            group = group * shape[a] + coord[a]
        d = devs[pos]
        groups.setdefault(group, {})[rank] = d
        members.append(_Member(d, rank, group))
    R = math.prod(shape[a] for a in ep)
    return {g: [m[r] for r in range(R)] for g, m in groups.items()}, members, R


@functools.cache
def _close_ipc_at_exit():
    """Once per process, after the first peer buffer opened through CUDA IPC: close them
    all at exit, so the exporting processes' allocations are not held by this one."""
    atexit.register(lambda: _ext.require_ext().cuda_close_ipc_handles())


def setup(mesh, axis_name, *, num_tokens: int | None, hidden: int, topk: int,
          dtype=jnp.bfloat16, capacity: int | None = None, area_bytes: dict | None = None,
          timeout_ms: int = 300_000, max_tokens_per_rank: int | None = None,
          num_experts: int | None = None, num_sms: int | None = None) -> dict:
    """Allocates (once per GPU) and wires the communication buffers for EP over
    `axis_name` of `mesh`, sized for per-rank shapes x[num_tokens, hidden] of `dtype`,
    top-`topk` routing and `capacity` (default R * num_tokens). Pass `area_bytes`
    (``{"dispatch", "combine", "gather"}``) to size the buffers yourself. Call it before
    jitting; call it with the largest shapes first. Returns the area sizes used.

    Low-latency mode: `max_tokens_per_rank` (M) and `num_experts` (E) add the area
    `jax_ep.low_latency` with ``backend='ffi'`` needs, sized once for calls of at most M
    tokens per rank, top-`topk` routing and rows of at most `hidden` elements of `dtype`
    (see :func:`buffer_bytes`); `num_tokens` may then be None (no normal-mode areas).

    One EP group per GPU and process: programs captured as CUDA graphs keep the buffer
    pointers, so a GPU's group cannot change afterwards.

    `num_sms`: SMs the intranode kernels may use (see :func:`set_num_sms`)."""
    global _ll_area
    if num_sms is not None:
        set_num_sms(num_sms)
    ext = _bindings()
    if num_tokens is None and max_tokens_per_rank is None and area_bytes is None:
        raise ValueError("num_tokens=None reserves no normal-mode buffers; pass num_tokens, "
                         "or max_tokens_per_rank and num_experts for the low-latency mode")
    groups, members, R = _group_members(mesh, axis_name)
    max_ranks = _consts()["max_ranks"]
    if not 1 <= R <= max_ranks:
        raise ValueError(f"EP groups of {R} ranks: the intranode GPU path supports 1 to "
                         f"{max_ranks}")
    if any(getattr(d, "platform", "") != "gpu" for d in np.asarray(mesh.devices).ravel()):
        raise ValueError("jax_ep.cuda.setup needs a mesh of GPU devices")
    for g, devs in groups.items():
        gpus = {d.local_hardware_id for d in devs}  # one host: the local id names the GPU
        if len(gpus) - 1 > MAX_PEER_GPUS:
            raise ValueError(
                f"EP group {g} spans {len(gpus)} GPUs: the intranode path reaches peers by "
                f"legacy CUDA peer access (or CUDA IPC), which allows at most "
                f"{MAX_PEER_GPUS} peers per GPU; use EP groups of at most "
                f"{MAX_PEER_GPUS + 1} GPUs per node, or the internode backend")
    ll_shape = []
    if max_tokens_per_rank is not None:
        M, E = _check_ll_shapes(R, max_tokens_per_rank, num_experts, topk, hidden)
        ll_row = int(hidden) * jnp.dtype(dtype).itemsize
        ll_shape = [M, int(topk), E, ll_row]
    call = next(_setup_calls)
    if area_bytes is None:
        area_bytes = buffer_bytes(R, num_tokens, hidden, topk, dtype, capacity)
    areas = [int(area_bytes["dispatch"]), int(area_bytes["combine"]),
             int(area_bytes["gather"])]
    if ll_shape:
        areas.append(_align(low_latency_layout(R, M, ll_row, int(topk), E)["bytes"]))
    me = jax.process_index()
    local = [m for m in members if m.device.process_index == me]
    ptrs, handles = {}, {}
    for m in local:
        ptr, handle = ext.cuda_alloc_buffer(m.device.local_hardware_id, areas)
        ptrs[m.device.id], handles[m.device.id] = int(ptr), bytes(handle)
    client = _kv_client() if jax.process_count() > 1 else None
    if jax.process_count() > 1:
        if client is None:
            raise RuntimeError("jax_ep.cuda.setup across processes needs "
                               "jax.distributed.initialize() first")
        for m in local:
            if not handles[m.device.id]:
                raise RuntimeError(f"CUDA IPC is not available for {m.device}")
            client.key_value_set(f"jax_ep/cuda/ipc/{call}/{m.device.id}",
                                 handles[m.device.id].hex())
    for m in local:
        ordinal = m.device.local_hardware_id
        peers = []
        for p in groups[m.group]:
            if p.process_index == me:
                if not ext.cuda_enable_peer_access(ordinal, p.local_hardware_id):
                    raise RuntimeError(f"{m.device} cannot access {p} directly (no NVLink or "
                                       "PCIe peer access); the intranode path needs it")
                peers.append(ptrs[p.id])
            else:
                h = bytes.fromhex(client.blocking_key_value_get(
                    f"jax_ep/cuda/ipc/{call}/{p.id}", timeout_ms))
                peers.append(int(ext.cuda_open_ipc_handle(ordinal, h)))
                _close_ipc_at_exit()
        ext.cuda_set_domain(ordinal, m.rank, m.group, R, peers, areas, ll_shape)
    if client is not None:
        client.wait_at_barrier(f"jax_ep_cuda_setup_{call}", timeout_ms)
    _ext.registered_platforms()
    if ll_shape:
        _ll_area = dict(num_ranks=R, max_tokens_per_rank=ll_shape[0], topk=ll_shape[1],
                        num_experts=ll_shape[2], row_bytes=ll_shape[3], bytes=areas[3])
    return dict(zip(("dispatch", "combine", "gather", "low_latency"), areas))


def check_errors(clear: bool = True) -> None:
    """Waits for the GPUs this process used for EP work (no others) and raises
    RuntimeError with the errors their kernels recorded (bad topk ids, foreign handles,
    timeouts, call-site mismatches, failed peers); a protocol error that followed an
    earlier bad id or foreign handle is named too. Clears the records unless
    clear=False, but not the kernels' failed state: after a protocol error the buffers
    are out of step, so every later EP call moves no data (empty outputs) and is reported
    again here, until :func:`reset` re-zeroes the headers and lifts it."""
    msgs = list(_bindings().cuda_check_errors(clear))
    if msgs:
        raise RuntimeError("; ".join(msgs))


def reset(timeout_ms: int = 300_000) -> list[int]:
    """Brings every EP group back to a clean state without a restart: waits for this
    process's GPUs, then (between two barriers of all processes, when there are several)
    re-zeroes the protocol state of its buffer headers, the harness's too, and clears the
    error records. Collective: every process of the job calls it, after every EP program
    it launched has finished (kernels stuck on a missing peer end within
    ``JAX_EP_TIMEOUT_S``). The kernels' failed state is cleared with the records.
    Returns the device ordinals reset."""
    ext = _bindings()
    call = next(_reset_calls)
    client = _kv_client() if jax.process_count() > 1 else None
    ext.cuda_check_errors(False)  # waits for the GPUs in use; the errors are cleared below
    if client is not None:  # no peer still writes into a header ...
        client.wait_at_barrier(f"jax_ep_cuda_reset_{call}_a", timeout_ms)
    used = [int(i) for i in ext.cuda_reset()]
    if client is not None:  # ... and none starts a call before every header is zero
        client.wait_at_barrier(f"jax_ep_cuda_reset_{call}_b", timeout_ms)
    return used


# ----------------------------------------------------------------------------- harness

@dataclasses.dataclass(frozen=True)
class HarnessDispatch:
    """Per-rank dispatch results of the harness, each with a leading rank axis R."""
    recv_x: jax.Array
    recv_topk_idx: jax.Array
    recv_topk_weights: jax.Array
    num_recv: jax.Array
    num_dropped: jax.Array
    num_recv_tokens_per_expert: jax.Array
    src_rank: jax.Array
    src_index: jax.Array
    send_row: jax.Array


def _sds(shape, dtype):
    return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype))


def _harness_attrs(R: int, call_sites, concurrent: bool, absent_rank: int) -> dict:
    """FFI attributes of the harness's run options (see harness_dispatch)."""
    if call_sites is None:
        # One process runs every rank, so any id shared by all ranks works; a constant keeps
        # the process-wide counter of real EP calls (which processes must agree on) as is.
        call_sites = [HARNESS_CALL_SITE] * R
    sites = np.asarray(call_sites, np.int64).reshape(-1)
    if sites.shape != (R,):
        raise ValueError(f"call_sites must list one id per rank ({R}), got {sites.shape[0]}")
    if not concurrent:
        raise ValueError("concurrent=False (the ranks' kernels one after another on one "
                         "stream) cannot run: every rank's channel kernels wait for the "
                         "others'; pass concurrent=True")
    if not -1 <= int(absent_rank) < R:
        raise ValueError(f"absent_rank must be -1 (none) or a rank in [0, {R}), got "
                         f"{absent_rank}")
    return dict(call_sites=sites, concurrent=np.int64(bool(concurrent)),
                absent_rank=np.int64(absent_rank))


def harness_dispatch(x, topk_idx, topk_weights, *, num_experts: int,
                     capacity: int | None = None, concurrent: bool = True, call_sites=None,
                     absent_rank: int = -1) -> HarnessDispatch:
    """Dispatch for R virtual ranks on one GPU: x[R, T, H], topk_idx/topk_weights[R, T, K]
    hold each rank's inputs; results have a leading rank axis.

    concurrent: must be True: every rank runs on its own stream (at most
    CUDA_DEVICE_MAX_CONNECTIONS ranks, see the module's notes). For tests
    of the failure paths: call_sites[R] gives each rank's call-site id (default: one
    HARNESS_CALL_SITE for all), absent_rank leaves one rank's kernels out (its peers time
    out)."""
    _ext.registered_platforms()
    R, T, H = x.shape
    K = topk_idx.shape[2]
    C = R * T if capacity is None else int(capacity)
    el = int(num_experts) // R
    outs = _ext.ffi_call(
        "jax_ep_harness_dispatch",
        (_sds((R, C, H), x.dtype), _sds((R, C, K), jnp.int32), _sds((R, C, K), jnp.float32),
         _sds((R,), jnp.int32), _sds((R,), jnp.int32), _sds((R, el), jnp.int32),
         _sds((R, C), jnp.int32), _sds((R, C), jnp.int32), _sds((R, T, R), jnp.int32)),
    )(x=x, topk_idx=jnp.asarray(topk_idx, jnp.int32),
      topk_weights=jnp.asarray(topk_weights, jnp.float32), num_experts=num_experts,
      capacity=C, **_harness_attrs(R, call_sites, concurrent, absent_rank))
    return HarnessDispatch(*outs)


def harness_combine(y, send_row, *, concurrent: bool = True, call_sites=None,
                    absent_rank: int = -1):
    """Combine for R virtual ranks: y[R, C, H], send_row[R, T, R] -> out[R, T, H].
    Options as for harness_dispatch."""
    _ext.registered_platforms()
    R, _, H = y.shape
    T = send_row.shape[1]
    return _ext.ffi_call("jax_ep_harness_combine", _sds((R, T, H), y.dtype))(
        y=y, send_row=jnp.asarray(send_row, jnp.int32),
        **_harness_attrs(R, call_sites, concurrent, absent_rank))


def harness_gather(g, src_rank, src_index, *, concurrent: bool = True, call_sites=None,
                   absent_rank: int = -1):
    """Combine's transpose for R virtual ranks: g[R, T, H], src_rank/src_index[R, C]
    -> out[R, C, H] with out[r, i] = g[src_rank[r, i], src_index[r, i]]. Options as for
    harness_dispatch."""
    _ext.registered_platforms()
    R, _, H = g.shape
    C = src_rank.shape[1]
    return _ext.ffi_call("jax_ep_harness_gather", _sds((R, C, H), g.dtype))(
        g=g, src_rank=jnp.asarray(src_rank, jnp.int32),
        src_index=jnp.asarray(src_index, jnp.int32),
        **_harness_attrs(R, call_sites, concurrent, absent_rank))
