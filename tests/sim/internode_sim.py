"""Host SIMULATOR of the internode wire protocol (a model run on the CPU, not a
measurement and not a run of the CUDA kernels).

What it models, and how it corresponds to kernels/internode/internode_kernels.cu:

| kernels                                   | simulator                                    |
| ----------------------------------------- | -------------------------------------------- |
| heap halves, regions (internode_layout.h) | `Rank.heap[2]` byte arrays carved with the    |
|                                           | offsets from `internode_heap_layout` (binding)|
| signal word (kind, source, qp)            | `Rank.sigs[half][sig_word(...)]` (binding)    |
| logical QP q to a peer: an RC QP (FIFO)   | `Wire.fifos[(src, dst, q)]`, delivered in     |
|                                           | order, QPs interleaved arbitrarily            |
| put_signal_warp (data then signal, one QP)| one `Put` landing data, then its signal       |
| signal (closing signal)                   | `Put` with no data                            |
| HeaderKernel / SendKernel / WaitKernel /  | `_header`, `_send`, `_wait_data`, and the     |
| Unpack / Reduce / GatherUnpack / Finish   | unpack/reduce/finish steps of `dispatch`,     |
|                                           | `combine`, `gather` below, in the same order  |
| channel_of_qp, expected_signal,           | the same functions through the bindings       |
| config_hash, qp_for                       |                                               |
| JAX_EP_TIMEOUT_S, globaltimer             | `timeout` in scheduler steps                  |
| sticky error record (first error wins)    | `Rank.error`                                  |

Checks made on every event: a byte read for call n was written by call n (no read
before it lands); data or a signal of call n lands in a half only after the receiver
finished call n - 2 there (no half reused early) and, for a signal, before it finished
call n (it waited for it); a signal word is written from one QP only; bytes per (sender, port) are counted (port = qp % num_ports, the plan's
binding, which the QP API path makes true by construction).

The core (`Wire`: QP FIFOs, signal words, the interleaving scheduler, byte-per-port
accounting, fault injection) does not know the ops and can drive other schedules.
"""
from __future__ import annotations

import dataclasses
import random
from collections import deque

import numpy as np

from jax_ep import _jax_ep_ext as _ext

# --- the compiled protocol, through the bindings -----------------------------------

PROTO = dict(_ext.internode_protocol())
K_HEADER, K_COUNTS, K_DISPATCH, K_COMBINE = PROTO["sig_kinds"]
CONTROL_QP = PROTO["control_qp"]
HEADER_BYTES = PROTO["header_bytes"]
MAX_QPS = PROTO["max_qps"]
OP_DISPATCH, OP_COMBINE, OP_GATHER = 0, 1, 2


def sig_word(kind, R, src, qp):
    return _ext.internode_sig_word(kind, R, src, qp)


def layout(R, T, C, H, K, xb, yb):
    return dict(_ext.internode_heap_layout(R, T, C, H, K, xb, yb))


def qp_for(peer, channel, chunk, P, Q):
    return _ext.striping_qp_for(peer, channel, chunk, P, Q)


def channel_of_qp(peer, qp, P, Q):
    return _ext.internode_channel_of_qp(peer, qp, P, Q)


def expected_signal(n_chunks, receiver, qp, P, Q):
    return _ext.internode_expected_signal(n_chunks, receiver, qp, P, Q)


def config_hash(cfg):
    return _ext.internode_config_hash([int(v) for v in cfg])


def num_chunks(nbytes, chunk):
    return 0 if nbytes <= 0 else (nbytes + chunk - 1) // chunk


def round_up(v, a):
    return (v + a - 1) // a * a


# --- the reusable core ---------------------------------------------------------------

@dataclasses.dataclass
class Put:
    """One operation on a QP: optional data (bytes into `region` of `half` at `off`),
    then an optional signal (`op` "set"/"add" of `value` into word `word`)."""
    src: int
    dst: int
    qp: int
    seq: int            # sender's call number
    half: int
    off: int = 0
    data: bytes = b""
    word: int | None = None
    op: str = "add"
    value: int = 1
    kind: str = "data"  # "data" or "control" (for byte accounting)


class Violation(AssertionError):
    """The protocol broke a rule the simulator checks."""


class Rank:
    """One PE: two heap halves with per-byte tags (call that wrote them), signal words per
    half, the word -> writer QPs map, the call counter and the sticky error."""

    def __init__(self, rank, half_bytes, nwords):
        self.rank = rank
        self.heap = [np.zeros(half_bytes, np.uint8) for _ in range(2)]
        self.tag = [np.full(half_bytes, -1, np.int64) for _ in range(2)]
        self.sigs = [np.zeros(nwords, np.int64) for _ in range(2)]
        self.sig_seq = [np.full(nwords, -1, np.int64) for _ in range(2)]
        self.writers = [dict() for _ in range(2)]
        self.done = 0      # calls finished (FinishKernel ran)
        self.error = None  # first error (dict), sticky
        self.results = []  # per call: outputs or None

    def record(self, **err):
        if self.error is None:
            self.error = dict(err, rank=self.rank)

    @property
    def failed(self):
        return self.error is not None


class Wire:
    """R ranks, logical QPs as FIFOs between every ordered pair, and a scheduler that
    interleaves rank programs (generators) with deliveries.

    Programs yield requests: ("wait", half, word, expect, peer, kind_name, qp) -> bool
    (False after `timeout` steps), ("put", Put) and ("sleep", steps). The
    scheduler picks uniformly among runnable programs and nonempty FIFOs (policy
    "random"), or prefers programs over deliveries ("lazy": messages arrive as late as
    possible, which exposes reads that do not wait long enough).
    """

    def __init__(self, R, num_ports, qps_per_port, half_bytes, *, seed=0, timeout=10_000,
                 policy="random", nwords=None):
        """nwords: signal words per half per rank (default: the direct protocol's
        kinds x R x kMaxQps); another schedule on this core may size its own."""
        if not 1 <= R <= 64:
            raise ValueError(f"R must be in [1, 64], got {R}")
        if policy not in ("random", "lazy"):
            raise ValueError(f"policy must be 'random' or 'lazy', got {policy!r}")
        self.R, self.P, self.Q = R, num_ports, qps_per_port
        self.NQ = num_ports * qps_per_port
        if nwords is None:
            nwords = PROTO["num_sig_kinds"] * R * MAX_QPS
        self.ranks = [Rank(r, half_bytes, nwords) for r in range(R)]
        self.fifos: dict[tuple, deque] = {}
        self._ne_list: list[tuple] = []
        self._ne_pos: dict[tuple, int] = {}
        self.rng = random.Random(seed)
        self.timeout = timeout
        self.policy = policy
        self.clock = 0
        self.port_bytes = np.zeros((R, num_ports), np.int64)   # data bytes per sender port
        self.qp_bytes = np.zeros((R, self.NQ), np.int64)
        self.pair_port_bytes = np.zeros((R, R, num_ports), np.int64)  # [src, dst, port]
        self.control_bytes = np.zeros(R, np.int64)
        self.violations: list[str] = []
        self.events = 0

    # -- checks -----------------------------------------------------------------------
    def violate(self, msg):
        self.violations.append(msg)

    def read(self, r, half, off, n, seq, what):
        """Rank r reads n bytes at off in its half for call seq: every byte must have
        been written by call seq. Returns the bytes."""
        rk = self.ranks[r]
        tags = rk.tag[half][off:off + n]
        if n and not np.all(tags == seq):
            bad = int(np.argmax(tags != seq))
            self.violate(f"rank {r} read {what} byte {off + bad} of half {half} in call "
                         f"{seq} before it landed (holds call {int(tags[bad])})")
        return bytes(rk.heap[half][off:off + n])

    def write_local(self, r, half, off, data, seq):
        rk = self.ranks[r]
        rk.heap[half][off:off + len(data)] = np.frombuffer(data, np.uint8)
        rk.tag[half][off:off + len(data)] = seq

    # -- delivery ---------------------------------------------------------------------
    def enqueue(self, p: Put):
        key = (p.src, p.dst, p.qp)
        q = self.fifos.setdefault(key, deque())
        q.append(p)
        if key not in self._ne_pos:  # nonempty FIFOs, O(1) pick and removal
            self._ne_pos[key] = len(self._ne_list)
            self._ne_list.append(key)

    def _deliver(self, key):
        q = self.fifos[key]
        p = q.popleft()
        if not q:
            i = self._ne_pos.pop(key)
            last = self._ne_list.pop()
            if last != key:
                self._ne_list[i] = last
                self._ne_pos[last] = i
        rk = self.ranks[p.dst]
        # the receiver must be done with the previous use of this half (call seq - 2)
        if rk.done < p.seq - 1:
            self.violate(f"call {p.seq} from rank {p.src} on QP {p.qp} landed in half "
                         f"{p.half} of rank {p.dst}, which has finished only {rk.done} "
                         f"calls (half reused early)")
        if rk.done > p.seq and p.word is not None and not rk.failed:
            self.violate(f"a signal of call {p.seq} from rank {p.src} on QP {p.qp} landed "
                         f"at rank {p.dst} after it finished that call (it did not wait for "
                         f"it; the word was already reset)")
        if p.data:
            n = len(p.data)
            rk.heap[p.half][p.off:p.off + n] = np.frombuffer(p.data, np.uint8)
            rk.tag[p.half][p.off:p.off + n] = p.seq
            if p.kind == "data":
                self.port_bytes[p.src, p.qp % self.P] += n
                self.pair_port_bytes[p.src, p.dst, p.qp % self.P] += n
                self.qp_bytes[p.src, p.qp] += n
            else:
                self.control_bytes[p.src] += n
        if p.word is not None:
            w = rk.writers[p.half].setdefault(p.word, set())
            w.add((p.src, p.qp))
            if len(w) > 1:
                self.violate(f"signal word {p.word} of rank {p.dst} written from more "
                             f"than one QP: {sorted(w)}")
            if p.op == "set":
                rk.sigs[p.half][p.word] = p.value
            else:
                rk.sigs[p.half][p.word] += p.value
            rk.sig_seq[p.half][p.word] = p.seq
        self.events += 1

    def reset_words(self, r, half):
        rk = self.ranks[r]
        rk.sigs[half][:] = 0
        rk.writers[half].clear()

    # -- scheduler --------------------------------------------------------------------
    def run(self, programs, max_steps=10_000_000):
        """Runs rank programs (one generator per rank) to completion."""
        state = {}
        for r, g in enumerate(programs):
            if g is not None:
                state[r] = {"gen": g, "req": None, "since": 0}
                self._advance(r, state)
        for _ in range(max_steps):
            if not state and not self._ne_list:
                return
            runnable = [r for r in state if self._ready(r, state)]
            deliverable = self._ne_list
            if not runnable and not deliverable:
                # everyone waits: jump to the earliest deadline
                deadlines = [s["since"] + (self.timeout if s["req"][0] == "wait"
                                           else s["req"][1]) for s in state.values()]
                self.clock = max(self.clock + 1, min(deadlines) + 1)
                continue
            self.clock += 1
            if self.policy == "lazy" and runnable:
                choice = ("rank", self.rng.choice(runnable))
            else:
                n = len(runnable) + len(deliverable)
                i = self.rng.randrange(n)
                choice = ("rank", runnable[i]) if i < len(runnable) else \
                    ("fifo", deliverable[i - len(runnable)])
            if choice[0] == "fifo":
                self._deliver(choice[1])
            else:
                self._advance(choice[1], state)
        raise RuntimeError("simulation did not finish")

    def _ready(self, r, state):
        s = state[r]
        req = s["req"]
        if req[0] == "wait":
            _, half, word, expect = req[:4]
            return (self.ranks[r].sigs[half][word] >= expect
                    or self.clock - s["since"] > self.timeout)
        if req[0] == "sleep":
            return self.clock - s["since"] >= req[1]
        return True

    def _advance(self, r, state):
        s = state[r]
        req = s["req"]
        val = None
        if req is not None and req[0] == "wait":
            _, half, word, expect = req[:4]
            val = bool(self.ranks[r].sigs[half][word] >= expect)
        try:
            req = s["gen"].send(val) if req is not None else next(s["gen"])
            while req[0] == "put":
                self.enqueue(req[1])
                req = s["gen"].send(None)
        except StopIteration:
            del state[r]
            return
        s["req"] = req
        s["since"] = self.clock


# --- the protocol of the kernels -----------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Mistakes:
    """Planted mistakes (each test plants one and expects the simulator to report it)."""
    no_closing_signal: bool = False   # SendKernel omits the per-QP closing signal
    shared_counter: bool = False      # every QP signals word (kind, src, 0)
    early_wait: bool = False          # WaitKernel waits for 1 (any signal) per word
    t0_skips_wait: bool = False       # combine with T == 0 skips its wait (the old bug)


@dataclasses.dataclass
class Call:
    """One rank's part in one op. op: "dispatch" | "combine" | "gather"."""
    op: str
    x: np.ndarray | None = None         # dispatch: [T, H] float32; combine: y [C, H];
    topk_idx: np.ndarray | None = None  # gather: g [T, H]
    topk_w: np.ndarray | None = None
    handle: dict | None = None          # combine/gather: {"counts", "send_slot"}
    capacity: int = 0
    topk: int = 0
    num_experts: int = 0
    call_site: int = 1                  # the custom call's call_site attribute
    delay: int = 0                      # steps before the rank starts this call


class Protocol:
    """The internode protocol over a `Wire`, as the kernels run it, with float32 rows."""

    XB = YB = 4  # float32 rows: the wire format does not depend on the dtype otherwise

    def __init__(self, wire: Wire, chunk_bytes: int, mistakes: Mistakes = Mistakes()):
        self.w = wire
        self.chunk = round_up(chunk_bytes, 16)
        self.m = mistakes

    # geometry of one call, as MakeGeometry
    def geom(self, c: Call, T, H):
        R, w = self.w.R, self.w
        K = c.topk
        if c.op == "dispatch":
            L = layout(R, T, c.capacity, H, K, self.XB, 0)
            op, dt = OP_DISPATCH, 0
        else:
            L = layout(R, T, c.capacity, H, K, 0, self.YB)
            op, dt = (OP_COMBINE if c.op == "combine" else OP_GATHER), 0
        cfg = [op, R, T, H, K, c.capacity, dt, w.NQ, c.call_site]
        return L, cfg, config_hash(cfg)

    # -- phases shared by the ops ---------------------------------------------------------
    def _header(self, r, seq, half, L, cfg, h, bad, counts_row):
        """HeaderKernel. Returns the count matrix rows received (dispatch) or None."""
        w, R, rk = self.w, self.w.R, self.w.ranks[r]
        if rk.failed:
            return None
        hdr = np.zeros(16, np.int32)
        hdr.view(np.uint64)[0] = seq
        hdr.view(np.uint32)[2] = h
        hdr[3] = 1 if bad else 0
        hdr[4:4 + len(cfg)] = cfg
        hb = hdr.tobytes()
        w.write_local(r, half, L["hdr"] + r * HEADER_BYTES, hb, seq)
        crow = counts_row.astype(np.int32).tobytes() if counts_row is not None else None
        if crow is not None:
            w.write_local(r, half, L["counts"] + r * R * 4, crow, seq)
        for i in range(1, R):
            p = (r + i) % R
            yield ("put", Put(r, p, CONTROL_QP, seq, half, L["hdr"] + r * HEADER_BYTES, hb,
                              sig_word(K_HEADER, R, r, CONTROL_QP), "set", 1, "control"))
            if crow is not None:
                yield ("put", Put(r, p, CONTROL_QP, seq, half, L["counts"] + r * R * 4, crow,
                                  sig_word(K_COUNTS, R, r, CONTROL_QP), "set", 1, "control"))
        if bad:
            rk.record(code="bad_id", op=cfg[0], detail=bad)
        for s in range(R):
            if s == r:
                continue
            ok = yield ("wait", half, sig_word(K_HEADER, R, s, CONTROL_QP), 1, s, "header",
                        CONTROL_QP)
            if not ok:
                if not rk.failed:
                    rk.record(code="timeout", peer=s, kind="header", qp=CONTROL_QP,
                              expected=1, seen=int(rk.sigs[half][sig_word(K_HEADER, R, s, 0)]))
                continue
            th = np.frombuffer(w.read(r, half, L["hdr"] + s * HEADER_BYTES, HEADER_BYTES, seq,
                                      f"header of rank {s}"), np.int32)
            t_seq = int(th.view(np.uint64)[0])
            t_hash = int(th.view(np.uint32)[2])
            t_err = int(th[3])
            if t_seq != seq or t_hash != h or t_err:
                code = "peer_failed" if (t_err and t_seq == seq and t_hash == h) else "mismatch"
                rk.record(code=code, peer=s, my_seq=seq, peer_seq=t_seq, mine=list(cfg),
                          theirs=[int(v) for v in th[4:4 + len(cfg)]])
                continue
            if crow is not None:
                ok = yield ("wait", half, sig_word(K_COUNTS, R, s, CONTROL_QP), 1, s, "counts",
                            CONTROL_QP)
                if not ok and not rk.failed:
                    rk.record(code="timeout", peer=s, kind="counts", qp=CONTROL_QP,
                              expected=1, seen=0)
        if crow is None:
            return None
        rows = np.zeros((R, R), np.int32)
        for s in range(R):
            if s == r:
                rows[s] = counts_row
            elif not rk.failed:
                rows[s] = np.frombuffer(w.read(r, half, L["counts"] + s * R * 4, R * 4, seq,
                                               f"count row of rank {s}"), np.int32)
        return rows

    def _send(self, r, seq, half, kind, streams):
        """SendKernel: streams[peer] = (src_off, dst_off, nbytes) within the half."""
        w, R, rk = self.w, self.w.R, self.w.ranks[r]
        if rk.failed:
            return
        # CTAs (logical QPs) run concurrently: issue QP by QP in random order
        qps = list(range(w.NQ))
        w.rng.shuffle(qps)
        for q in qps:
            word = sig_word(kind, R, r, 0 if self.m.shared_counter else q)
            for i in range(1, R):
                p = (r + i) % R
                src, dst, nbytes = streams[p]
                ch = channel_of_qp(p, q, w.P, w.Q)
                n = num_chunks(nbytes, self.chunk)
                for j in range(ch, n, w.NQ):
                    assert qp_for(p, j % w.NQ, j, w.P, w.Q)[0] == q  # the plan's QP
                    off = j * self.chunk
                    size = min(self.chunk, nbytes - off)
                    data = w.read(r, half, src + off, size, seq, "stage")
                    yield ("put", Put(r, p, q, seq, half, dst + off, data, word, "add", 1))
                if not self.m.no_closing_signal:
                    yield ("put", Put(r, p, q, seq, half, 0, b"", word, "add", 1, "control"))

    def _wait_data(self, r, seq, half, kind, chunks_from):
        """WaitKernel: chunks_from[s] = chunks source s sends this rank."""
        w, R, rk = self.w, self.w.R, self.w.ranks[r]
        for s in range(R):
            for q in range(w.NQ):
                if s == r or rk.failed:
                    continue
                expect = expected_signal(chunks_from[s], r, q, w.P, w.Q)
                if self.m.early_wait:
                    expect = 1
                word = sig_word(kind, R, s, q)
                ok = yield ("wait", half, word, expect, s, "data", q)
                if not ok:
                    rk.record(code="timeout", peer=s, kind="data", qp=q, expected=expect,
                              seen=int(rk.sigs[half][word]))
                    continue
                v = int(rk.sigs[half][word])
                if v != expect and not self.m.early_wait:
                    rk.record(code="extra_signal", peer=s, qp=q, expected=expect, seen=v)

    def _finish(self, r, half):
        self.w.reset_words(r, half)
        self.w.ranks[r].done += 1

    # -- the ops ------------------------------------------------------------------------
    @staticmethod
    def slots(topk_idx, R, el, E):
        """SlotsKernel: send_slot[T, R], counts row, first bad id (token, slot, value)."""
        T, K = topk_idx.shape
        send_slot = np.full((T, R), -1, np.int32)
        counts = np.zeros(R, np.int32)
        bad = None
        for t in range(T):
            for k in range(K):
                v = int(topk_idx[t, k])
                if (v < -1 or v >= E) and bad is None:
                    bad = (t, k, v)
            for d in range(R):
                if any(0 <= int(e) < E and int(e) // el == d for e in topk_idx[t]):
                    send_slot[t, d] = counts[d]
                    counts[d] += 1
        return send_slot, counts, bad

    def program(self, r, calls):
        """The generator of rank r for a list of Calls (its sequence of ops)."""
        for seq, c in enumerate(calls):
            if c is None:   # this rank skips the call (a rank-dependent cond)
                continue
            if c.delay:
                yield ("sleep", c.delay)
            yield from getattr(self, "_" + c.op)(r, self.w.ranks[r].done, c)

    def _dispatch(self, r, seq, c: Call):
        w, R = self.w, self.w.R
        rk = w.ranks[r]
        half = seq % 2
        T, H = c.x.shape
        K, C, E = c.topk_idx.shape[1], c.capacity, c.num_experts
        el = E // R
        c = dataclasses.replace(c, topk=K)
        L, cfg, h = self.geom(c, T, H)
        ds, meta = L["dispatch_row_stride"], L["dispatch_meta_offset"]
        send_slot, counts_row, bad = self.slots(c.topk_idx, R, el, E)
        # PackKernel: rows grouped by destination in stage
        row_base = np.concatenate([[0], np.cumsum(counts_row)[:-1]])
        for t in range(T):
            for d in range(R):
                j = send_slot[t, d]
                if j < 0:
                    continue
                row = np.zeros(ds, np.uint8)
                row[:H * 4] = np.frombuffer(c.x[t].astype(np.float32).tobytes(), np.uint8)
                m = np.concatenate([c.topk_idx[t].astype(np.int32).view(np.uint8),
                                    c.topk_w[t].astype(np.float32).view(np.uint8),
                                    np.array([t], np.int32).view(np.uint8)])
                row[meta:meta + len(m)] = m
                w.write_local(r, half, L["stage"] + (row_base[d] + j) * ds, row.tobytes(), seq)
        counts = yield from self._header(r, seq, half, L, cfg, h, bad, counts_row)
        if rk.failed or counts is None:
            rk.results.append(None)
            self._finish(r, half)
            return
        col_base = counts[:r].sum(axis=0)           # rows of sources < r at each d
        recv_base = np.concatenate([[0], np.cumsum(counts[:, r])])
        streams, chunks_from = {}, {}
        for p in range(R):
            n = int(counts[r, p])
            kept = max(0, min(n, C - int(col_base[p])))
            streams[p] = (L["stage"] + int(row_base[p]) * ds, L["recv"] + int(col_base[p]) * ds,
                          kept * ds)
            base_s = int(recv_base[p])
            kept_s = max(0, min(int(counts[p, r]), C - base_s))
            chunks_from[p] = num_chunks(kept_s * ds, self.chunk)
        yield from self._send(r, seq, half, K_DISPATCH, streams)
        yield from self._wait_data(r, seq, half, K_DISPATCH, chunks_from)
        # UnpackKernel
        total = int(recv_base[R])
        num_recv = min(total, C) if not rk.failed else 0
        out = {"recv_x": np.zeros((C, H), np.float32), "src_rank": np.full(C, -1, np.int32),
               "src_index": np.full(C, -1, np.int32),
               "recv_topk_idx": np.full((C, K), -1, np.int32), "counts": counts,
               "send_slot": send_slot, "num_recv": num_recv}
        for i in range(num_recv):
            s = int(np.searchsorted(recv_base, i, side="right") - 1)
            if s == r:
                off = L["stage"] + (int(row_base[r]) + i - int(recv_base[s])) * ds
            else:
                off = L["recv"] + i * ds
            row = np.frombuffer(w.read(r, half, off, ds, seq, f"recv row {i}"), np.uint8)
            out["recv_x"][i] = row[:H * 4].view(np.float32)
            ids = row[meta:meta + 4 * K].view(np.int32)
            out["recv_topk_idx"][i] = np.where((ids >= 0) & (ids // el == r), ids - r * el, -1)
            out["src_rank"][i] = s
            out["src_index"][i] = row[meta + 8 * K:meta + 8 * K + 4].view(np.int32)[0]
        rk.results.append(out)
        self._finish(r, half)

    def _handle_streams(self, r, c, counts, L, stride, region_src, region_dst, back_rows):
        """StreamTo for the combine (back_rows=True) or gather/dispatch pattern."""
        R, C = self.w.R, c.capacity
        col_base = counts[:r].sum(axis=0)
        row_base = np.concatenate([[0], np.cumsum(counts[r])[:-1]])
        recv_base = np.concatenate([[0], np.cumsum(counts[:, r])])
        streams, chunks_from = {}, {}
        for p in range(R):
            if back_rows:
                n, base = int(counts[p, r]), int(recv_base[p])
                kept = max(0, min(n, C - base))
                peer_row_base = int(counts[p, :r].sum())
                streams[p] = (L["cstage"] + base * stride, L["back"] + peer_row_base * stride,
                              kept * stride)
                mine_base = int(col_base[p])
                kept_from = max(0, min(int(counts[r, p]), C - mine_base))
            else:
                n, base = int(counts[r, p]), int(col_base[p])
                kept = max(0, min(n, C - base))
                streams[p] = (L["back"] + int(row_base[p]) * stride,
                              L["cstage"] + base * stride, kept * stride)
                src_base = int(recv_base[p])
                kept_from = max(0, min(int(counts[p, r]), C - src_base))
            chunks_from[p] = num_chunks(kept_from * stride, self.chunk)
        return streams, chunks_from, col_base, row_base, recv_base

    def _combine(self, r, seq, c: Call):
        w, R = self.w, self.w.R
        rk = w.ranks[r]
        half = seq % 2
        counts, send_slot = c.handle["counts"], c.handle["send_slot"]
        T, H, C = send_slot.shape[0], c.x.shape[1], c.capacity
        L, cfg, h = self.geom(c, T, H)
        cs = L["combine_row_stride"]
        streams, chunks_from, col_base, row_base, recv_base = self._handle_streams(
            r, c, counts, L, cs, "cstage", "back", True)
        rows = min(int(recv_base[R]), C)
        for i in range(rows):  # CombineStageKernel
            w.write_local(r, half, L["cstage"] + i * cs,
                          c.x[i].astype(np.float32).tobytes().ljust(cs, b"\0"), seq)
        yield from self._header(r, seq, half, L, cfg, h, None, None)
        yield from self._send(r, seq, half, K_COMBINE, streams)
        if not (self.m.t0_skips_wait and T == 0):
            yield from self._wait_data(r, seq, half, K_COMBINE, chunks_from)
        out = np.zeros((T, H), np.float32)
        for t in range(T if not rk.failed else 0):  # ReduceKernel
            acc = np.zeros(H, np.float32)
            for d in range(R):
                j = int(send_slot[t, d])
                if j < 0 or int(col_base[d]) + j >= C:
                    continue
                if d == r:
                    acc += c.x[int(col_base[d]) + j].astype(np.float32)
                else:
                    b = w.read(r, half, L["back"] + (int(row_base[d]) + j) * cs, H * 4, seq,
                               f"combine row from rank {d}")
                    acc += np.frombuffer(b, np.float32)
            out[t] = acc
        rk.results.append(None if rk.failed else {"out": out})
        self._finish(r, half)

    def _gather(self, r, seq, c: Call):
        w, R = self.w, self.w.R
        rk = w.ranks[r]
        half = seq % 2
        counts, send_slot = c.handle["counts"], c.handle["send_slot"]
        T, H, C = send_slot.shape[0], c.x.shape[1], c.capacity
        L, cfg, h = self.geom(c, T, H)
        cs = L["combine_row_stride"]
        streams, chunks_from, col_base, row_base, recv_base = self._handle_streams(
            r, c, counts, L, cs, "back", "cstage", False)
        for t in range(T):  # GatherPackKernel
            for d in range(R):
                j = int(send_slot[t, d])
                if j < 0 or int(col_base[d]) + j >= C:
                    continue
                w.write_local(r, half, L["back"] + (int(row_base[d]) + j) * cs,
                              c.x[t].astype(np.float32).tobytes().ljust(cs, b"\0"), seq)
        yield from self._header(r, seq, half, L, cfg, h, None, None)
        yield from self._send(r, seq, half, K_DISPATCH, streams)
        yield from self._wait_data(r, seq, half, K_DISPATCH, chunks_from)
        num_recv = 0 if rk.failed else min(int(recv_base[R]), C)
        out = np.zeros((C, H), np.float32)
        for i in range(num_recv):  # GatherUnpackKernel
            s = int(np.searchsorted(recv_base, i, side="right") - 1)
            off = (L["back"] + (int(row_base[r]) + i - int(recv_base[s])) * cs if s == r
                   else L["cstage"] + i * cs)
            out[i] = np.frombuffer(w.read(r, half, off, H * 4, seq, f"gather row {i}"),
                                   np.float32)
        rk.results.append(None if rk.failed else {"out": out})
        self._finish(r, half)


def half_bytes_for(R, T, C, H, K):
    """Bytes of one half big enough for every op of these limits (float32 rows)."""
    return max(layout(R, T, C, H, K, 4, 0)["total"], layout(R, T, C, H, K, 0, 4)["total"])


def simulate(per_rank_calls, *, num_ports=2, qps_per_port=2, chunk_bytes=64, seed=0,
             timeout=20_000, policy="random", mistakes=Mistakes(), limits=None):
    """Runs per_rank_calls[r] (a list of Call or None) on every rank; returns the Wire.

    limits: (T, C, H, K) sizing the heap; default from the calls.
    """
    R = len(per_rank_calls)
    if limits is None:
        T = max((c.x.shape[0] if c.op == "dispatch" else c.handle["send_slot"].shape[0])
                for calls in per_rank_calls for c in calls if c is not None)
        C = max(c.capacity for calls in per_rank_calls for c in calls if c is not None)
        H = max(c.x.shape[1] for calls in per_rank_calls for c in calls if c is not None)
        K = max((c.topk_idx.shape[1] if c.op == "dispatch" else c.topk)
                for calls in per_rank_calls for c in calls if c is not None)
        limits = (max(T, 1), C, H, K)
    w = Wire(R, num_ports, qps_per_port, half_bytes_for(R, *limits), seed=seed,
             timeout=timeout, policy=policy)
    proto = Protocol(w, chunk_bytes, mistakes)
    w.run([proto.program(r, calls) for r, calls in enumerate(per_rank_calls)])
    return w
