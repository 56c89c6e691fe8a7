"""Start NVSHMEM once per process for the internode kernels.

    jax.distributed.initialize(...)          # one process per GPU
    jax_ep.nvshmem_bootstrap.initialize(capacity=C, max_tokens=T, hidden=H, topk=K)
    ... build and jit the model ...

`initialize` must run eagerly, before the first jit that uses the internode backend:
allocating the symmetric heap is collective over all processes and cannot happen inside
a compiled program. Process 0 creates an NVSHMEM unique id and publishes it through
`jax.distributed`'s key-value store; every process reads it and joins as PE
`jax.process_index()` of `jax.process_count()`. The heap is sized from the largest
capacity the program will use (see `heap_bytes_for`); a later call asking for more is an
error, a call asking for less is a no-op.

The NVSHMEM calls go through a small `Runtime` seam (unique_id, init, finalize, and
optionally qp_api_available, init_status) so the logic can be tested without GPUs; the
default runtime is the compiled extension.

QP path: with NVSHMEM's QP API (3.8+, found at run time) each planned QP gets its own
handle and the plan's QP is the QP on the wire. Without it the transport runs on one port
(`TransportConfig.single_port()`) and says so once, loudly; `transport_report()` in
`jax_ep._src.backends.internode` shows which path is in use.

Already running: when another library (XLA's own NVSHMEM kernels) started NVSHMEM first,
its QP count, multi-port and heap settings were fixed then. `initialize` adopts it only
if the environment already holds every NVSHMEM_* value the plan needs (NVSHMEM read them
at its start); otherwise it refuses, naming what to set.

Bootstrap interface: NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME, unless set, becomes the interface
this node routes to `jax.distributed`'s coordinator through, so process 0 gives the
other nodes an address they reach (`jax_ep.network.bootstrap_iface`; reported in
`transport_report()["bootstrap_interface"]`).

Memory: XLA preallocates a fraction of GPU memory (XLA_PYTHON_CLIENT_MEM_FRACTION, 0.75
by default) before this runs; the symmetric heap must fit in the rest. `initialize`
checks this from the device's memory stats and refuses with the fraction to set.

Low-latency mode: `initialize(low_latency=dict(max_tokens_per_rank=M, hidden=H, topk=K,
num_experts=E))` also allocates the internode low-latency area (`ll_area_bytes_for`), a
second symmetric allocation made right after NVSHMEM starts; without the normal mode's
limits the heap halves are made as small as they go.

Exit: nothing collective runs at exit (a barrier there hangs if a peer died); call
`finalize()` explicitly, on every process, to stop NVSHMEM earlier.
"""

from __future__ import annotations

import atexit
import dataclasses
import hashlib
import itertools
import json
import os
import sys
import threading
import time
import warnings
from typing import Protocol

import numpy as np

from jax_ep.network.transport import TransportConfig

__all__ = ["Runtime", "BootstrapState", "heap_bytes_for", "ll_area_bytes_for", "initialize",
           "finalize", "is_initialized", "state", "NvshmemBootstrapError", "adopt_check",
           "heap_headroom_error"]

KEY_PREFIX = "jax_ep/nvshmem"
UNIQUE_ID_BYTES = 128


class NvshmemBootstrapError(RuntimeError):
    """NVSHMEM could not be started as jax-ep needs it."""


class Runtime(Protocol):
    """The NVSHMEM calls the bootstrap makes (mocked in tests)."""

    def unique_id(self) -> bytes: ...

    def init(self, rank: int, world: int, unique_id: bytes, heap_bytes: int,
             num_qps: int, use_qp_api: bool, adopt: bool) -> None: ...

    def finalize(self) -> None: ...


class ExtensionRuntime:
    """NVSHMEM through the compiled extension (built with NVSHMEM)."""

    def __init__(self):
        from jax_ep._src import ext as _ext
        ext = _ext.nvshmem_ext()  # loads _jax_ep_nvshmem (libnvshmem_host.so.3) now
        if ext is None or not hasattr(ext, "nvshmem_init"):
            raise NvshmemBootstrapError(
                "this jax_ep build has no usable NVSHMEM support "
                f"({_ext.nvshmem_import_error()}): install the `cuda` extra "
                "(nvidia-nvshmem-cu13 3.8.x) where nvcc is available and rebuild")
        _ext.register_nvshmem_targets()
        self._ext = ext

    def unique_id(self) -> bytes:
        return bytes(self._ext.nvshmem_unique_id())

    def init(self, rank, world, unique_id, heap_bytes, num_qps, use_qp_api, adopt):
        self._ext.nvshmem_init(int(rank), int(world), bytes(unique_id), int(heap_bytes),
                               int(num_qps), bool(use_qp_api), bool(adopt))

    def finalize(self):
        if hasattr(self._ext, "ll_internode_finalize"):
            self._ext.ll_internode_finalize()  # the low-latency area, if allocated
        self._ext.nvshmem_finalize()

    def ll_init(self, world, max_tokens, row_bytes, topk, num_experts):
        if not hasattr(self._ext, "ll_internode_init"):
            raise NvshmemBootstrapError("this jax_ep build has no internode low-latency kernels")
        self._ext.ll_internode_init(int(world), int(max_tokens), int(row_bytes), int(topk),
                                    int(num_experts))

    def qp_api_available(self) -> bool:
        return bool(self._ext.nvshmem_qp_api_available())

    def versions(self) -> tuple[int, int]:
        """(headers, host library) NVSHMEM versions as major*10000+minor*100+patch; -1:
        unknown. Queries only: no NVSHMEM call is made."""
        info = self._ext.nvshmem_info()
        return int(info["version"]), int(info["runtime_version"])

    def qp_handles(self) -> list[int]:
        return [int(h) for h in self._ext.nvshmem_info()["qp_handles"]]

    def set_qp_order(self, order) -> None:
        """Logical QP q takes the handle created order[q]-th (kernels' table too)."""
        self._ext.nvshmem_set_qp_order([int(i) for i in order])

    def can_init_device_state(self) -> bool:
        # Adopting an NVSHMEM another library started needs the device state of the
        # device library linked into _jax_ep_nvshmem set up; the module says if it can.
        return hasattr(self._ext, "nvshmem_init_device_state")

    def init_device_state(self) -> None:
        self._ext.nvshmem_init_device_state()

    def init_status(self) -> int:
        return int(self._ext.nvshmem_init_status())


# --- heap size and the low-latency area: the kernels' layouts through their bindings -----

def _round_up(v: int, a: int) -> int:
    return (v + a - 1) // a * a


def heap_bytes_for(*, num_ranks: int, max_tokens: int, capacity: int | None = None,
                   hidden: int, topk: int, x_dtype="bfloat16", y_dtype="float32",
                   gpus_per_node: int | None = None, num_qps: int = 1) -> int:
    """Symmetric heap bytes the internode kernels need for these limits
    (kernels/internode/internode_layout.h heap_bytes).

    capacity defaults to num_ranks * max_tokens (never overflows). Pass the largest
    values any jitted call will use. With `gpus_per_node` (and the plan's `num_qps`,
    ports * QPs per port), each half also holds the hierarchical mode's rings
    (jax_ep.network.hier_layout, independent of T and C) beside the direct mode's
    regions, so calls of both modes fit.
    """
    from jax_ep._src.ext import require_ext

    if capacity is None:
        capacity = num_ranks * max_tokens
    for name, v in (("num_ranks", num_ranks), ("max_tokens", max_tokens),
                    ("capacity", capacity), ("hidden", hidden), ("topk", topk)):
        if int(v) < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    xb, yb = _itemsize(x_dtype), _itemsize(y_dtype)
    R, T, C, H, K = map(int, (num_ranks, max_tokens, capacity, hidden, topk))
    hier_half = 0
    if gpus_per_node is not None:
        from jax_ep.network import hier_layout
        g = int(gpus_per_node)
        if g < 1 or R % g:
            raise ValueError(f"gpus_per_node must divide num_ranks ({R}), got {gpus_per_node}")
        eb = max(xb, yb)  # one ring stride serves both directions of a call
        hier_half = hier_layout.hier_layout(R, g, int(num_qps), H, K, eb, eb).total
    return require_ext().internode_heap_bytes(R, T, C, H, K, xb, yb, hier_half_bytes=hier_half)


def ll_area_bytes_for(*, num_ranks: int, max_tokens_per_rank: int, hidden: int, topk: int,
                      num_experts: int, dtype="bfloat16") -> int:
    """Bytes of the internode low-latency mode's symmetric area for these limits (one
    allocation per PE, beside the heap halves; independent of the calls' T):
    2 buffers (the two parities) of E_local * R * M dispatch rows, of R * M * min(K,
    E_local) combine rows, of M * K staged rows and of R * M * min(K, E_local) combine
    staging rows, signal words and headers (llwire::area_layout in
    kernels/internode/low_latency_wire.h, bound as ll_area_layout). `dtype` is the dtype
    of the rows the calls move (the tokens' dtype; the FP8 dispatch's rows, H bytes of
    values and H / 32 bytes of scales, fit in those of a 16-bit dtype)."""
    from jax_ep._src.ext import require_ext

    R, M, H, K, E = map(int, (num_ranks, max_tokens_per_rank, hidden, topk, num_experts))
    for name, v in (("num_ranks", R), ("max_tokens_per_rank", M), ("hidden", H),
                    ("topk", K), ("num_experts", E)):
        if v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    if E % R:
        raise ValueError(f"num_experts={E} must be a multiple of num_ranks={R}")
    return require_ext().ll_area_layout(R, M, H * _itemsize(dtype), K, E)["total"]


def _ll_limits(low_latency: dict, num_ranks: int) -> dict:
    """The low-latency area's limits from initialize's `low_latency` argument."""
    need = ("max_tokens_per_rank", "hidden", "topk", "num_experts")
    unknown = set(low_latency) - set(need) - {"dtype"}
    missing = [k for k in need if k not in low_latency]
    if missing or unknown:
        raise ValueError(f"low_latency needs the keys {need} (and optionally dtype); missing "
                         f"{missing}, unknown {sorted(unknown)}")
    lim = {k: int(low_latency[k]) for k in need}
    lim["row_bytes"] = lim["hidden"] * _itemsize(low_latency.get("dtype", "bfloat16"))
    lim["area_bytes"] = ll_area_bytes_for(num_ranks=num_ranks,
                                          dtype=low_latency.get("dtype", "bfloat16"),
                                          **{k: lim[k] for k in need})
    return lim


def _hier_heap_args(num_ranks: int, config) -> dict:
    """heap_bytes_for's hierarchical arguments where the config may pick that mode."""
    from jax_ep.network import topology

    cfg = (config or TransportConfig()).resolve()
    topo = topology.detect(num_ranks)
    if topology.choose_mode(cfg.mode, topo) != "hierarchical":
        return {}
    return dict(gpus_per_node=topo.gpus_per_node, num_qps=cfg.num_qps)


def _itemsize(dt) -> int:
    if isinstance(dt, int):
        return dt
    try:
        return np.dtype(dt).itemsize
    except TypeError:
        import jax.numpy as jnp
        return jnp.dtype(dt).itemsize


# --- state -------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class BootstrapState:
    rank: int
    world: int
    heap_bytes: int
    config: TransportConfig  # as the kernels use it (one port on the fallback path)
    env: dict
    qp_api: bool = True      # explicit QP handles (False: fallback, one port)
    # what is on the wire: "qp_api" (one explicit handle per planned QP), "default handles"
    # (the QP API answered with NVSHMEM's default handles, e.g. IBGDA off), "fallback"
    qp_path: str = "qp_api"
    adopted: bool = False    # NVSHMEM was already running; its settings were checked
    # the internode low-latency area's limits (max_tokens_per_rank, hidden, topk,
    # num_experts, row_bytes, area_bytes), None when not allocated
    low_latency: dict | None = None


_lock = threading.Lock()
# initialize() is collective: every process calls it equally often, so this counter names
# the same agreement keys everywhere (also after a failed attempt).
_agree_calls = itertools.count()
_state: BootstrapState | None = None
_runtime: Runtime | None = None
_generation = 0


def is_initialized() -> bool:
    return _state is not None


def state() -> BootstrapState | None:
    return _state


def _kv_client():
    from jax._src import distributed
    return distributed.global_state.client


def _check_one_process_per_gpu():
    import jax
    devs = jax.local_devices()
    if len(devs) != 1:
        kinds = ", ".join(sorted({d.platform for d in devs}))
        raise NvshmemBootstrapError(
            f"the internode backend needs one process per GPU (one NVSHMEM PE each), but "
            f"process {jax.process_index()} sees {len(devs)} local devices ({kinds}). "
            f"Launch one process per GPU, e.g. with CUDA_VISIBLE_DEVICES=<i> or "
            f"jax.distributed.initialize(..., local_device_ids=[<i>]).")


def _apply_env(env: dict, heap_bytes: int, environ) -> dict:
    applied = {}
    wanted = dict(env)
    wanted["NVSHMEM_SYMMETRIC_SIZE"] = str(heap_bytes)
    for k, v in wanted.items():
        cur = environ.get(k)
        if cur is not None and cur != v:
            if k == "NVSHMEM_SYMMETRIC_SIZE":
                try:
                    ok = int(cur) >= heap_bytes
                except ValueError:
                    ok = False
                if ok:
                    applied[k] = cur
                    continue
            else:
                warnings.warn(f"jax_ep: keeping {k}={cur} from the environment "
                              f"(jax_ep would set {v})", stacklevel=3)
                applied[k] = cur
                continue
        environ[k] = v
        applied[k] = v
    return applied


def initialize(*, heap_bytes: int | None = None, num_ranks: int | None = None,
               max_tokens: int | None = None, capacity: int | None = None,
               hidden: int | None = None, topk: int | None = None, x_dtype="bfloat16",
               y_dtype="float32", config: TransportConfig | None = None,
               runtime: Runtime | None = None, client=None, timeout_s: float = 300.0,
               environ=None, low_latency: dict | None = None) -> BootstrapState:
    """Start NVSHMEM in this process (once), before jit. See the module docstring.

    Either give heap_bytes, or the limits (max_tokens, hidden, topk, and optionally
    capacity and num_ranks, default jax.process_count()) to size it with heap_bytes_for.
    low_latency: dict(max_tokens_per_rank=M, hidden=H, topk=K, num_experts=E,
    dtype="bfloat16") also allocates the internode low-latency mode's area
    (`ll_area_bytes_for`; NVSHMEM_SYMMETRIC_SIZE grows by it), collectively, right after
    NVSHMEM starts.
    """
    global _state, _runtime, _generation
    import jax

    with _lock:
        if heap_bytes is None and low_latency is not None and (max_tokens, hidden,
                                                                 topk) == (None,) * 3:
            # only the low-latency mode: the normal mode's halves at their smallest
            max_tokens, hidden, topk = 1, 1, 1
        if heap_bytes is None:
            if None in (max_tokens, hidden, topk):
                raise ValueError("give heap_bytes, or max_tokens, hidden and topk "
                                 "(and optionally capacity) to size the symmetric heap")
            n = num_ranks or jax.process_count()
            heap_bytes = heap_bytes_for(
                num_ranks=n, max_tokens=max_tokens,
                capacity=capacity, hidden=hidden, topk=topk, x_dtype=x_dtype, y_dtype=y_dtype,
                **_hier_heap_args(n, config))
        heap_bytes = int(heap_bytes)
        if heap_bytes < 1:
            raise ValueError(f"heap_bytes must be >= 1, got {heap_bytes}")
        ll = None
        if low_latency is not None:
            # Sized for every NVSHMEM process, as ll_init allocates it (the internode EP
            # axis spans them all), whatever num_ranks sized the heap halves for.
            ll = _ll_limits(low_latency, jax.process_count())
        if _state is not None:
            have = _state.low_latency
            if ll is not None and (have is None or any(
                    ll[k] > have[k] for k in ("max_tokens_per_rank", "topk", "row_bytes"))
                    or ll["num_experts"] != have["num_experts"]):
                raise NvshmemBootstrapError(
                    f"NVSHMEM is already running with the low-latency area {have}; {ll} was "
                    f"asked for. Call initialize once, before jit, with the largest limits.")
            if heap_bytes > _state.heap_bytes:
                raise NvshmemBootstrapError(
                    f"NVSHMEM is already running with a {_state.heap_bytes}-byte symmetric "
                    f"heap; {heap_bytes} bytes were asked for. Call initialize once, before "
                    f"jit, with the largest capacity the program uses.")
            return _state

        cfg = (config or TransportConfig()).resolve()
        if client is None:
            client = _kv_client()
        if client is None:
            raise NvshmemBootstrapError(
                "call jax.distributed.initialize() before jax_ep.nvshmem_bootstrap.initialize: "
                "the NVSHMEM unique id is shared through its key-value store")
        _check_one_process_per_gpu()
        rank, world = jax.process_index(), jax.process_count()
        rt = runtime if runtime is not None else ExtensionRuntime()
        environ = os.environ if environ is None else environ
        # Every process is here, on the same jax_ep and NVSHMEM releases, before the
        # fabric exchange and any NVSHMEM call (a missing process is named here).
        versions = tuple(getattr(rt, "versions", lambda: (-1, -1))())
        agree_key = f"{KEY_PREFIX}/agree/{next(_agree_calls)}"
        agree(client, rank, world, startup_params_early(versions), error=None,
              timeout_s=timeout_s, key=f"{agree_key}/early")
        # the fabric: device selection, plan ports, agreement, LAG shim (network/fabric.py)
        from jax_ep.network import fabric as _fabric
        try:
            fab = _fabric.setup_for_bootstrap(cfg, environ, rank, world, client,
                                              key_prefix=f"{KEY_PREFIX}/{_generation}",
                                              timeout_ms=int(timeout_s * 1000))
        except RuntimeError as e:
            raise NvshmemBootstrapError(str(e)) from None
        cfg = fab.config
        qp_api = bool(getattr(rt, "qp_api_available", lambda: True)())
        if not qp_api:
            _say_fallback(cfg)
            cfg = cfg.single_port()
        status = int(getattr(rt, "init_status", lambda: 0)())
        adopt = status >= _STATUS_INITIALIZED
        # the low-latency area is a second allocation beside the heap halves
        sym_bytes = heap_bytes + (_round_up(ll["area_bytes"], 2 << 20) if ll else 0)
        if ll is not None and not hasattr(rt, "ll_init"):
            raise NvshmemBootstrapError("this jax_ep build has no internode low-latency "
                                        "kernels (the runtime has no ll_init)")
        # Checks that fail on one process only are published with the agreement below, so
        # every process fails together instead of its peers waiting inside NVSHMEM.
        local_error = None
        try:
            why = version_mismatch(*versions)
            if why:
                raise NvshmemBootstrapError(why)
            if adopt:
                wanted = dict(cfg.nvshmem_env(), NVSHMEM_SYMMETRIC_SIZE=str(sym_bytes))
                missing = adopt_check(wanted, environ)
                if missing:
                    raise NvshmemBootstrapError(
                        "NVSHMEM is already initialised in this process (XLA starts it for "
                        "its own kernels), with settings jax_ep cannot change. Set these in "
                        "the environment before the process starts, so both use them: "
                        + " ".join(missing))
                why = adopt_refusal(rt)
                if why:
                    raise NvshmemBootstrapError(why)
                env = {k: environ.get(k) for k in wanted}
            else:
                env = _apply_env({**cfg.nvshmem_env(), **fab.env}, sym_bytes, environ)
            if runtime is None:
                why = heap_headroom_error(sym_bytes, _bytes_limit(), environ)
                if why:
                    raise NvshmemBootstrapError(why)
        except NvshmemBootstrapError as e:
            local_error, env = str(e), {}
        # Before any NVSHMEM call: every value that must match across processes.
        params = startup_params(cfg=cfg, qp_api=qp_api, heap_bytes=heap_bytes,
                                sym_bytes=sym_bytes, ll=ll, env=env, versions=versions,
                                adopt=adopt)
        agree(client, rank, world, params, error=local_error, timeout_s=timeout_s,
              key=agree_key)

        key = f"{KEY_PREFIX}/uid/{_generation}"
        timeout_ms = int(timeout_s * 1000)
        if rank == 0:
            uid = bytes(rt.unique_id())
            if len(uid) != UNIQUE_ID_BYTES:
                raise NvshmemBootstrapError(
                    f"NVSHMEM unique id has {len(uid)} bytes, expected {UNIQUE_ID_BYTES}")
            client.key_value_set_bytes(key, uid)
        else:
            try:
                uid = bytes(client.blocking_key_value_get_bytes(key, timeout_ms))
            except Exception as e:  # noqa: BLE001 - the store raises XlaRuntimeError
                raise NvshmemBootstrapError(
                    f"process {rank} did not receive the NVSHMEM unique id from process 0 "
                    f"within {timeout_s:g} s: {e}") from None
        # NVSHMEM's collectives have no bound of their own: a watchdog turns a stuck one
        # into an error naming the step (the process exits: it cannot unwind from inside
        # NVSHMEM), instead of a silent hang.
        with watchdog("NVSHMEM start (nvshmemx_init_attr, symmetric heap, QPs, barrier)",
                      timeout_s, rank):
            rt.init(rank, world, uid, heap_bytes, cfg.num_qps, qp_api, adopt)
        if adopt:  # the device library linked into jax_ep needs its own device state
            rt.init_device_state()
        _fabric.after_nvshmem_start()  # what the LAG shim did to NVSHMEM's QPs
        # the recorded handle -> port table decides which handle each logical QP uses
        _fabric.apply_handle_order(rt, cfg)
        if ll is not None:  # collective, every process in the same order
            with watchdog("low-latency area (nvshmem_malloc)", timeout_s, rank):
                rt.ll_init(world, ll["max_tokens_per_rank"], ll["row_bytes"], ll["topk"],
                           ll["num_experts"])
        qp_path = qp_path_from(qp_api, getattr(rt, "qp_handles", lambda: None)())
        if qp_path == "default handles":
            _say_default_handles(cfg)
        try:
            client.wait_at_barrier(f"{KEY_PREFIX}/ready/{_generation}", timeout_ms)
        except Exception as e:  # noqa: BLE001
            raise NvshmemBootstrapError(f"NVSHMEM started on process {rank} but not on all "
                                        f"{world} processes within {timeout_s:g} s: {e}") from None
        _generation += 1
        _runtime = rt
        _state = BootstrapState(rank=rank, world=world, heap_bytes=heap_bytes, config=cfg,
                                env=env, qp_api=qp_api, adopted=adopt, low_latency=ll,
                                qp_path=qp_path)
        return _state


def finalize() -> None:
    """Stop NVSHMEM (collective: every process must call it). Not called at exit."""
    global _state, _runtime
    with _lock:
        if _state is None:
            return
        rt, _runtime, _state = _runtime, None, None
        rt.finalize()


def _forget_at_exit() -> None:
    # No collective at exit: a barrier there hangs when a peer died. The process's
    # NVSHMEM resources go with it.
    global _state, _runtime
    _state, _runtime = None, None


atexit.register(_forget_at_exit)


# NVSHMEM_STATUS_IS_INITIALIZED in nvshmem_constants.h
_STATUS_INITIALIZED = 2


def adopt_check(wanted: dict, environ) -> list[str]:
    """NVSHMEM_* settings the plan needs that the environment (read by an NVSHMEM some
    other library already started) does not hold: ["VAR=value", ...]; [] if adoptable."""
    missing = []
    for k, v in wanted.items():
        cur = environ.get(k)
        if k == "NVSHMEM_SYMMETRIC_SIZE":
            try:
                ok = cur is not None and int(cur) >= int(v)
            except ValueError:
                ok = False
        else:
            ok = cur == v
        if not ok:
            missing.append(f"{k}={v}")
    return missing


def heap_headroom_error(heap_bytes: int, bytes_limit: int | None, environ,
                        margin_bytes: int = 1 << 30) -> str | None:
    """Why the symmetric heap will not fit next to XLA's preallocated pool, or None.

    bytes_limit: XLA's pool on this GPU (device.memory_stats()['bytes_limit']), None if
    unknown. With preallocation on, the pool is fraction * total, so total is estimated
    as bytes_limit / fraction; the heap and a margin must fit in the rest.
    """
    if bytes_limit is None:
        return None
    if environ.get("XLA_PYTHON_CLIENT_PREALLOCATE", "true").lower() in ("false", "0"):
        return None
    if environ.get("XLA_PYTHON_CLIENT_ALLOCATOR", "").lower() == "platform":
        return None
    try:
        frac = float(environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.75"))
    except ValueError:
        return None
    if not 0 < frac < 1:
        return None
    total = bytes_limit / frac
    free = total - bytes_limit
    need = heap_bytes + margin_bytes
    if need <= free:
        return None
    fit = max(0.0, (total - need) / total)
    return (f"the NVSHMEM heap ({heap_bytes} bytes + {margin_bytes} margin) does not fit next "
            f"to XLA's preallocated pool ({bytes_limit} of ~{int(total)} bytes, "
            f"XLA_PYTHON_CLIENT_MEM_FRACTION={frac:g}); set "
            f"XLA_PYTHON_CLIENT_MEM_FRACTION={fit:.2f} (or lower) before the process starts")


def _bytes_limit() -> int | None:
    import jax
    try:
        stats = jax.local_devices()[0].memory_stats() or {}
    except Exception:  # noqa: BLE001 - CPU devices and old runtimes have none
        return None
    v = stats.get("bytes_limit")
    return int(v) if v else None


_fallback_said = False


def _say_fallback(cfg: TransportConfig) -> None:
    global _fallback_said
    if _fallback_said:
        return
    _fallback_said = True
    lost = (f", instead of striping over {cfg.num_ports} ports" if cfg.num_ports > 1 else
            ", so the planned QP of a chunk is not guaranteed on the wire")
    msg = (f"jax_ep: NVSHMEM's QP API (nvshmemx_qp_create, NVSHMEM >= 3.8) is not available: "
           f"the internode transport runs on ONE port with {cfg.qps_per_port} QPs per peer "
           f"and NVSHMEM's own QP choice{lost}. Install nvidia-nvshmem-cu13>=3.8.")
    import sys
    print(msg, file=sys.stderr, flush=True)
    warnings.warn(msg, stacklevel=3)


# --- start-up safety: versions, adoption, agreement, watchdog, QP path ----------------------

# The release line of the NVSHMEM device library linked statically into _jax_ep_nvshmem
# (the nvidia-nvshmem-cu13 wheel pinned in pyproject.toml).
LINKED_RELEASE = (3, 8)


def _ver_text(v: int) -> str:
    return "unknown" if v < 0 else f"{v // 10000}.{v // 100 % 100}.{v % 100}"


def version_mismatch(headers: int, runtime: int) -> str | None:
    """Why the NVSHMEM host library cannot run with the headers and device library jax_ep
    was built with (another major.minor release: the device library is linked statically,
    the host library is loaded at run time), or None. -1: unknown (not checked)."""
    if headers < 0 or runtime < 0:
        return None
    if headers // 100 != runtime // 100:
        want = f"{headers // 10000}.{headers // 100 % 100}"
        return (f"the NVSHMEM host library is {_ver_text(runtime)} but jax_ep was built "
                f"with NVSHMEM {_ver_text(headers)} (its device library is linked in): "
                f"install nvidia-nvshmem-cu13=={want}.* (pip install 'jax-ep[cuda]') or "
                f"rebuild jax_ep against the installed release")
    return None


def adopt_refusal(rt) -> str | None:
    """Why jax_ep cannot adopt an NVSHMEM another library already started in this
    process, or None. The device library linked into jax_ep keeps its own device state
    (nvshmemi_device_state_d), which only NVSHMEM's init fills for the modules it knows;
    without a way to fill it for jax_ep's module the kernels would fault."""
    if bool(getattr(rt, "can_init_device_state", lambda: False)()):
        return None
    return ("NVSHMEM is already initialised in this process (XLA starts it for its own "
            "kernels), and this jax_ep build cannot set up the device state of the NVSHMEM "
            "device library linked into its kernels after that, so they would fault. Call "
            "jax_ep.nvshmem_bootstrap.initialize(...) before anything else starts NVSHMEM "
            "(before the first XLA program that uses NVSHMEM runs), or keep XLA from using "
            "NVSHMEM in processes that run the internode backend")


def startup_params_early(versions) -> dict:
    """The values agreed first, before the fabric exchange (known without the plan)."""
    from jax_ep import __version__
    return {"jax_ep_version": __version__,
            "nvshmem_version": "/".join(_ver_text(int(v)) for v in versions)}


def startup_params(*, cfg, qp_api: bool, heap_bytes: int, sym_bytes: int, ll, env: dict,
                   versions, adopt: bool) -> dict:
    """The values every process must share before NVSHMEM starts (JSON-able)."""
    from jax_ep import __version__
    # the plan's settings only: the device list and the bootstrap interface
    # (NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME) are chosen per node and may differ
    nv_env = {k: env.get(k) for k in sorted(cfg.nvshmem_env()) if k in env}
    cfg_text = repr(sorted(dataclasses.asdict(cfg).items())) if dataclasses.is_dataclass(
        cfg) else repr(cfg)
    return {
        "jax_ep_version": __version__,
        "nvshmem_version": "/".join(_ver_text(int(v)) for v in versions),
        "qp_path": "qp_api" if qp_api else "fallback",
        "num_ports": int(cfg.num_ports),
        "qps_per_port": int(cfg.qps_per_port),
        "heap_bytes": int(heap_bytes),
        "symmetric_bytes": int(sym_bytes),
        "low_latency": None if ll is None else {k: int(v) for k, v in sorted(ll.items())},
        "transport_config_hash": hashlib.sha256(cfg_text.encode()).hexdigest()[:16],
        "nvshmem_env": nv_env,
        "adopt_running_nvshmem": bool(adopt),
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


def agree(client, rank: int, world: int, params: dict, *, error: str | None,
          timeout_s: float, key: str) -> None:
    """Publishes this process's start-up values (or the reason it cannot start) in the
    jax.distributed key-value store and reads every other process's, within timeout_s.
    Raises NvshmemBootstrapError on every process alike when one failed or any value
    differs, naming the process and the values; on a process whose peer never published,
    naming that peer. Makes no NVSHMEM call."""
    mine = {"params": params, "error": error}
    client.key_value_set_bytes(f"{key}/{rank}", json.dumps(mine, sort_keys=True).encode())
    deadline = time.monotonic() + timeout_s
    got = {rank: mine}
    for p in range(world):
        if p == rank:
            continue
        left_ms = max(1, int((deadline - time.monotonic()) * 1000))
        try:
            raw = client.blocking_key_value_get_bytes(f"{key}/{p}", left_ms)
        except Exception as e:  # noqa: BLE001 - the store raises XlaRuntimeError
            raise NvshmemBootstrapError(
                f"NVSHMEM not started: process {p} did not publish its start-up settings "
                f"within {timeout_s:g} s (it is missing, stuck, or did not call "
                f"jax_ep.nvshmem_bootstrap.initialize); process {rank} made no NVSHMEM "
                f"call. ({e})") from None
        got[p] = json.loads(bytes(raw).decode())
    failed = [(p, g["error"]) for p, g in sorted(got.items()) if g.get("error")]
    if failed:
        raise NvshmemBootstrapError(
            "NVSHMEM not started on any process (no NVSHMEM call was made): "
            + "; ".join(f"process {p}: {e}" for p, e in failed))
    ref = got[0]["params"]
    diffs = []
    for p in sorted(got):
        for name, want, have in _differences(ref, got[p]["params"]):
            diffs.append(f"process {p} has {name}={have!r} where process 0 has {want!r}")
    if diffs:
        raise NvshmemBootstrapError(
            "NVSHMEM not started: the processes disagree on settings that must match "
            "(no NVSHMEM call was made): " + "; ".join(diffs))


_STUCK_EXIT = 75  # EX_TEMPFAIL: a peer may be missing; a restart may succeed


def _exit_stuck(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
    os._exit(_STUCK_EXIT)


_on_stuck = _exit_stuck  # tests replace it


class watchdog:
    """Bounds one collective start-up step of `library` (NVSHMEM, or NCCL for
    jax_ep.nccl_bootstrap): if it has not returned after timeout_s, says which step on
    which process and ends the process (exit code 75), since a thread stuck inside the
    library cannot be unwound. The step must release the GIL while it waits (the
    compiled bindings do)."""

    def __init__(self, step: str, timeout_s: float, rank: int, library: str = "NVSHMEM"):
        self.step, self.timeout_s, self.rank, self.library = step, float(timeout_s), rank, library
        self._timer = None

    def _fire(self):
        _on_stuck(f"jax_ep: {self.library} start-up step '{self.step}' did not finish within "
                  f"{self.timeout_s:g} s on process {self.rank}: a peer is missing or stuck "
                  f"in an earlier step (see its log); exiting instead of hanging")

    def __enter__(self):
        self._timer = threading.Timer(self.timeout_s, self._fire)
        self._timer.daemon = True
        self._timer.start()
        return self

    def __exit__(self, *exc):
        self._timer.cancel()
        return False


_NVSHMEMX_QP_HOST, _NVSHMEMX_QP_DEFAULT = 0, 1  # nvshmem_constants.h


def qp_path_from(qp_api: bool, handles) -> str:
    """What the transport has on the wire after start: "qp_api" (an explicit handle per
    planned QP), "default handles" (the QP API handed back NVSHMEM's default or host
    handles, as it does when IBGDA is off: the plan's QP is not the QP on the wire) or
    "fallback" (no QP API). handles None: not reported (taken as asked)."""
    if not qp_api:
        return "fallback"
    if handles is None:
        return "qp_api"
    handles = [int(h) for h in handles]
    if not handles or all(h in (_NVSHMEMX_QP_HOST, _NVSHMEMX_QP_DEFAULT) for h in handles):
        return "default handles"
    return "qp_api"


def _say_default_handles(cfg: TransportConfig) -> None:
    msg = (f"jax_ep: NVSHMEM's QP API handed back default QP handles for the {cfg.num_qps} "
           f"planned QPs (IBGDA is off or unavailable): NVSHMEM picks the QP of each put, so "
           f"the striping plan's QP is not the QP on the wire")
    print(msg, file=sys.stderr, flush=True)
    warnings.warn(msg, stacklevel=3)
