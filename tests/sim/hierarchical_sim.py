"""Host SIMULATOR of the internode protocols (a model of the wire, not a GPU run):
the hierarchical mode (RDMA once per destination node to the rail peer, NVLink
forwarding inside the node, chunked rings with head/tail credits) and, for comparison on
the same inputs, the direct mode (every rank puts to every rank).

Core (written here; the direct-mode simulator of the internode kernels lives in
tests/sim/internode_sim.py once it exists, and is the authority for that protocol):
  * every rank runs several actors (Python generators) that yield `Wait`s on conditions;
  * every (source, destination, QP) is a FIFO of puts and signals, delivered in order on
    that QP, with arbitrary interleaving across QPs, actors and ranks (seeded scheduler);
  * signal words remember who wrote them: a word written from two (source, QP) pairs
    is a violation;
  * ring slots and receive rows remember what landed in them: reading a slot before the
    expected data landed, or overwriting one before it was consumed, is a violation;
  * waits are bounded (`timeout_steps` scheduler steps; when nothing can move the clock
    jumps to the next deadline), a timed-out rank records which peer and which signal it
    waited for and signals an abort to every peer, so the error reaches every rank;
  * every call starts with a count exchange carrying a sequence number, a hash of the
    configuration and the sticky error flag: a mismatch or a bad expert id on any rank is
    an error on every rank, not a hang;
  * bytes are counted per (source, port) and per (source, peer, port).

Layout constants (rows per RDMA chunk, chunks per RDMA ring, rows per NVLink ring, row
strides) come from `jax_ep.network.modes`, which binds
kernels/internode/hierarchical_layout.h; tests pass smaller rings to force wrap-around.

Planted mistakes (`bugs=`), each of which a test must see reported:
  credit_early          forwarder returns an RDMA ring credit before forwarding the chunk
  forward_before_land   forwarder waits for one chunk too few on the QP before reading
                        (direct mode: the receiver waits for QP 0's closing signal only)
  nvl_publish_early     forwarder publishes an NVLink ring slot before writing it
  missing_close         a sender omits the closing signal on its last QP
  shared_signal_word    all QPs of a source signal one word
  no_final_credit_wait  a sender resets its credit word without waiting for the last
                        credit (a late credit would corrupt the call after next)
"""
from __future__ import annotations

import collections
import dataclasses
import hashlib

import numpy as np

from jax_ep._src.ext import require_ext
from jax_ep.network import modes
from jax_ep.network.topology import Topology
from jax_ep.network.transport import _qp_for_arrays  # the compiled striping rule (binding)

BUGS = frozenset({"credit_early", "forward_before_land", "nvl_publish_early",
                  "missing_close", "shared_signal_word", "no_final_credit_wait"})


class Violation(AssertionError):
    """The simulated protocol broke a rule (read before landing, early reuse, ...)."""


@dataclasses.dataclass
class Wait:
    pred: object  # () -> bool
    desc: str     # what is awaited, naming the peer and the signal
    peer: int = -1


@dataclasses.dataclass
class Config:
    nodes: int
    gpus: int
    mode: str = "hierarchical"            # or "direct"
    num_ports: int = 2
    qps_per_port: int = 2
    chunk_rows: int = modes.RDMA_CHUNK_ROWS
    ring_chunks: int = modes.RDMA_RING_CHUNKS
    nvl_rows: int = modes.NVL_RING_ROWS
    timeout_steps: int = 10 ** 9
    seed: int = 0
    bugs: frozenset = frozenset()
    # fault injection
    skip_ranks: frozenset = frozenset()   # ranks that never make the call
    late: dict = dataclasses.field(default_factory=dict)  # rank -> start step
    seq_override: dict = dataclasses.field(default_factory=dict)  # rank -> seq number

    def __post_init__(self):
        unknown = set(self.bugs) - BUGS
        if unknown:
            raise ValueError(f"bugs: unknown {sorted(unknown)}; known {sorted(BUGS)}")
        if self.mode not in ("hierarchical", "direct"):
            raise ValueError(f"mode must be 'hierarchical' or 'direct', got {self.mode!r}")

    @property
    def num_qps(self) -> int:
        return self.num_ports * self.qps_per_port


class Ring:
    """Slots that remember their tag (what landed) and whether it was consumed."""

    def __init__(self, name: str, slots: int):
        self.name, self.slots, self.writes, self.kind = name, [None] * slots, 0, ""

    @property
    def wrapped(self) -> bool:
        """Some slot was written more than once (the ring went round)."""
        return self.writes > len(self.slots)

    def write(self, i: int, tag, data):
        cur = self.slots[i]
        if cur is not None and not cur[2]:
            raise Violation(f"{self.name}: slot {i} overwritten by {tag} before {cur[0]} "
                            f"was consumed")
        self.slots[i] = [tag, data, False]
        self.writes += 1

    def read(self, i: int, tag):
        cur = self.slots[i]
        if cur is None or cur[0] != tag:
            raise Violation(f"{self.name}: slot {i} read for {tag} before it landed "
                            f"(holds {None if cur is None else cur[0]})")
        return cur[1]

    def consume(self, i: int, tag):
        self.read(i, tag)
        self.slots[i][2] = True


class Words:
    """Signal words of one rank; each word may be written from one (source, QP) only."""

    def __init__(self, rank: int):
        self.rank, self.v, self.writer = rank, collections.defaultdict(int), {}
        self.reset_keys = set()

    def reset(self, key):
        """The reader zeroes a word at the end of the call; nothing of this call may
        land in it afterwards (the word is next used two calls later)."""
        self.v[key] = 0
        self.reset_keys.add(key)

    def op(self, key, value, add: bool, src: int, qp: int):
        if key in self.reset_keys:
            raise Violation(f"rank {self.rank}: signal word {key} written by (source {src}, "
                            f"QP {qp}) after its reader reset it: a late signal of this call")
        w = self.writer.setdefault(key, (src, qp))
        if w != (src, qp):
            raise Violation(f"rank {self.rank}: signal word {key} written from (source "
                            f"{w[0]}, QP {w[1]}) and (source {src}, QP {qp})")
        self.v[key] = self.v[key] + value if add else value


class Net:
    """The scheduler, the QP FIFOs and the per-rank memories."""

    def __init__(self, cfg: Config, R: int):
        self.cfg, self.R = cfg, R
        self.rng = np.random.default_rng(cfg.seed)
        self.clock = 0
        self.fifos = collections.defaultdict(collections.deque)  # (src, dst, qp) -> ops
        self.words = [Words(r) for r in range(R)]
        self.port_bytes = np.zeros((R, cfg.num_ports), np.int64)
        self.peer_port_bytes = collections.defaultdict(lambda: np.zeros(cfg.num_ports,
                                                                         np.int64))
        self.error = [None] * R      # first error of each rank
        self.rings = []              # every Ring, for wrap-around statistics
        self.actors = []             # [rank, generator, Wait or None, since]
        self.started = set()

    # --- wire ------------------------------------------------------------------
    def put(self, src, dst, qp, nbytes, apply, data=True):
        """A put (or put-with-signal) on QP `qp`: `apply()` runs when it lands. `data`:
        counted in peer_port_bytes (the striped streams; not control messages)."""
        self.fifos[(src, dst, qp)].append((nbytes if data else -nbytes, apply))

    def signal(self, src, dst, qp, key, value, add=True):
        self.put(src, dst, qp, 0, lambda: self.words[dst].op(key, value, add, src, qp))

    def word(self, rank, key) -> int:
        return self.words[rank].v[key]

    def aborted(self, rank) -> bool:
        return self.words[rank].v[("abort",)] != 0 or self.error[rank] is not None

    def fail(self, rank, msg):
        """Records `msg` on `rank` and tells every peer (sticky flag + abort signal)."""
        if self.error[rank] is not None:
            return
        self.error[rank] = msg
        for d in range(self.R):
            if d != rank:
                self.put(rank, d, 0, 0, lambda d=d, m=msg: self._abort(d, m))

    def _abort(self, d, msg):
        self.words[d].v[("abort",)] = 1
        if self.error[d] is None:
            self.error[d] = f"aborted by a peer: {msg}"

    # --- scheduling --------------------------------------------------------------
    def spawn(self, rank, gen):
        self.actors.append([rank, gen, None, 0])

    def _enabled(self, a) -> bool:
        rank, _, w, _ = a
        if rank not in self.started:
            return False
        return w is None or self.aborted(rank) or w.pred()

    def _step_actor(self, a):
        rank, gen = a[0], a[1]
        if self.aborted(rank) and a[2] is not None:
            self.actors.remove(a)  # the rank gave up: its actors stop
            return
        try:
            w = next(gen)
            a[2], a[3] = w, self.clock
        except StopIteration:
            self.actors.remove(a)

    def run(self):
        late = dict(self.cfg.late)
        for r in range(self.R):
            if r not in self.cfg.skip_ranks and r not in late:
                self.started.add(r)
        T = self.cfg.timeout_steps
        while self.actors or any(self.fifos.values()):
            self.clock += 1
            for r, s in list(late.items()):
                if self.clock >= s:
                    self.started.add(r)
                    del late[r]
            pick = self._pick()
            if pick is not None:
                if pick[0] == "actor":
                    self._step_actor(pick[1])
                else:
                    key = pick[1]
                    nbytes, apply = self.fifos[key].popleft()
                    if not self.fifos[key]:
                        del self.fifos[key]
                    src, dst, qp = key
                    port = qp % self.cfg.num_ports
                    self.port_bytes[src, port] += abs(nbytes)
                    if nbytes > 0:
                        self.peer_port_bytes[(src, dst)][port] += nbytes
                    apply()
                self._expire(T, only_late=True)
                continue
            waiting = [a for a in self.actors if a[0] in self.started]
            if not waiting and not late:
                break  # only actors of skipped ranks are left
            deadline = min((a[3] + T for a in waiting), default=None)
            nxt = min(late.values(), default=None)
            if nxt is not None and (deadline is None or nxt <= deadline):
                self.clock = nxt - 1
                continue
            self.clock = deadline
            self._expire(T, only_late=False)
        return self

    def _pick(self):
        """A uniformly random enabled action (actor step or FIFO delivery), or None.
        Random probes first; a full scan only when they keep missing."""
        queues = list(self.fifos)
        n_a, n = len(self.actors), len(self.actors) + len(queues)
        if n == 0:
            return None
        for _ in range(8):
            i = int(self.rng.integers(n))
            if i >= n_a:
                return ("fifo", queues[i - n_a])
            if self._enabled(self.actors[i]):
                return ("actor", self.actors[i])
        ready = [a for a in self.actors if self._enabled(a)]
        n = len(ready) + len(queues)
        if n == 0:
            return None
        i = int(self.rng.integers(n))
        return ("actor", ready[i]) if i < len(ready) else ("fifo", queues[i - len(ready)])

    def check_quiet(self):
        """After a call that ended without error: no put in flight and every signal word
        written in the call reset by its reader, so the half can be reused two calls
        later."""
        if any(self.fifos.values()):
            raise Violation(f"puts still in flight after the call: {sorted(self.fifos)[:5]}")
        for w in self.words:
            left = [k for k in w.writer if k not in w.reset_keys]
            if left:
                raise Violation(f"rank {w.rank}: signal words {left[:5]} never reset")

    def _expire(self, T, only_late):
        if only_late and (T >= 10 ** 8 or self.clock % 16):
            return
        for a in list(self.actors):
            rank, _, w, since = a
            if rank in self.started and w is not None and self.clock - since >= T \
                    and not self._enabled(a):
                self.fail(rank, f"rank {rank} timed out waiting for {w.desc}")
                self.actors.remove(a)


# ----------------------------------------------------------------------------- inputs

def config_hash(T, H, K, C, E, dtype, R) -> str:
    return hashlib.sha1(repr((T, H, K, C, E, str(dtype), R)).encode()).hexdigest()[:12]


@dataclasses.dataclass
class Result:
    outputs: list          # per rank: dict of dispatch outputs
    errors: list           # per rank: None or the error message
    port_bytes: np.ndarray  # [R, ports] bytes each rank put on each port
    peer_port_bytes: dict  # (src, dst) -> [ports]
    net_dispatch: Net = None


def _hit(idx_row, el, R):
    owner = {int(e) // el for e in idx_row if e >= 0}
    return sorted(owner)


class Problem:
    """One EP call's inputs on R = nodes * gpus ranks (per-rank lists)."""

    def __init__(self, topo: Topology, x, idx, w, E, C):
        self.topo, self.R = topo, topo.num_ranks
        self.x, self.idx, self.w, self.E, self.C = x, idx, w, E, C
        self.el = E // self.R

    def shapes(self, r):
        return (self.x[r].shape[0], self.x[r].shape[1], self.idx[r].shape[1], self.C, self.E,
                self.x[r].dtype, self.R)


# ----------------------------------------------------------------------------- counts

def _count_row(p: Problem, r: int):
    """counts[r, d] (tokens r sends rank d), node_counts[r, m] and the bad-id flag."""
    R, G = p.R, p.topo.gpus_per_node
    counts = np.zeros(R, np.int64)
    node_counts = np.zeros(p.topo.num_nodes, np.int64)
    bad = bool(np.any((p.idx[r] < -1) | (p.idx[r] >= p.E)))
    if not bad:
        for t in range(p.idx[r].shape[0]):
            dests = _hit(p.idx[r][t], p.el, R)
            for d in dests:
                counts[d] += 1
            for m in sorted({d // G for d in dests}):
                node_counts[m] += 1
    return counts, node_counts, bad


def _exchange(net: Net, p: Problem, r: int, shared: dict, seq: int):
    """Actor step 1 of every call: all-gather (counts, node counts, seq, config hash,
    error flag) with put + signal on QP 0, one word per source. Yields waits; leaves the
    gathered rows in shared[r]['rows'] or fails the rank."""
    counts, node_counts, bad = _count_row(p, r)
    row = (counts, node_counts, seq, config_hash(*p.shapes(r)), bad, p.shapes(r))
    rows = {r: row}
    shared[r] = {"rows": rows}
    for d in range(p.R):
        if d != r:
            def land(d=d):
                net.words[d].op(("counts", r), 1, True, r, 0)
                shared.setdefault(("inbox", d), {})[r] = row
            net.put(r, d, 0, 8 * (p.R + p.topo.num_nodes) + 32, land, data=False)
    for s in range(p.R):
        if s == r:
            continue
        yield Wait(lambda s=s: net.word(r, ("counts", s)) >= 1,
                   f"the count row of rank {s} (signal word counts[{s}] on QP 0)", s)
        if net.aborted(r):
            return
        rows[s] = shared[("inbox", r)][s]
        net.words[r].reset(("counts", s))
    for s in range(p.R):
        cs, _, sseq, sh, sbad, sshape = rows[s]
        if sbad:
            net.error[r] = net.error[r] or (
                f"rank {s}: topk_idx has values outside [-1, num_experts)")
            return
        if sseq != seq or sh != row[3]:
            net.error[r] = net.error[r] or (
                f"rank {r} and rank {s} are not in the same call: rank {r} has seq {seq}, "
                f"shapes (T, H, K, C, E, dtype, R) {row[5]}; rank {s} has seq {sseq}, "
                f"shapes {sshape}")
            return
    shared[r]["counts"] = np.stack([rows[s][0] for s in range(p.R)])
    shared[r]["node_counts"] = np.stack([rows[s][1] for s in range(p.R)])


def _recv_base(counts, C):
    """recv_base[s, d]: rows of sources < s at d; kept[s, d] rows of s that d keeps."""
    base = np.cumsum(counts, axis=0) - counts
    kept = np.clip(np.minimum(counts, C - base), 0, None)
    return base, kept


def _qp_of_chunk(peer, chunk, cfg: Config) -> int:
    qp, _ = _qp_for_arrays(peer, chunk % cfg.num_qps, chunk, cfg.num_ports, cfg.qps_per_port)
    return int(qp)


def _rank_in_chunks(peer, n_chunks, cfg: Config):
    """For chunks 0..n-1 of a stream to `peer`: their QP, their index among that QP's
    chunks, and the number of chunks on each QP."""
    qps = [_qp_of_chunk(peer, c, cfg) for c in range(n_chunks)]
    seen = collections.Counter()
    nth = []
    for q in qps:
        nth.append(seen[q])
        seen[q] += 1
    return qps, nth, [seen[q] for q in range(cfg.num_qps)]


# ----------------------------------------------------------------------------- streams

class RdmaStream:
    """One chunked RDMA stream src -> dst. `ring=True`: into a ring of `ring_chunks`
    chunks at dst, credits returned by dst on QP 0 (word ("credit", tag) at src, SET to
    the chunks freed). `ring=False` (direct mode): rows land at their final place, no
    reuse within a call. Data signals go on the chunk's own QP (word ("data", tag, qp) at
    dst, ADD 1 per chunk); one closing signal per QP, so each word ends at (chunks on that
    QP) + 1 and a stream with no rows still signals."""

    def __init__(self, net: Net, src, dst, n_rows, row_bytes, cfg: Config, ring=True):
        self.net, self.src, self.dst, self.cfg = net, src, dst, cfg
        self.tag = (src, dst)
        self.n_rows, self.row_bytes, self.is_ring = n_rows, row_bytes, ring
        self.CR, self.RC = cfg.chunk_rows, cfg.ring_chunks
        self.n_chunks = -(-n_rows // self.CR)
        self.qps, self.nth, self.per_qp = _rank_in_chunks(dst, self.n_chunks, cfg)
        slots = self.RC if ring else self.n_chunks
        self.ring = Ring(f"rank {dst} {'ring' if ring else 'rows'} from rank {src}", slots)
        self.ring.kind = "rdma" if ring else "rows"
        net.rings.append(self.ring)

    def _word(self, q):
        return ("data", self.tag, 0 if "shared_signal_word" in self.cfg.bugs else q)

    def _slot(self, c):
        return c % self.RC if self.is_ring else c

    def send(self, chunks: list):
        """Generator: sends chunks[c] (lists of rows) as they appear in `chunks` (the
        producer may still be appending), then the closing signals."""
        net = self.net
        for c in range(self.n_chunks):
            yield Wait(lambda c=c: len(chunks) > c, f"rows of chunk {c} at rank {self.src}")
            if self.is_ring:
                need = 0 if c < self.RC else c - self.RC + 1  # = hier::credit_needed
                yield Wait(lambda need=need: net.word(self.src, ("credit", self.tag)) >= need,
                           f"a ring credit from rank {self.dst} (word credit{self.tag} >= "
                           f"{need})", self.dst)
            q, rows = self.qps[c], list(chunks[c])

            def land(c=c, rows=rows, q=q):
                self.ring.write(self._slot(c), c, rows)
                net.words[self.dst].op(self._word(q), 1, True, self.src, q)
            net.put(self.src, self.dst, q, len(rows) * self.row_bytes, land)
        for q in range(self.cfg.num_qps):
            if "missing_close" in self.cfg.bugs and q == self.cfg.num_qps - 1:
                continue
            net.put(self.src, self.dst, q, 0,
                    lambda q=q: net.words[self.dst].op(self._word(q), 1, True, self.src, q))
        if self.is_ring:
            # the stream ends once every chunk is freed: no credit of this call is still
            # in flight when the word is reset
            if "no_final_credit_wait" not in self.cfg.bugs:
                n = self.n_chunks
                yield Wait(lambda: net.word(self.src, ("credit", self.tag)) >= n,
                           f"the last ring credit from rank {self.dst} (word "
                           f"credit{self.tag} >= {n})", self.dst)
            net.words[self.src].reset(("credit", self.tag))

    def wait_chunk(self, c):
        q, k = self.qps[c], self.nth[c] + 1
        if "forward_before_land" in self.cfg.bugs:
            k -= 1
        return Wait(lambda: self.net.word(self.dst, self._word(q)) >= k,
                    f"chunk {c} from rank {self.src} (signal word {self._word(q)} >= {k})",
                    self.src)

    def read(self, c, j):
        return self.ring.read(self._slot(c), c)[j]

    def free(self, c):
        self.ring.consume(self._slot(c), c)
        if self.is_ring:
            self.net.signal(self.dst, self.src, 0, ("credit", self.tag), c + 1, add=False)

    def wait_closed(self):
        for q in range(self.cfg.num_qps):
            k = self.per_qp[q] + 1
            if "forward_before_land" in self.cfg.bugs and not self.is_ring and q > 0:
                continue  # the direct receiver's early wait: QP 0 only
            yield Wait(lambda q=q, k=k: self.net.word(self.dst, self._word(q)) >= k,
                       f"the closing signal of rank {self.src} on QP {q} (signal word "
                       f"{self._word(q)} >= {k})", self.src)

    def finish(self):
        """The reader's end of the stream: reset its data words."""
        for q in range(self.cfg.num_qps):
            self.net.words[self.dst].reset(self._word(q))


class NvlRing:
    """A ring of `slots` rows at `owner`, written by one producer through peer pointers
    (stores, then a release store of the tail) and drained by `owner` (head store)."""

    def __init__(self, net: Net, owner, producer, tag, slots, bugs):
        self.net, self.owner, self.producer, self.tag = net, owner, producer, tag
        self.ring = Ring(f"rank {owner} NVLink ring {tag} from rank {producer}", slots)
        self.ring.kind = "nvl"
        net.rings.append(self.ring)
        self.n, self.head, self.tail, self.bugs = slots, 0, 0, bugs

    def push(self, item):
        yield Wait(lambda: self.tail - self.head < self.n,
                   f"NVLink ring {self.tag} space at rank {self.owner}", self.owner)
        i = self.tail
        if "nvl_publish_early" in self.bugs:
            self.tail += 1
            yield Wait(lambda: True, "")
        self.ring.write(i % self.n, i, item)
        if "nvl_publish_early" not in self.bugs:
            self.tail += 1

    def pop(self):
        """Generator returning the next item (use `yield from`)."""
        yield Wait(lambda: self.tail > self.head,
                   f"NVLink ring {self.tag} data from rank {self.producer}", self.producer)
        i = self.head
        item = self.ring.read(i % self.n, i)
        self.ring.consume(i % self.n, i)
        self.head += 1
        return item


class Streams:
    """Both ends of a stream compute its row count from their own state; they must agree."""

    def __init__(self, net, cfg):
        self.net, self.cfg, self.s = net, cfg, {}

    def get(self, src, dst, n_rows, row_bytes, ring=True) -> RdmaStream:
        st = self.s.get((src, dst))
        if st is None:
            st = self.s[(src, dst)] = RdmaStream(self.net, src, dst, n_rows, row_bytes,
                                                 self.cfg, ring)
        elif st.n_rows != n_rows:
            raise Violation(f"ranks {src} and {dst} disagree on the rows of their stream "
                            f"({st.n_rows} vs {n_rows})")
        return st


# ----------------------------------------------------------------------------- dispatch

def _rows_for(p: Problem, s: int, pred):
    """(t, receivers) for the tokens of s with a receiver d where pred(d), in order."""
    res = []
    for t in range(p.idx[s].shape[0]):
        ds = [d for d in _hit(p.idx[s][t], p.el, p.R) if pred(d)]
        if ds:
            res.append((t, ds))
    return res


def _row(p, s, t, dests):
    return dict(x=p.x[s][t], idx=p.idx[s][t], w=p.w[s][t], t=t, s=s, dests=tuple(dests))


def _dispatch(net: Net, p: Problem, cfg: Config, seq: int):
    """Runs one dispatch; returns (rows_at[r]: dest row -> row dict, shared state)."""
    topo, R = p.topo, p.R
    G, N = topo.gpus_per_node, topo.num_nodes
    H, K = p.x[0].shape[1], p.idx[0].shape[1]
    hier = cfg.mode == "hierarchical"
    row_bytes = (modes.hier_dispatch_row_stride(H * p.x[0].dtype.itemsize, K) if hier else
                 require_ext().internode_dispatch_row_stride(H * p.x[0].dtype.itemsize, K))
    streams = Streams(net, cfg)
    shared, rings, rows_at = {}, {}, collections.defaultdict(dict)

    def nvl(r, g, n):  # at receiver r, from the forwarder with local index g, source node n
        if (r, g, n) not in rings:
            rings[(r, g, n)] = NvlRing(net, r, topo.rank_of(r // G, g), ("dispatch", g, n),
                                       cfg.nvl_rows, cfg.bugs)
        return rings[(r, g, n)]

    def forward(f, s, row, sent):
        """Forwarder f hands a row of s to each receiver of its node that keeps it;
        sent[d] numbers the rows of s for d (the send slot), dropped ones included."""
        base, kept = shared[f]["base"], shared[f]["kept"]
        for d in row["dests"]:
            if d // G != f // G:
                continue
            slot = sent[d]
            sent[d] += 1
            if slot >= kept[s, d]:
                continue  # past the capacity at d: never forwarded
            yield from nvl(d, f % G, s // G).push(dict(row, dest=int(base[s, d] + slot)))

    def local_forwarder(s):
        sent = collections.defaultdict(int)
        for t, ds in _rows_for(p, s, lambda d: d // G == s // G):
            yield from forward(s, s, _row(p, s, t, ds), sent)

    def rail_forwarder(f, n):
        src = topo.rank_of(n, f % G)
        st = streams.get(src, f, int(shared[f]["node_counts"][src, f // G]), row_bytes)
        sent = collections.defaultdict(int)
        for c in range(st.n_chunks):
            yield st.wait_chunk(c)
            if "credit_early" in cfg.bugs:
                st.read(c, 0)
                net.signal(f, src, 0, ("credit", st.tag), c + 1, add=False)
            for j in range(min(cfg.chunk_rows, st.n_rows - c * cfg.chunk_rows)):
                yield from forward(f, src, st.read(c, j), sent)
            if "credit_early" in cfg.bugs:
                st.ring.slots[c % st.RC][2] = True
            else:
                st.free(c)
        yield from st.wait_closed()
        st.finish()

    def receiver(r, g, n):
        s = topo.rank_of(n, g)
        for _ in range(int(shared[r]["kept"][s, r])):
            row = yield from nvl(r, g, n).pop()
            if row["s"] != s or row["dest"] in rows_at[r]:
                raise Violation(f"rank {r}: row {row['dest']} of rank {row['s']} arrived "
                                f"twice or through the ring of rank {s}")
            rows_at[r][row["dest"]] = row

    def direct_receiver(r, s):
        st = streams.get(s, r, int(shared[r]["kept"][s, r]), row_bytes, ring=False)
        yield from st.wait_closed()
        base = shared[r]["base"][s, r]
        for i in range(st.n_rows):
            rows_at[r][int(base + i)] = st.read(i // cfg.chunk_rows, i % cfg.chunk_rows)
        for c in range(st.n_chunks):
            st.free(c)
        st.finish()

    def rank_main(s):
        yield from _exchange(net, p, s, shared, cfg.seq_override.get(s, seq))
        if net.aborted(s) or "counts" not in shared[s]:
            return
        base, kept = _recv_base(shared[s]["counts"], p.C)
        shared[s]["base"], shared[s]["kept"] = base, kept
        if hier:
            for m in range(N):
                if m == s // G:
                    continue
                rows = [_row(p, s, t, ds) for t, ds in _rows_for(p, s, lambda d: d // G == m)]
                st = streams.get(s, topo.rail_peer(s, m), len(rows), row_bytes)
                net.spawn(s, st.send([rows[i:i + cfg.chunk_rows]
                                      for i in range(0, len(rows), cfg.chunk_rows)]))
                net.spawn(s, rail_forwarder(s, m))
            net.spawn(s, local_forwarder(s))
            for n in range(N):
                for g in range(G):
                    net.spawn(s, receiver(s, g, n))
        else:
            for d in range(R):
                toks = [t for t, ds in _rows_for(p, s, lambda x: x == d)][:int(kept[s, d])]
                rows = [_row(p, s, t, [d]) for t in toks]
                if d == s:  # own rows: a local copy
                    for i, row in enumerate(rows):
                        rows_at[s][int(base[s, s] + i)] = row
                    continue
                st = streams.get(s, d, len(rows), row_bytes, ring=False)
                net.spawn(s, st.send([rows[i:i + cfg.chunk_rows]
                                      for i in range(0, len(rows), cfg.chunk_rows)]))
                net.spawn(s, direct_receiver(s, d))

    for s in range(R):
        net.spawn(s, rank_main(s))
    net.run()
    return rows_at, shared


def _dispatch_outputs(p: Problem, r: int, shared: dict, rows: dict) -> dict:
    """The contract's outputs of rank r from the rows that landed."""
    C, H, K, el = p.C, p.x[0].shape[1], p.idx[0].shape[1], p.el
    counts = shared[r]["counts"]
    kept = shared[r]["kept"]
    num_recv = int(kept[:, r].sum())
    o = dict(recv_x=np.zeros((C, H), p.x[0].dtype), recv_idx=np.full((C, K), -1, np.int32),
             recv_w=np.zeros((C, K), np.float32), num_recv=np.int32(num_recv),
             num_dropped=np.int32(int(counts[:, r].sum()) - num_recv),
             per_expert=np.zeros(el, np.int32), src_rank=np.full(C, -1, np.int32),
             src_index=np.full(C, -1, np.int32))
    missing = [i for i in range(num_recv) if i not in rows]
    if missing or any(i >= num_recv for i in rows):
        raise Violation(f"rank {r}: rows {missing[:5]} never arrived, or rows past "
                        f"num_recv={num_recv} were written")
    for i, row in rows.items():
        o["recv_x"][i] = row["x"]
        local = np.where(row["idx"] // el == r, row["idx"] - r * el, -1).astype(np.int32)
        local[row["idx"] < 0] = -1
        o["recv_idx"][i] = local
        o["recv_w"][i] = np.where(local >= 0, row["w"], np.float32(0))
        for e in local[local >= 0]:
            o["per_expert"][e] += 1
        o["src_rank"][i], o["src_index"][i] = row["s"], row["t"]
    return o


def _send_row(p: Problem, s: int, shared: dict) -> np.ndarray:
    """send_row[t, d] of source s (the handle): its row on d, -1 if not sent or dropped."""
    T = p.idx[s].shape[0]
    base, kept = shared[s]["base"], shared[s]["kept"]
    out = np.full((T, p.R), -1, np.int32)
    slot = np.zeros(p.R, np.int64)
    for t in range(T):
        for d in _hit(p.idx[s][t], p.el, p.R):
            if slot[d] < kept[s, d]:
                out[t, d] = base[s, d] + slot[d]
            slot[d] += 1
    return out


# ----------------------------------------------------------------------------- entry point

def run(cfg: Config, x, idx, w, *, E: int, C: int, seq: int = 1, g=None) -> Result:
    """Dispatch of per-rank inputs x[r][T, H], idx/w[r][T, K] (lists or stacked arrays)
    under `cfg`; with g[r][T, H] also the gather (combine's transpose: dispatch's wire
    pattern for rows of g, outputs[r]["gather"]). Protocol violations raise `Violation`;
    errors a rank would return (timeouts, mismatches, bad ids) are in `Result.errors`.
    There is no combine here: the hierarchical combine (reduced within the node, in the
    order of kernels/common/combine_order.h) is tested on the kernels themselves
    (tests/emu/test_internode_hier_emu.py)."""
    topo = Topology(cfg.nodes * cfg.gpus, cfg.gpus)
    p = Problem(topo, list(x), list(idx), list(w), E, C)
    net_d = Net(cfg, topo.num_ranks)
    rows_at, shared = _dispatch(net_d, p, cfg, seq)
    errors = list(net_d.error)
    res = Result(outputs=[None] * p.R, errors=errors, port_bytes=net_d.port_bytes.copy(),
                 peer_port_bytes=dict(net_d.peer_port_bytes), net_dispatch=net_d)
    if any(e is not None for e in errors):
        return res
    net_d.check_quiet()
    disp = [_dispatch_outputs(p, r, shared, rows_at[r]) for r in range(p.R)]
    send_row = [_send_row(p, s, shared) for s in range(p.R)]
    for r in range(p.R):
        disp[r]["send_row"] = send_row[r]
    res.outputs = disp
    if g is not None:
        pg = Problem(topo, list(g), list(idx), list(w), E, C)
        net_g = Net(dataclasses.replace(cfg, seed=cfg.seed + 2), p.R)
        rows_g, shared_g = _dispatch(net_g, pg, cfg, seq + 1)
        if any(e is not None for e in net_g.error):
            res.errors = list(net_g.error)
            return res
        net_g.check_quiet()
        for r in range(p.R):
            disp[r]["gather"] = _dispatch_outputs(pg, r, shared_g, rows_g[r])["recv_x"]
    return res
