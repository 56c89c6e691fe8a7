"""Flax NNX mixture-of-experts layer on jax-ep's dispatch and combine.

    import jax, jax.numpy as jnp
    from flax import nnx
    from jax_ep.flax import MoE

    mesh = jax.make_mesh((2, 4), ("data", "expert"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    with jax.set_mesh(mesh):
        moe = MoE(64, 128, num_experts=8, top_k=2, rngs=nnx.Rngs(0))
        y, aux = nnx.jit(lambda m, x: m(x))(moe, x)      # x[B, S, 64]

The layer works on global arrays: it needs no `shard_map` from the caller. Inside, the
router runs on the global token array; the expert path (dispatch, grouped SwiGLU,
combine) runs per shard in a `jax.shard_map` over the mesh in context, with tokens split
over every mesh axis (`data_axes` first, then `mesh_axis`) and the stacked expert weights
`[E, ...]` split over `mesh_axis`. So each index of the data axes forms its own EP group
of `R = mesh.shape[mesh_axis]` ranks, each holding `E // R` experts.

Grouping received rows by expert (`jax_ep.experts`). A received row carries up to `top_k`
local expert ids (a token whose several experts live on this rank arrives once). The
layer packs the (row, slot) pairs by local expert into static places `[E_local, cap]`,
runs each expert's SwiGLU on its pairs only (in chunks of up to 1024 rows, the last
rounded up to a 32-row tile; forward and backward), and sums each pair's output, scaled by its top-k weight,
back onto its row (in float32); `jax_ep.combine` then sums the rows of all ranks back
onto the source tokens. So the work follows the routed pairs. `cap` comes from
`capacity_factor`: `ceil(capacity_factor * T * top_k / E_local)` places per expert (T
tokens per shard; `T * top_k / E_local` is an expert's mean load), rounded up to a
multiple of 8; it bounds the memory of the saved activations (`[E_local, cap, F]` twice)
and the drops: an expert's pairs past `cap` (in received order: source rank, then token)
get no output and are counted in `aux["dropped"]`. `capacity_factor=None` sizes the
places for every received row (`cap` = C) and never drops. The grouping is a pure
function of the received ids, so the `reference` and `ffi` backends (which receive the
same rows bit for bit) compute the same numbers.

Receive capacity. With `capacity_factor` set, a rank receives at most `E_local * cap`
rows by default (`receive_capacity`; never above the worst case `R * T`): a received
row holds at least one pair, so more rows than the experts have places means the
experts drop pairs anyway. The receive buffers then follow what the experts can use (at
R = 64, top-8, factor 2: 16 T rows instead of 64 T). Rows past it are dropped at
receive (the last in source rank, token order) and counted in `aux["dropped_rows"]`.
`capacity_factor=None` keeps `R * T` rows (never drops).

Expert matmuls. `expert_matmul="tiles"` runs the loop over tiles above (the CPU
default); `"ragged_dot"` packs the kept pairs expert after expert and runs three
`jax.lax.ragged_dot`s with no data-dependent loop (the GPU default; see
`jax_ep.experts.grouped_swiglu`).
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from jax_ep import experts, fp8, ops

__all__ = ["MoE", "RoutingBias", "SwiGLU", "route", "load_balance_loss",
           "sequence_balance_loss", "receive_capacity"]


class RoutingBias(nnx.Variable):
    """Per-expert bias added to the router scores for top-k *selection* only
    (aux-loss-free balancing). Not an `nnx.Param`: optimizers built with
    `wrt=nnx.Param` leave it alone; update it with `MoE.update_routing_bias`."""


def _fan_in(in_axis, out_axis, batch_axis=()):
    return nnx.initializers.variance_scaling(1.0, "fan_in", "truncated_normal",
                                             in_axis=in_axis, out_axis=out_axis,
                                             batch_axis=batch_axis)


def _context_mesh():
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty:
        return None
    return mesh


def _maybe_partitioned(init, spec, mesh_axis):
    """Annotates `init` with `spec` when a mesh holding `mesh_axis` is in context (flax
    shards annotated variables eagerly and needs a mesh to do so)."""
    mesh = _context_mesh()
    if mesh is not None and mesh_axis in mesh.axis_names:
        return nnx.with_partitioning(init, spec)
    return init


def route(logits, top_k: int, *, score: str = "softmax", bias=None, n_groups=None,
          topk_groups=None, norm_topk_prob: bool = True, group_score: str = "top2_sum",
          routed_scaling_factor: float = 1.0):
    """Top-k routing of router logits [N, E] (float32).

    Returns (topk_idx int32[N, K], topk_weights float32[N, K], probs float32[N, E]):
    `probs` are the per-token scores normalized to sum to 1 (softmax, or sigmoid scores
    divided by their sum), used by the load-balance loss. `bias` [E] shifts the scores
    used to *select* experts only; the weights are the unbiased scores of the selected
    experts, renormalized to sum to 1 when `norm_topk_prob`. With `n_groups`, the experts
    are split into `n_groups` contiguous groups, each group scored by `group_score`:
    "top2_sum", the sum of its two best (biased) scores (its best one when a group has a
    single expert; DeepSeek-V3), or "max", its best score (DeepSeek-V2); only the
    `topk_groups` best groups are eligible. The weights are finally multiplied by
    `routed_scaling_factor` (DeepSeek-V3: 2.5; the shared experts are not scaled).
    """
    N, E = logits.shape
    logits = logits.astype(jnp.float32)
    if score == "softmax":
        scores = jax.nn.softmax(logits, axis=-1)
        probs = scores
    elif score == "sigmoid":
        scores = jax.nn.sigmoid(logits)
        probs = scores / jnp.sum(scores, axis=-1, keepdims=True)
    else:
        raise ValueError(f"score must be 'softmax' or 'sigmoid', got {score!r}")
    if group_score not in GROUP_SCORES:
        raise ValueError(f"group_score must be one of {GROUP_SCORES}, got {group_score!r}")
    sel = scores if bias is None else scores + bias.astype(jnp.float32)
    if n_groups is not None and n_groups > 1:
        per = E // n_groups
        g = sel.reshape(N, n_groups, per)
        if group_score == "max":
            gs = jnp.max(g, axis=-1)  # [N, G]
        else:
            gs = jnp.sum(jax.lax.top_k(g, min(2, per))[0], axis=-1)
        _, top_groups = jax.lax.top_k(gs, topk_groups)
        allowed = jnp.any(top_groups[:, :, None] == jnp.arange(n_groups)[None, None, :],
                          axis=1)  # [N, G]
        allowed = jnp.repeat(allowed, per, axis=1)
        sel = jnp.where(allowed, sel, -jnp.inf)
    _, idx = jax.lax.top_k(jax.lax.stop_gradient(sel), top_k)
    weights = jnp.take_along_axis(scores, idx, axis=-1)
    if norm_topk_prob:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    if routed_scaling_factor != 1.0:
        weights = weights * routed_scaling_factor
    return idx.astype(jnp.int32), weights.astype(jnp.float32), probs


GROUP_SCORES = ("top2_sum", "max")
AUX_LOSSES = ("batch", "sequence")


def receive_capacity(tokens_per_shard: int, num_ranks: int, num_experts: int,
                     top_k: int, capacity_factor: float | None) -> int:
    """Rows a rank receives per dispatch by default (a pure function of the static
    sizes): `R * T` (the worst case, never drops) when `capacity_factor` is None; else
    `E_local * cap` with `cap = experts.expert_capacity(T * K, E_local, capacity_factor)`,
    the places of all local experts together, at most `R * T`."""
    T, R = int(tokens_per_shard), int(num_ranks)
    if T < 1 or R < 1 or num_experts % R:
        raise ValueError(f"need tokens_per_shard >= 1 and num_experts={num_experts} a "
                         f"multiple of num_ranks={R}, got tokens_per_shard={T}")
    full = R * T
    if capacity_factor is None:
        return full
    el = num_experts // R
    return min(full, el * experts.expert_capacity(T * top_k, el, capacity_factor,
                                                  limit=full))


def _counts(topk_idx, num_experts):
    """int32[E]: top-k slots per expert (a one-hot sum, which partitions under any
    sharding of the tokens, explicit included)."""
    hit = topk_idx[..., None] == jnp.arange(num_experts, dtype=topk_idx.dtype)
    return jnp.sum(hit, axis=tuple(range(topk_idx.ndim)), dtype=jnp.int32)


def load_balance_loss(probs, topk_idx, num_experts: int):
    """E * sum_e f_e * p_e, with f_e the fraction of top-k slots sent to expert e and p_e
    the mean routing probability of e; 1.0 when routing is uniform."""
    return _load_balance(probs, _counts(topk_idx, num_experts), topk_idx.size)


def sequence_balance_loss(probs, topk_idx, num_experts: int):
    """DeepSeek-V3's sequence-wise balance loss: `load_balance_loss` of each sequence,
    averaged over the sequences. probs float32[B, S, E], topk_idx int32[B, S, K]; per
    sequence, E * sum_e f_e * P_e with f_e the fraction of the sequence's top-k slots
    sent to e and P_e the mean over its tokens of e's normalized score (1.0 uniform)."""
    B, S, K = topk_idx.shape
    hit = topk_idx[..., None] == jnp.arange(num_experts, dtype=topk_idx.dtype)
    f = jnp.sum(hit, axis=(1, 2), dtype=jnp.float32) / (S * K)          # [B, E]
    p = jnp.mean(probs, axis=1)                                         # [B, E]
    return num_experts * jnp.mean(jnp.sum(f * p, axis=-1))


def _load_balance(probs, counts, num_slots):
    """load_balance_loss from the slot counts per expert (`_counts`) and their total."""
    f = counts.astype(jnp.float32) / num_slots
    p = jnp.mean(probs, axis=0)
    return counts.shape[0] * jnp.sum(f * p)


class SwiGLU(nnx.Module):
    """Dense SwiGLU FFN (used for the shared experts): down(silu(x @ gate) * (x @ up))."""

    def __init__(self, hidden: int, ffn_hidden: int, *, dtype=jnp.float32,
                 param_dtype=jnp.float32, rngs: nnx.Rngs):
        init = _fan_in(-2, -1)
        self.dtype = dtype
        self.w_gate = nnx.Param(init(rngs.params(), (hidden, ffn_hidden), param_dtype))
        self.w_up = nnx.Param(init(rngs.params(), (hidden, ffn_hidden), param_dtype))
        self.w_down = nnx.Param(init(rngs.params(), (ffn_hidden, hidden), param_dtype))

    def __call__(self, x):
        x = x.astype(self.dtype)
        h = jax.nn.silu(x @ self.w_gate[...].astype(self.dtype)) * (
            x @ self.w_up[...].astype(self.dtype))
        return h @ self.w_down[...].astype(self.dtype)


class MoE(nnx.Module):
    """Mixture-of-experts SwiGLU layer with expert parallelism through jax-ep.

    Args:
      hidden: model width H.
      ffn_hidden: width F of each expert's SwiGLU.
      num_experts: E, a multiple of the mesh size on `mesh_axis`.
      top_k: experts per token K.
      mesh_axis: the mesh axis the experts are split over (the EP axis).
      data_axes: the other mesh axes the tokens are split over; default every other axis
        of the mesh in context, in mesh order.
      backend: 'reference', 'intranode', 'internode' or None/'auto' (see `jax_ep.dispatch`).
      capacity: rows each rank can receive per call. None: `receive_capacity(...)`, i.e.
        `R * T` (T tokens per shard; never drops) when `capacity_factor` is None, else
        the places of the local experts together, `E_local * cap`, at most `R * T`. An
        int: that many rows. A float f: `ceil(f * T * min(K, R))`, capped at `R * T`
        (f = 1.0 fits perfectly balanced routing).
      capacity_factor: places per local expert, as a multiple of an expert's mean load
        `T * top_k / E_local` (rounded up to a multiple of 8, at most the received rows).
        Pairs past an expert's places are dropped and counted in `aux["dropped"]`. Only
        places holding pairs are computed, so the factor sets memory (the saved
        activations, `[E_local, cap, F]` twice) and drops, not the work. None: never
        drop (places for every received row, and `R * T` received rows). Default 2.0.
      expert_matmul: "tiles" (a loop over each expert's pairs in chunks of up to 1024
        rows; the CPU default), "ragged_dot" (`jax.lax.ragged_dot` on the packed pairs, no per-tile
        loop; the GPU default) or None/"auto" (by JAX's default backend at trace time).
      score: 'softmax' (default; Mixtral, DeepSeek-V2) or 'sigmoid' (DeepSeek-V3)
        router scores.
      n_groups, topk_groups: group-limited routing (both or neither).
      group_score: how a group is scored for group-limited routing: "top2_sum" (default;
        DeepSeek-V3, the sum of its two best biased scores) or "max" (DeepSeek-V2, its
        best score; V2 has no routing bias).
      routed_scaling_factor: multiplies the routed experts' top-k weights (after
        `norm_topk_prob`), not the shared experts. Default 1.0 (no scaling, as
        Mixtral); DeepSeek-V3 uses 2.5 (DeepSeek-V2 checkpoints carry theirs in their
        config). Folding it into `w_down` instead gives the same outputs but not the same
        optimizer steps.
      aux_loss: which balance loss `aux["load_balance_loss"]` is: "batch" (default; the
        Switch/GShard form over every token of the batch) or "sequence" (DeepSeek-V3's
        sequence-wise complementary loss: the same form per sequence of x[B, S, H],
        averaged over the B sequences; a 2-D x is one sequence). Both are always in
        `aux` as "batch_balance_loss" and "sequence_balance_loss".
      routing_bias: add a `RoutingBias` [E] used for expert selection only (aux-loss-free
        balancing; update it with `update_routing_bias`).
      shared_experts: number of always-on experts, run as one dense SwiGLU of width
        `shared_experts * ffn_hidden` on every token and added to the output.
      norm_topk_prob: renormalize the selected experts' weights to sum to 1 (default
        True, as DeepSeek-V3; Mixtral too; DeepSeek-V2 does not).
      dtype: compute dtype of the tokens and expert matmuls (router math is float32).
      param_dtype: parameter dtype.
      dispatch_dtype: None (tokens travel in `dtype`) or "fp8": tokens are quantized to
        float8_e4m3fn with one scale per 1 x 128 block (`jax_ep.fp8`; hidden must be a
        multiple of 128), dispatched as FP8 pairs (H + H/32 bytes a row) and dequantized
        into the expert matmuls in `dtype`; the gradient with respect to the tokens is
        the combine of the received rows' cotangent in `dtype` (straight-through the
        quantization, as DeepSeek-V3 trains). Combine stays in `dtype`.
      mode: "normal", or "low_latency" for decoding (`jax_ep.low_latency`): each local
        expert's rows arrive as their own fixed block of `R * max_tokens_per_rank` rows,
        the experts run on the blocks and combine applies the top-k weights; no capacity,
        nothing dropped; the same outputs as "normal" to float32 summation order.
      max_tokens_per_rank: M, tokens per shard the low-latency buffers hold (mode
        "low_latency" only; T <= M).
      rngs: `nnx.Rngs`; parameters depend only on its `params` stream, never on the
        backend.

    Call: `y, aux = moe(x)` with x[B, S, H] (or [N, H]); y has x's shape and dtype. `aux`
    holds `load_balance_loss` (scalar), `router_z_loss` (scalar), `tokens_per_expert`
    (int32[E], top-k slots routed to each expert over the whole batch), `dropped`
    (int32 scalar: top-k slots, i.e. (token, expert) pairs, that got no expert output,
    whether their row did not fit in `capacity` or their expert's places were full; over
    all EP groups), `dropped_rows` (int32 scalar: rows that did not fit in `capacity`,
    dropped at receive) and `dropped_at_experts` (int32 scalar: slots of received rows
    past their expert's places); `dropped` counts the slots of both.
    `batch_balance_loss` and `sequence_balance_loss` (scalars) are the two balance
    losses `aux_loss` chooses between.
    """

    def __init__(self, hidden: int, ffn_hidden: int, num_experts: int, top_k: int, *,
                 mesh_axis: str = "expert", data_axes: Sequence[str] | None = None,
                 backend: str | None = None, capacity: int | float | None = None,
                 capacity_factor: float | None = 2.0, expert_matmul: str | None = None,
                 score: str = "softmax", n_groups: int | None = None,
                 topk_groups: int | None = None, group_score: str = "top2_sum",
                 routed_scaling_factor: float = 1.0, aux_loss: str = "batch",
                 routing_bias: bool = False,
                 shared_experts: int = 0, norm_topk_prob: bool = True,
                 dtype: Any = jnp.float32, param_dtype: Any = jnp.float32,
                 dispatch_dtype: str | None = None, mode: str = "normal",
                 max_tokens_per_rank: int | None = None, rngs: nnx.Rngs):
        _check_dispatch_dtype(dispatch_dtype, hidden)
        _check_mode(mode, max_tokens_per_rank, dispatch_dtype)  # low-latency section
        self.mode, self.max_tokens_per_rank = mode, max_tokens_per_rank
        self.dispatch_dtype = dispatch_dtype
        if score not in ("softmax", "sigmoid"):
            raise ValueError(f"score must be 'softmax' or 'sigmoid', got {score!r}")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")
        if (n_groups is None) != (topk_groups is None):
            raise ValueError("n_groups and topk_groups must be given together")
        if n_groups is not None:
            if num_experts % n_groups != 0:
                raise ValueError(f"num_experts={num_experts} must be divisible by "
                                 f"n_groups={n_groups}")
            if not 1 <= topk_groups <= n_groups:
                raise ValueError(f"topk_groups must be in [1, n_groups={n_groups}], got "
                                 f"{topk_groups}")
            if topk_groups * (num_experts // n_groups) < top_k:
                raise ValueError(f"topk_groups={topk_groups} groups of "
                                 f"{num_experts // n_groups} experts cannot hold "
                                 f"top_k={top_k} experts")
        if group_score not in GROUP_SCORES:
            raise ValueError(f"group_score must be one of {GROUP_SCORES}, got "
                             f"{group_score!r}")
        if aux_loss not in AUX_LOSSES:
            raise ValueError(f"aux_loss must be one of {AUX_LOSSES}, got {aux_loss!r}")
        if (isinstance(routed_scaling_factor, bool)
                or not isinstance(routed_scaling_factor, (int, float))
                or not routed_scaling_factor > 0):
            raise ValueError(f"routed_scaling_factor must be a positive number, got "
                             f"{routed_scaling_factor!r}")
        if expert_matmul not in (None, "auto", *experts.EXPERT_MATMULS):
            raise ValueError(f"expert_matmul must be None, 'auto' or one of "
                             f"{experts.EXPERT_MATMULS}, got {expert_matmul!r}")
        self.expert_matmul = expert_matmul
        self.group_score, self.aux_loss = group_score, aux_loss
        self.routed_scaling_factor = float(routed_scaling_factor)
        ops.resolve_backend(backend)  # validates the name early
        if capacity is not None and not isinstance(capacity, (int, float)):
            raise TypeError(f"capacity must be None, an int or a float, got {capacity!r}")
        if capacity is not None and capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        if capacity_factor is not None:
            if (isinstance(capacity_factor, bool)
                    or not isinstance(capacity_factor, (int, float))):
                raise TypeError(f"capacity_factor must be None or a number, got "
                                f"{capacity_factor!r}")
            if not capacity_factor > 0:
                raise ValueError(f"capacity_factor must be positive, got {capacity_factor}")
        self.capacity_factor = capacity_factor
        self.hidden, self.ffn_hidden = hidden, ffn_hidden
        self.num_experts, self.top_k = num_experts, top_k
        self.mesh_axis = mesh_axis
        self.data_axes = None if data_axes is None else tuple(data_axes)
        self.backend, self.capacity = backend, capacity
        self.score, self.n_groups, self.topk_groups = score, n_groups, topk_groups
        self.norm_topk_prob = norm_topk_prob
        self.dtype, self.param_dtype = dtype, param_dtype

        E, H, F = num_experts, hidden, ffn_hidden
        self.router = nnx.Param(_fan_in(-2, -1)(rngs.params(), (H, E), param_dtype))
        w_init = _maybe_partitioned(_fan_in(-2, -1, (0,)), (mesh_axis, None, None),
                                    mesh_axis)
        self.w_gate = nnx.Param(w_init(rngs.params(), (E, H, F), param_dtype))
        self.w_up = nnx.Param(w_init(rngs.params(), (E, H, F), param_dtype))
        self.w_down = nnx.Param(w_init(rngs.params(), (E, F, H), param_dtype))
        self.routing_bias = (RoutingBias(jnp.zeros((E,), jnp.float32)) if routing_bias
                             else None)
        self.shared = (SwiGLU(H, shared_experts * F, dtype=dtype, param_dtype=param_dtype,
                              rngs=rngs) if shared_experts else None)

    # ------------------------------------------------------------------ routing bias

    def update_routing_bias(self, tokens_per_expert, rate: float = 1e-3):
        """Aux-loss-free balancing step: raise the bias of under-loaded experts and lower
        it for over-loaded ones by `rate` (sign of mean load minus load)."""
        if self.routing_bias is None:
            raise ValueError("this MoE was built with routing_bias=False")
        load = tokens_per_expert.astype(jnp.float32)
        self.routing_bias[...] = self.routing_bias[...] + rate * jnp.sign(
            jnp.mean(load) - load)

    # ------------------------------------------------------------------ forward

    def _mesh_and_specs(self):
        mesh = _context_mesh()
        if mesh is None:
            # No mesh in context: one rank holding every expert.
            mesh = jax.make_mesh((1,), (self.mesh_axis,), devices=jax.devices()[:1],
                                 axis_types=(jax.sharding.AxisType.Auto,))
        if self.mesh_axis not in mesh.axis_names:
            raise ValueError(f"mesh_axis {self.mesh_axis!r} is not an axis of the mesh in "
                             f"context (axes {mesh.axis_names})")
        if self.data_axes is None:
            data_axes = tuple(a for a in mesh.axis_names if a != self.mesh_axis)
        else:
            data_axes = self.data_axes
            for a in data_axes:
                if a not in mesh.axis_names or a == self.mesh_axis:
                    raise ValueError(f"data_axes entry {a!r} must be a mesh axis other "
                                     f"than mesh_axis (axes {mesh.axis_names})")
        return mesh, data_axes

    def _capacity(self, tokens_per_shard, R):
        """Rows each rank receives, or None for the worst case `R * T`."""
        c = self.capacity
        if c is None:
            c = receive_capacity(tokens_per_shard, R, self.num_experts, self.top_k,
                                 self.capacity_factor)
            return None if c == R * tokens_per_shard else c
        if isinstance(c, float):
            c = math.ceil(c * tokens_per_shard * min(self.top_k, R))
        return max(1, min(int(c), R * tokens_per_shard))

    def __call__(self, x):
        shape = x.shape
        if x.shape[-1] != self.hidden:
            raise ValueError(f"x must end in hidden={self.hidden}, got shape {x.shape}")
        x2 = x.reshape(-1, self.hidden)
        N = x2.shape[0]
        E, K = self.num_experts, self.top_k

        # Mesh and token shards first: the router's top-k runs per shard.
        mesh, data_axes = self._mesh_and_specs()
        R = mesh.shape[self.mesh_axis]
        if E % R != 0:
            raise ValueError(f"num_experts={E} must be divisible by the mesh size "
                             f"{R} of axis {self.mesh_axis!r}")
        tok_axes = (*data_axes, self.mesh_axis)
        shards = math.prod(mesh.shape[a] for a in tok_axes)
        if N % shards != 0:
            raise ValueError(f"the {N} tokens (batch * seq) must split evenly over the "
                             f"{shards} shards of mesh axes {tok_axes}")
        T = N // shards
        tok = P(tok_axes)
        explicit = any(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types)

        # Router: logits on the global token array, top-k per token shard (left to the
        # partitioner, XLA would gather every token's logits to every device for TopK).
        logits = x2.astype(jnp.float32) @ self.router[...].astype(jnp.float32)
        bias = None if self.routing_bias is None else jax.lax.stop_gradient(
            self.routing_bias[...])
        route_kw = dict(score=self.score, n_groups=self.n_groups,
                        topk_groups=self.topk_groups, norm_topk_prob=self.norm_topk_prob,
                        group_score=self.group_score,
                        routed_scaling_factor=self.routed_scaling_factor)
        r_args, r_specs = (logits,), (tok,)
        if bias is not None:
            r_args, r_specs = (logits, bias), (tok, P())
        if explicit:
            r_args = tuple(jax.sharding.reshard(a, s) for a, s in zip(r_args, r_specs))
        topk_idx, topk_w, probs = jax.shard_map(
            lambda lg, *b: route(lg, K, bias=b[0] if b else None, **route_kw),
            mesh=mesh, in_specs=r_specs, out_specs=(tok, tok, tok))(*r_args)
        if explicit:  # back to the logits' layout, as the global-array code had them
            spec = jax.typeof(logits).sharding.spec
            topk_idx, topk_w, probs = (jax.sharding.reshard(a, spec)
                                       for a in (topk_idx, topk_w, probs))
        tokens_per_expert = _counts(topk_idx, E)
        lb = _load_balance(probs, tokens_per_expert, topk_idx.size)
        seqs = shape[0] if len(shape) == 3 else 1
        seq_lb = sequence_balance_loss(probs.reshape(seqs, -1, E),
                                       topk_idx.reshape(seqs, -1, K), E)
        z = jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2)

        # Expert path, per shard.
        C = self._capacity(T, R)
        rows = R * T if C is None else C
        el = E // R
        cap = rows if self.capacity_factor is None else experts.expert_capacity(
            T * K, el, self.capacity_factor, limit=rows)
        wspec = P(self.mesh_axis)
        dtype = self.dtype
        matmul = experts.check_expert_matmul(self.expert_matmul)

        def shard_fn(xs, idx, w, wg, wu, wd):
            y, counts = _experts_per_shard(
                xs, idx, w, wg.astype(dtype), wu.astype(dtype), wd.astype(dtype),
                num_experts=E, axis_name=self.mesh_axis, capacity=C,
                expert_capacity=cap, backend=self.backend,
                dispatch_dtype=self.dispatch_dtype, expert_matmul=matmul)
            return y, jax.lax.psum(counts, tok_axes)

        if self.mode == "low_latency":  # see the low-latency section at the end
            shard_fn = _low_latency_shard_fn(self, tok_axes, dtype)

        args = (x2.astype(dtype), topk_idx, topk_w, self.w_gate[...], self.w_up[...],
                self.w_down[...])
        specs = (tok, tok, tok, wspec, wspec, wspec)
        if explicit:
            # Explicit axes: shard_map wants its inputs laid out as in_specs already.
            args = tuple(jax.sharding.reshard(a, s) for a, s in zip(args, specs))
        y, counts = jax.shard_map(shard_fn, mesh=mesh, in_specs=specs,
                                  out_specs=(tok, P()))(*args)
        # Slots routed (all experts, all tokens) minus slots some expert computed.
        dropped = jnp.sum(tokens_per_expert) - counts[0]
        if explicit:
            y = jax.sharding.reshard(y, jax.typeof(x2).sharding.spec)
        if self.shared is not None:
            y = y + self.shared(x2).astype(y.dtype)
        aux = {"load_balance_loss": seq_lb if self.aux_loss == "sequence" else lb,
               "batch_balance_loss": lb, "sequence_balance_loss": seq_lb,
               "router_z_loss": z, "tokens_per_expert": tokens_per_expert,
               "dropped": dropped, "dropped_rows": counts[1],
               "dropped_at_experts": counts[2]}
        return y.reshape(shape).astype(x.dtype), aux


def _experts_per_shard(x, topk_idx, topk_w, w_gate, w_up, w_down, **kw):
    """Dispatch, grouped SwiGLU over the local experts, combine (inside shard_map);
    keywords num_experts, axis_name, capacity, expert_capacity, backend, dispatch_dtype,
    expert_matmul. Returns (y[T, H], int32[3]: pairs computed here, rows this rank dropped
    at receive, pairs of received rows past their expert's places).

    Under autodiff, the tokens' cotangent is computed only where x is differentiated: a
    gradient over the parameters alone (x the data) skips the received rows' cotangent
    (a third of the experts' backward matmuls) and its combine (`_routed`)."""
    return _routed(x, topk_idx, topk_w, w_gate, w_up, w_down, tuple(sorted(kw.items())))


def _experts_impl(x, topk_idx, topk_w, w_gate, w_up, w_down, *, num_experts, axis_name,
                  capacity, expert_capacity, backend, dispatch_dtype=None,
                  expert_matmul="tiles", need_dx=True):
    dispatch = _dispatch_fp8 if dispatch_dtype == "fp8" else ops.dispatch
    recv_x, recv_idx, recv_w, handle = dispatch(
        x, topk_idx, topk_w, num_experts=num_experts, axis_name=axis_name,
        capacity=capacity, backend=backend)
    if not need_dx:
        # The rows' cotangent only ever reaches x (dispatch's transpose), which nothing
        # differentiates here.
        recv_x = jax.lax.stop_gradient(recv_x)
    y, groups = experts.grouped_swiglu(recv_x, recv_idx, recv_w, w_gate, w_up, w_down,
                                       capacity=expert_capacity, matmul=expert_matmul,
                                       need_dx=need_dx)
    y = ops.combine(y.astype(x.dtype), handle, backend=backend)
    computed = jnp.sum(jnp.minimum(groups.counts, expert_capacity), dtype=jnp.int32)
    return y, jnp.stack([computed, handle.num_dropped.astype(jnp.int32),
                         groups.dropped.astype(jnp.int32)])


def _routed_primal(x, topk_idx, topk_w, w_gate, w_up, w_down, kw):
    return _experts_impl(x, topk_idx, topk_w, w_gate, w_up, w_down, **dict(kw))


def _routed_fwd(*args):
    # symbolic_zeros: every argument comes with whether autodiff perturbs it, known only
    # here (a trace-time test of x would be wrong under grad of jit, which traces first).
    *prims, kw = args
    vals = [p.value for p in prims]
    live = [i for i, p in enumerate(prims) if p.perturbed]

    def f(*d):
        a = list(vals)
        for i, v in zip(live, d):
            a[i] = v
        return _experts_impl(*a, **dict(kw), need_dx=0 in live)

    y, vjp, counts = jax.vjp(f, *(vals[i] for i in live), has_aux=True)
    # Which arguments are live, as the residual's structure (static for the backward).
    return (y, counts), (vjp, tuple(() if p.perturbed else None for p in prims))


def _routed_bwd(kw, res, cts):
    vjp, live = res
    d_y = cts[0]
    if isinstance(d_y, jax.custom_derivatives.SymbolicZero):
        return (None,) * len(live)
    grads = iter(vjp(d_y))
    return tuple(None if m is None else next(grads) for m in live)


_routed = jax.custom_vjp(_routed_primal, nondiff_argnums=(6,))
_routed.defvjp(_routed_fwd, _routed_bwd, symbolic_zeros=True)


# ----------------------------------------------------------------------------- FP8 dispatch

def _check_dispatch_dtype(dispatch_dtype, hidden):
    if dispatch_dtype not in (None, "fp8"):
        raise ValueError(f"dispatch_dtype must be None or 'fp8', got {dispatch_dtype!r}")
    if dispatch_dtype == "fp8" and hidden % fp8.DEFAULT_BLOCK:
        raise ValueError(f"dispatch_dtype='fp8' needs hidden={hidden} to be a multiple of "
                         f"{fp8.DEFAULT_BLOCK} (one scale per 1 x {fp8.DEFAULT_BLOCK} block)")


def _dispatch_fp8(x, topk_idx, topk_w, *, backend, **kw):
    """`ops.dispatch` of x[T, H] as FP8 pairs; the received rows come back dequantized in
    x's dtype. Their cotangent reaches x as its combine (straight-through)."""
    (q, s), recv_idx, recv_w, handle = ops.dispatch(
        fp8.quantize(jax.lax.stop_gradient(x)), topk_idx, topk_w, backend=backend, **kw)
    rows = fp8.dequantize(jax.lax.stop_gradient(q), jax.lax.stop_gradient(s))
    return _straight_through(rows.astype(x.dtype), x, handle, backend), recv_idx, recv_w, \
        handle


def _st_primal(rows, x, handle, backend):
    return rows


def _st_fwd(rows, x, handle, backend):
    return rows, handle


def _st_bwd(backend, handle, d_rows):
    zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, jax.dtypes.float0), handle)
    return jnp.zeros_like(d_rows), ops.combine(d_rows, handle, backend=backend), zeros


_straight_through = jax.custom_vjp(_st_primal, nondiff_argnums=(3,))
_straight_through.defvjp(_st_fwd, _st_bwd)


# ============================================================================
# --- low-latency mode (MoE(..., mode="low_latency", max_tokens_per_rank=M)): each
# local expert's rows arrive as their own fixed block (jax_ep.low_latency), so the
# experts run straight on the receive blocks and combine applies the top-k weights.
# ============================================================================

def _check_mode(mode, max_tokens_per_rank, dispatch_dtype=None):
    if mode not in ("normal", "low_latency"):
        raise ValueError(f"mode must be 'normal' or 'low_latency', got {mode!r}")
    if mode == "low_latency":
        if dispatch_dtype is not None:
            raise NotImplementedError(
                "MoE(mode='low_latency', dispatch_dtype='fp8') is not implemented "
                "(jax_ep/flax.py, low-latency section): jax_ep.low_latency.dispatch(fp8=True) "
                "has no gradient; use dispatch_dtype=None")
        if isinstance(max_tokens_per_rank, bool) or not isinstance(max_tokens_per_rank, int):
            raise TypeError("mode='low_latency' needs max_tokens_per_rank, an int (the "
                            f"tokens per shard the buffers hold), got {max_tokens_per_rank!r}")
        if max_tokens_per_rank < 1:
            raise ValueError(f"max_tokens_per_rank must be >= 1, got {max_tokens_per_rank}")
    elif max_tokens_per_rank is not None:
        raise ValueError("max_tokens_per_rank applies to mode='low_latency' only")


def _low_latency_shard_fn(moe, tok_axes, dtype):
    """The per-shard expert path of the low-latency mode, with `shard_fn`'s signature:
    (y[T, H], psum over the token axes of [slots computed, rows dropped, slots dropped
    at the experts] (the drops always 0))."""
    from jax_ep import low_latency

    def shard_fn(xs, idx, w, wg, wu, wd):
        recv, count, handle = low_latency.dispatch(
            xs, idx, num_experts=moe.num_experts, axis_name=moe.mesh_axis,
            max_tokens_per_rank=moe.max_tokens_per_rank, backend=moe.backend)
        yb = experts.swiglu_blocks(recv, wg.astype(dtype), wu.astype(dtype),
                                   wd.astype(dtype), counts=count)
        y = low_latency.combine(yb.astype(xs.dtype), idx, w, handle, backend=moe.backend)
        computed = jnp.sum(count, dtype=jnp.int32)  # every routed slot has a row
        zero = jnp.zeros((), jnp.int32)
        return y, jax.lax.psum(jnp.stack([computed, zero, zero]), tok_axes)

    return shard_fn
