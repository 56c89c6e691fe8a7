"""The CUDA kernels on the emulated GPU: R virtual GPUs on the CPU running the unchanged
kernel sources and the CUDA backend's own handlers (module `_jax_ep_emu`, kernels/emu).

    emu = Emulator(num_ranks=4, seed=3)
    emu.setup(tokens=T, capacity=C, row_bytes=H * 2, topk=K)
    out = emu.dispatch(x, topk_idx, topk_w, num_experts=E, capacity=C)   # per-rank lists

Inputs and outputs carry a leading rank axis (x[R, T, H], ...). Every call runs the same
handler on every virtual GPU (rank r on GPU r), in one scheduler run, and returns NumPy
arrays plus each rank's handler error and the device error records. Seeds fix the
interleaving; docs/emulator.md describes the model and its limits.
"""
from __future__ import annotations

import importlib
import os
import sys
from typing import Any, Sequence

import ml_dtypes
import numpy as np

_DTYPES = {
    np.dtype(np.float32): "f32",
    np.dtype(ml_dtypes.bfloat16): "bf16",
    np.dtype(np.float16): "f16",
    np.dtype(np.int32): "s32",
    np.dtype(np.bool_): "pred",
    np.dtype(np.uint8): "u8",
    np.dtype(np.int8): "s8",
    np.dtype(ml_dtypes.float8_e4m3fn): "f8e4m3fn",
    np.dtype(ml_dtypes.float8_e5m2): "f8e5m2",
}


def module():
    """The emulated module: from $JAX_EP_EMU_MODULE_DIR when set (a scratch or sanitizer
    build), else the one built with the package."""
    from jax_ep import config
    d = os.environ.get("JAX_EP_EMU_MODULE_DIR")
    if d:
        if d not in sys.path:
            sys.path.insert(0, d)
        mod = importlib.import_module("_jax_ep_emu")
    else:
        try:
            mod = importlib.import_module("jax_ep._jax_ep_emu")
        except ImportError as e:  # pragma: no cover - depends on the build
            raise NotImplementedError(
                "jax_ep was built without the emulated GPU (cmake -DJAX_EP_EMU=ON)") from e
    config.attach(mod)  # its own copy of the kernel settings (jax_ep.config)
    return mod


def _code(dt) -> str:
    dt = np.dtype(dt)
    if dt not in _DTYPES:
        raise ValueError(f"dtype {dt} is not supported by the emulated GPU's buffers")
    return _DTYPES[dt]


class EmuError(RuntimeError):
    """The emulator itself found a fault (deadlock, hang, a bad warp collective)."""


class Emulator:
    """R virtual GPUs, one EP group (rank r on virtual GPU r).

    seed: scheduler and store-buffer seed; resident_blocks: blocks one virtual GPU runs at
    once (None: per kernel, as on a 132-SM H100/H200 from the kernel's ptxas registers and
    shared memory at its launch configuration; docs/emulator.md, "Co-residency");
    timeout_s: the kernels' own timeout, in virtual seconds; weak_stores: stores into
    peers' buffers become visible late (fences and release stores drain them);
    preempt_prob, preempt_ns: after each scheduler step the block that ran is parked (none
    of its threads runs) for preempt_ns virtual nanoseconds with chance preempt_prob (0: off);
    idle_after_ns: once the threads have only polled and slept for this much virtual time,
    their sleeps lengthen (at most timeout_s / 50), so a kernel waiting for a peer that
    never comes reaches its timeout quickly (0: off; docs/emulator.md).
    connections: hardware queues per virtual GPU, 1 to 32; streams share them round-robin
    and a queue issues its commands in order (None: CUDA_DEVICE_MAX_CONNECTIONS, else 8,
    as the driver; docs/emulator.md, "Streams and hardware queues").
    """

    def __init__(self, num_ranks: int, *, seed: int = 1, resident_blocks: int | None = None,
                 timeout_s: float = 0.05, weak_stores: bool = True, group: int = 0,
                 preempt_prob: float = 0.0, preempt_ns: float = 0.0,
                 idle_after_ns: float = 250e3, connections: int | None = None):
        if not 1 <= num_ranks <= 32:
            raise ValueError(f"num_ranks must be in [1, 32], got {num_ranks}")
        if resident_blocks is not None and (isinstance(resident_blocks, bool)
                                            or not isinstance(resident_blocks, int)
                                            or resident_blocks < 1):
            raise ValueError(f"resident_blocks must be None or an int >= 1, got {resident_blocks!r}")
        if connections is not None and (isinstance(connections, bool)
                                        or not isinstance(connections, int)
                                        or not 1 <= connections <= 32):
            raise ValueError(f"connections must be None or an int in [1, 32], got {connections!r}")
        self.m = module()
        self.R = num_ranks
        self.group = group
        self.seed = seed
        # Always at least 8 virtual GPUs: check_errors() and reset() visit every GPU an
        # earlier group in this process used.
        self.m.configure(num_devices=max(num_ranks, 8), seed=seed,
                         resident_blocks=resident_blocks or 0, timeout_s=timeout_s,
                         weak_stores=weak_stores, preempt_prob=preempt_prob,
                         preempt_ns=preempt_ns, idle_after_ns=idle_after_ns,
                         connections=connections or 0)
        self.connections = self.m.num_connections()
        self.m.cuda_reset()

    # ---- group set-up (jax_ep.cuda.setup's work) ----
    def setup(self, *, tokens: int, capacity: int, row_bytes: int, topk: int,
              ll_shape: Sequence[int] | None = None):
        """Buffers for intranode calls up to these shapes; ll_shape = (max_tokens, topk,
        num_experts, row_bytes) adds a low-latency area."""
        a = self.m.cuda_area_bytes(self.R, tokens, capacity, row_bytes, topk)
        areas = [a["dispatch"], a["combine"], a["gather"]]
        ll = []
        if ll_shape is not None:
            M, K, E, rb = ll_shape
            areas.append(self.m.cuda_ll_layout(self.R, M, rb, K, E)["bytes"])
            ll = [M, K, E, rb]
        self.m.setup_group(self.R, self.group, areas, ll)

    # ---- calls ----
    def run(self, op: str, inputs: Sequence[Sequence[np.ndarray]],
            outputs: Sequence[Sequence[tuple]], attrs: dict, *, skip: Sequence[int] = (),
            per_rank_attrs: Sequence[dict] | None = None):
        """One handler call per rank (ranks in `skip` make none), then one scheduler run.

        inputs[r]: arrays; outputs[r]: (shape, dtype). Returns (outs, errors): outs[r] a
        list of arrays (None for a skipped rank), errors[r] the handler's error or "".
        """
        ids = {}
        for r in range(self.R):
            if r in skip:
                continue
            ins = [(np.ascontiguousarray(a).tobytes(), list(np.shape(a)), _code(np.asarray(a).dtype))
                   for a in inputs[r]]
            outs = [(list(s), _code(d)) for s, d in outputs[r]]
            at = dict(attrs)
            if per_rank_attrs is not None:
                at.update(per_rank_attrs[r])
            ids[r] = self.m.enqueue(op, r, ins, outs, {k: int(v) for k, v in at.items()})
        faults = self.m.synchronize()
        if faults:
            raise EmuError(f"emulated GPU (seed {self.seed}): " + "; ".join(faults))
        res, errs = [], []
        for r in range(self.R):
            if r not in ids:
                res.append(None)
                errs.append("")
                continue
            err, blobs = self.m.result(ids[r])
            arrs = [np.frombuffer(b, dtype=np.dtype(d)).reshape(s).copy()
                    for b, (s, d) in zip(blobs, outputs[r])]
            res.append(arrs)
            errs.append(err)
        return res, errs

    def check_errors(self, clear: bool = True) -> list[str]:
        """The device error records of every virtual GPU (jax_ep.cuda.check_errors' text)."""
        return list(self.m.cuda_check_errors(clear))

    def counters(self, device: int | None = None) -> dict[str, int]:
        """What the kernels did since the last reset, counted by the emulated GPU (not
        measured): summed over the virtual GPUs, or those of virtual GPU `device`.
        Names: docs/emulator.md, "Counters"; `summarize` groups them."""
        return counters(device)

    def device_counters(self) -> list[dict[str, int]]:
        """counters(r) for each rank r of this group."""
        return [counters(r) for r in range(self.R)]

    def reset_counters(self):
        self.m.reset_counters()

    def _scalars(self, r):
        return [np.array([r], np.int32), np.array([self.group], np.int32)]

    # ---- ops ----
    def layout(self, topk_idx, *, num_experts: int, num_ranks: int | None = None):
        """topk_idx[R, T, K] -> dict of per_rank[R, Rl], per_expert[R, E], in_rank[R, T, Rl]."""
        Rl = num_ranks or self.R
        T = topk_idx.shape[1]
        outs = [[((Rl,), np.int32), ((num_experts,), np.int32), ((T, Rl), np.bool_)]] * self.R
        res, errs = self.run("layout", [[topk_idx[r]] for r in range(self.R)], outs,
                             dict(num_experts=num_experts, num_ranks=Rl))
        _raise(errs)
        return dict(per_rank=np.stack([o[0] for o in res]),
                    per_expert=np.stack([o[1] for o in res]),
                    in_rank=np.stack([o[2] for o in res]))

    def dispatch(self, x, topk_idx, topk_w, *, num_experts: int, capacity: int,
                 call_sites: Sequence[int] | None = None, skip: Sequence[int] = ()):
        """x[R, T, H], topk_idx/topk_w[R, T, K] -> dict of per-rank outputs (leading R)."""
        R = self.R
        T, H = x.shape[1], x.shape[2]
        K = topk_idx.shape[2]
        C, el = capacity, num_experts // R
        outs = [[((C, H), x.dtype), ((C, K), np.int32), ((C, K), np.float32), ((), np.int32),
                 ((), np.int32), ((el,), np.int32), ((C,), np.int32), ((C,), np.int32),
                 ((T, R), np.int32)]] * R
        ins = [[x[r], topk_idx[r], topk_w[r], *self._scalars(r)] for r in range(R)]
        res, errs = self.run("dispatch", ins, outs,
                             dict(num_experts=num_experts, num_ranks=R, capacity=C, call_site=1),
                             skip=skip, per_rank_attrs=_sites(call_sites, R))
        _raise(errs)
        names = ("recv_x", "recv_idx", "recv_w", "num_recv", "num_dropped", "per_expert",
                 "src_rank", "src_index", "send_row")
        return _stack(res, names)

    def dispatch_pipelined(self, cases, *, num_experts: int, capacity: int):
        """Several dispatches enqueued on every rank before one scheduler run (a rank may
        run ahead into the next call, as on hardware): cases is a list of (x, topk_idx,
        topk_w); returns one result dict per case."""
        R, C, el = self.R, capacity, num_experts // self.R
        ids = []
        for x, idx, w in cases:
            T, H, K = x.shape[1], x.shape[2], idx.shape[2]
            outs = [((C, H), x.dtype), ((C, K), np.int32), ((C, K), np.float32), ((), np.int32),
                    ((), np.int32), ((el,), np.int32), ((C,), np.int32), ((C,), np.int32),
                    ((T, R), np.int32)]
            call = []
            for r in range(R):
                ins = [(np.ascontiguousarray(a).tobytes(), list(np.shape(a)),
                        _code(np.asarray(a).dtype))
                       for a in (x[r], idx[r], w[r], *self._scalars(r))]
                o = [(list(sh), _code(d)) for sh, d in outs]
                call.append((self.m.enqueue("dispatch", r, ins, o,
                                            dict(num_experts=num_experts, num_ranks=R,
                                                 capacity=C, call_site=1)), outs))
            ids.append(call)
        faults = self.m.synchronize()
        if faults:
            raise EmuError(f"emulated GPU (seed {self.seed}): " + "; ".join(faults))
        names = ("recv_x", "recv_idx", "recv_w", "num_recv", "num_dropped", "per_expert",
                 "src_rank", "src_index", "send_row")
        results = []
        for call in ids:
            per_rank, errs = [], []
            for cid, outs in call:
                err, blobs = self.m.result(cid)
                errs.append(err)
                per_rank.append([np.frombuffer(b, dtype=np.dtype(d)).reshape(sh).copy()
                                 for b, (sh, d) in zip(blobs, outs)])
            _raise(errs)
            results.append(_stack(per_rank, names))
        return results

    def combine(self, y, send_row, *, call_sites=None, skip=()):
        """y[R, C, H], send_row[R, T, R] -> out[R, T, H]."""
        R = self.R
        T, H = send_row.shape[1], y.shape[2]
        outs = [[((T, H), y.dtype)]] * R
        ins = [[y[r], send_row[r], *self._scalars(r)] for r in range(R)]
        res, errs = self.run("combine", ins, outs, dict(num_ranks=R, call_site=2), skip=skip,
                             per_rank_attrs=_sites(call_sites, R))
        _raise(errs)
        return _stack(res, ("out",))["out"]

    def gather(self, g, src_rank, src_index, *, call_sites=None, skip=()):
        """g[R, T, H], src_rank/src_index[R, C] -> out[R, C, H]."""
        R = self.R
        C, H = src_rank.shape[1], g.shape[2]
        outs = [[((C, H), g.dtype)]] * R
        ins = [[g[r], src_rank[r], src_index[r], *self._scalars(r)] for r in range(R)]
        res, errs = self.run("gather", ins, outs, dict(num_ranks=R, call_site=3), skip=skip,
                             per_rank_attrs=_sites(call_sites, R))
        _raise(errs)
        return _stack(res, ("out",))["out"]

    # ---- the virtual-rank harness (jax_ep.cuda.harness_*): every rank on virtual GPU 0 ----
    def _harness(self, op, ins, outs, attrs, call_sites, concurrent, absent_rank):
        R = ins[0].shape[0]
        sites = [1] * R if call_sites is None else [int(c) for c in call_sites]
        at = dict(attrs, concurrent=int(bool(concurrent)), absent_rank=int(absent_rank))
        return self._on_gpu0(op, ins, outs, at, {"call_sites": sites})

    def _on_gpu0(self, op, ins, outs, attrs, array_attrs=None):
        """One handler call on virtual GPU 0, then one scheduler run; its outputs."""
        cid = self.m.enqueue(
            op, 0, [(np.ascontiguousarray(a).tobytes(), list(np.shape(a)),
                     _code(np.asarray(a).dtype)) for a in ins],
            [(list(sh), _code(d)) for sh, d in outs], {k: int(v) for k, v in attrs.items()},
            array_attrs or {})
        faults = self.m.synchronize()
        err, blobs = self.m.result(cid)
        if faults:
            raise EmuError(f"emulated GPU (seed {self.seed}): " + "; ".join(faults))
        if err:
            raise ValueError(err)
        return [np.frombuffer(b, dtype=np.dtype(d)).reshape(sh).copy()
                for b, (sh, d) in zip(blobs, outs)]

    def harness_dispatch(self, x, topk_idx, topk_w, *, num_experts: int, capacity: int,
                         call_sites=None, concurrent: bool = True, absent_rank: int = -1):
        """The harness's dispatch of R = x.shape[0] ranks on virtual GPU 0 (one handler
        call, every rank's kernels on its own stream): x[R, T, H], topk_idx/topk_w[R, T, K]
        -> the per-rank outputs with a leading R, named as dispatch's."""
        R, T, H = x.shape
        K, C, el = topk_idx.shape[2], capacity, num_experts // R
        outs = [((R, C, H), x.dtype), ((R, C, K), np.int32), ((R, C, K), np.float32),
                ((R,), np.int32), ((R,), np.int32), ((R, el), np.int32), ((R, C), np.int32),
                ((R, C), np.int32), ((R, T, R), np.int32)]
        res = self._harness("harness_dispatch", [x, topk_idx, topk_w], outs,
                            dict(num_experts=num_experts, capacity=C), call_sites, concurrent,
                            absent_rank)
        names = ("recv_x", "recv_idx", "recv_w", "num_recv", "num_dropped", "per_expert",
                 "src_rank", "src_index", "send_row")
        return dict(zip(names, res))

    def harness_combine(self, y, send_row, *, call_sites=None, concurrent: bool = True,
                        absent_rank: int = -1):
        """y[R, C, H], send_row[R, T, R] -> out[R, T, H] through the harness."""
        R, _, H = y.shape
        outs = [((R, send_row.shape[1], H), y.dtype)]
        return self._harness("harness_combine", [y, send_row], outs, {}, call_sites,
                             concurrent, absent_rank)[0]

    def harness_gather(self, g, src_rank, src_index, *, call_sites=None,
                       concurrent: bool = True, absent_rank: int = -1):
        """g[R, T, H], src_rank/src_index[R, C] -> out[R, C, H] through the harness."""
        R, _, H = g.shape
        outs = [((R, src_rank.shape[1], H), g.dtype)]
        return self._harness("harness_gather", [g, src_rank, src_index], outs, {}, call_sites,
                             concurrent, absent_rank)[0]

    # ---- the low-latency harness (jax_ep.low_latency.harness_*): every rank on GPU 0 ----
    def ll_harness_dispatch(self, x, topk_idx, *, num_experts: int, max_tokens: int):
        """x[R, M, H], topk_idx[R, M, K] (M = max_tokens; pad unused slots with -1) ->
        dict of recv_x[R, E_l, R * M, H], recv_count[R, E_l], src_rank, src_index
        [R, E_l, R * M], first_row, row_count [R, E_l, R]: the send half for every rank,
        then the receive half, each one handler call on one stream."""
        R, M, H = x.shape
        if M != max_tokens:
            raise ValueError(f"x must hold max_tokens = {max_tokens} rows per rank, got {M}")
        el = num_experts // R
        at = dict(num_experts=num_experts, max_tokens=max_tokens, topk_max=topk_idx.shape[2])
        tok = self._on_gpu0("ll_harness_dispatch_send", [x, topk_idx], [((R,), np.int32)], at)
        res = self._on_gpu0("ll_harness_dispatch_recv", tok,
                            [((R, el, R * M, H), x.dtype), ((R, el), np.int32),
                             ((R, el, R * M), np.int32), ((R, el, R * M), np.int32),
                             ((R, el, R), np.int32), ((R, el, R), np.int32)], at)
        names = ("recv_x", "recv_count", "src_rank", "src_index", "first_row", "row_count")
        return dict(zip(names, res))

    def ll_harness_combine(self, y, topk_idx, topk_w, first_row, row_count, *,
                           num_experts: int, max_tokens: int):
        """y[R, E_l, R * M, H] with the dispatch's first_row/row_count, topk_idx/topk_w
        [R, M, K] -> out[R, M, H]."""
        R, M, K = topk_idx.shape
        at = dict(num_experts=num_experts, max_tokens=max_tokens, topk_max=K)
        tok = self._on_gpu0("ll_harness_combine_send", [y, first_row, row_count],
                            [((R,), np.int32)], at)
        return self._on_gpu0("ll_harness_combine_recv", [tok[0], topk_idx, topk_w],
                             [((R, M, y.shape[-1]), y.dtype)], at)[0]

    # ---- low-latency mode (real ranks: the send and receive halves) ----
    def ll_dispatch_send(self, x, topk_idx, *, num_experts: int, max_tokens: int,
                         call_sites=None, skip=()):
        """x[R, S, H], topk_idx[R, S, K] -> the send halves' outputs (stage_x placeholder,
        stage_idx holding the epoch, expert_count[R, E])."""
        R, S, H = x.shape
        K = topk_idx.shape[2]
        outs = [[((0, H), x.dtype), ((S, K), np.int32), ((num_experts,), np.int32)]] * R
        res, errs = self.run("ll_dispatch_send", [[x[r], topk_idx[r]] for r in range(R)], outs,
                             dict(num_experts=num_experts, num_ranks=R, max_tokens=max_tokens,
                                  call_site=1), skip=skip, per_rank_attrs=_sites(call_sites, R))
        _raise(errs)
        return _stack(res, ("stage_x", "stage_idx", "expert_count"))

    def ll_dispatch_recv(self, sent, *, num_experts: int, max_tokens: int, H: int, dtype,
                         call_sites=None, skip=()):
        """The receive halves of `sent` (ll_dispatch_send's result) -> recv_x[R, E_l, R*M,
        H], recv_count, src_rank, src_index, first_row, row_count (leading R)."""
        R, M = self.R, max_tokens
        el = num_experts // R
        outs = [[((el, R * M, H), dtype), ((el,), np.int32), ((el, R * M), np.int32),
                 ((el, R * M), np.int32), ((el, R), np.int32), ((el, R), np.int32)]] * R
        ins = [[sent["stage_x"][r], sent["stage_idx"][r], sent["expert_count"][r],
                *self._scalars(r)] if sent["stage_idx"][r] is not None else []
               for r in range(R)]
        res, errs = self.run("ll_dispatch_recv", ins, outs,
                             dict(num_experts=num_experts, num_ranks=R, max_tokens=M,
                                  call_site=1), skip=skip, per_rank_attrs=_sites(call_sites, R))
        _raise(errs)
        return _stack(res, ("recv_x", "recv_count", "src_rank", "src_index", "first_row",
                            "row_count"))

    def ll_dispatch_send_fp8(self, x, topk_idx, *, num_experts: int, max_tokens: int,
                             round_scale: bool = False, call_sites=None, skip=()):
        """x[R, S, H] cast to FP8 in the send kernel, one message per (token, expert) ->
        the send halves' outputs (stage_x placeholder [0, bytes] uint8, stage_idx holding
        the epoch, expert_count[R, E])."""
        R, S, H = x.shape
        K = topk_idx.shape[2]
        W = (H + 4 * (H // 128) + 15) // 16 * 16
        outs = [[((0, W), np.uint8), ((S, K), np.int32), ((num_experts,), np.int32)]] * R
        res, errs = self.run("ll_dispatch_send_fp8", [[x[r], topk_idx[r]] for r in range(R)],
                             outs, dict(num_experts=num_experts, num_ranks=R,
                                        max_tokens=max_tokens, call_site=1,
                                        round_scale=int(bool(round_scale))),
                             skip=skip, per_rank_attrs=_sites(call_sites, R))
        _raise(errs)
        return _stack(res, ("stage_x", "stage_idx", "expert_count"))

    def ll_dispatch_recv_fp8(self, sent, *, num_experts: int, max_tokens: int, H: int,
                             call_sites=None, skip=()):
        """The receive halves of ll_dispatch_send_fp8 -> recv_x float8_e4m3fn [R, E_l, R*M,
        H], recv_scales float32 [R, E_l, R*M, H // 128], then as ll_dispatch_recv."""
        R, M = self.R, max_tokens
        el = num_experts // R
        f8 = np.dtype(ml_dtypes.float8_e4m3fn)
        outs = [[((el, R * M, H), f8), ((el, R * M, H // 128), np.float32), ((el,), np.int32),
                 ((el, R * M), np.int32), ((el, R * M), np.int32), ((el, R), np.int32),
                 ((el, R), np.int32)]] * R
        ins = [[sent["stage_x"][r], sent["stage_idx"][r], sent["expert_count"][r],
                *self._scalars(r)] if sent["stage_idx"][r] is not None else []
               for r in range(R)]
        res, errs = self.run("ll_dispatch_recv_fp8", ins, outs,
                             dict(num_experts=num_experts, num_ranks=R, max_tokens=M,
                                  call_site=1), skip=skip, per_rank_attrs=_sites(call_sites, R))
        _raise(errs)
        return _stack(res, ("recv_x", "recv_scales", "recv_count", "src_rank", "src_index",
                            "first_row", "row_count"))

    def ll_combine_send(self, y, first_row, row_count, *, max_tokens: int, rows_per_dest: int,
                        call_sites=None, skip=()):
        """y[R, E_l, R*M, H] and the handle -> (stage placeholder, status with the epoch)."""
        R, H = self.R, y.shape[-1]
        outs = [[((R, 0, H), y.dtype), ((), np.int32)]] * R
        ins = [[y[r], first_row[r], row_count[r]] for r in range(R)]
        res, errs = self.run("ll_combine_send", ins, outs,
                             dict(num_ranks=R, max_tokens=max_tokens, rows_per_dest=rows_per_dest,
                                  call_site=2), skip=skip, per_rank_attrs=_sites(call_sites, R))
        _raise(errs)
        return _stack(res, ("stage", "status"))

    def ll_combine_recv(self, sent, topk_idx, topk_w, *, num_experts: int, max_tokens: int,
                        call_sites=None, skip=()):
        """The receive halves: topk_idx/topk_w[R, S, K] -> out[R, S, H]."""
        R = self.R
        S = topk_idx.shape[1]
        H = sent["stage"][0].shape[-1] if sent["stage"][0] is not None else sent["stage"][1].shape[-1]
        dt = next(s for s in sent["stage"] if s is not None).dtype
        outs = [[((S, H), dt)]] * R
        ins = [[sent["stage"][r], sent["status"][r], topk_idx[r], topk_w[r], *self._scalars(r)]
               if sent["status"][r] is not None else [] for r in range(R)]
        res, errs = self.run("ll_combine_recv", ins, outs,
                             dict(num_experts=num_experts, num_ranks=R, max_tokens=max_tokens,
                                  call_site=2), skip=skip, per_rank_attrs=_sites(call_sites, R))
        _raise(errs)
        return _stack(res, ("out",))["out"]


# ------------------------------------------------------------------------------ counters

def counters(device: int | None = None) -> dict[str, int]:
    """The emulated GPU's counters since the last reset (counts, not measurements):
    totals over every virtual GPU, or one virtual GPU's (device >= 0)."""
    m = module()
    if device is not None and not 0 <= device < max(m.num_counted_devices(), 1):
        raise ValueError(f"device must name a virtual GPU in [0, {m.num_counted_devices()}), "
                         f"got {device}")
    return dict(m.counters(-1 if device is None else int(device)))


def reset_counters():
    module().reset_counters()


class counting:
    """`with counting() as c:` resets the counters; on exit c.total holds the totals and
    c.per_device the counters of each virtual GPU that has any (counted, not measured)."""

    def __enter__(self):
        reset_counters()
        self.total: dict[str, int] = {}
        self.per_device: list[dict[str, int]] = []
        return self

    def __exit__(self, *exc):
        self.total = counters()
        self.per_device = [counters(d) for d in range(module().num_counted_devices())]
        return False


def summarize(c: dict[str, int]) -> dict[str, Any]:
    """Groups flat counters: kernels {name: launches, blocks, warps, threads_per_block},
    bytes {load|store: {local|peer: {width: bytes}}}, puts {rdma|peer: puts, bytes,
    signals, wrs}, qps {q: puts, bytes, signals, wrs}, and the scalars (fences by scope,
    release stores, acquire loads, polls, sleeps, atomics)."""
    out: dict[str, Any] = {"kernels": {}, "bytes": {"load": {}, "store": {}}, "puts": {},
                           "qps": {}, "fences": {}}
    for k, v in sorted(c.items()):
        parts = k.split(":")
        if parts[0] == "kernel" and len(parts) >= 3:  # a template name may hold "::"
            name, field = k[len("kernel:"):].rsplit(":", 1)
            out["kernels"].setdefault(name, {})[field] = v
        elif parts[0] in ("load_bytes", "store_bytes") and len(parts) == 3:
            d = out["bytes"]["load" if parts[0] == "load_bytes" else "store"]
            d.setdefault(parts[1], {})[int(parts[2])] = v
        elif parts[0] in ("puts", "put_bytes", "signals", "wrs") and len(parts) == 2:
            name = "bytes" if parts[0] == "put_bytes" else parts[0]
            out["puts"].setdefault(parts[1], {})[name] = v
        elif parts[0] == "nvshmem" and len(parts) == 3 and parts[1].startswith("qp"):
            out["qps"].setdefault(int(parts[1][2:]), {})[parts[2]] = v
        elif parts[0] == "fences" and len(parts) == 2:
            out["fences"][parts[1]] = v
        elif len(parts) == 1:
            out[k] = v
    for kv in out["kernels"].values():
        if kv.get("blocks"):
            kv["threads_per_block"] = kv.get("threads", 0) // kv["blocks"]
    return out


_standard_nodes: dict = {}


def standard_node(gpus: int, ports: int) -> str:
    """A sysfs tree of the standard node (jax_ep.network.fixtures.standard), written once
    per process into a temporary folder."""
    key = (gpus, ports)
    if key not in _standard_nodes:
        import tempfile

        from jax_ep.network import fixtures
        root = tempfile.mkdtemp(prefix=f"jax_ep_node_g{gpus}_p{ports}_")
        _standard_nodes[key] = fixtures.standard(root, gpus, ports)
    return _standard_nodes[key]


class EmulatedFabric:
    """The node every emulated node is, and the NVSHMEM_* environment each PE starts with,
    for the emulated NVSHMEM (nvshmem_emu.h set_fabric).

    sysfs: a node's tree (default: the standard node, one HCA of num_ports ports per GPU);
    env_for(fabric, cfg) -> dict: a PE's NVSHMEM variables from its GPU's Fabric (default:
    what the bootstrap sets, jax_ep.network.fabric.nvshmem_env_for); lag_affinity: the
    QPs of bonded devices carry a LAG TX affinity (the shim's, as the bootstrap arms it).
    `own_ports[pe]`: the wire ports of that PE's GPU's own NIC (ports, or bond members),
    in the plan's order: the log's port column is a put's place in them (-1: elsewhere).
    """

    def __init__(self, num_pes: int, gpus_per_node: int, cfg, *, sysfs: str | None = None,
                 env_for=None, lag_affinity: bool = True):
        from jax_ep.network import fabric as fb

        root = sysfs or standard_node(gpus_per_node, cfg.num_ports)
        gpus = fb.node_gpus(root)
        if len(gpus) < gpus_per_node:
            raise ValueError(f"the node under {root} has {len(gpus)} GPUs, fewer than "
                             f"gpus_per_node={gpus_per_node}")
        gpus = gpus[:gpus_per_node]
        env_for = env_for or fb.nvshmem_env_for
        devices = fb.discover(root).devices
        node = fb.nvshmem_node(root, devices, gpus)
        bonds = {d.name: d.bond.slaves for d in devices if d.bond and len(d.bond.slaves) > 1}
        lines = []
        for name, path, numa, ports in node["devices"]:
            pts = ",".join(f"{n}:{int(a)}:{int(r)}" for n, a, r in ports)
            lines.append(f"dev {name} {numa} {path} {pts}" +
                         (f" {','.join(bonds[name])}" if name in bonds else ""))
        for path, numa in zip(node["gpu_paths"], node["gpu_numa"]):
            lines.append(f"gpu {numa} {path}")
        self.gpus, self.fabrics, self.own_ports, self.env = gpus, [], [], []
        for g in gpus:
            f = fb.discover(root, g)
            self.fabrics.append(f)
            if f.fabric_class == "roce-lag" and f.bond:
                self.own_ports.append(list(f.bond.slaves))
            else:
                self.own_ports.append([f"{d}:{p}" for d, p in sorted(f.selected)])
        for pe in range(num_pes):
            env = dict(env_for(self.fabrics[pe % gpus_per_node], cfg))
            self.env.append(env)
            lines.append(f"env {pe} " + ";".join(f"{k}={v}" for k, v in sorted(env.items())))
        lines.append(f"lag_affinity {int(lag_affinity)}")
        self.sysfs, self.G = root, gpus_per_node
        self.text = "\n".join(lines) + "\n"

    def port_index(self, src: int, name: str) -> int:
        """The place of wire port `name` among PE src's own NIC ports, -1 if not one."""
        own = self.own_ports[src % self.G]
        return own.index(name) if name in own else -1


class InternodeEmulator:
    """The internode (NVSHMEM) modes' handlers on the emulated GPU: R virtual GPUs, one
    emulated NVSHMEM PE each, G per node (a driver for counting and benchmarks; the tests'
    tests/emu/internode_emu_util.py adds the reference oracle). Modes: "direct",
    "hierarchical"; low latency through ll_init and the ll_* halves."""

    _PREFIX = {"direct": "internode_", "hierarchical": "internode_hier_"}

    def __init__(self, R: int, *, gpus_per_node: int = 1, num_ports: int = 2,
                 qps_per_port: int = 1, chunk_bytes: int = 4096, seed: int = 1,
                 max_delay: int = 32, heap_mib: int = 16, resident_blocks: int = 16,
                 timeout_s: float = 0.05):
        self.R, self.G, self.P, self.Q, self.chunk = R, gpus_per_node, num_ports, qps_per_port, chunk_bytes
        self.emu = Emulator(R, seed=seed, resident_blocks=resident_blocks, timeout_s=timeout_s)
        self.calls = 0
        world = dict(num_pes=R, gpus_per_node=gpus_per_node, num_ports=num_ports,
                     qps_per_port=qps_per_port, seed=seed, max_delay=max_delay, qp_api=1)
        _, errs = self.emu.run("internode_world", [[]] * R, [[]] * R, world, skip=range(1, R))
        _raise(errs)
        from jax_ep.network.transport import TransportConfig
        self.fabric = EmulatedFabric(R, gpus_per_node, TransportConfig(
            num_ports=num_ports, qps_per_port=qps_per_port))
        err = self.emu.m.nvshmem_set_fabric(self.fabric.text)
        if err:
            raise RuntimeError(err)
        init = dict(num_pes=R, heap_bytes=(32 << 20) + (heap_mib << 20),
                    num_qps=num_ports * qps_per_port, qp_api=1)
        _, errs = self.emu.run("internode_init", [[]] * R, [[]] * R, init)
        _raise(errs)

    def _call(self, op, ins, outs, attrs):
        self.calls += 1
        self.emu.run("internode_call_tag", [[]] * self.R, [[]] * self.R, dict(call=self.calls),
                     skip=range(1, self.R))
        res, errs = self.emu.run(op, ins, outs, attrs,
                                 per_rank_attrs=[dict(rank=r) for r in range(self.R)])
        _raise(errs)
        return res

    def _attrs(self, **kw):
        return dict(num_ranks=self.R, num_ports=self.P, qps_per_port=self.Q,
                    chunk_bytes=self.chunk, call_site=0, gpus_per_node=self.G, **kw)

    def dispatch(self, x, idx, w, *, num_experts: int, capacity: int, mode: str = "direct"):
        """x[R, T, H], idx/w[R, T, K] -> per-rank dicts (recv_x, ..., counts, send_slot)."""
        R, T, H = x.shape
        K, C, el = idx.shape[2], capacity, num_experts // R
        names = ("recv_x", "recv_idx", "recv_w", "num_recv", "num_dropped", "per_expert",
                 "src_rank", "src_index", "counts", "send_slot")
        shapes = ((C, H), (C, K), (C, K), (), (), (el,), (C,), (C,), (R, R), (T, R))
        dts = (x.dtype, np.int32, np.float32) + (np.int32,) * 7
        res = self._call(self._PREFIX[mode] + "dispatch",
                         [[x[r], idx[r].astype(np.int32), w[r].astype(np.float32)] for r in range(R)],
                         [list(zip(shapes, dts))] * R,
                         self._attrs(num_experts=num_experts, capacity=C))
        return [dict(zip(names, o)) for o in res]

    def combine(self, y, d, *, topk: int, mode: str = "direct"):
        """y[R, C, H] and dispatch's per-rank dicts -> out[R, T, H]."""
        R, C, H = y.shape
        T = d[0]["send_slot"].shape[0]
        ins = [[y[r], d[r]["counts"], d[r]["send_slot"]]
               + ([d[r]["src_index"]] if mode != "direct" else []) for r in range(R)]
        res = self._call(self._PREFIX[mode] + "combine", ins, [[((T, H), y.dtype)]] * R,
                         self._attrs(capacity=C, topk=topk))
        return np.stack([o[0] for o in res])

    # ---- low-latency mode ----
    def ll_init(self, *, max_tokens: int, row_bytes: int, topk: int, num_experts: int):
        _, errs = self.emu.run("internode_ll_init", [[]] * self.R, [[]] * self.R,
                               dict(num_ranks=self.R, max_tokens=max_tokens,
                                    row_bytes=row_bytes, topk=topk, num_experts=num_experts))
        _raise(errs)
        self.ll = dict(num_experts=num_experts, max_tokens=max_tokens)

    def _ll(self, op, ins, outs, **attrs):
        a = dict(num_ranks=self.R, num_ports=self.P, qps_per_port=self.Q, call_site=0, **self.ll)
        a.update(attrs)
        return self._call("internode_ll_" + op, ins, outs, a)

    def ll_round(self, x, idx, w, y, *, topk: int, phases=None, fp8: bool = False):
        """One low-latency dispatch and combine (send, then receive halves); phases, if a
        dict, gets each half's counters per rank (reset before each half). fp8: the
        dispatch sends FP8 messages (values and 1 x 128 scales, cast in the send kernel;
        H a multiple of 128), the combine the rows of y as they are."""
        R, S, H = x.shape
        E, M = self.ll["num_experts"], self.ll["max_tokens"]
        el = E // R

        def phase(name, f):
            if phases is not None:
                reset_counters()
            out = f()
            if phases is not None:
                phases[name] = [counters(r) for r in range(R)]
            return out

        sfx = "_fp8" if fp8 else ""
        tok = phase("dispatch_send", lambda: self._ll(
            "dispatch_send" + sfx, [[x[r], idx[r]] for r in range(R)],
            [[((2,), np.int32)]] * R, **({"round_scale": 0} if fp8 else {})))
        names = ("recv_x", "recv_count", "src_rank", "src_index", "first_row", "row_count")
        shapes = ((el, R * M, H), (el,), (el, R * M), (el, R * M), (el, R), (el, R))
        dts = (x.dtype,) + (np.int32,) * 5
        if fp8:
            import ml_dtypes
            names = names[:1] + ("recv_scales",) + names[1:]
            shapes = shapes[:1] + ((el, R * M, H // 128),) + shapes[1:]
            dts = (np.dtype(ml_dtypes.float8_e4m3fn), np.float32) + dts[1:]
        outs = [list(zip(shapes, dts))] * R
        d = phase("dispatch_recv", lambda: [dict(zip(names, o)) for o in self._ll(
            "dispatch_recv" + sfx, [[t[0]] for t in tok], outs)])
        rpd = M * min(topk, el)
        tok = phase("combine_send", lambda: self._ll(
            "combine_send", [[y[r], d[r]["first_row"], d[r]["row_count"]] for r in range(R)],
            [[((2,), np.int32)]] * R, rows_per_dest=rpd))
        out = phase("combine_recv", lambda: self._ll(
            "combine_recv", [[tok[r][0], idx[r], w[r]] for r in range(R)],
            [[((S, H), x.dtype)]] * R))
        return d, np.stack([o[0] for o in out])


def _sites(call_sites, R):
    if call_sites is None:
        return None
    if len(call_sites) != R:
        raise ValueError(f"call_sites must list one id per rank ({R}), got {len(call_sites)}")
    return [dict(call_site=int(c)) for c in call_sites]


def _raise(errs):
    bad = [f"rank {r}: {e}" for r, e in enumerate(errs) if e]
    if bad:
        raise ValueError("; ".join(bad))


def _stack(res, names) -> dict[str, Any]:
    out = {}
    for i, n in enumerate(names):
        vals = [None if o is None else o[i] for o in res]
        if any(v is None for v in vals):
            out[n] = vals
        else:
            out[n] = np.stack(vals)
    return out
