"""Host SIMULATOR of the low-latency mode's intranode protocol on real ranks (a model run
on the CPU, not a GPU run): every rank's buffer is a peer-writable memory, ranks run their
own programs at their own pace, and a scheduler interleaves their memory operations in a
random order.

How it corresponds to kernels/cuda/low_latency_kernels.{h,cu} (real-rank path):

| kernels                                        | simulator                               |
| ---------------------------------------------- | --------------------------------------- |
| LowLatencyHeader: seq, per half h = n % 2:     | `Buffer.seq`, `Buffer.arrive/credit/    |
|   arrive, credit, tag, my_tag                  |   tag/my_tag[kind][h]`                  |
| slots [2][E_local][R][M], slot_tok, counts     | `Buffer.slots`, `Buffer.counts`, keyed  |
| cstage [2][R][rows_per_dest]                   | `Buffer.cstage`    by half first        |
| ll_dispatch_plan: ++seq, credit >= n - 2 wait, | `_dispatch_send` up to the pushes       |
|   counts, epoch into the staging output        |   (returns n to the receive half)       |
| ll_dispatch_push: rows, then tag + arrive      | `_dispatch_send` rows, then the signals |
| ll_dispatch_recv: arrive wait, == n and tag    | `_dispatch_recv(n)`                     |
|   checks, pack, last block credits sources     |                                         |
| ll_combine_plan / push / recv_plan / recv      | `_combine_send`, `_combine_recv(n)`     |
| ll_slot, ll_stage_row, ll_half,                | `slot_index`, `stage_row`, `half`,      |
|   ll_epoch_from_low (low_latency_math.h)       |   `epoch_from_low` below                |
| JAX_EP_TIMEOUT_S, globaltimer                  | `timeout` in scheduler steps            |
| sticky error record (first error wins)         | `Rank.error`                            |
| g_ll_failed (set by every protocol error)      | `Rank.protocol_failed`                  |
| handler's FitsArea error (host, no launch)     | ERR_AREA; the rank's program stops      |

Every memory cell remembers who wrote it, for which epoch and call configuration, and
every region remembers the last epoch its reader finished. The checks made on every
event (`World.findings`): a read sees data of the reader's own epoch, from the expected
writer, written with the reader's configuration (no read before the data lands, no
stale epoch, no mixed shapes); a write into a region comes only after its reader
finished the previous epoch there (no slot or stage overwritten unread); rows stay in
the area sized at setup. A run where every rank blocks for good raises `Hang`.

Planted mistakes (`plant=`) switch single pieces of the protocol off, so tests can show
each is caught: "no_dispatch_credit", "no_combine_credit", "credit_before_read",
"flag_before_data", "stale_epoch", "no_timeout", "no_config_check", "single_half" (one
data half with the double-buffered credit rule n - 2), "latest_epoch" (a receive half
takes the last epoch sent instead of the one its send half handed over),
"silent_bad_handle" (an owner with a foreign combine handle sends no rows but its normal
tag, so its sources read rows nobody wrote), "masked_failure" (whether the rank failed is
read from the first recorded error only, so a timeout after an earlier bad id or foreign
handle goes unseen and the send writes without its credit), "combine_counts_repeats" (the
combine's receive half numbers a repeated id of a token, which the dispatch left unused,
so later rows of that expert and the experts after it are read from the wrong stage row).

Protocol errors set `Rank.protocol_failed` (g_ll_failed in the kernels) even when the
sticky record already holds an earlier value error: the record keeps the first error, the
flag decides whether data moves.

Programs are lists of `Call`s (the send half, then the receive half) or of ("send", Call)
/ ("recv", Call) pairs, so send halves can be in flight together and receive halves can
come in another order, as in a real program.
"""
from __future__ import annotations

import dataclasses
import random

import numpy as np

PLANTS = ("no_dispatch_credit", "no_combine_credit", "credit_before_read",
          "flag_before_data", "stale_epoch", "no_timeout", "no_config_check", "single_half",
          "latest_epoch", "silent_bad_handle", "masked_failure", "combine_counts_repeats")
EPOCH_MASK = 0x7fffffff
FAILED = "failed"  # tag a rank with a protocol error sends in place of its own
BAD_HANDLE = "bad_handle"  # tag of an owner whose combine handle does not fit y

# Error codes, as kernels/cuda/intranode_buffer.h names them; ERR_AREA is the handler's
# host-side error for a call beyond the area (it launches nothing and XLA stops the
# rank's program there).
ERR_BAD_ID, ERR_TIMEOUT, ERR_BAD_HANDLE, ERR_CALL_SITE, ERR_PEER_FAILED, ERR_AREA = (
    "bad_topk_id", "timeout", "bad_handle", "config_mismatch", "peer_failed", "area")
PROTOCOL_ERRORS = (ERR_TIMEOUT, ERR_CALL_SITE, ERR_PEER_FAILED)


class Hang(RuntimeError):
    """Every unfinished rank waits for something no rank will ever do."""


# --- index math (kernels/common/low_latency_math.h) -------------------------------------

def slot_index(e, s, p, R, M):
    """Slot of source s's p-th row for local expert e in an owner's [E_local][R][M] slots."""
    return (e * R + s) * M + p


def stage_row(e, p, row_count_col):
    """Row in an owner's stage region for one source: the source's rows of experts before
    e, then p. row_count_col[e2] = rows of that source for local expert e2."""
    return int(sum(row_count_col[:e])) + p


def half(n):
    """Data half epoch n uses."""
    return n % 2


def epoch_from_low(seq, low):
    """Full epoch from the 31 bits a send half hands over, given the latest epoch sent."""
    return seq - ((seq - low) & EPOCH_MASK)


def positions(idx, E, M, skip_repeats=True):
    """Each (token, slot)'s row among this rank's tokens that name the same expert
    (-1: unused, a bad id, a repeat in the token, or past M), and per-expert counts
    capped at M. idx[S, K] int32. skip_repeats=False numbers repeats too (a planted
    mistake of the combine's receive half)."""
    S, K = idx.shape
    pos = np.full((S, K), -1, np.int64)
    cnt = np.zeros(E, np.int64)
    bad = []
    for t in range(S):
        for k in range(K):
            g = int(idx[t, k])
            if g < -1 or g >= E:
                bad.append((t, k, g))
                continue
            if g < 0 or (skip_repeats and g in idx[t, :k]):
                if g >= 0:
                    bad.append((t, k, g))
                continue
            if cnt[g] < M:
                pos[t, k] = cnt[g]
            cnt[g] += 1
    return pos, np.minimum(cnt, M), bad


def _fit(row, H):
    """A row cut or zero-padded to H elements (rows of a call with other shapes)."""
    out = np.zeros(H, row.dtype)
    n = min(H, row.shape[0])
    out[:n] = row[:n]
    return out


# --- memory -------------------------------------------------------------------------------

@dataclasses.dataclass
class Cell:
    epoch: int
    writer: int
    tag: object
    value: object


class Buffer:
    """One rank's low-latency area: header words and data cells."""

    def __init__(self, R):
        self.seq = {"d": 0, "c": 0}
        self.arrive = {k: [[0] * R for _ in range(2)] for k in "dc"}
        self.credit = {k: [[0] * R for _ in range(2)] for k in "dc"}
        self.tag = {k: [[None] * R for _ in range(2)] for k in "dc"}
        self.my_tag = {k: [None, None] for k in "dc"}
        self.slots = {}   # (half, slot) -> Cell(value=(row, token))
        self.counts = {}  # (half, e, s) -> Cell(value=count)
        self.cstage = {}  # (half, r, row) -> Cell(value=row)


@dataclasses.dataclass
class Call:
    """One low-latency op of a rank's program: kind 'dispatch' (x[S, H], idx[S, K]) or
    'combine' (y[E_local, R*M, H], idx/w[S, K], first_row/row_count[E_local, R])."""
    kind: str
    x: np.ndarray | None = None
    idx: np.ndarray | None = None
    y: np.ndarray | None = None
    w: np.ndarray | None = None
    first_row: np.ndarray | None = None
    row_count: np.ndarray | None = None
    M: int | None = None        # this call's max_tokens (default: setup's)
    site: int = 0               # call-site id (same on every rank of a correct program)
    rows_per_dest: int | None = None  # combine: M * min(K, E_local) of the call (default:
    #                                   the area's)


@dataclasses.dataclass
class Setup:
    R: int
    E: int
    M: int
    K: int
    H: int

    @property
    def el(self):
        return self.E // self.R

    @property
    def rows_per_dest(self):
        return self.M * min(self.K, self.el)


class Rank:
    def __init__(self, me, setup):
        self.me = me
        self.error = None  # sticky: (code, details), the first error recorded
        self.protocol_failed = False  # any protocol error so far (g_ll_failed)
        self.stopped = False  # a handler returned an error: the program ends there
        self.masked = False  # planted "masked_failure": failed() from the first error only
        self.results = []  # in the order of the receive halves
        self.by_call = {}  # id(call) -> its result

    def record(self, code, *details):
        if self.error is None:
            self.error = (code,) + details
        if code in PROTOCOL_ERRORS:
            self.protocol_failed = True

    def failed(self):
        if self.masked:
            return self.error is not None and self.error[0] in PROTOCOL_ERRORS
        return self.protocol_failed


class World:
    def __init__(self, setup: Setup, plant=(), timeout=400, seed=0, hang_limit=20000):
        for p in plant:
            if p not in PLANTS:
                raise ValueError(f"unknown planted mistake {p!r}; one of {PLANTS}")
        self.s = setup
        self.plant = set(plant)
        self.timeout = None if "no_timeout" in self.plant else timeout
        self.rng = random.Random(seed)
        self.hang_limit = hang_limit
        self.epochs = {}  # (rank, id(call)) -> low 31 bits its send half handed over
        self.bufs = [Buffer(setup.R) for _ in range(setup.R)]
        self.ranks = [Rank(r, setup) for r in range(setup.R)]
        for rk in self.ranks:
            rk.masked = "masked_failure" in self.plant
        # consumed[kind][h][reader][writer]: last epoch `reader` finished reading in
        # writer's region of half h
        self.consumed = {k: [[[0] * setup.R for _ in range(setup.R)] for _ in range(2)]
                         for k in "dc"}
        self.findings = []

    # --- checks ---------------------------------------------------------------------
    def _find(self, what):
        self.findings.append(what)

    def _half(self, n):
        return 0 if "single_half" in self.plant else half(n)

    def _write(self, kind, reader, writer, epoch, cells, key, cell):
        h = key[0]
        last = max([e for e in range(epoch - 1, 0, -1) if self._half(e) == h][:1] or [0])
        if self.consumed[kind][h][reader][writer] < last:
            self._find(f"overwrote unread: rank {writer} wrote epoch {epoch} into rank "
                       f"{reader}'s {kind} region (half {h}) before {reader} read epoch "
                       f"{last}")
        cells[key] = cell

    def _read(self, cells, key, reader, epoch, writer, tag, what):
        c = cells.get(key)
        if c is None or c.epoch != epoch or c.writer != writer:
            got = None if c is None else (c.epoch, c.writer)
            self._find(f"read before written/stale: rank {reader} read {what} {key} for "
                       f"epoch {epoch} from rank {writer}, found (epoch, writer) {got}")
            return None if c is None else c.value
        if c.tag != tag:
            self._find(f"mixed configs: rank {reader} read {what} {key} written with "
                       f"{c.tag}, its own is {tag}")
        return c.value

    # --- waits ----------------------------------------------------------------------
    def _wait(self, rank, cond, peer, what, epoch):
        """Generator: spins until cond(); bounded by the timeout. Returns True when met."""
        spun = 0
        while not cond():
            if rank.failed():  # an error is recorded: later waits end at once
                return False
            spun += 1
            if self.timeout is not None and spun > self.timeout:
                rank.record(ERR_TIMEOUT, peer, what, epoch)
                return False
            yield "blocked"
        return True

    # --- dispatch -------------------------------------------------------------------
    def _tag(self, call, extra):
        return (call.site,) + extra

    def _dispatch_send(self, rank, call):
        S, R = self.s, self.s.R
        me, buf = rank.me, self.bufs[rank.me]
        M = call.M or S.M
        if M > S.M or call.x.shape[1] > S.H or call.idx.size > S.M * S.K:
            # FitsArea in the handler: an error before any kernel, no epoch taken.
            rank.record(ERR_AREA, me, "dispatch does not fit the area sized at setup")
            rank.stopped = True
            return
        n = buf.seq["d"] = buf.seq["d"] + 1
        h = self._half(n)
        self.epochs[(me, id(call))] = n & EPOCH_MASK
        x, idx = call.x, call.idx
        tag = self._tag(call, ("d", x.shape[0], x.shape[1], idx.shape[1], M, x.dtype.str))
        buf.my_tag["d"][h] = tag
        pos, cnt, bad = positions(idx, S.E, M)
        for t, k, g in bad:
            rank.record(ERR_BAD_ID, t, k, g)
        yield "step"
        # Credits: no owner's slots are touched before it read the previous epoch.
        if "no_dispatch_credit" not in self.plant:
            for r in self.rng.sample(range(R), R):
                yield from self._wait(rank, lambda r=r: buf.credit["d"][h][r] >= n - 2, r,
                                      "dispatch credit", n)
        moving = not rank.failed()
        send_tag = tag if moving else FAILED
        signals = [(r, "signal") for r in range(R)]
        if moving:
            writes = [(r, "counts") for r in range(R)]
            for t in range(idx.shape[0]):
                for k in range(idx.shape[1]):
                    if pos[t, k] >= 0:
                        writes.append(((t, k), "row"))
            self.rng.shuffle(writes)
        else:
            writes = []
        if "flag_before_data" in self.plant:
            ops = signals + writes
        else:
            ops = writes + signals
        for target, op in ops:
            if op == "counts":
                r = target
                ob = self.bufs[r]
                for e in range(S.el):
                    self._write("d", r, me, n, ob.counts, (h, e, me),
                                Cell(n, me, tag, int(cnt[r * S.el + e])))
            elif op == "row":
                t, k = target
                g = int(idx[t, k])
                r, e = g // S.el, g % S.el
                p = int(pos[t, k])
                if p >= S.M:
                    self._find(f"row past the area: p={p} >= M={S.M}")
                    continue
                ob = self.bufs[r]
                self._write("d", r, me, n, ob.slots, (h, slot_index(e, me, p, R, S.M)),
                            Cell(n, me, tag, (x[t].copy(), t)))
            else:
                ob = self.bufs[target]
                ob.tag["d"][h][me] = send_tag
                yield "step"
                ob.arrive["d"][h][me] = n
            yield "step"

    def _dispatch_recv(self, rank, call):
        S, R, el = self.s, self.s.R, self.s.el
        me, buf = rank.me, self.bufs[rank.me]
        M = call.M or S.M
        n = self._recv_epoch(rank, "d", call)
        h = self._half(n)
        H = call.x.shape[1]
        need = 1 if "stale_epoch" in self.plant else n
        for s in self.rng.sample(range(R), R):
            yield from self._wait(rank, lambda s=s: buf.arrive["d"][h][s] >= need, s,
                                  "dispatch arrival", n)
        self._check_arrivals(rank, "d", h, n)
        recv = np.zeros((el, R * M, H), call.x.dtype)
        src_rank = np.full((el, R * M), -1, np.int32)
        src_index = np.full((el, R * M), -1, np.int32)
        first = np.zeros((el, R), np.int32)
        rows = np.zeros((el, R), np.int32)
        count = np.zeros(el, np.int32)
        credit_early = "credit_before_read" in self.plant
        if credit_early:
            yield from self._credit(rank, "d", n)
        if not rank.failed():
            tag = buf.my_tag["d"][h]
            for e in range(el):
                total = 0
                for s in range(R):
                    c = self._read(buf.counts, (h, e, s), me, n, s, tag, "count")
                    c = 0 if c is None else min(int(c), M)
                    first[e, s], rows[e, s] = total, c
                    for p in range(c):
                        v = self._read(buf.slots, (h, slot_index(e, s, p, R, S.M)), me, n, s,
                                       tag, "slot")
                        if v is not None:
                            recv[e, total + p] = _fit(v[0], H)
                            src_rank[e, total + p], src_index[e, total + p] = s, v[1]
                        yield "step"
                    total += c
                count[e] = total
        if not credit_early:
            yield from self._credit(rank, "d", n)
        res = dict(recv=recv, count=count, src_rank=src_rank, src_index=src_index,
                   first_row=first, row_count=rows)
        rank.results.append(res)
        rank.by_call[id(call)] = res

    def _recv_epoch(self, rank, kind, call):
        """The epoch a receive half works on: handed over by its send half."""
        seq = self.bufs[rank.me].seq[kind]
        if "latest_epoch" in self.plant:
            return seq
        return epoch_from_low(seq, self.epochs.pop((rank.me, id(call))))

    def _check_arrivals(self, rank, kind, h, n):
        """After the waits: every peer's arrival is exactly epoch n, with this call's tag.
        Returns the owners that sent BAD_HANDLE (combine): their rows count as zero."""
        buf = self.bufs[rank.me]
        bad_owners = set()
        if rank.failed():
            return bad_owners
        for p in range(self.s.R):
            got = buf.arrive[kind][h][p]
            if got != n and "stale_epoch" not in self.plant:
                rank.record(ERR_CALL_SITE, p, kind, got, n)
                return bad_owners
            tag = buf.tag[kind][h][p]
            if "no_config_check" in self.plant:
                continue
            if tag == FAILED:
                rank.record(ERR_PEER_FAILED, p, kind)
            elif tag == BAD_HANDLE and kind == "c":
                rank.record(ERR_BAD_HANDLE, p)
                bad_owners.add(p)
            elif tag != buf.my_tag[kind][h]:
                rank.record(ERR_CALL_SITE, p, kind, tag, buf.my_tag[kind][h])
        return bad_owners

    def _credit(self, rank, kind, n):
        """The reader is done with epoch n of every writer's region: credit each writer."""
        h = self._half(n)
        for p in range(self.s.R):
            c = self.consumed[kind][h][rank.me]
            c[p] = max(c[p], n)
        for p in self.rng.sample(range(self.s.R), self.s.R):
            self.bufs[p].credit[kind][h][rank.me] = n
            yield "step"

    # --- combine --------------------------------------------------------------------
    def _combine_send(self, rank, call):
        S, R, el = self.s, self.s.R, self.s.el
        me, buf = rank.me, self.bufs[rank.me]
        M = call.M or S.M
        if M > S.M or call.y.shape[-1] > S.H or (call.rows_per_dest or 0) > S.rows_per_dest:
            rank.record(ERR_AREA, me, "combine does not fit the area sized at setup")
            rank.stopped = True
            return
        n = buf.seq["c"] = buf.seq["c"] + 1
        h = self._half(n)
        self.epochs[(me, id(call))] = n & EPOCH_MASK
        y = call.y
        # As ll_call_tag in the handler: rows per source, M, row size and dtype.
        tag = self._tag(call, ("c", call.rows_per_dest or S.rows_per_dest, y.shape[-1], M,
                               y.dtype.str))
        buf.my_tag["c"][h] = tag
        fr, rc = call.first_row, call.row_count
        # In int64, as the kernel: a foreign first_row + row_count may pass 2^31.
        fr64, rc64 = fr.astype(np.int64), rc.astype(np.int64)
        ok = bool(np.all(fr64 >= 0) and np.all(rc64 >= 0) and np.all(fr64 + rc64 <= R * M))
        cap = min(call.rows_per_dest or S.rows_per_dest, S.rows_per_dest)
        if ok:
            ok = all(int(rc64[:, d].sum()) <= cap for d in range(R))
        if not ok:
            rank.record(ERR_BAD_HANDLE, me)
        yield "step"
        if "no_combine_credit" not in self.plant:
            for d in self.rng.sample(range(R), R):
                yield from self._wait(rank, lambda d=d: buf.credit["c"][h][d] >= n - 2, d,
                                      "combine credit", n)
        moving = not rank.failed() and ok
        silent = "silent_bad_handle" in self.plant
        send_tag = FAILED if rank.failed() else (tag if ok or silent else BAD_HANDLE)
        writes = []
        if moving:
            for d in range(R):
                for e in range(el):
                    for p in range(int(rc[e, d])):
                        writes.append((d, e, p))
            self.rng.shuffle(writes)
        signals = [(d, None, None) for d in range(R)]
        ops = signals + writes if "flag_before_data" in self.plant else writes + signals
        for d, e, p in ops:
            if e is None:
                self.bufs[d].tag["c"][h][me] = send_tag
                yield "step"
                self.bufs[d].arrive["c"][h][me] = n
            else:
                row = stage_row(e, p, rc[:, d])
                if row >= S.rows_per_dest:
                    self._find(f"stage row past the area: {row} >= {S.rows_per_dest}")
                    continue
                self._write("c", d, me, n, self.bufs[d].cstage, (h, me, row),
                            Cell(n, me, tag, y[e, fr[e, d] + p].copy()))
            yield "step"

    def _combine_recv(self, rank, call):
        S, R, el = self.s, self.s.R, self.s.el
        me, buf = rank.me, self.bufs[rank.me]
        M = call.M or S.M
        n = self._recv_epoch(rank, "c", call)
        h = self._half(n)
        idx, w = call.idx, call.w
        H = call.y.shape[-1]
        pos, cnt, bad = positions(idx, S.E, M,
                                  skip_repeats="combine_counts_repeats" not in self.plant)
        for t, k, g in bad:  # reported, left unused (the CPU's combine errors on them)
            rank.record(ERR_BAD_ID, t, k, g)
        need = 1 if "stale_epoch" in self.plant else n
        for r in self.rng.sample(range(R), R):
            yield from self._wait(rank, lambda r=r: buf.arrive["c"][h][r] >= need, r,
                                  "combine arrival", n)
        bad_owners = self._check_arrivals(rank, "c", h, n)
        out = np.zeros((idx.shape[0], H), call.y.dtype)
        credit_early = "credit_before_read" in self.plant
        if credit_early:
            yield from self._credit(rank, "c", n)
        if not rank.failed():
            tag = buf.my_tag["c"][h]
            # Where each expert's rows start in its owner's stage region for this rank.
            start = np.zeros(S.E, np.int64)
            for r in range(R):
                start[r * el:(r + 1) * el] = [stage_row(e, 0, cnt[r * el:(r + 1) * el])
                                              for e in range(el)]
            for t in range(idx.shape[0]):
                acc = np.zeros(H, np.float32)
                for k in range(idx.shape[1]):
                    g, p = int(idx[t, k]), int(pos[t, k])
                    if g < 0 or p < 0 or g // el in bad_owners:
                        continue
                    v = self._read(buf.cstage, (h, g // el, int(start[g]) + p), me, n,
                                   g // el, tag, "stage row")
                    if v is not None:
                        acc = acc + np.float32(w[t, k]) * _fit(v, H).astype(np.float32)
                out[t] = acc.astype(call.y.dtype)
                yield "step"
        if not credit_early:
            yield from self._credit(rank, "c", n)
        rank.results.append(dict(out=out))
        rank.by_call[id(call)] = rank.results[-1]

    # --- driver ---------------------------------------------------------------------
    def _program(self, rank, calls):
        halves = {("send", "dispatch"): self._dispatch_send,
                  ("recv", "dispatch"): self._dispatch_recv,
                  ("send", "combine"): self._combine_send,
                  ("recv", "combine"): self._combine_recv}
        for item in calls:
            ops = [("send", item), ("recv", item)] if isinstance(item, Call) else [item]
            for op, call in ops:
                if (op, call.kind) not in halves:
                    raise ValueError(f"unknown half {op!r} of call kind {call.kind!r}")
                yield from halves[(op, call.kind)](rank, call)
                if rank.stopped:
                    return

    def run(self, programs):
        """programs[r]: rank r's list of Calls (None: the rank never runs). Interleaves the
        ranks' memory operations in a random order until all finish."""
        gens = {r: self._program(self.ranks[r], calls)
                for r, calls in enumerate(programs) if calls is not None}
        stalled = 0
        while gens:
            r = self.rng.choice(list(gens))
            try:
                ev = next(gens[r])
            except StopIteration:
                del gens[r]
                stalled = 0
                continue
            stalled = stalled + 1 if ev == "blocked" else 0
            if stalled > self.hang_limit:
                raise Hang(f"ranks {sorted(gens)} wait for good (no progress in "
                           f"{self.hang_limit} scheduler steps)")
        return self


def simulate(setup: Setup, programs, **kw) -> World:
    return World(setup, **kw).run(programs)
