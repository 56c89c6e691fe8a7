"""Host SIMULATOR of the internode low-latency protocol (a model run on the CPU, not a
run of the CUDA kernels): kernels/internode/low_latency_kernels.cu, whose word-level
rules are kernels/internode/low_latency_wire.h.

| kernels                                        | simulator                                   |
| ---------------------------------------------- | ------------------------------------------- |
| the symmetric area (llwire::area_layout)       | `Mem`: dicts of rows, headers and words,     |
|                                                | keyed like the area, each value tagged with |
|                                                | the (op, epoch) that wrote it               |
| logical QP q between two ranks                 | `Sim.queues[(src, dst, q)]`; with           |
|                                                | `reorder=True` any pending operation of a   |
|                                                | QP may land next (puts delayed, reordered)  |
| put_signal_warp (data, then its signal)        | one operation: the data lands, then the     |
|                                                | signal, atomically; the data is read from   |
|                                                | the writer's stage when it lands            |
| the stages (hstage, dstage, cstage), written   | `Sim.stage[r]`, tagged with the epoch that  |
| by plan and pack before the credit wait        | packed them                                 |
| nvshmem_quiet at the end of a send kernel      | a "quiet" step: waits until every operation |
|                                                | the rank issued has landed                  |
| signal (credit)                                | an operation with no data                   |
| epoch n per op, buffer n & 1, token (n, hash)  | `Sim.epoch`, `buf()`, the send's token      |
| token int32: low 32 bits, widen_epoch          | the same, through the bindings              |
| row_qp, rows_on_qp, config_hash                | the same functions through the bindings     |
| JAX_EP_TIMEOUT_S                               | `timeout` in scheduler steps                |
| sticky error record, first error wins          | `Sim.errors`; a failed rank stays silent    |

Checks made on every event (they land in `Result.violations`): a reader reads only what
the epoch it completes wrote (no read before the data landed, no stale header or row);
a write never replaces rows or headers whose reader has not finished their epoch (no slot
reuse before the reader is done); a put reads a stage no later call rewrote (no send
buffer reused before quiet); a signal word is written from one QP only; a reader
accepts a data word only if every increment in it came from the epoch it completes; no
signal lands in a word after its reader finished that epoch. A run where every rank
waits on a word no one will write, with no timeout, is reported as a hang.
"""
from __future__ import annotations

import dataclasses
import random
from collections import defaultdict

import numpy as np

from jax_ep import _jax_ep_ext as _ext

PROTO = dict(_ext.ll_protocol())
OP_D, OP_C = PROTO["ops"]
CONTROL_QP = PROTO["control_qp"]
N_CFG = PROTO["num_cfg_fields"]


def row_qp(peer, j, P, Q):
    return _ext.ll_row_qp(int(peer), int(j), P, Q)


def rows_on_qp(rows, reader, qp, P, Q):
    return _ext.ll_rows_on_qp(int(rows), int(reader), int(qp), P, Q)


def config_hash(cfg):
    return _ext.ll_config_hash([int(v) for v in cfg])


def widen_epoch(latest, low):
    return _ext.ll_widen_epoch(int(latest), int(low) & 0xFFFFFFFF)


def token_word(n):
    """The epoch as the int32 token word holds it."""
    low = n & 0xFFFFFFFF
    return low - (1 << 32) if low >= 1 << 31 else low


@dataclasses.dataclass(frozen=True)
class Mistakes:
    """Planted mistakes: each test plants one and expects the simulator to report it."""
    signal_before_data: bool = False  # a row's ADD goes out as its own signal, before a plain put
    shared_signal_word: bool = False  # every QP signals the writer's word of QP 0
    no_epoch_check: bool = False      # the reader takes any nonzero header word
    single_buffer: bool = False       # every epoch writes buffer 0 and waits for no credit
    no_credit: bool = False           # epoch-parity buffers, but no credit wait
    wrong_row_order: bool = False     # the owner lays out an expert's rows source-descending
    no_timeout: bool = False          # waits never give up
    credit_before_reset: bool = False  # the reader returns the credit, then resets its words
    no_quiet: bool = False            # a send returns before its puts complete (no nvshmem_quiet)
    narrow_token: bool = False        # the receive takes the int32 token as the epoch (sign-extended)
    total_rows_only: bool = False     # combine checks each owner's total, not each expert's count
    pack_first_match: bool = False    # combine pack: each y row to the first source whose range
                                      # holds it (stage rows of overlapping ranges left unwritten)


@dataclasses.dataclass
class Op:
    """One pending operation on a QP: writes (key -> stage key of the writer, read when
    the operation lands) tagged `tag`, then an optional signal (`how` "set"/"add" of
    `value` into `word`)."""
    src: int
    dst: int
    qp: int
    tag: tuple
    writes: tuple = ()
    word: tuple | None = None
    how: str = "add"
    value: int = 1


class Mem:
    """One rank's area: tagged values, signal words, the increments in each data word,
    the QPs that wrote each word, and the epochs its reads finished."""

    def __init__(self):
        self.vals = {}              # key -> (value, tag)
        self.words = defaultdict(int)
        self.contrib = defaultdict(list)   # data word -> tags of the increments since reset
        self.writers = defaultdict(set)    # word -> {(src, qp)}
        self.finished = set()              # (op, epoch) this rank finished reading


@dataclasses.dataclass
class Result:
    outputs: list          # per rank: list of step outputs (None for sends)
    errors: list           # per rank: first error dict or None
    violations: list
    hang: bool
    port_rows: dict        # (src, dst, port) -> rows
    events: int


class Sim:
    def __init__(self, R, E, M, H, *, num_ports=2, qps_per_port=2, seed=0, timeout=5000,
                 reorder=True, policy="random", mistakes: Mistakes = Mistakes(),
                 first_epoch=0):
        """policy: "random" picks uniformly among runnable ranks and nonempty QPs;
        "lazy" runs ranks first and delivers only when none can run (operations land as
        late as possible, which exposes reads that do not wait long enough).
        first_epoch: every op's counter starts there, as after that many finished calls
        (credits given for them), to run epochs across 2^31 and 2^32."""
        if E % R:
            raise ValueError("E must be a multiple of R")
        self.R, self.E, self.M, self.H = R, E, M, H
        self.el = E // R
        self.P, self.Q = num_ports, qps_per_port
        self.NQ = num_ports * qps_per_port
        self.rng = random.Random(seed)
        self.timeout = timeout
        self.reorder = reorder
        if policy not in ("random", "lazy"):
            raise ValueError(f"policy must be 'random' or 'lazy', got {policy!r}")
        self.policy = policy
        self.m = mistakes
        self.mem = [Mem() for _ in range(R)]
        self.queues = defaultdict(list)
        self.violations = []
        self.port_rows = defaultdict(int)
        self.errors = [None] * R
        self.epoch = [[first_epoch, first_epoch] for _ in range(R)]
        self.stage = [{} for _ in range(R)]  # stage key -> (value, tag of the packing call)
        for mem in self.mem:
            for op in (OP_D, OP_C):
                for b in (0, 1):
                    for p in range(R):
                        mem.words[("credit", op, b, p)] = first_epoch
        self.clock = 0
        self.events = 0

    # -- helpers -----------------------------------------------------------------------
    def violate(self, msg):
        if msg not in self.violations:
            self.violations.append(msg)

    def record(self, r, **err):
        if self.errors[r] is None:
            self.errors[r] = dict(err, rank=r)

    def buf(self, n):
        return 0 if self.m.single_buffer else n & 1

    def read(self, r, key, tag, what):
        v = self.mem[r].vals.get(key)
        if v is None or v[1] != tag:
            self.violate(f"rank {r} read {what} {key} for {tag} before it landed "
                         f"(holds {None if v is None else v[1]})")
        return None if v is None else v[0]

    # -- delivery ----------------------------------------------------------------------
    def deliver(self, key):
        q = self.queues[key]
        i = self.rng.randrange(len(q)) if self.reorder else 0
        op = q.pop(i)
        if not q:
            del self.queues[key]
        mem = self.mem[op.dst]
        for k, sk in op.writes:
            if sk not in self.stage[op.src]:
                self.violate(f"{op.tag} from rank {op.src} put its stage {sk}, which no call "
                             "wrote (an unwritten stage row sent)")
                continue
            v, stag = self.stage[op.src][sk]
            if stag != op.tag and self.errors[op.src] is None:
                if stag[1] > op.tag[1]:
                    self.violate(f"{op.tag} from rank {op.src}: its stage {sk} was rewritten "
                                 f"by {stag} before the put landed (send buffer reused before "
                                 "quiet)")
                else:
                    self.violate(f"{op.tag} from rank {op.src} put its stage {sk}, last "
                                 f"written by {stag} (an unwritten stage row sent)")
            old = mem.vals.get(k)
            if old is not None and old[1] != op.tag and old[1] not in mem.finished \
                    and self.errors[op.dst] is None:
                self.violate(f"{op.tag} from rank {op.src} overwrote {k} on rank {op.dst} "
                             f"before it finished reading {old[1]} (slot reused early)")
            mem.vals[k] = (v, stag)
            if k[0] == "drecv" or k[0] == "crecv":
                self.port_rows[(op.src, op.dst, op.qp % self.P)] += 1
        if op.word is not None:
            w = mem.writers[op.word]
            w.add((op.src, op.qp))
            if len(w) > 1:
                self.violate(f"word {op.word} of rank {op.dst} written from more than one "
                             f"QP: {sorted(w)}")
            if op.word[0] == "dsig" and op.tag in mem.finished and self.errors[op.dst] is None:
                self.violate(f"a signal of {op.tag} from rank {op.src} landed on rank "
                             f"{op.dst} after it finished that epoch (it did not wait for it)")
            if op.how == "set":
                mem.words[op.word] = op.value
            else:
                mem.words[op.word] += op.value
                mem.contrib[op.word].append(op.tag)
        self.events += 1

    # -- scheduler ---------------------------------------------------------------------
    def run(self, programs, max_steps=2_000_000) -> bool:
        """Runs one generator per rank to completion; True if they hung."""
        state = {}
        for r, g in enumerate(programs):
            state[r] = {"gen": g, "req": None, "since": 0}
            self._advance(r, state, None)
        for _ in range(max_steps):
            if not state and not self.queues:
                return False
            runnable = [r for r in state if self._ready(r, state)]
            keys = list(self.queues)
            if not runnable and not keys:
                finite = [s["since"] + (self.timeout if s["req"][0] == "wait" else s["req"][1])
                          for s in state.values()
                          if s["req"][0] != "quiet"
                          and not (s["req"][0] == "wait" and self.m.no_timeout)]
                if not finite:
                    self.violate(f"hang: ranks {sorted(state)} wait forever on words no one "
                                 "writes (no timeout)")
                    return True
                self.clock = max(self.clock + 1, min(finite) + 1)
                continue
            self.clock += 1
            if self.policy == "lazy" and runnable:
                i = self.rng.randrange(len(runnable))
            else:
                i = self.rng.randrange(len(runnable) + len(keys))
            if i < len(runnable):
                r = runnable[i]
                s = state[r]
                val = None
                if s["req"][0] == "wait":
                    val = bool(s["req"][1]())
                self._advance(r, state, val)
            else:
                self.deliver(keys[i - len(runnable)])
        raise RuntimeError("simulation did not finish")

    def _ready(self, r, state):
        s = state[r]
        req = s["req"]
        if req[0] == "wait":
            if req[1]():
                return True
            return not self.m.no_timeout and self.clock - s["since"] > self.timeout
        if req[0] == "quiet":  # unbounded, like nvshmem_quiet: operations always land
            return req[1]()
        return self.clock - s["since"] >= req[1]  # sleep

    def _advance(self, r, state, val):
        s = state[r]
        try:
            req = s["gen"].send(val) if s["req"] is not None else next(s["gen"])
            while req[0] == "put":
                self.queues[(req[1].src, req[1].dst, req[1].qp)].append(req[1])
                req = s["gen"].send(None)
        except StopIteration:
            del state[r]
            return
        s["req"] = req
        s["since"] = self.clock

    # -- the protocol ------------------------------------------------------------------
    def _cfg(self, op, S, K, H, rpd, site):
        cfg = [0] * N_CFG
        cfg[0:11] = [op, self.R, self.E, self.M, S if op == OP_D else 0,
                     K if op == OP_D else 0, H, 0, rpd, self.NQ, site]
        return config_hash(cfg)

    def _wait(self, r, pred, peer, kind, qp, want):
        ok = yield ("wait", pred)
        if not ok:
            self.record(r, code="timeout", peer=peer, kind=kind, qp=qp, expected=want)
        return ok

    def _credits(self, r, op, b, n):
        if self.m.single_buffer or self.m.no_credit or n <= 2:
            return True
        mem = self.mem[r]
        for p in range(self.R):
            key = ("credit", op, b, p)
            ok = yield from self._wait(r, lambda k=key: mem.words[k] >= n - 2, p, "credit",
                                       CONTROL_QP, n - 2)
            if not ok:
                return False
        return True

    def _pack_headers(self, r, op, n, hdrs):
        for p in range(self.R):
            self.stage[r][("hstage", op, p)] = (hdrs[p], (op, n))

    def _headers(self, r, op, b, n):
        for i in range(1, self.R + 1):
            p = (r + i) % self.R
            yield ("put", Op(r, p, CONTROL_QP, (op, n), ((("hdr", op, b, r), ("hstage", op, p)),),
                             ("hsig", op, b, r), "set", n))

    def _quiet(self, r):
        """The send kernel's nvshmem_quiet: every operation this rank issued has landed."""
        if self.m.no_quiet:
            return
        yield ("quiet", lambda: not any(k[0] == r for k in self.queues))

    def _epoch_of(self, r, op, token):
        """The receive half's epoch from its int32 token word."""
        if self.m.narrow_token:
            return token[0] % (1 << 64)  # int32 sign-extended to 64 bits
        return widen_epoch(self.epoch[r][op], token[0])

    def _row(self, r, p, q, tag, key, stage_key, op, b):
        word = ("dsig", op, b, r, 0 if self.m.shared_signal_word else q)
        if self.m.signal_before_data:
            yield ("put", Op(r, p, q, tag, (), word, "add", 1))
            yield ("put", Op(r, p, q, tag, ((key, stage_key),)))
        else:
            yield ("put", Op(r, p, q, tag, ((key, stage_key),), word, "add", 1))

    @staticmethod
    def positions(idx, E, M, strict=True):
        """pos[S, K] (-1: unused or past M), counts[E] (at most M), bad (t, k, id) or None.
        strict=False is the combine receive's plan (CombineRecvPlan): ids outside [0, E)
        get no position, a repeated id gets one per slot, nothing is reported."""
        S, K = idx.shape
        pos = np.full((S, K), -1, np.int64)
        c = np.zeros(E, np.int64)
        bad = None
        for t in range(S):
            for k in range(K):
                g = int(idx[t, k])
                if strict and (g < -1 or g >= E or (g >= 0 and g in idx[t, :k])):
                    bad = bad or (t, k, g)
                    continue
                if g >= E:
                    continue
                if g < 0:
                    continue
                pos[t, k] = c[g] if c[g] < M else -1
                c[g] += 1
        return pos, np.minimum(c, M), bad

    def dispatch_send(self, r, x, idx, site=1):
        """Generator: the send half on rank r (x[S, H] float32, idx[S, K]); returns the
        token (epoch)."""
        self.epoch[r][OP_D] += 1
        n = self.epoch[r][OP_D]
        S, K = idx.shape
        h = self._cfg(OP_D, S, K, x.shape[1], 0, site)
        token = (token_word(n), h)
        if self.errors[r] is not None:
            return token  # a failed rank stays silent
        b = self.buf(n)
        pos, counts, bad = self.positions(idx, self.E, self.M)
        el = self.el
        hdrs = {p: dict(seq=n, hash=h, error=bad is not None,
                        counts=counts[p * el:(p + 1) * el].copy(),
                        rows=int(counts[p * el:(p + 1) * el].sum())) for p in range(self.R)}
        offsets = np.zeros(self.E, np.int64)
        for g in range(self.E):
            offsets[g] = counts[(g // el) * el:g].sum()
        # plan and pack write the stages before the credit wait
        self._pack_headers(r, OP_D, n, hdrs)
        for t in range(S):
            self.stage[r][("dstage", t)] = ((x[t].copy(), t), (OP_D, n))
        ok = yield from self._credits(r, OP_D, b, n)
        if not ok:
            return token
        yield from self._headers(r, OP_D, b, n)
        if bad is not None:
            yield from self._quiet(r)
            self.record(r, code="bad_id", token=bad[0], slot=bad[1], value=bad[2])
            return token
        order = [(t, k) for t in range(S) for k in range(K) if pos[t, k] >= 0]
        self.rng.shuffle(order)  # warps of the QP's CTAs issue in any order
        for t, k in order:
            g = int(idx[t, k])
            p, e = g // el, g % el
            j = int(offsets[g] + pos[t, k])
            q = row_qp(p, j, self.P, self.Q)
            key = ("drecv", b, e, r, int(pos[t, k]))
            yield from self._row(r, p, q, (OP_D, n), key, ("dstage", t), OP_D, b)
        yield from self._quiet(r)
        return token

    def _recv_headers(self, r, op, token, check_counts=None, rpd=None):
        """Waits for every writer's header (epoch n and the hash of this rank's own send,
        both in its token) and data words; the headers, or None if the call failed.
        check_counts[w]: the per-expert counts writer w must send (combine)."""
        n, hash_ = self._epoch_of(r, op, token), token[1]
        mem = self.mem[r]
        b = self.buf(n)
        if self.errors[r] is not None:
            return None
        hdrs = {}
        for w in range(self.R):
            key = ("hsig", op, b, w)
            want = 1 if self.m.no_epoch_check else n
            ok = yield from self._wait(r, lambda k=key: mem.words[k] >= want, w, "header",
                                       CONTROL_QP, n)
            if not ok:
                return None
            hd = self.read(r, ("hdr", op, b, w), (op, n), "header")
            if hd is None:
                hd = dict(seq=-1, hash=-1, error=False, counts=np.zeros(self.el, np.int64),
                          rows=0)
            if hd["seq"] != n or hd["hash"] != hash_:
                self.record(r, code="mismatch", peer=w, my_seq=n, peer_seq=hd["seq"])
                return None
            if hd["error"]:
                if w != r:
                    self.record(r, code="peer_failed", peer=w)
                return None
            cnt = np.asarray(hd["counts"])
            if np.any(cnt < 0) or np.any(cnt > self.M) or int(cnt.sum()) != hd["rows"] \
                    or (rpd is not None and hd["rows"] > rpd):
                self.record(r, code="bad_counts", peer=w)  # CountsFit in the kernels
                return None
            if check_counts is not None:
                want = np.asarray(check_counts[w])
                if self.m.total_rows_only:
                    want, cnt = want.sum(keepdims=True), cnt.sum(keepdims=True)
                diff = np.flatnonzero(want != cnt)
                if diff.size:
                    e = int(diff[0])
                    self.record(r, code="rows_mismatch", peer=w, expert=e,
                                expected=int(want[e]), seen=int(cnt[e]))
                    return None
            hdrs[w] = hd
        for w in range(self.R):
            for q in range(self.NQ):
                want = rows_on_qp(hdrs[w]["rows"], r, q, self.P, self.Q)
                key = ("dsig", op, b, w, q)
                ok = yield from self._wait(r, lambda k=key, v=want: mem.words[k] >= v, w,
                                           "data", q, want)
                if not ok:
                    return None
                if mem.words[key] != want:
                    self.record(r, code="extra_signal", peer=w, qp=q, expected=want,
                                seen=mem.words[key])
                    return None
                stale = [c for c in mem.contrib[key] if c != (op, n)]
                if stale:
                    self.violate(f"rank {r} accepted word {key} for {(op, n)} holding "
                                 f"increments of {sorted(set(stale))}")
        return hdrs

    def _finish(self, r, op, n):
        """Reset buffer b's data words, mark the epoch read, return the credits."""
        mem = self.mem[r]
        b = self.buf(n)
        mem.finished.add((op, n))
        if self.m.credit_before_reset:
            for w in range(self.R):
                yield ("put", Op(r, w, CONTROL_QP, (op, n), (), ("credit", op, b, r), "set", n))
            yield ("sleep", 1)  # the reset is a later step: writers may run in between
        for k in [k for k in mem.words if k[0] == "dsig" and k[1] == op and k[2] == b]:
            later = [c for c in mem.contrib[k] if c != (op, n)]
            if later:
                self.violate(f"rank {r} reset word {k} after epoch {n} holding increments of "
                             f"{sorted(set(later))} (they are lost)")
            mem.words[k] = 0
            mem.contrib[k] = []
            mem.writers[k] = set()
        if not self.m.credit_before_reset:
            for w in range(self.R):
                yield ("put", Op(r, w, CONTROL_QP, (op, n), (), ("credit", op, b, r), "set", n))

    def dispatch_recv(self, r, token, H):
        """Generator: the receive half of the send's token (epoch, hash) on rank r;
        returns (recv_x, recv_count, src_rank, src_index, first_row, row_count)."""
        el, R, M = self.el, self.R, self.M
        n = self._epoch_of(r, OP_D, token)
        recv_x = np.zeros((el, R * M, H), np.float32)
        src_rank = np.full((el, R * M), -1, np.int32)
        src_index = np.full((el, R * M), -1, np.int32)
        first_row = np.zeros((el, R), np.int32)
        row_count = np.zeros((el, R), np.int32)
        hdrs = yield from self._recv_headers(r, OP_D, token)
        if hdrs is None:
            return recv_x, np.zeros(el, np.int32), src_rank, src_index, first_row, row_count
        b = self.buf(n)
        sources = list(range(R))[::-1] if self.m.wrong_row_order else list(range(R))
        for e in range(el):
            row = 0
            for s in sources:
                c = int(hdrs[s]["counts"][e])
                first_row[e, s], row_count[e, s] = row, c
                for p in range(c):
                    v = self.read(r, ("drecv", b, e, s, p), (OP_D, n), "row")
                    if v is not None:
                        recv_x[e, row], src_index[e, row] = v[0], v[1]
                    src_rank[e, row] = s
                    row += 1
        yield from self._finish(r, OP_D, n)
        return recv_x, row_count.sum(1).astype(np.int32), src_rank, src_index, first_row, \
            row_count

    def combine_send(self, r, y, first_row, row_count, rows_per_dest, site=2):
        """Generator: the owner's send half (y[E_local, R*M, H]); returns the token."""
        self.epoch[r][OP_C] += 1
        n = self.epoch[r][OP_C]
        h = self._cfg(OP_C, 0, 0, y.shape[-1], rows_per_dest, site)
        token = (token_word(n), h)
        if self.errors[r] is not None:
            return token
        b = self.buf(n)
        el, R = self.el, self.R
        streams, hdrs = {}, {}
        f64, c64 = first_row.astype(np.int64), row_count.astype(np.int64)
        bad = bool(np.any((f64 < 0) | (c64 < 0) | (c64 > self.M) | (f64 + c64 > R * self.M)))
        for d in range(R):
            rows = [] if bad else [(e, int(first_row[e, d]) + i) for e in range(el)
                                   for i in range(int(row_count[e, d]))]
            bad = bad or len(rows) > rows_per_dest
            streams[d] = rows
            hdrs[d] = dict(seq=n, hash=h, error=False, rows=len(rows),
                           counts=row_count[:, d].copy())
        for d in range(R):
            hdrs[d]["error"] = bad
        self._pack_headers(r, OP_C, n, hdrs)
        if bad:
            pass
        elif self.m.pack_first_match:
            for e in range(el):
                for i in range(R * self.M):
                    for d in range(R):
                        f, c = int(first_row[e, d]), int(row_count[e, d])
                        if f <= i < f + c:
                            j = sum(int(row_count[e2, d]) for e2 in range(e)) + i - f
                            self.stage[r][("cstage", d, j)] = (y[e, i].copy(), (OP_C, n))
                            break
        else:  # CombinePack: stage row j of source d is y[e, first_row[e, d] + r]
            for d in range(R):
                for j, (e, i) in enumerate(streams[d]):
                    self.stage[r][("cstage", d, j)] = (y[e, i].copy(), (OP_C, n))
        ok = yield from self._credits(r, OP_C, b, n)
        if not ok:
            return token
        yield from self._headers(r, OP_C, b, n)
        if bad:
            yield from self._quiet(r)
            self.record(r, code="bad_handle")
            return token
        order = [(d, j) for d in range(R) for j in range(len(streams[d]))]
        self.rng.shuffle(order)
        for d, j in order:
            q = row_qp(d, j, self.P, self.Q)
            yield from self._row(r, d, q, (OP_C, n), ("crecv", b, r, j), ("cstage", d, j),
                                 OP_C, b)
        yield from self._quiet(r)
        return token

    def combine_recv(self, r, token, idx, w, H, rows_per_dest=None):
        """Generator: the source's receive half; returns out[S, H] float32."""
        el = self.el
        n = self._epoch_of(r, OP_C, token)
        S, K = idx.shape
        out = np.zeros((S, H), np.float32)
        pos, counts, _ = self.positions(idx, self.E, self.M, strict=False)
        expect = [counts[p * el:(p + 1) * el] for p in range(self.R)]
        hdrs = yield from self._recv_headers(r, OP_C, token, check_counts=expect,
                                             rpd=rows_per_dest)
        if hdrs is None:
            return out
        b = self.buf(n)
        offsets = np.array([counts[(g // el) * el:g].sum() for g in range(self.E)])
        for t in range(S):
            acc = np.zeros(H, np.float32)
            for k in range(K):
                g = int(idx[t, k])
                if g < 0 or pos[t, k] < 0:
                    continue
                v = self.read(r, ("crecv", b, g // el, int(offsets[g] + pos[t, k])), (OP_C, n),
                              "row")
                if v is not None:
                    acc = (acc + (np.float32(w[t, k]) * v).astype(np.float32)).astype(np.float32)
            out[t] = acc
        yield from self._finish(r, OP_C, n)
        return out

    # -- programs ----------------------------------------------------------------------
    def program(self, r, steps, outs):
        """Steps (dicts with "do"): dispatch_send (x, idx, name), dispatch_recv (name),
        combine_send (y, first_row, row_count, rows_per_dest, name), combine_recv (name,
        idx, w, rows_per_dest), sleep (steps). Outputs are appended to outs."""
        tokens = {}
        for st in steps:
            do = st["do"]
            if do == "sleep":
                yield ("sleep", st["steps"])
                continue
            if do == "dispatch_send":
                tokens[st["name"]] = (yield from self.dispatch_send(
                    r, st["x"], st["idx"], st.get("site", 1))), st["x"].shape[1]
                outs.append(None)
            elif do == "dispatch_recv":
                token, H = tokens.pop(st["name"])
                outs.append((yield from self.dispatch_recv(r, token, H)))
            elif do == "combine_send":
                tokens[st["name"]] = (yield from self.combine_send(
                    r, st["y"], st["first_row"], st["row_count"], st["rows_per_dest"],
                    st.get("site", 2))), st["y"].shape[-1]
                outs.append(None)
            elif do == "combine_recv":
                token, H = tokens.pop(st["name"])
                outs.append((yield from self.combine_recv(r, token, st["idx"], st["w"], H,
                                                          st.get("rows_per_dest"))))
            else:
                raise ValueError(f"unknown step {do!r}")

    def simulate(self, steps_per_rank) -> Result:
        outs = [[] for _ in range(self.R)]
        hang = self.run([self.program(r, s, outs[r]) for r, s in enumerate(steps_per_rank)])
        return Result(outs, list(self.errors), list(self.violations), hang,
                      dict(self.port_rows), self.events)
