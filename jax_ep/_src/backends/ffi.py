"""The "ffi" backend: custom calls into the compiled kernels. The CPU transport
(xla_ffi/cpu) and the CUDA intranode transport (xla_ffi/cuda) register the same target
names (`jax_ep_layout`, `jax_ep_dispatch`, `jax_ep_combine`, `jax_ep_gather`, and the
low-latency `jax_ep_ll_*`), so XLA picks the platform's handler. Functions run per shard,
inside `shard_map`, with the signatures every backend module shares (cfg is a
`jax_ep._src.common.Cfg`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_ep._src.common import Cfg, ep_call, ep_coords, like, next_call_site, unify_varying
from jax_ep._src.ext import ffi_call
from jax_ep._src.types import DispatchHandle, DispatchLayout
from jax_ep._src.value_check import across_groups, checked, on_cpu


def layout(topk_idx, cfg: Cfg) -> DispatchLayout:
    """topk_idx[T, K] int32 -> DispatchLayout (no communication; ids checked in the
    kernel)."""
    T = topk_idx.shape[0]
    R, E = cfg.num_ranks, cfg.num_experts
    per_rank, per_expert, in_rank = ffi_call(
        "jax_ep_layout",
        (like(topk_idx, (R,), jnp.int32), like(topk_idx, (E,), jnp.int32),
         like(topk_idx, (T, R), jnp.bool_)),
        vmap_method="broadcast_all",
    )(topk_idx=topk_idx, num_experts=E, num_ranks=R)
    return DispatchLayout(per_rank, per_expert, in_rank)


def dispatch(x, topk_idx, topk_weights, cfg: Cfg):
    """x[T, H], topk_idx[T, K] int32, topk_weights[T, K] float32 -> (recv_x[C, H],
    recv_topk_idx[C, K], recv_topk_weights[C, K], DispatchHandle)."""
    if cfg.check_ids and across_groups(cfg.axis_name, cfg.group_axes):
        # The kernel's id error reaches its own EP group only (jax_ep/_src/value_check.py).
        topk_idx = on_cpu(lambda i: checked(i, cfg.num_experts, axis_name=cfg.axis_name,
                                            groups=cfg.group_axes), topk_idx)
    rank, group = ep_coords(cfg.axis_name, cfg.group_axes)
    # The group id only separates rendezvous; results vary like the data and the rank.
    x, topk_idx, topk_weights, rank = unify_varying(x, topk_idx, topk_weights, rank)
    T, H = x.shape
    K = topk_idx.shape[1]
    C, R = cfg.capacity, cfg.num_ranks
    el = cfg.experts_per_rank
    outs = ep_call(
        "jax_ep_dispatch",
        (like(x, (C, H), x.dtype), like(x, (C, K), jnp.int32), like(x, (C, K), jnp.float32),
         like(x, (), jnp.int32), like(x, (), jnp.int32), like(x, (el,), jnp.int32),
         like(x, (C,), jnp.int32), like(x, (C,), jnp.int32), like(x, (T, R), jnp.int32)),
    )(x=x, topk_idx=topk_idx, topk_weights=topk_weights, rank=rank, group=group,
      num_experts=cfg.num_experts, num_ranks=R, capacity=C, call_site=next_call_site())
    recv_x, recv_idx, recv_w, num_recv, num_dropped, per_expert, src_rank, src_index, \
        send_row = outs
    handle = DispatchHandle(num_recv, num_dropped, per_expert, src_rank, src_index, send_row,
                            cfg.num_experts, R, C, cfg.axis_name)
    return recv_x, recv_idx, recv_w, handle


def combine(y, handle: DispatchHandle, cfg: Cfg):
    """y[C, H] -> out[T, H]: float32 sums in combine's order (backends/reference.py
    combine), cast to y.dtype."""
    return combine_with_bias(y, handle, cfg, ())


def combine_with_bias(y, handle: DispatchHandle, cfg: Cfg, bias):
    """combine, plus each [T, H] array of `bias` added in float32 before the cast (the
    CPU kernel takes them as trailing operands; the CUDA handler takes none). The CPU
    kernel takes the order's node size G (reference.combine_node_size) as an attribute;
    the intranode CUDA kernels sum as one node."""
    rank, group = ep_coords(handle.axis_name, cfg.group_axes)
    y, send_row, rank, *bias = unify_varying(y, handle.send_row, rank, *bias)
    T = send_row.shape[0]
    R = handle.num_ranks
    order = {}
    if jax.default_backend() == "cpu":
        from jax_ep._src.backends.reference import combine_node_size
        G = combine_node_size(R)
        if G < R:  # several nodes (the kernel's default is one)
            order = dict(gpus_per_node=G)
    if bias:  # the CPU kernel's trailing operands
        order["bias"] = bias
    return ep_call("jax_ep_combine", like(y, (T, y.shape[1]), y.dtype))(
        y=y, send_row=send_row, rank=rank, group=group, num_ranks=R,
        call_site=next_call_site(), **order)


def gather(g, handle: DispatchHandle, cfg: Cfg):
    """Combine's transpose: g[T, H] -> out[C, H], out[i] = g_{src_rank[i]}[src_index[i]]."""
    rank, group = ep_coords(handle.axis_name, cfg.group_axes)
    g, src_rank, src_index, rank = unify_varying(g, handle.src_rank, handle.src_index, rank)
    return ep_call("jax_ep_gather", like(g, (handle.capacity, g.shape[1]), g.dtype))(
        g=g, src_rank=src_rank, src_index=src_index, rank=rank, group=group,
        num_ranks=handle.num_ranks, call_site=next_call_site())


# ============================================================================
# --- low-latency mode (jax_ep.low_latency): targets jax_ep_ll_dispatch_send/_recv and
# jax_ep_ll_combine_send/_recv, the send and receive halves as separate custom calls.
# CPU (xla_ffi/cpu/low_latency_handlers.cc) and CUDA real ranks
# (xla_ffi/cuda/low_latency_handlers.cc) register the same names and operands, so one
# lowering serves both. On CUDA the send halves push rows straight into the peers'
# low-latency areas (jax_ep.cuda.setup(..., max_tokens_per_rank=M, num_experts=E)); their
# staging outputs are placeholders nothing writes, so on GPUs they have zero rows (x
# [0, H], combine stage [R, 0, H]: no XLA buffer of staged rows); the CUDA handlers accept
# the CPU's full shapes too. Signatures as in backends/reference.py's low-latency section
# (cfg.capacity = M).
# ============================================================================

_SETUP_HINT = ("call jax_ep.cuda.setup(mesh, axis_name, ..., max_tokens_per_rank=M, "
               "num_experts=E) (its low-latency option) before jitting")


def _ll_platform_check(cfg: Cfg, topk: int | None = None,
                       row_bytes: int | None = None) -> bool:
    """On GPUs the call needs the low-latency area of jax_ep.cuda.setup, large enough for
    it (the handlers check again, per GPU); CPU needs nothing. Returns whether the CUDA
    real-rank handlers run (their staging outputs are then zero-row placeholders)."""
    platform = jax.default_backend()
    if platform == "cpu":
        return False
    if platform != "gpu":
        raise NotImplementedError(
            f"jax_ep.low_latency with backend='ffi' on {platform!r}: only CPU and CUDA "
            "GPUs have handlers (jax_ep/_src/backends/ffi.py ll_*); use backend='reference'")
    from jax_ep import cuda as cuda_rt
    area = cuda_rt.low_latency_area()
    if area is None:
        raise ValueError("jax_ep.low_latency with backend='ffi' on GPUs needs a low-latency "
                         f"area: {_SETUP_HINT}")
    problems = []
    if area["num_ranks"] != cfg.num_ranks:
        problems.append(f"the EP axis has {cfg.num_ranks} ranks, the area "
                        f"{area['num_ranks']}")
    if area["num_experts"] != cfg.num_experts:
        problems.append(f"num_experts={cfg.num_experts}, the area's {area['num_experts']}")
    if cfg.capacity > area["max_tokens_per_rank"]:
        problems.append(f"max_tokens_per_rank={cfg.capacity} exceeds the area's "
                        f"{area['max_tokens_per_rank']}")
    if topk is not None and topk > area["topk"]:
        problems.append(f"topk={topk} exceeds the area's {area['topk']}")
    if row_bytes is not None and row_bytes > area["row_bytes"]:
        problems.append(f"rows of {row_bytes} bytes exceed the area's {area['row_bytes']} "
                        "(setup's hidden * dtype size)")
    if problems:
        raise ValueError("jax_ep.low_latency: the low-latency area of jax_ep.cuda.setup does "
                         "not fit this call: " + "; ".join(problems) + f"; {_SETUP_HINT} "
                         "with the largest shapes")
    return True


def _ll_attrs(cfg: Cfg):
    return dict(num_ranks=cfg.num_ranks, max_tokens=cfg.capacity, call_site=next_call_site())


def ll_dispatch_send(x, topk_idx, cfg: Cfg):
    """Stages x[S, H] and topk_idx[S, K]; also returns tokens per expert int32[E]. (On
    CUDA: pushes the rows into the owners' areas; the staged x is a [0, H] placeholder and
    the staged topk_idx carries the epoch.)"""
    S, H = x.shape
    K = topk_idx.shape[1]
    gpu = _ll_platform_check(cfg, topk=K, row_bytes=H * jnp.dtype(x.dtype).itemsize)
    if cfg.check_ids and across_groups(cfg.axis_name, cfg.group_axes):
        # The kernel's id error reaches its own EP group only (jax_ep/_src/value_check.py).
        topk_idx = on_cpu(lambda i: checked(
            i, cfg.num_experts, axis_name=cfg.axis_name, groups=cfg.group_axes,
            repeats=True, where="jax_ep.low_latency"), topk_idx)
    x, topk_idx = unify_varying(x, topk_idx)
    return tuple(ep_call("jax_ep_ll_dispatch_send",
                         (like(x, (0 if gpu else S, H), x.dtype), like(x, (S, K), jnp.int32),
                          like(x, (cfg.num_experts,), jnp.int32)))(
        x=x, topk_idx=topk_idx, num_experts=cfg.num_experts, **_ll_attrs(cfg)))


def ll_fp8_msg_bytes(hidden: int) -> int:
    """Bytes of one FP8 message (kernels/common/fp8_quant.h): H values, H // 128 float32
    scales, padded to 16."""
    return (hidden + 4 * (hidden // 128) + 15) // 16 * 16


def ll_dispatch_send_fp8(x, topk_idx, cfg: Cfg, round_scale: bool):
    """x[S, H] cast to FP8 in the send half (jax_ep.fp8.quantize's rule, 1 x 128 blocks),
    one message per (token, expert) holding the values and the scales: staged messages
    uint8 [S, bytes] (on CUDA a [0, bytes] placeholder), topk_idx (CUDA: the epoch), tokens
    per expert."""
    S, H = x.shape
    K = topk_idx.shape[1]
    W = ll_fp8_msg_bytes(H)
    gpu = _ll_platform_check(cfg, topk=K, row_bytes=W)
    if cfg.check_ids and across_groups(cfg.axis_name, cfg.group_axes):
        topk_idx = on_cpu(lambda i: checked(
            i, cfg.num_experts, axis_name=cfg.axis_name, groups=cfg.group_axes,
            repeats=True, where="jax_ep.low_latency"), topk_idx)
    x, topk_idx = unify_varying(x, topk_idx)
    return tuple(ep_call("jax_ep_ll_dispatch_send_fp8",
                         (like(x, (0 if gpu else S, W), jnp.uint8), like(x, (S, K), jnp.int32),
                          like(x, (cfg.num_experts,), jnp.int32)))(
        x=x, topk_idx=topk_idx, num_experts=cfg.num_experts, round_scale=bool(round_scale),
        **_ll_attrs(cfg)))


def ll_dispatch_recv_fp8(sent, cfg: Cfg, hidden: int):
    """The FP8 messages unpacked: ((recv_x_fp8, recv_scales), recv_count, src_rank,
    src_index, first_row, row_count)."""
    stage, stage_idx, counts = sent
    rank, group = ep_coords(cfg.axis_name, cfg.group_axes)
    stage, stage_idx, counts, rank = unify_varying(stage, stage_idx, counts, rank)
    R, M, H = cfg.num_ranks, cfg.capacity, hidden
    el = cfg.experts_per_rank
    i32 = jnp.int32
    outs = ep_call(
        "jax_ep_ll_dispatch_recv_fp8",
        (like(stage, (el, R * M, H), jnp.float8_e4m3fn),
         like(stage, (el, R * M, H // 128), jnp.float32), like(stage, (el,), i32),
         like(stage, (el, R * M), i32), like(stage, (el, R * M), i32),
         like(stage, (el, R), i32), like(stage, (el, R), i32)))(
        stage_x=stage, stage_idx=stage_idx, expert_count=counts, rank=rank, group=group,
        num_experts=cfg.num_experts, **_ll_attrs(cfg))
    return ((outs[0], outs[1]),) + tuple(outs[2:])


def ll_dispatch_recv(sent, cfg: Cfg):
    stage_x, stage_idx, counts = sent
    rank, group = ep_coords(cfg.axis_name, cfg.group_axes)
    stage_x, stage_idx, counts, rank = unify_varying(stage_x, stage_idx, counts, rank)
    R, M, H = cfg.num_ranks, cfg.capacity, stage_x.shape[1]
    el = cfg.experts_per_rank
    i32 = jnp.int32
    return tuple(ep_call(
        "jax_ep_ll_dispatch_recv",
        (like(stage_x, (el, R * M, H), stage_x.dtype), like(stage_x, (el,), i32),
         like(stage_x, (el, R * M), i32), like(stage_x, (el, R * M), i32),
         like(stage_x, (el, R), i32), like(stage_x, (el, R), i32)))(
        stage_x=stage_x, stage_idx=stage_idx, expert_count=counts, rank=rank, group=group,
        num_experts=cfg.num_experts, **_ll_attrs(cfg)))


def ll_combine_send(y, first_row, row_count, rows_per_dest, cfg: Cfg):
    """Stages each source rank's rows of y[E_local, R*M, H]: [R, rows_per_dest, H], plus a
    status scalar the receive half reports. (On CUDA: pushes the rows into the sources'
    stages; the stage output is an [R, 0, H] placeholder and status carries the epoch.)"""
    gpu = _ll_platform_check(cfg, row_bytes=y.shape[-1] * jnp.dtype(y.dtype).itemsize)
    y, first_row, row_count = unify_varying(y, first_row, row_count)
    R, H = cfg.num_ranks, y.shape[-1]
    rows = 0 if gpu else rows_per_dest
    return tuple(ep_call("jax_ep_ll_combine_send",
                         (like(y, (R, rows, H), y.dtype), like(y, (), jnp.int32)))(
        y=y, first_row=first_row, row_count=row_count, rows_per_dest=rows_per_dest,
        **_ll_attrs(cfg)))


def ll_combine_recv(sent, topk_idx, topk_weights, cfg: Cfg):
    stage, status = sent
    if cfg.check_ids and across_groups(cfg.axis_name, cfg.group_axes):
        # As in ll_dispatch_send; after this rank's part of the exchange, which the
        # kernel below completes on every rank of the group before reporting.
        topk_idx = on_cpu(lambda i: checked(
            i, cfg.num_experts, axis_name=cfg.axis_name, groups=cfg.group_axes,
            repeats=True, where="jax_ep.low_latency", wait_for=(status,)), topk_idx)
    rank, group = ep_coords(cfg.axis_name, cfg.group_axes)
    stage, status, topk_idx, topk_weights, rank = unify_varying(stage, status, topk_idx,
                                                                topk_weights, rank)
    S, H = topk_idx.shape[0], stage.shape[-1]
    return ep_call("jax_ep_ll_combine_recv", like(stage, (S, H), stage.dtype))(
        stage=stage, status=status, topk_idx=topk_idx, topk_weights=topk_weights, rank=rank,
        group=group, num_experts=cfg.num_experts, **_ll_attrs(cfg))
