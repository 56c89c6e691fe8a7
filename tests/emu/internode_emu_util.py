"""The internode (NVSHMEM) kernels on the emulated GPU, for the tests: R virtual GPUs, one
emulated NVSHMEM PE each, running the direct and hierarchical modes' own FFI handlers
(xla_ffi/internode/emu_direct.cc, emu_hier.cc) through `jax_ep._src.emu.Emulator.run`, and
the reference backend (jax_ep._src.backends.reference under shard_map) as the oracle.

Arrays carry a leading rank axis: x[R, T, H], topk_idx/topk_weights[R, T, K], y[R, C, H].
"""
from __future__ import annotations

import functools

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

import jax_ep
from jax_ep._src.common import Cfg
from jax_ep._src.backends import reference as ref_backend
from jax_ep._src.emu import Emulator, EmuError, EmulatedFabric  # noqa: F401  (re-exported)
from jax_ep.network.transport import TransportConfig

# Emulated heap: the slack the layout reserves plus room for both modes' halves.
HEAP_SLACK = 32 << 20
LOG_COLS = ("src", "dst", "qp", "port", "handle", "bytes", "sig_op", "call", "block")
SIGNAL_SET, SIGNAL_ADD = 0, 5  # NVSHMEM_SIGNAL_SET / _ADD in nvshmem_emu.h (-1: no signal)
MODES = {"direct": "internode_", "hierarchical": "internode_hier_",
         "hierarchical_small_rings": "internode_hier_small_"}
# The transport an InternodeEmu runs on when not told (the matrix modules parametrize it
# with ids `nvshmem` and `nccl`: tests/conftest.py `transport`).
TRANSPORTS = ("nvshmem", "nccl")
DEFAULT = {"transport": "nvshmem"}
NCCL_LOG_COLS = ("src", "dst", "context", "port", "devcomm", "block", "bytes", "kind", "call",
                 "done", "sig_off")
# nccl_emu.h LogKind
NCCL_PUT, NCCL_PUT_STRONG, NCCL_PUT_WEAK, NCCL_SIGNAL_STRONG, NCCL_SIGNAL_WEAK = range(5)


class InternodeEmu:
    """An emulated NVSHMEM world of R PEs (G per node) and the internode kernels on it.

    num_ports, qps_per_port, chunk_bytes: the TransportConfig of every call; max_delay:
    transport steps an operation may wait before delivery; qp_api: explicit QP handles
    (False: NVSHMEM's own QP choice). seed fixes both the scheduler and the transport.
    sysfs, env_for, lag_affinity: the node and the NVSHMEM environment of each PE
    (jax_ep._src.emu.EmulatedFabric; default the standard node with what the bootstrap
    sets), from which the emulated NVSHMEM places every QP handle on a wire port.
    default_handles: nvshmemx_qp_create returns NVSHMEMX_QP_DEFAULT for every handle.
    transport: "nvshmem" or "nccl" (default DEFAULT["transport"]): over NCCL GIN the world
    is an emulated NCCL one (kernels/emu/nccl_emu.h) started by `gpus_per_process` GPUs
    per process, as one JAX process drives its local devices (1: a process per GPU);
    max_contexts: GIN contexts the emulated NCCL grants a device communicator at most;
    low_latency: dict(max_tokens, row_bytes, topk, num_experts) of a low-latency area made
    at the NCCL start, in the window past the heap halves (no ll_init then).
    """

    def __init__(self, R, *, gpus_per_node=1, num_ports=2, qps_per_port=1, chunk_bytes=256,
                 seed=1, max_delay=32, qp_api=True, heap_mib=4, resident_blocks=16,
                 timeout_s=0.05, preempt_prob=0.0, preempt_ns=0.0, idle_after_ns=250e3,
                 sysfs=None, env_for=None, lag_affinity=True, default_handles=False,
                 transport=None, gpus_per_process=1, max_contexts=None, low_latency=None):
        self.R, self.G = R, gpus_per_node
        self.P, self.Q, self.chunk = num_ports, qps_per_port, chunk_bytes
        self.qp_api = qp_api
        self.seed = seed
        self.transport = transport or DEFAULT["transport"]
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {self.transport!r}")
        self.emu = Emulator(R, seed=seed, resident_blocks=resident_blocks, timeout_s=timeout_s,
                            preempt_prob=preempt_prob, preempt_ns=preempt_ns,
                            idle_after_ns=idle_after_ns)
        self.calls = 0
        if self.transport == "nccl":
            self._start_nccl(gpus_per_process, max_delay, heap_mib, max_contexts, sysfs,
                             low_latency)
            return
        world = dict(num_pes=R, gpus_per_node=gpus_per_node, num_ports=num_ports,
                     qps_per_port=qps_per_port, seed=seed, max_delay=max_delay,
                     qp_api=int(qp_api), default_handles=int(default_handles))
        _, errs = self.emu.run("internode_world", [[]] * R, [[]] * R, world,
                               skip=range(1, R))
        self._raise(errs)
        self.fabric = EmulatedFabric(
            R, gpus_per_node, TransportConfig(num_ports=num_ports, qps_per_port=qps_per_port),
            sysfs=sysfs, env_for=env_for, lag_affinity=lag_affinity)
        err = self.emu.m.nvshmem_set_fabric(self.fabric.text)
        if err:
            raise RuntimeError(err)
        init = dict(num_pes=R, heap_bytes=HEAP_SLACK + (heap_mib << 20),
                    num_qps=num_ports * qps_per_port, qp_api=int(qp_api))
        _, errs = self.emu.run("internode_init", [[]] * R, [[]] * R, init)
        self._raise(errs)

    def _start_nccl(self, per_process, max_delay, heap_mib, max_contexts, sysfs, ll):
        """A fresh emulated NCCL world, then one start per emulated process: the process of
        GPUs [p, p + per_process) makes its communicators in one group and the internode
        runtime on each (internode::StartOverNccl), as jax_ep.nccl_bootstrap does."""
        R = self.R
        if per_process < 1 or R % per_process:
            raise ValueError(f"gpus_per_process={per_process} must divide R={R}")
        self.gpus_per_process = per_process
        one = dict(skip=range(1, R))
        world = dict(num_ranks=R, gpus_per_node=self.G, seed=self.seed, max_delay=max_delay)
        if max_contexts is not None:
            world["max_contexts"] = max_contexts
        _, errs = self.emu.run("internode_nccl_world", [[]] * R, [[]] * R, world, **one)
        self._raise(errs)
        res, errs = self.emu.run("internode_nccl_uid", [[]] * R, [[((128,), np.uint8)]] * R,
                                 {}, **one)
        self._raise(errs)
        uid = res[0][0]
        self.heap_bytes = HEAP_SLACK + (heap_mib << 20)
        start = dict(world=R, local=per_process, heap_bytes=self.heap_bytes,
                     num_qps=self.P * self.Q, gpus_per_node=self.G)
        if ll is not None:
            start.update({"ll_" + k: ll[k] for k in ("max_tokens", "row_bytes", "topk",
                                                       "num_experts")})
            self.ll = dict(num_experts=ll["num_experts"], max_tokens=ll["max_tokens"])
        _, errs = self.emu.run("internode_nccl_start", [[uid]] * R, [[]] * R, start,
                               skip=[r for r in range(R) if r % per_process])
        self._raise(errs)
        # Each rank's GIN contexts on its NIC's ports, as NCCL places them (the C++ rule,
        # nccl_select.h, through jax_ep.network.fabric.nccl_selection) with what the
        # bootstrap sets: the log's port is the context's place among its GPU's own ports.
        self.fabric = NcclFabric(R, self.G, TransportConfig(num_ports=self.P,
                                                            qps_per_port=self.Q),
                                 sysfs=sysfs)
        ports = np.array(self.fabric.context_ports, np.int32)
        _, errs = self.emu.run("internode_nccl_ports", [[ports]] * R, [[]] * R, {}, **one)
        self._raise(errs)

    def _raise(self, errs):
        bad = [f"rank {r}: {e}" for r, e in enumerate(errs) if e]
        if bad:
            raise RuntimeError("; ".join(bad))

    def _attrs(self, **kw):
        a = dict(num_ranks=self.R, num_ports=self.P, qps_per_port=self.Q,
                 chunk_bytes=self.chunk, call_site=kw.pop("call_site", 0),
                 gpus_per_node=self.G)
        a.update(kw)
        return a

    def _tag(self):
        self.calls += 1
        self.emu.run("internode_call_tag", [[]] * self.R, [[]] * self.R,
                     dict(call=self.calls), skip=range(1, self.R))

    def _run(self, op, mode, ins, outs, attrs, skip, per_rank_attrs=None):
        self._tag()
        pra = [{"rank": r, **(per_rank_attrs[r] if per_rank_attrs else {})}
               for r in range(self.R)]
        return self.emu.run(MODES[mode] + op, ins, outs, attrs, skip=skip, per_rank_attrs=pra)

    def dispatch(self, x, idx, w, *, num_experts, capacity, mode="direct", skip=(),
                 per_rank_attrs=None):
        """Returns (outs, errors): outs[r] a dict of the ten dispatch results (None for a
        skipped rank), errors[r] the handler's error text ("" if none)."""
        R, T, H = x.shape
        K = idx.shape[2]
        C, el = capacity, num_experts // R
        names = ("recv_x", "recv_idx", "recv_w", "num_recv", "num_dropped", "per_expert",
                 "src_rank", "src_index", "counts", "send_slot")
        shapes = ((C, H), (C, K), (C, K), (), (), (el,), (C,), (C,), (R, R), (T, R))
        dts = (x.dtype, np.int32, np.float32) + (np.int32,) * 7
        outs = [list(zip(shapes, dts))] * R
        ins = [[x[r], idx[r].astype(np.int32), w[r].astype(np.float32)] for r in range(R)]
        res, errs = self._run("dispatch", mode, ins, outs,
                              self._attrs(num_experts=num_experts, capacity=C), skip,
                              per_rank_attrs)
        return [None if o is None else dict(zip(names, o)) for o in res], errs

    def combine(self, y, counts, send_slot, *, topk, src_index=None, mode="direct", skip=()):
        R, C, H = y.shape
        T = send_slot.shape[1]
        ins = [[y[r], counts[r], send_slot[r]] + ([src_index[r]] if mode != "direct" else [])
               for r in range(R)]
        outs = [[((T, H), y.dtype)]] * R
        res, errs = self._run("combine", mode, ins, outs,
                              self._attrs(capacity=C, topk=topk), skip)
        return [None if o is None else o[0] for o in res], errs

    def gather(self, g, counts, send_slot, *, capacity, topk, mode="direct", skip=()):
        R, T, H = g.shape
        ins = [[g[r], counts[r], send_slot[r]] for r in range(R)]
        outs = [[((capacity, H), g.dtype)]] * R
        res, errs = self._run("gather", mode, ins, outs,
                              self._attrs(capacity=capacity, topk=topk), skip)
        return [None if o is None else o[0] for o in res], errs

    # ---- low-latency mode (send and receive halves; shapes as jax_ep.low_latency) ----
    def ll_init(self, *, max_tokens, row_bytes, topk, num_experts):
        """The low-latency area on every PE (the bootstrap's low_latency= start)."""
        _, errs = self.emu.run("internode_ll_init", [[]] * self.R, [[]] * self.R,
                               dict(num_ranks=self.R, max_tokens=max_tokens,
                                    row_bytes=row_bytes, topk=topk, num_experts=num_experts))
        self._raise(errs)
        self.ll = dict(num_experts=num_experts, max_tokens=max_tokens)

    def _ll(self, op, ins, outs, skip=(), **attrs):
        self._tag()
        a = dict(num_ranks=self.R, num_ports=self.P, qps_per_port=self.Q, call_site=0,
                 **self.ll)
        a.update(attrs)
        return self.emu.run("internode_ll_" + op, ins, outs, a, skip=skip,
                            per_rank_attrs=[dict(rank=r) for r in range(self.R)])

    def ll_dispatch_send(self, x, idx, skip=()):
        """x[R, S, H], topk_idx[R, S, K] -> tokens[R, 2] (None for a skipped rank)."""
        res, errs = self._ll("dispatch_send", [[x[r], idx[r]] for r in range(self.R)],
                             [[((2,), np.int32)]] * self.R, skip)
        return [None if o is None else o[0] for o in res], errs

    def ll_dispatch_recv(self, tokens, *, H, dtype, skip=()):
        E, M, R = self.ll["num_experts"], self.ll["max_tokens"], self.R
        el = E // R
        names = ("recv_x", "recv_count", "src_rank", "src_index", "first_row", "row_count")
        shapes = ((el, R * M, H), (el,), (el, R * M), (el, R * M), (el, R), (el, R))
        outs = [list(zip(shapes, (np.dtype(dtype),) + (np.int32,) * 5))] * R
        res, errs = self._ll("dispatch_recv", [[t] if t is not None else [] for t in tokens],
                             outs, skip)
        return [None if o is None else dict(zip(names, o)) for o in res], errs

    def ll_combine_send(self, y, first_row, row_count, *, rows_per_dest, skip=()):
        """y[R, E_local, R*M, H] and the dispatch handle -> tokens[R, 2]."""
        res, errs = self._ll("combine_send",
                             [[y[r], first_row[r], row_count[r]] for r in range(self.R)],
                             [[((2,), np.int32)]] * self.R, skip, rows_per_dest=rows_per_dest)
        return [None if o is None else o[0] for o in res], errs

    def ll_combine_recv(self, tokens, idx, w, *, H, dtype, skip=()):
        S = idx.shape[1]
        res, errs = self._ll("combine_recv",
                             [[tokens[r], idx[r], w[r]] if tokens[r] is not None else []
                              for r in range(self.R)],
                             [[((S, H), np.dtype(dtype))]] * self.R, skip)
        return [None if o is None else o[0] for o in res], errs

    def errors(self):
        """Each rank's recorded device error ("" if none), as the next call would report it."""
        _, errs = self.emu.run("internode_error", [[]] * self.R, [[]] * self.R, {})
        return errs

    def ll_errors(self):
        """As errors(), read through the low-latency mode's decoder (its records carry an
        op past llwire::kErrOpBase, which the other modes' decoders do not know)."""
        _, errs = self.emu.run("internode_ll_error", [[]] * self.R, [[]] * self.R, {})
        return errs

    def nccl_log(self):
        """The emulated NCCL's GIN operations since the last call, as dicts of
        NCCL_LOG_COLS (kind: NCCL_PUT ... NCCL_SIGNAL_WEAK), and the operations pending."""
        one = dict(skip=range(1, self.R))
        res, _ = self.emu.run("internode_nccl_log_size", [[]] * self.R,
                              [[((2,), np.int32)]] * self.R, {}, **one)
        n, pending = (int(v) for v in res[0][0])
        res, _ = self.emu.run("internode_nccl_log", [[]] * self.R,
                              [[((n, len(NCCL_LOG_COLS)), np.int32)]] * self.R, {}, **one)
        return [dict(zip(NCCL_LOG_COLS, (int(v) for v in row))) for row in res[0][0]], pending

    def _nccl_records(self):
        """The GIN puts as log() gives them: qp = handle = the context (context q carries
        the plan's QP q), port from the context's wire port, and sig_op from what the
        signal word is (GIN has only adds, so the word tells a SET's header or count from
        a data chunk's ADD): the low-latency area past the heap halves and the
        hierarchical exchange (full devComm, past the direct signal words) hold SET
        words, the rail devComm's signals are chunk ADDs, and a direct signal word's kind
        is its place in [kind][source][qp] (wire_protocol.h sig_word)."""
        from jax_ep._src.ext import require_ext
        proto = require_ext().internode_protocol()
        half = require_ext().internode_heap_half_bytes(self.heap_bytes)
        per_kind = self.R * proto["max_qps"]
        control_kinds = proto["sig_kinds"][:2]  # kSigHeader, kSigCounts
        log, pending = self.nccl_log()
        recs = []
        for r in log:
            if r["kind"] not in (NCCL_PUT, NCCL_PUT_STRONG, NCCL_PUT_WEAK):
                continue  # signals alone are counted, not logged (as the NVSHMEM log)
            if r["kind"] == NCCL_PUT:
                sig_op = -1
            elif r["sig_off"] >= 2 * half or r["devcomm"] == 0 and (
                    (r["sig_off"] % half) // 8 >= proto["num_sig_kinds"] * per_kind):
                sig_op = SIGNAL_SET
            elif r["devcomm"] == 1:
                sig_op = SIGNAL_ADD
            else:
                kind = ((r["sig_off"] % half) // 8) // per_kind
                sig_op = SIGNAL_SET if kind in control_kinds else SIGNAL_ADD
            recs.append(dict(src=r["src"], dst=r["dst"], qp=r["context"],
                             handle=r["context"], bytes=r["bytes"], sig_op=sig_op,
                             call=r["call"], block=r["block"], port=r["port"],
                             wire=self.fabric.wire_name(r["src"], r["port"]),
                             strong=r["kind"] == NCCL_PUT_STRONG))
        return recs, pending

    def log(self):
        """The puts since the last log() as dicts {src, dst, qp, port, wire, handle,
        bytes, sig_op (SIGNAL_ADD: a data chunk, SIGNAL_SET: a header or count row), call,
        block}, as jax_ep.network.plan.check_wire_log reads them, and the operations still
        queued (a finished call leaves none). `wire` is the device:port (or bond member)
        the emulated NVSHMEM put it on; `port` its place among the source GPU's own NIC
        ports (-1: not one of them)."""
        if self.transport == "nccl":
            return self._nccl_records()
        one = dict(skip=range(1, self.R))
        res, _ = self.emu.run("internode_log_size", [[]] * self.R,
                              [[((2,), np.int32)]] * self.R, {}, **one)
        n, pending = (int(v) for v in res[0][0])
        res, _ = self.emu.run("internode_log", [[]] * self.R,
                              [[((n, len(LOG_COLS)), np.int32)]] * self.R, {}, **one)
        names = self.emu.m.nvshmem_port_names()
        recs = []
        for row in res[0][0]:
            r = dict(zip(LOG_COLS, (int(v) for v in row)))
            r["wire"] = names[r["port"]] if 0 <= r["port"] < len(names) else None
            r["port"] = -1 if r["wire"] is None else self.fabric.port_index(r["src"],
                                                                            r["wire"])
            recs.append(r)
        return recs, pending

    def counters(self):
        return self.emu.counters()


class NcclFabric:
    """The node every emulated node is (default the standard node, one HCA of num_ports
    ports per GPU), and where NCCL puts each rank's GIN contexts there with the variables
    the bootstrap sets (jax_ep.network.fabric.nccl_env_for), by the C++ rule
    (nccl_selection). context_ports[r][c]: context c's place among rank r's GPU's own
    ports in the plan's order (-1: a port that is not one of them)."""

    def __init__(self, R, G, cfg, *, sysfs=None):
        from jax_ep._src.emu import standard_node
        from jax_ep.network import fabric as fb
        root = sysfs or standard_node(G, cfg.num_ports)
        gpus = fb.node_gpus(root)[:G]
        self.sysfs, self.G, self.own_ports, self.selections, self.wires = root, G, [], [], []
        for g in gpus:
            f = fb.discover(root, g)
            env = fb.nccl_env_for(f, cfg, ranks_per_node=G)
            sel = fb.nccl_selection(env, sysfs=root, gpu=g, ranks_per_node=G,
                                    num_contexts=cfg.num_qps, devices=f.devices)
            if sel.get("error"):
                raise RuntimeError(f"NCCL's selection for GPU {g}: {sel['error']}")
            self.selections.append(sel)
            if f.fabric_class == "roce-lag" and f.bond:
                own = list(f.bond.slaves)
                wires = [f.bond.slaves[m - 1] if m > 0 else p
                         for p, m in zip(sel["context_ports"], sel["context_lag_member"])]
            else:
                own = [f"{d}:{p}" for d, p in sorted(f.selected)]
                wires = list(sel["context_ports"])
            self.own_ports.append(own)
            self.wires.append(wires)
        self.context_ports = [[self.own_ports[r % G].index(w) if w in self.own_ports[r % G]
                               else -1 for w in self.wires[r % G]] for r in range(R)]

    def wire_name(self, src, port):
        own = self.own_ports[src % self.G]
        return own[port] if 0 <= port < len(own) else None

    def port_index(self, src: int, name: str) -> int:
        own = self.own_ports[src % self.G]
        return own.index(name) if name in own else -1


# ------------------------------------------------------------------ the reference oracle

@functools.lru_cache(maxsize=None)
def _reference_program(R, E, C, G=None):
    mesh = jax.make_mesh((R,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:R])

    def f(x, idx, w, y):
        rx, ri, rw, h = jax_ep.dispatch(x, idx, w, num_experts=E, axis_name="ep",
                                        capacity=C, backend="reference")
        if G is None:
            out = jax_ep.combine(y, h, backend="reference")
        else:  # combine's summation order with nodes of G ranks (combine_order.h)
            out = ref_backend.combine_with_bias(y, h, Cfg.for_handle(h, "reference"), (),
                                                node_size=G)
        d = dict(recv_x=rx, recv_idx=ri, recv_w=rw, num_recv=h.num_recv[None],
                 num_dropped=h.num_dropped[None],
                 per_expert=h.num_recv_tokens_per_expert[None], src_rank=h.src_rank[None],
                 src_index=h.src_index[None], send_row=h.send_row[None], out=out)
        return d

    return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))


def reference(x, idx, w, y, g=None, *, E, C, G=None):
    """The reference backend's dispatch and combine (of y[R, C, H]) on per-rank inputs, and
    gather (of g[R, T, H]) by the contract from its handle; arrays with a leading rank
    axis. G: the node size of combine's summation order (None: the backend's default,
    one node on CPU unless JAX_EP_GPUS_PER_NODE is set)."""
    R, T = idx.shape[:2]
    flat = lambda a: a.reshape((a.shape[0] * a.shape[1],) + a.shape[2:])  # noqa: E731
    res = _reference_program(R, E, C, G)(flat(x), flat(idx), flat(w), flat(y))
    out = {}
    if g is not None:  # gather, combine's transpose: g[src_rank, src_index] per kept row
        sr, si = np.asarray(res["src_rank"]), np.asarray(res["src_index"])
        out["gather"] = np.zeros(sr.shape + g.shape[2:], g.dtype)
        used = sr >= 0
        out["gather"][used] = g[sr[used], si[used]]
    for k, v in res.items():
        v = np.asarray(v)
        out[k] = v if k in ("num_recv", "num_dropped", "per_expert", "src_rank",
                            "src_index", "send_row") else v.reshape((R, -1) + v.shape[1:])
    return out


def bits(a):
    """`a` as unsigned ints of its width, so comparisons are bit for bit (NaN, -0.0)."""
    a = np.asarray(a)
    if a.dtype.kind == "f" or a.dtype.itemsize == 2 and a.dtype.kind == "V":
        return a.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])
    if str(a.dtype) == "bfloat16":
        return a.view(np.uint16)
    return a


def routing(rng, R, T, K, E, kind="uniform"):
    """topk_idx[R, T, K] of a kind: uniform (distinct experts per token), skewed (most
    tokens on rank 0's experts), collapsed (every token on expert 0 first), none (-1)."""
    idx = np.full((R, T, K), -1, np.int32)
    for r in range(R):
        for t in range(T):
            if kind == "none":
                continue
            if kind == "uniform":
                idx[r, t] = rng.choice(E, size=K, replace=False)
            elif kind == "skewed":
                el = E // R
                pool = np.arange(min(E, max(K, el)))
                idx[r, t] = rng.choice(pool, size=K, replace=False) if rng.random() < 0.8 \
                    else rng.choice(E, size=K, replace=False)
            elif kind == "collapsed":
                idx[r, t] = np.arange(K)
            if kind != "collapsed" and K > 1 and rng.random() < 0.2:
                idx[r, t, rng.integers(K)] = -1
    return idx
