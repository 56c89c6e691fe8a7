"""Start NCCL's GPU-initiated networking (GIN) once per process for the internode kernels.

    jax.distributed.initialize(...)     # one process per GPU, or one per host (all its GPUs)
    jax_ep.nccl_bootstrap.initialize(max_tokens=T, hidden=H, topk=K)   # before jit

Unlike NVSHMEM (one PE per process), one process may drive several local GPUs: each local
GPU gets its own communicator, window (the internode heap) and device communicators,
all created by the native `Start` in one NCCL group (kernels/internode/nccl_host.{h,cc}).

World ranks: the devices of `jax.devices()` taken process by process (stable, in
`jax.devices()` order within a process), so process p's GPUs hold one contiguous block
of ranks and an EP mesh axis made with `jax.make_mesh` over `jax.devices()` lists them in
rank order. The world is every device of the job.

Start-up (bounded; every step within `timeout_s`, default jax_ep.config.timeout_s):

1. `plan_start`: every process publishes, through `jax.distributed`'s key-value store,
   its ranks and the values that must match (jax-ep version, world size, the
   TransportConfig field by field and its hash, heap bytes, GIN contexts, GPUs per node)
   and reads every other process's. A difference fails on every process alike, naming
   the process and the field; a process that does not publish within `timeout_s` is
   named by its peers. No NCCL call is made before this agrees.
2. Process 0 creates the ncclUniqueId (native `UniqueId`) and publishes it; the others
   read it (bounded).
3. The native `Start(ordinals, ranks, world, uid, heap_bytes, num_contexts,
   gpus_per_node)` runs under a watchdog (NCCL's collectives have no bound of their own:
   a stuck one ends the process with exit code 75 and a message naming the step), then a
   barrier in the key-value store says every process started.

The native calls go through a `Runtime` seam (unique_id, start, finish): the default is
the compiled extension through jax_ep._src.nccl_native; tests pass their own. Steps 1-2
(`plan_start`) need neither GPUs nor NCCL (tests/test_transport_choice.py and the
2-process CPU test run them through the real key-value store).

Exit: nothing collective runs at exit; call `finalize()` on every process to stop earlier.
"""
from __future__ import annotations

import atexit
import dataclasses
import hashlib
import itertools
import json
import threading
import time
from typing import Callable, Protocol, Sequence

from jax_ep.network.transport import TransportConfig

__all__ = ["NcclBootstrapError", "Runtime", "NativeRuntime", "StartPlan", "NcclState",
           "world_ranks", "startup_params", "plan_start", "start", "initialize",
           "finalize", "is_initialized", "state", "KEY_PREFIX", "UNIQUE_ID_BYTES"]

KEY_PREFIX = "jax_ep/nccl"
UNIQUE_ID_BYTES = 128  # sizeof(ncclUniqueId)


class NcclBootstrapError(RuntimeError):
    """NCCL could not be started as jax-ep needs it."""


class Runtime(Protocol):
    """The native NCCL calls the bootstrap makes (tests pass their own)."""

    def unique_id(self) -> bytes: ...

    def start(self, ordinals: list[int], ranks: list[int], world: int, uid: bytes,
              heap_bytes: int, num_contexts: int, gpus_per_node: int,
              low_latency: Sequence[int] = ()) -> None: ...

    def finish(self, ordinals: list[int]) -> None: ...


class NativeRuntime:
    """NCCL through the compiled bindings (jax_ep._src.nccl_native); checks first that the
    NCCL transport can run here (TransportUnavailableError naming the package otherwise)."""

    def __init__(self):
        from jax_ep._src import libraries
        libraries.require("nccl")

    def unique_id(self) -> bytes:
        from jax_ep._src import nccl_native
        return nccl_native.unique_id()

    def start(self, ordinals, ranks, world, uid, heap_bytes, num_contexts, gpus_per_node,
              low_latency=()):
        from jax_ep._src import nccl_native
        nccl_native.start(ordinals, ranks, world, uid, heap_bytes, num_contexts,
                          gpus_per_node, low_latency=low_latency)

    def finish(self, ordinals):
        from jax_ep._src import nccl_native
        nccl_native.finish(ordinals)


# --- ranks ---------------------------------------------------------------------------------

def world_ranks(devices: Sequence, process: int) -> tuple[list[int], list[int], int]:
    """(ordinals, ranks, world) of process `process`: `devices` is the job's device list
    (jax.devices(): objects with process_index and local_hardware_id); ranks follow the
    devices process by process, in list order within a process; ordinals[i] is the CUDA
    device (local_hardware_id) that holds ranks[i]; world = len(devices)."""
    order = sorted(range(len(devices)), key=lambda i: (devices[i].process_index, i))
    ordinals, ranks = [], []
    for rank, i in enumerate(order):
        d = devices[i]
        if d.process_index == process:
            hw = getattr(d, "local_hardware_id", None)
            ordinals.append(int(d.id if hw is None else hw))
            ranks.append(rank)
    return ordinals, ranks, len(devices)


# --- the agreement -------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class StartPlan:
    """What this process passes to the native Start, agreed with every other process.

    ordinals, ranks: [L] this process's CUDA devices and their world ranks; rank_sets:
    [P] every process's ranks (process order); unique_id: 128 bytes."""
    process: int
    num_processes: int
    ordinals: tuple[int, ...]
    ranks: tuple[int, ...]
    world: int
    unique_id: bytes
    heap_bytes: int
    num_contexts: int
    gpus_per_node: int
    config: TransportConfig
    rank_sets: tuple[tuple[int, ...], ...]


def _config_fields(cfg) -> dict:
    if dataclasses.is_dataclass(cfg):
        return {k: v for k, v in sorted(dataclasses.asdict(cfg).items())}
    return {"repr": repr(cfg)}


def startup_params(*, world: int, config, heap_bytes: int, num_contexts: int,
                   gpus_per_node: int) -> dict:
    """The values every process must share before NCCL starts (JSON-able)."""
    from jax_ep import __version__
    fields = _config_fields(config)
    return {
        "jax_ep_version": __version__,
        "transport": "nccl",
        "world": int(world),
        "heap_bytes": int(heap_bytes),
        "num_contexts": int(num_contexts),
        "gpus_per_node": int(gpus_per_node),
        "transport_config": fields,
        "transport_config_hash": hashlib.sha256(
            json.dumps(fields, sort_keys=True, default=repr).encode()).hexdigest()[:16],
    }


def _differences(mine: dict, theirs: dict) -> list[tuple[str, object, object]]:
    out = []
    for k in sorted(set(mine) | set(theirs)):
        a, b = mine.get(k), theirs.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out += [(f"{k}.{kk}", va, vb) for kk, va, vb in _differences(a, b)]
        elif a != b:
            out.append((k, a, b))
    return out


def _local_checks(ordinals, ranks, world, gpus_per_node) -> str | None:
    if len(ordinals) != len(ranks) or not ranks:
        return f"{len(ordinals)} local devices for {len(ranks)} ranks (need >= 1, equal)"
    if len(set(ranks)) != len(ranks) or any(not 0 <= r < world for r in ranks):
        return f"local ranks {list(ranks)} are not distinct ranks in [0, {world})"
    if len(set(ordinals)) != len(ordinals):
        return f"a CUDA device is listed twice: {list(ordinals)}"
    if gpus_per_node < 1 or world % gpus_per_node:
        return f"gpus_per_node={gpus_per_node} does not divide the world ({world} ranks)"
    return None


def _get(client, key: str, deadline: float, what: str, timeout_s: float):
    left_ms = max(1, int((deadline - time.monotonic()) * 1000))
    try:
        return bytes(client.blocking_key_value_get_bytes(key, left_ms))
    except Exception as e:  # noqa: BLE001 - the store raises XlaRuntimeError on a timeout
        raise NcclBootstrapError(f"{what} within {timeout_s:g} s ({type(e).__name__}: "
                                 f"{str(e).splitlines()[0] if str(e) else ''})") from None


def plan_start(client, *, process: int, num_processes: int, ordinals: Sequence[int],
               ranks: Sequence[int], world: int, config, heap_bytes: int,
               num_contexts: int, gpus_per_node: int,
               make_unique_id: Callable[[], bytes], timeout_s: float, key: str,
               error: str | None = None) -> StartPlan:
    """Agrees this process's start with every other one through the key-value store
    `client` (key_value_set_bytes, blocking_key_value_get_bytes) under prefix `key`, each
    wait bounded by one deadline `timeout_s` away; process 0 then makes the unique id
    (make_unique_id, called only once every process agreed) and shares it. Returns the
    StartPlan; NcclBootstrapError on every process alike when one failed (its `error`
    or a local check), a shared value differs (naming the process and field, e.g.
    transport_config.num_ports) or the ranks do not tile [0, world); naming the process
    that did not publish within timeout_s. Makes no NCCL call but make_unique_id."""
    ordinals, ranks = [int(o) for o in ordinals], [int(r) for r in ranks]
    error = error or _local_checks(ordinals, ranks, int(world), int(gpus_per_node))
    params = startup_params(world=world, config=config, heap_bytes=heap_bytes,
                            num_contexts=num_contexts, gpus_per_node=gpus_per_node)
    mine = {"params": params, "ranks": ranks, "error": error}
    client.key_value_set_bytes(f"{key}/agree/{process}",
                               json.dumps(mine, sort_keys=True).encode())
    deadline = time.monotonic() + float(timeout_s)
    got = {process: mine}
    for p in range(num_processes):
        if p != process:
            raw = _get(client, f"{key}/agree/{p}", deadline,
                       f"NCCL not started: process {p} did not publish its start-up "
                       f"settings (it is missing, stuck, or did not call "
                       f"jax_ep.nccl_bootstrap.initialize); process {process} made no "
                       f"NCCL call", timeout_s)
            got[p] = json.loads(raw.decode())
    failed = [(p, g["error"]) for p, g in sorted(got.items()) if g.get("error")]
    if failed:
        raise NcclBootstrapError("NCCL not started on any process (no NCCL call was made): "
                                 + "; ".join(f"process {p}: {e}" for p, e in failed))
    ref = got[0]["params"]
    diffs = [f"process {p} has {name}={have!r} where process 0 has {want!r}"
             for p in sorted(got) for name, want, have in _differences(ref, got[p]["params"])]
    if diffs:
        raise NcclBootstrapError("NCCL not started: the processes disagree on settings that "
                                 "must match (no NCCL call was made): " + "; ".join(diffs))
    rank_sets = tuple(tuple(got[p]["ranks"]) for p in range(num_processes))
    flat = sorted(r for s in rank_sets for r in s)
    if flat != list(range(int(world))):
        raise NcclBootstrapError(
            f"NCCL not started: the processes' ranks {[list(s) for s in rank_sets]} do not "
            f"cover the world of {world} ranks once each (no NCCL call was made)")
    uid_key = f"{key}/uid"
    if process == 0:
        uid = bytes(make_unique_id())
        if len(uid) != UNIQUE_ID_BYTES:
            raise NcclBootstrapError(f"the NCCL unique id has {len(uid)} bytes, expected "
                                     f"{UNIQUE_ID_BYTES}")
        client.key_value_set_bytes(uid_key, uid)
    else:
        uid = _get(client, uid_key, deadline, f"process {process} did not receive the NCCL "
                   f"unique id from process 0", timeout_s)
    return StartPlan(process=int(process), num_processes=int(num_processes),
                     ordinals=tuple(ordinals), ranks=tuple(ranks), world=int(world),
                     unique_id=uid, heap_bytes=int(heap_bytes),
                     num_contexts=int(num_contexts), gpus_per_node=int(gpus_per_node),
                     config=config, rank_sets=rank_sets)


def watchdog(step: str, timeout_s: float, process: int):
    """Bounds one native NCCL step (jax_ep.nvshmem_bootstrap.watchdog: past timeout_s it
    names the step and process and ends the process with exit code 75)."""
    from jax_ep import nvshmem_bootstrap as _nv
    return _nv.watchdog(step, timeout_s, process, library="NCCL")


def start(plan: StartPlan, runtime: Runtime, *, timeout_s: float,
          low_latency: Sequence[int] = ()) -> None:
    """The native Start of `plan`, under the watchdog (collective over the world);
    low_latency: [max_tokens, row_bytes, topk, num_experts] of the low-latency area, which
    the window then holds past the heap halves (empty: none)."""
    extra = {"low_latency": [int(v) for v in low_latency]} if low_latency else {}
    with watchdog("NCCL start (communicators, windows, device communicators)", timeout_s,
                  plan.process):
        runtime.start(list(plan.ordinals), list(plan.ranks), plan.world, plan.unique_id,
                      plan.heap_bytes, plan.num_contexts, plan.gpus_per_node, **extra)


# --- state ---------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class NcclState:
    """NCCL as started: this process's ordinals and ranks [L], the world, heap bytes per
    GPU, GIN contexts, GPUs per node, the TransportConfig the kernels use."""
    ordinals: tuple[int, ...]
    ranks: tuple[int, ...]
    world: int
    heap_bytes: int
    num_contexts: int
    gpus_per_node: int
    config: TransportConfig
    low_latency: dict | None = None  # the area's limits (nvshmem_bootstrap._ll_limits)


_lock = threading.Lock()
_calls = itertools.count()  # initialize is collective: the same key on every process
_state: NcclState | None = None
_runtime: Runtime | None = None


def is_initialized() -> bool:
    return _state is not None


def state() -> NcclState | None:
    return _state


def _kv_client():
    from jax_ep import nvshmem_bootstrap  # the same jax.distributed key-value store
    return nvshmem_bootstrap._kv_client()


def _gpus_per_node(world: int, local: int) -> int:
    """JAX_EP_GPUS_PER_NODE; else this process's GPUs when it drives several (one process
    per host); else jax_ep.network.topology.detect (a launcher's local size, one node)."""
    from jax_ep import config
    from jax_ep.network import topology
    if config.current().gpus_per_node is None and local > 1:
        return local
    return topology.detect(world).gpus_per_node


def initialize(*, heap_bytes: int | None = None, num_ranks: int | None = None,
               max_tokens: int | None = None, capacity: int | None = None,
               hidden: int | None = None, topk: int | None = None, x_dtype="bfloat16",
               y_dtype="float32", config: TransportConfig | None = None,
               runtime: Runtime | None = None, client=None,
               timeout_s: float | None = None, devices=None, process: int | None = None,
               num_processes: int | None = None,
               low_latency: dict | None = None) -> NcclState:
    """Start NCCL GIN in this process (once, collectively, before jit). See the module
    docstring.

    Give heap_bytes (per GPU), or the limits (max_tokens, hidden, topk; optionally
    capacity and num_ranks, default the world) to size it with
    jax_ep.nvshmem_bootstrap.heap_bytes_for. devices (default jax.devices()), process and
    num_processes (default jax.process_index(), jax.process_count()) are for tests. A
    later call asking for a larger heap is an error, one asking for less a no-op.
    low_latency=dict(max_tokens_per_rank=M, hidden=H, topk=K, num_experts=E[, dtype]):
    the internode low-latency area too, in each GPU's window past the heap halves
    (jax_ep.nvshmem_bootstrap.ll_area_bytes_for bytes), made on every local GPU at start.
    """
    global _state, _runtime
    import jax
    from jax_ep import config as _config
    from jax_ep import nvshmem_bootstrap as _nv

    with _lock:
        devices = list(jax.devices() if devices is None else devices)
        process = jax.process_index() if process is None else int(process)
        num_processes = jax.process_count() if num_processes is None else int(num_processes)
        ordinals, ranks, world = world_ranks(devices, process)
        if heap_bytes is None:
            if None in (max_tokens, hidden, topk):
                raise ValueError("give heap_bytes, or max_tokens, hidden and topk (and "
                                 "optionally capacity) to size the NCCL window")
            heap_bytes = _nv.heap_bytes_for(num_ranks=num_ranks or world,
                                            max_tokens=max_tokens, capacity=capacity,
                                            hidden=hidden, topk=topk, x_dtype=x_dtype,
                                            y_dtype=y_dtype)
        heap_bytes = int(heap_bytes)
        if heap_bytes < 1:
            raise ValueError(f"heap_bytes must be >= 1, got {heap_bytes}")
        if _state is not None:
            if heap_bytes > _state.heap_bytes:
                raise NcclBootstrapError(
                    f"NCCL is already running with a {_state.heap_bytes}-byte window per "
                    f"GPU; {heap_bytes} bytes were asked for. Call initialize once, before "
                    f"jit, with the largest limits the program uses.")
            return _state
        rt = runtime if runtime is not None else NativeRuntime()
        cfg = (config or TransportConfig()).resolve()
        if client is None:
            client = _kv_client()
        if client is None:
            raise NcclBootstrapError(
                "call jax.distributed.initialize() before jax_ep.nccl_bootstrap.initialize: "
                "the NCCL unique id is shared through its key-value store")
        timeout_s = float(_config.current().timeout_s if timeout_s is None else timeout_s)
        error = None
        if runtime is None and any(d.platform != "gpu" for d in devices):
            error = (f"the NCCL transport needs GPU devices; process {process} has "
                     f"{sorted({d.platform for d in devices})}")
        key = f"{KEY_PREFIX}/{next(_calls)}"
        plan = plan_start(client, process=process, num_processes=num_processes,
                          ordinals=ordinals, ranks=ranks, world=world, config=cfg,
                          heap_bytes=heap_bytes, num_contexts=cfg.num_qps,
                          gpus_per_node=_gpus_per_node(world, len(ordinals)),
                          make_unique_id=rt.unique_id, timeout_s=timeout_s, key=key,
                          error=error)
        ll = _nv._ll_limits(low_latency, world) if low_latency is not None else None
        start(plan, rt, timeout_s=timeout_s,
              low_latency=() if ll is None else (ll["max_tokens_per_rank"], ll["row_bytes"],
                                                 ll["topk"], ll["num_experts"]))
        try:
            client.wait_at_barrier(f"{key}/ready", int(timeout_s * 1000))
        except Exception as e:  # noqa: BLE001
            raise NcclBootstrapError(f"NCCL started on process {process} but not on all "
                                     f"{num_processes} processes within {timeout_s:g} s: "
                                     f"{e}") from None
        _runtime = rt
        _state = NcclState(ordinals=plan.ordinals, ranks=plan.ranks, world=plan.world,
                           heap_bytes=plan.heap_bytes, num_contexts=plan.num_contexts,
                           gpus_per_node=plan.gpus_per_node, config=cfg, low_latency=ll)
        return _state


def finalize() -> None:
    """Stop NCCL (collective: every process must call it). Not called at exit."""
    global _state, _runtime
    with _lock:
        if _state is None:
            return
        st, rt, _runtime, _state = _state, _runtime, None, None
        rt.finish(list(st.ordinals))


def _forget_at_exit() -> None:
    global _state, _runtime
    _state, _runtime = None, None


atexit.register(_forget_at_exit)
