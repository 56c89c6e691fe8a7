"""The "internode" backend (NVSHMEM): FFI calls to the CUDA targets
`jax_ep_internode_dispatch`, `jax_ep_internode_combine` and `jax_ep_internode_gather`
(xla_ffi/internode/internode_handlers.cc), producing the same outputs and `DispatchHandle`
as the other backends, with the signatures every backend module shares. `jax_ep.ops`
calls them when the backend resolves to "internode"; the layout has no communication and
uses the ffi backend's kernel.

The transport runs one process per GPU and its EP group is every NVSHMEM PE, so this
process's rank on the EP axis is static: its PE index (`runtime.nvshmem.state().rank`),
read at trace time by `ep_rank`, which also checks that the EP axis has one rank per PE
and, where the mesh is known, that this process's device sits at that index on it.

Mode "hierarchical" (kernels/internode/hierarchical_kernels.cu) calls
`jax_ep_internode_hier_dispatch` / `_combine` / `_gather` instead, with the same operands
and results plus a `gpus_per_node` attribute (its combine also takes the handle's
src_index[C]); `internode_mode` says which runs.

The low-latency mode (`jax_ep.low_latency`) calls `jax_ep_internode_ll_dispatch_send` /
`_recv` and `jax_ep_internode_ll_combine_send` / `_recv` (kernels/internode/
low_latency_kernels.cu): direct per-expert puts into a symmetric area that
`nvshmem_bootstrap.initialize(low_latency=...)` allocates; see docs/low_latency.md.

The kernels' handle is (counts[R, R], send_slot[T, R]), where send_slot is a token's
position among the rows this rank sends each receiver. The contract's `send_row` (the row
it occupies there, -1 where not sent or dropped) is derived from them here; both go in
`DispatchHandle.extra` as an `InternodeHandleParts` for combine and the gradients.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_ep._src.common import Cfg, axis_names, ep_call, like, next_call_site, unify_varying
from jax_ep._src.types import DispatchHandle, InternodeHandleParts
from jax_ep._src.backends.ffi import layout
from jax_ep import nvshmem_bootstrap as nvshmem

__all__ = ["ep_rank", "transport_attrs", "send_row_from", "layout", "dispatch", "combine",
           "gather", "InternodeRankError", "InternodeError", "transport_report",
           "check_errors", "ll_dispatch_send", "ll_dispatch_recv", "ll_combine_send",
           "ll_combine_recv", "ll_dispatch_send_fp8", "ll_dispatch_recv_fp8"]


class InternodeRankError(ValueError):
    """The EP axis does not match the internode transport's group (all NVSHMEM PEs)."""


class InternodeError(RuntimeError):
    """An internode call failed on the device (timeout, mismatched call, bad ids)."""


def _ext():
    """The NVSHMEM module (jax_ep._src.ext.nvshmem_ext), None where not built or loadable."""
    from jax_ep._src import ext as ext_mod
    return ext_mod.nvshmem_ext()


def check_errors() -> None:
    """Raises `InternodeError` with the sticky device error of an earlier internode call
    (timeouts name the peer and signal waited for; mismatches name both sides' values).
    The kernels never synchronise with the host, so a failing call is reported by the
    next call on this process or here. The state is sticky for the process's life."""
    ext = _ext()
    if ext is None or not hasattr(ext, "internode_error"):
        return
    msg = str(ext.internode_error())
    if msg:
        raise InternodeError(msg)


def transport_report(config=None, num_peers: int | None = None) -> dict:
    """What the internode transport does on the wire, for humans and logs.

    Keys: nvshmem_built (the build has the backend), headers_version and runtime_version
    (NVSHMEM, "major.minor.patch", None when unknown), qp_api_available, qp_path
    ("qp_api" | "fallback" | "not started"), ports, qps_per_port, qps_planned,
    qps_created (explicit handles), qp_map (logical QP -> handle, port the plan assigns
    it, the device and NIC port it is on from the fabric table the bootstrap recorded
    (jax_ep.network.fabric.recorded_qp_table; under a RoCE LAG the member its LAG
    affinity pins it to), and whether that is the plan's port), fabric (the node's class
    and selected ports), nvshmem_env (the NVSHMEM settings in force), bootstrap_interface
    (NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME: the interface, "user" / "loopback" / "route" /
    "none" (unset) and why; jax_ep.network.bootstrap_iface), notes.
    """
    from jax_ep.network.transport import TransportConfig

    ext = _ext()
    built = ext is not None and hasattr(ext, "nvshmem_info")
    info = dict(ext.nvshmem_info()) if built else {}
    st = nvshmem.state()
    cfg = st.config if st is not None else (config or TransportConfig()).resolve()

    def ver(v):
        v = int(v) if v is not None else -1
        return None if v < 0 else f"{v // 10000}.{v // 100 % 100}.{v % 100}"

    handles = list(info.get("qp_handles", []))
    qp_api = bool(info.get("qp_api_available", False))
    if st is None:
        path = "not started"
    else:
        path = "qp_api" if (st.qp_api and handles) else "fallback"
        if path == "qp_api":  # "default handles" where NVSHMEM handed back its defaults
            path = nvshmem.qp_path_from(True, handles)
    from jax_ep.network import fabric as _fabric  # the recorded QP -> (device, port) table
    table = _fabric.recorded_qp_table(cfg, handles) if st is not None else None
    qp_map = []
    for q in range(cfg.num_qps):
        row = {"qp": q, "handle": handles[q] if q < len(handles) else None,
               "planned_port": q % cfg.num_ports, "nic_port": "unknown"}
        if table:
            t = table[q]
            row.update(device=t["device"], nic_port=t["port"], on_plan=t["on_plan"],
                       **{k: t[k] for k in ("member", "qpns", "udp_sports") if k in t})
        qp_map.append(row)
    fab = _fabric.state() if st is not None else None
    notes = []
    if path == "fallback":
        notes.append("no explicit QP handles: NVSHMEM picks the QP of each put; the "
                     "transport runs on one port (no striping across ports)")
    if not built:
        notes.append("this build has no NVSHMEM backend")
    return {
        "nvshmem_built": built,
        "headers_version": ver(info.get("version")),
        "runtime_version": ver(info.get("runtime_version")),
        "qp_api_available": qp_api,
        "qp_path": path,
        "adopted_nvshmem": bool(st.adopted) if st is not None else False,
        "ports": cfg.num_ports,
        "qps_per_port": cfg.qps_per_port,
        "lag": cfg.lag,
        "qps_planned": cfg.num_qps,
        "qps_created": len(handles),
        "qp_map": qp_map,
        "fabric": ({"class": fab.fabric.fabric_class, "reason": fab.fabric.reason,
                    "selected": [f"{d}:{p}" for d, p in fab.fabric.selected],
                    "lag_affinity": fab.lag_affinity, "shim_armed": fab.shim_armed,
                    "messages": list(fab.messages)} if fab is not None else None),
        "nvshmem_env": dict(st.env) if st is not None else cfg.nvshmem_env(),
        "bootstrap_interface": (fab.bootstrap_iface.to_json()
                                if fab is not None and fab.bootstrap_iface is not None
                                else None),
        "notes": notes,
    }


class _NcclView:
    """What the internode backend reads of a started transport, for NCCL GIN
    (jax_ep.nccl_bootstrap.state()): world, rank, config, low_latency, gpus_per_node."""

    qp_api, adopted, hosts, local_ranks = True, False, None, None

    def __init__(self, st):
        if len(st.ranks) != 1:
            raise NotImplementedError(
                f"backend='internode' in a process that drives {len(st.ranks)} GPUs (NCCL "
                f"ranks {list(st.ranks)}): the handlers take each GPU's rank from its "
                f"runtime, but the JAX side of the internode backend still needs one rank "
                f"per process; run one process per GPU, or choose backend='reference'")
        self.world, self.rank, self.config = st.world, st.ranks[0], st.config
        self.low_latency = st.low_latency
        self.env = {}
        self.gpus_per_node = st.gpus_per_node


def _state():
    """The started internode transport's state: NVSHMEM's, else NCCL GIN's."""
    st = nvshmem.state()
    if st is not None:
        return st
    from jax_ep import nccl_bootstrap
    if nccl_bootstrap.state() is not None:
        return _NcclView(nccl_bootstrap.state())
    raise nvshmem.NvshmemBootstrapError(
        "the internode backend needs its transport running in this process: call "
        "jax_ep.nvshmem_bootstrap.initialize(...) or jax_ep.nccl_bootstrap.initialize(...) "
        "after jax.distributed.initialize() and before jit, or choose backend='reference'")


def position_in_mesh(devices, axis_names, names, process_index) -> int | None:
    """Index on the (possibly multi-axis) EP axis `names` of the one device of
    `process_index` in the mesh device array `devices` (axes `axis_names`); None when the
    process has no device or more than one there (then the position is not unique)."""
    devices = np.asarray(devices, dtype=object)
    mine = np.argwhere(np.vectorize(lambda d: d.process_index == process_index,
                                    otypes=[bool])(devices))
    if len(mine) != 1:
        return None
    coord = dict(zip(axis_names, (int(c) for c in mine[0])))
    shape = dict(zip(axis_names, devices.shape))
    pos = 0
    for n in names:
        pos = pos * shape[n] + coord[n]
    return pos


def _mesh_position(axis_name) -> int | None:
    """This process's device's index on the EP axis, when a concrete mesh is in context
    (`jax.set_mesh(mesh)` or `with mesh:`); None otherwise (shard_map(mesh=...) does not
    put its mesh in context)."""
    try:
        from jax._src import mesh as mesh_lib  # no public accessor works inside jit
        mesh = mesh_lib.get_concrete_mesh()
        if mesh is None or mesh.empty:
            mesh = mesh_lib.thread_resources.env.physical_mesh
    except Exception:  # noqa: BLE001 - best effort: private API may move
        return None
    if mesh is None or mesh.empty:
        return None
    names = axis_names(axis_name)
    if any(n not in mesh.axis_names for n in names):
        return None
    return position_in_mesh(mesh.devices, mesh.axis_names, names, jax.process_index())


def ep_rank(axis_name, num_ranks: int) -> int:
    """This process's rank on the EP axis for the internode transport (static).

    It is the NVSHMEM PE index: the transport's EP group is every PE, one process per
    GPU. Raises if NVSHMEM is not running, if the axis does not have one rank per PE, or
    if the mesh in context puts this process's device at another index on the axis.
    """
    st = _state()
    if num_ranks != st.world:
        raise InternodeRankError(
            f"the internode backend's EP group is every NVSHMEM PE ({st.world} processes, "
            f"one GPU each), but EP axis {axis_name!r} has {num_ranks} ranks: make the EP "
            f"axis span all processes (no other mesh axis larger than 1), or choose "
            f"backend='reference'")
    pos = _mesh_position(axis_name)
    if pos is not None and pos != st.rank:
        raise InternodeRankError(
            f"this process is NVSHMEM PE {st.rank}, but its device sits at index {pos} on "
            f"EP axis {axis_name!r}: the internode backend needs the mesh's EP axis to list "
            f"the devices in process order (as jax.make_mesh over jax.devices() does)")
    return int(st.rank)


def transport_attrs() -> dict:
    """The striping attributes of the kernels: the TransportConfig NVSHMEM was started
    with (`JAX_EP_*` overrides already applied by the bootstrap)."""
    cfg = _state().config
    return dict(num_ports=np.int64(cfg.num_ports), qps_per_port=np.int64(cfg.qps_per_port),
                chunk_bytes=np.int64(cfg.chunk_bytes))


def send_row_from(counts, send_slot, rank: int, capacity: int):
    """The contract's send_row[T, R] from the kernels' handle: token t's row on receiver
    d is (rows of sources < rank at d) + send_slot[t, d], -1 where not sent or past the
    capacity (dropped)."""
    col_base = jnp.sum(counts[:rank], axis=0, dtype=jnp.int32)  # [R]
    row = col_base[None, :] + send_slot
    return jnp.where((send_slot >= 0) & (row < capacity), row, -1).astype(jnp.int32)


def _vary_with_axis(axis_name, *arrays):
    # Results are typed like the first operand: make the operands vary over the EP axis
    # (no rank operand does it here; the rank is a static attribute).
    marker = jax.lax.axis_index(axis_names(axis_name))
    return unify_varying(*arrays, marker)[:-1]


# --- internode mode (network/topology.py) ------------------------------------------------
# The hierarchical kernels (kernels/internode/hierarchical_kernels.cu, targets
# jax_ep_internode_hier_*) are built with the NVSHMEM backend: "auto" picks them when
# there are several nodes with several GPUs each. Compiled, not yet run on hardware.
HIERARCHICAL_KERNELS = True


def internode_mode(num_ranks: int) -> str:
    """"direct" or "hierarchical": the started TransportConfig's `mode` (with
    JAX_EP_INTERNODE_MODE applied) on the EP group's node topology
    (JAX_EP_GPUS_PER_NODE, else the processes' local ranks or the launcher's local
    size)."""
    return _mode_and_topology(num_ranks)[0]


def _mode_and_topology(num_ranks: int):
    """(mode, Topology) of the EP group, as `internode_mode`."""
    from jax_ep.network import topology

    st = _state()
    # local ranks or host names per rank, where the bootstrap records them
    local = getattr(st, "local_ranks", None)
    if local is None and getattr(st, "hosts", None) is not None:
        local = topology.local_ranks_from_hosts(st.hosts)
    if local is None and getattr(st, "gpus_per_node", None):  # NCCL's start recorded it
        local = [r % st.gpus_per_node for r in range(num_ranks)]
    topo = topology.detect(num_ranks, local)
    mode = topology.choose_mode(getattr(st.config, "mode", "auto"), topo,
                                hierarchical_available=HIERARCHICAL_KERNELS)
    if mode == "hierarchical":
        # hier::kMaxGpusPerNode: a row's node mask is one 32-bit word
        from jax_ep.network.hier_layout import MAX_GPUS_PER_NODE
        if topo.gpus_per_node > MAX_GPUS_PER_NODE:
            raise ValueError(
                f"internode mode 'hierarchical' needs at most {MAX_GPUS_PER_NODE} GPUs per "
                f"node (kernels/internode/hierarchical_layout.h), the EP group has "
                f"{topo.gpus_per_node}: set JAX_EP_GPUS_PER_NODE or use mode='direct'")
    return mode, topo


def _target(op: str, mode: str, topo) -> tuple[str, dict]:
    """The custom-call target of `op` in `mode` and the attributes the mode adds."""
    if mode == "hierarchical":
        return f"jax_ep_internode_hier_{op}", dict(gpus_per_node=topo.gpus_per_node)
    if op == "combine":  # the node size of combine's summation order (combine_order.h)
        return f"jax_ep_internode_{op}", dict(gpus_per_node=topo.gpus_per_node)
    return f"jax_ep_internode_{op}", {}


def dispatch(x, topk_idx, topk_weights, cfg: Cfg):
    """Internode dispatch: (recv_x, recv_topk_idx, recv_topk_weights,
    DispatchHandle) as in DESIGN.md, with the kernels' handle in `handle.extra`."""
    R, C, E = cfg.num_ranks, cfg.capacity, cfg.num_experts
    rank = ep_rank(cfg.axis_name, R)
    target, mode_attrs = _target("dispatch", *_mode_and_topology(R))
    x, topk_idx, topk_weights = _vary_with_axis(cfg.axis_name, x, topk_idx, topk_weights)
    T, H = x.shape
    K = topk_idx.shape[1]
    el = E // R
    i32 = jnp.int32
    outs = ep_call(
        target,
        (like(x, (C, H), x.dtype), like(x, (C, K), i32), like(x, (C, K), jnp.float32),
         like(x, (), i32), like(x, (), i32), like(x, (el,), i32), like(x, (C,), i32),
         like(x, (C,), i32), like(x, (R, R), i32), like(x, (T, R), i32)),
    )(x=x, topk_idx=topk_idx, topk_weights=topk_weights, num_experts=E, num_ranks=R,
      rank=rank, capacity=C, **transport_attrs(), call_site=next_call_site(), **mode_attrs)
    (recv_x, recv_idx, recv_w, num_recv, num_dropped, per_expert, src_rank, src_index,
     counts, send_slot) = outs
    send_row = send_row_from(counts, send_slot, rank, C)
    handle = DispatchHandle(num_recv, num_dropped, per_expert, src_rank, src_index, send_row,
                            E, R, C, cfg.axis_name,
                            InternodeHandleParts(counts, send_slot, rank, K))
    return recv_x, recv_idx, recv_w, handle


def _parts(handle: DispatchHandle, what: str) -> tuple[InternodeHandleParts, int]:
    parts = handle.extra
    if not isinstance(parts, InternodeHandleParts):
        raise ValueError(
            f"the internode {what} needs the handle of an internode dispatch (its "
            f"handle.extra holds the transport's counts and send slots); this handle has "
            f"extra={type(parts).__name__}. Use the same backend for dispatch and {what}.")
    rank = ep_rank(handle.axis_name, handle.num_ranks)
    if rank != parts.rank:
        raise InternodeRankError(f"the handle was made on rank {parts.rank}, this process "
                                 f"is rank {rank}")
    return parts, rank


def _back_call(op, a, handle, what, rows_of):
    parts, rank = _parts(handle, what)
    rows = rows_of(parts)
    mode, topo = _mode_and_topology(handle.num_ranks)
    target, mode_attrs = _target(op, mode, topo)
    operands = {"g" if op == "gather" else "y": a, "counts": parts.counts,
                "send_slot": parts.send_slot}
    if mode == "hierarchical" and op == "combine":
        # a node's forwarder merges its rows by token: src_index[C] of the handle
        operands["src_index"] = handle.src_index
    operands = dict(zip(operands, _vary_with_axis(handle.axis_name, *operands.values())))
    first = next(iter(operands.values()))
    return ep_call(target, like(first, (rows, a.shape[1]), a.dtype))(
        **operands, num_ranks=handle.num_ranks, rank=rank, capacity=handle.capacity,
        topk=parts.topk, **transport_attrs(), call_site=next_call_site(), **mode_attrs)


def combine(y, handle: DispatchHandle, cfg: Cfg):
    """Internode combine: y[C, H] -> out[T, H] (float32 sums in combine's summation order,
    kernels/common/combine_order.h, with the topology's node size)."""
    return _back_call("combine", y, handle, "combine", lambda parts: parts.send_slot.shape[0])


def gather(g, handle: DispatchHandle, cfg: Cfg):
    """Combine's transpose: g[T, H] -> out[C, H], out[i] = g_{src_rank[i]}[src_index[i]],
    zero past num_recv."""
    return _back_call("gather", g, handle, "gather", lambda parts: handle.capacity)


# ============================================================================
# --- low-latency mode (jax_ep.low_latency): targets jax_ep_internode_ll_dispatch_send /
# _recv and jax_ep_internode_ll_combine_send / _recv (xla_ffi/internode/
# low_latency_handlers.cc, kernels/internode/low_latency_kernels.cu): direct per-expert
# puts into each owner's per-(expert, source) slots, no layout pass. Signatures as in
# backends/reference.py's low-latency section (cfg.capacity = M). The send halves return
# (token int32[2], carrier): the token (epoch, config hash) is the receive half's operand;
# the carrier is a zero-size array whose shape and dtype hold what the receive half's
# result types need (the row dtype and H; for combine also rows_per_dest).
# ============================================================================

def _ll_limits(cfg: Cfg, rows: int, topk: int, hidden: int, itemsize: int,
               rows_per_dest: int | None = None) -> None:
    """Trace-time check of a call against the low-latency area NVSHMEM was started with
    (`nvshmem_bootstrap.initialize(low_latency=...)`)."""
    st = _state()
    ll = getattr(st, "low_latency", None)
    if ll is None:
        raise nvshmem.NvshmemBootstrapError(
            "jax_ep.low_latency on the internode backend needs its symmetric area: pass "
            "low_latency=dict(max_tokens_per_rank=M, hidden=H, topk=K, num_experts=E) to "
            "jax_ep.nvshmem_bootstrap.initialize (before jit), or choose backend='reference'")
    E, M = cfg.num_experts, cfg.capacity
    if E != ll["num_experts"]:
        raise ValueError(f"num_experts={E}, but the internode low-latency area was started "
                         f"for num_experts={ll['num_experts']}")
    if M > ll["max_tokens_per_rank"]:
        raise ValueError(f"max_tokens_per_rank={M} is more than the internode low-latency "
                         f"area's {ll['max_tokens_per_rank']} (nvshmem_bootstrap.initialize("
                         f"low_latency=...))")
    if hidden * itemsize > ll["row_bytes"]:
        raise ValueError(f"rows of hidden={hidden} x {itemsize} bytes do not fit the internode "
                         f"low-latency area's {ll['row_bytes']}-byte rows")
    if rows * topk > ll["max_tokens_per_rank"] * ll["topk"]:
        raise ValueError(f"{rows} staged tokens x topk={topk} slots are more than the internode "
                         f"low-latency area holds (max_tokens_per_rank x topk = "
                         f"{ll['max_tokens_per_rank']} x {ll['topk']})")
    if rows_per_dest is not None:
        from jax_ep._src import ext as _ext
        lay = _ext.require_ext().ll_area_layout(cfg.num_ranks, ll["max_tokens_per_rank"],
                                                ll["row_bytes"], ll["topk"], E)
        if rows_per_dest > lay["rows_per_dest"]:
            raise ValueError(f"combine returns up to {rows_per_dest} rows per source, more "
                             f"than the internode low-latency area's {lay['rows_per_dest']} "
                             "(its topk is too small)")


def _ll_attrs(cfg: Cfg, rank: int) -> dict:
    t = _state().config
    return dict(num_experts=cfg.num_experts, num_ranks=cfg.num_ranks, rank=rank,
                max_tokens=cfg.capacity, num_ports=t.num_ports, qps_per_port=t.qps_per_port,
                call_site=next_call_site())


def ll_dispatch_send(x, topk_idx, cfg: Cfg):
    """x[S, H] (any 1, 2 or 4-byte dtype: rows move as bytes), topk_idx[S, K] int32 ->
    (token int32[2], carrier [0, H] in x's dtype). Puts every (token, slot) row into its
    owner's slot; ids are checked on the device (an error on every rank)."""
    R = cfg.num_ranks
    rank = ep_rank(cfg.axis_name, R)
    S, H = x.shape
    _ll_limits(cfg, S, topk_idx.shape[1], H, jnp.dtype(x.dtype).itemsize)
    x, topk_idx = _vary_with_axis(cfg.axis_name, x, topk_idx)
    token = ep_call("jax_ep_internode_ll_dispatch_send", like(x, (2,), jnp.int32))(
        x=x, topk_idx=topk_idx, **_ll_attrs(cfg, rank))
    return token, x[:0]


def ll_dispatch_recv(sent, cfg: Cfg):
    """-> (recv_x[E_local, R*M, H], recv_count[E_local], src_rank, src_index
    [E_local, R*M], first_row, row_count [E_local, R]), int32 but recv_x."""
    token, carrier = sent
    R, M = cfg.num_ranks, cfg.capacity
    rank = ep_rank(cfg.axis_name, R)
    el, H = cfg.experts_per_rank, carrier.shape[1]
    i32 = jnp.int32
    return tuple(ep_call(
        "jax_ep_internode_ll_dispatch_recv",
        (like(token, (el, R * M, H), carrier.dtype), like(token, (el,), i32),
         like(token, (el, R * M), i32), like(token, (el, R * M), i32),
         like(token, (el, R), i32), like(token, (el, R), i32)))(
        token=token, **_ll_attrs(cfg, rank)))


def ll_dispatch_send_fp8(x, topk_idx, cfg: Cfg, round_scale: bool):
    """x[S, H] (float32, bfloat16, float16; H a multiple of 128) cast to FP8 in the send
    kernel (jax_ep.fp8.quantize's rule), one message per (token, slot) holding the values
    and the 1 x 128 scales -> (token int32[2], carrier [0, H] float8_e4m3fn)."""
    from jax_ep._src.backends.ffi import ll_fp8_msg_bytes
    R = cfg.num_ranks
    rank = ep_rank(cfg.axis_name, R)
    S, H = x.shape
    _ll_limits(cfg, S, topk_idx.shape[1], ll_fp8_msg_bytes(H), 1)
    x, topk_idx = _vary_with_axis(cfg.axis_name, x, topk_idx)
    token = ep_call("jax_ep_internode_ll_dispatch_send_fp8", like(x, (2,), jnp.int32))(
        x=x, topk_idx=topk_idx, round_scale=bool(round_scale), **_ll_attrs(cfg, rank))
    return token, jnp.zeros((0, H), jnp.float8_e4m3fn)


def ll_dispatch_recv_fp8(sent, cfg: Cfg, hidden: int):
    """-> ((recv_x float8_e4m3fn [E_local, R*M, H], recv_scales float32 [E_local, R*M,
    H // 128]), recv_count, src_rank, src_index, first_row, row_count)."""
    token, _ = sent
    R, M, H = cfg.num_ranks, cfg.capacity, hidden
    rank = ep_rank(cfg.axis_name, R)
    el = cfg.experts_per_rank
    i32 = jnp.int32
    outs = ep_call(
        "jax_ep_internode_ll_dispatch_recv_fp8",
        (like(token, (el, R * M, H), jnp.float8_e4m3fn),
         like(token, (el, R * M, H // 128), jnp.float32), like(token, (el,), i32),
         like(token, (el, R * M), i32), like(token, (el, R * M), i32),
         like(token, (el, R), i32), like(token, (el, R), i32)))(
        token=token, **_ll_attrs(cfg, rank))
    return ((outs[0], outs[1]),) + tuple(outs[2:])


def ll_combine_send(y, first_row, row_count, rows_per_dest, cfg: Cfg):
    """y[E_local, R*M, H] (float32, bfloat16, float16) and the handle's first_row,
    row_count [E_local, R] -> (token int32[2], carrier [0, rows_per_dest, H] in y's dtype).
    Puts each source's rows back into its receive area."""
    R = cfg.num_ranks
    rank = ep_rank(cfg.axis_name, R)
    H = y.shape[-1]
    _ll_limits(cfg, 0, 1, H, jnp.dtype(y.dtype).itemsize, rows_per_dest)
    y, first_row, row_count = _vary_with_axis(cfg.axis_name, y, first_row, row_count)
    token = ep_call("jax_ep_internode_ll_combine_send", like(y, (2,), jnp.int32))(
        y=y, first_row=first_row, row_count=row_count, rows_per_dest=rows_per_dest,
        **_ll_attrs(cfg, rank))
    carrier = jnp.zeros((0, rows_per_dest, H), y.dtype)
    return token, carrier


def ll_combine_recv(sent, topk_idx, topk_weights, cfg: Cfg):
    """out[S, H] in y's dtype: sum over k ascending of w[t, k] * row(t, k) in float32,
    each product rounded before the add (kernels/common/low_latency_math.h)."""
    token, carrier = sent
    R = cfg.num_ranks
    rank = ep_rank(cfg.axis_name, R)
    S, K = topk_idx.shape
    _ll_limits(cfg, S, K, carrier.shape[-1], jnp.dtype(carrier.dtype).itemsize)
    token, topk_idx, topk_weights = unify_varying(token, topk_idx, topk_weights)
    return ep_call("jax_ep_internode_ll_combine_recv",
                   like(token, (S, carrier.shape[-1]), carrier.dtype))(
        token=token, topk_idx=topk_idx, topk_weights=topk_weights, **_ll_attrs(cfg, rank))
