"""The arrival barrier of the multi-process CPU path: every EP call waits for all of its
peers at most `JAX_EP_TIMEOUT_S` seconds before its first collective.

With several processes (`jax.distributed`) on CPU, the ops run the reference backend:
XLA collectives (the value check's all-gather, then all-to-alls) over gloo, which wait
for a peer that never comes for good. So before any of them, inside the program, each
device runs a host callback that meets the other devices of the mesh through the
`jax.distributed` key-value store:

1. it publishes `jax_ep/arrive/<site>/<mesh>/<n>/<position>` = the call's signature (op,
   per-shard operand shapes and dtypes, static attributes) and its process id, where
   `site` is the call-site id (the same on every process for the same program point,
   whatever the shapes; `jax_ep._src.common.next_call_site`), `mesh` names the devices and
   `n` counts this device's calls at that site;
2. it reads the round; the device that sees every position arrived with one signature
   creates the round's `decision` key saying go (an atomic create: one decision per
   round), one that sees another signature creates an abort naming both; the others
   wait for the decision, and the first whose deadline passes creates an abort naming
   the positions (and their processes) that did not arrive;
3. every device follows that one decision: "go" returns 0, which the op's inputs depend
   on (bitwise, so rows stay bit for bit), an abort raises on every device of every
   process that made the call, before any collective. A device that reaches a round
   after it was aborted raises at once: the call failed on every rank that made it,
   and the next call at that site meets as usual (the next round). The process stays
   usable.

A round's keys are deleted when the next round at the same site says "go" (every device
has then left it), so the store stays bounded over a long run.

Costs, on this path only (several processes and a CPU program over a mesh that spans
them): one host callback per device per EP call, three or four key-value requests to
the coordinator per device, and the wait for the slowest peer, which the collectives
would wait for anyway. One process, GPUs and the ffi backend run no barrier.

Not covered: a shard_map that leaves mesh axes of size > 1 automatic (several devices
per manual position), and collectives XLA itself adds outside the EP calls (resharding
an operand to the op's sharding happens before the barrier).

From jax 0.11 a host callback's error no longer stops the rest of its program: XLA
reports it when the program ends but runs the collectives after it first. Where the
ranks aborted on different shapes those collectives cannot match and wait for gloo's
timeout. So at import, where JAX's backends have not started and `XLA_FLAGS` does not
set it, jax_ep sets `--xla_cpu_collective_timeout_seconds` to JAX_EP_TIMEOUT_S + 60
(`bound_cpu_collectives`): the job then ends in an error (the barrier's, printed, and
the collective's timeout) instead of waiting for good.
"""
from __future__ import annotations

import contextlib
import contextvars
import hashlib
import json
import os
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from jax_ep._src.common import call_site_info, next_call_site

_PREFIX = "jax_ep/arrive"

_lock = threading.Lock()
_rounds: dict[tuple, int] = {}  # (site, mesh key, position) -> last round number
# Per-shard barriers are left out inside a global-view op's partitioned body (a host
# callback there is not safe; the op itself had its barrier) ...
_inside_partitioned = contextvars.ContextVar("jax_ep_inside_partitioned", default=False)
# ... and a barrier is left out where the caller already ran one that covers the call:
# a global-view public function over all of the op's operands (before its value check),
# the send half of a low-latency combine for its receive half.
_covered = contextvars.ContextVar("jax_ep_arrival_covered", default=False)


def timeout_s() -> float:
    """The setting timeout_s (JAX_EP_TIMEOUT_S; jax_ep.config), the kernels' timeout: seconds,
    default kernels/common/settings.h kDefaultTimeoutSeconds through the bindings."""
    from jax_ep import config
    return float(config.current().timeout_s)


COLLECTIVE_TIMEOUT_FLAG = "xla_cpu_collective_timeout_seconds"


def bound_cpu_collectives(environ=None) -> bool:
    """Adds --xla_cpu_collective_timeout_seconds=JAX_EP_TIMEOUT_S + 60 to XLA_FLAGS where
    it is not set and JAX's backends have not started (XLA reads the flags then). True if
    it did."""
    env = os.environ if environ is None else environ
    flags = env.get("XLA_FLAGS", "")
    if COLLECTIVE_TIMEOUT_FLAG in flags:
        return False
    try:
        from jax._src import xla_bridge
        if xla_bridge.backends_are_initialized():
            return False
    except (ImportError, AttributeError):  # cannot tell: leave the flags alone
        return False
    env["XLA_FLAGS"] = f"{flags} --{COLLECTIVE_TIMEOUT_FLAG}={int(timeout_s()) + 60}".strip()
    return True


def _on_path() -> bool:
    """Several processes and a CPU program (what the barrier is for)."""
    return jax.process_count() > 1 and jax.default_backend() == "cpu"


@contextlib.contextmanager
def partitioned_body():
    """No per-shard barrier while a global-view op's partitioned body is traced."""
    token = _inside_partitioned.set(True)
    try:
        yield
    finally:
        _inside_partitioned.reset(token)


@contextlib.contextmanager
def covered():
    """The EP calls traced inside skip their own barrier: the caller just ran one that
    covers them (every rank that passed it reaches them)."""
    token = _covered.set(True)
    try:
        yield
    finally:
        _covered.reset(token)


# ----------------------------------------------------------------------------- trace time

class _Where:
    """The mesh the barrier spans: its axes and, where known, each position's process."""

    def __init__(self, names, sizes, procs, device_ids):
        self.names, self.sizes = tuple(names), tuple(int(s) for s in sizes)
        self.count = int(np.prod(self.sizes)) if self.sizes else 1
        self.procs = None if procs is None else tuple(int(p) for p in procs)
        text = repr((self.names, self.sizes, device_ids)).encode()
        self.key = hashlib.sha256(text).hexdigest()[:12]

    def spans_processes(self) -> bool:
        return self.procs is None or len(set(self.procs)) > 1

    def position(self, i: int) -> str:
        coords = np.unravel_index(i, self.sizes) if self.sizes else ()
        return ",".join(f"{a}={int(c)}" for a, c in zip(self.names, coords)) or "0"

    def process(self, i: int):
        return None if self.procs is None else self.procs[i]

    def describe(self, positions, pids=None) -> str:
        """'process 1 (ep=4, ep=5)' for positions, grouped by process (pids: position ->
        process id where the mapping of the mesh is unknown)."""
        groups: dict = {}
        for i in sorted(positions):
            p = self.process(i)
            if p is None and pids is not None:
                p = pids.get(i)
            groups.setdefault(p, []).append(self.position(i))
        parts = []
        for p in sorted(groups, key=lambda q: (q is None, q if q is not None else 0)):
            who = "process ?" if p is None else f"process {p}"
            parts.append(f"{who} ({', '.join(groups[p])})")
        return "; ".join(parts)


def _where_from_mesh(mesh, names) -> _Where:
    devices = mesh.devices
    sizes = [int(mesh.shape[a]) for a in names]
    flat = devices.reshape(-1)
    return _Where(names, sizes, [d.process_index for d in flat], [d.id for d in flat])


def _shard_map_mesh(abstract):
    """The concrete mesh of the shard_map being traced: the one in context
    (`jax.set_mesh`), else the `mesh` JAX's shard_map holds on the stack
    (`jax.shard_map(f, mesh=mesh)` puts only the abstract mesh in context). None if
    neither matches `abstract`."""
    from jax._src import mesh as mesh_lib

    def matches(m):
        return (isinstance(m, jax.sharding.Mesh) and not m.empty
                and tuple(m.axis_names) == tuple(abstract.axis_names)
                and dict(m.shape) == dict(abstract.shape))

    getter = getattr(mesh_lib, "get_concrete_mesh", None)
    m = getter() if getter is not None else None
    if matches(m):
        return m
    tail = os.path.join("jax", "_src", "shard_map.py")
    f = sys._getframe(1)
    while f is not None:
        if f.f_code.co_filename.endswith(tail):
            try:
                m = f.f_locals.get("mesh")
            except Exception:  # noqa: BLE001 - a frame without readable locals
                m = None
            if matches(m):
                return m
        f = f.f_back
    return None


def _operand_text(leaves) -> str:
    return ", ".join(f"{jnp.dtype(a.dtype).name}[{','.join(map(str, a.shape))}]"
                     for a in leaves)


@jax.custom_jvp
def _depend(zero, a):
    """a, computed from `zero` (the barrier's int32 0) bit for bit: an arithmetic
    dependency XLA keeps (see jax_ep._src.value_check._depend), so nothing that reads `a`
    runs before the barrier. To autodiff, the identity of `a`."""
    if a.size == 0:
        return a
    dt = jnp.dtype(a.dtype)
    if dt == jnp.bool_:
        return a | (zero != 0)
    if jnp.issubdtype(dt, jnp.integer):
        return a | zero.astype(dt)
    bits = jnp.dtype(f"uint{8 * dt.itemsize}")
    return jax.lax.bitcast_convert_type(
        jax.lax.bitcast_convert_type(a, bits) | zero.astype(bits), dt)


@_depend.defjvp
def _depend_jvp(primals, tangents):
    zero, a = primals
    return _depend(zero, a), tangents[1]


def _is_array(leaf) -> bool:
    return isinstance(leaf, jax.Array)


def _emit(op: str, site: int, where: _Where, index, tree, static: str):
    """tree (inside a shard_map), made to depend on the barrier's callback, which runs
    once the arrays exist on this device (one element of each is an operand)."""
    leaves, treedef = jax.tree.flatten(tree)
    arrays = [a for a in leaves if _is_array(a)]
    signature = f"{op}({_operand_text(arrays)}){static}"
    barrier = _Barrier(op, site, where, signature)
    # No tangent reaches the callback (it has no derivative; it returns 0 anyway).
    waited = tuple(jax.lax.stop_gradient(a.reshape(-1)[:1]) for a in arrays if a.size)
    zero = jax.pure_callback(barrier, jax.ShapeDtypeStruct((), jnp.int32), index, *waited,
                             vmap_method="sequential")
    return jax.tree.unflatten(treedef, [_depend(zero, a) if _is_array(a) else a
                                        for a in leaves])


def _op_name(kind: str) -> str:
    """The call as messages name it: the public op being traced ('jax_ep.dispatch'),
    with the part of it that has this barrier where that is not the whole op; `kind`
    alone in a backward pass (traced after its op returned)."""
    from jax_ep._src.scope import current_op
    public = current_op()
    if public is None:
        return f"{kind} (in a backward pass)"
    return public if public.rsplit(".", 1)[-1] == kind.rsplit(".", 1)[-1] else \
        f"{public} ({kind})"


def arrive(kind: str, tree, static: str = ""):
    """`tree` (operands of one EP call, per shard inside shard_map), made to wait for the
    arrival barrier on the multi-process CPU path; unchanged elsewhere. `kind`: the
    backend function ('dispatch', 'combine', ...); `static`: its static attributes as
    text (part of the signature every rank must share)."""
    if not _on_path() or _inside_partitioned.get() or _covered.get():
        return tree
    abstract = jax.sharding.get_abstract_mesh()
    if abstract is None or abstract.empty:
        return tree
    manual = set(getattr(abstract, "manual_axes", ()))
    names = tuple(a for a in abstract.axis_names if a in manual)
    if not names or any(int(abstract.shape[a]) > 1 for a in abstract.axis_names
                        if a not in manual):
        return tree
    mesh = _shard_map_mesh(abstract)
    if mesh is not None:
        where = _where_from_mesh(mesh, names)
    else:
        where = _Where(names, [abstract.shape[a] for a in names], None, None)
    if not where.spans_processes():
        return tree
    site = next_call_site("arrival", kind, types=False)
    index = jax.lax.axis_index(names).astype(jnp.int32)
    return _emit(_op_name(kind), site, where, index, tree, static)


def arrive_global(kind: str, tree, token_axes):
    """The global view's barrier: `tree` (global arrays, dim 0 sharded over
    `token_axes`), made to wait for the barrier run per device by a shard_map over the
    whole mesh in context; unchanged off the multi-process CPU path or inside
    `covered()`."""
    if not _on_path() or _covered.get() or _inside_partitioned.get():
        return tree
    from jax.sharding import PartitionSpec as P

    from jax_ep._src.common import concrete_mesh
    mesh = concrete_mesh()
    names = tuple(mesh.axis_names)
    where = _where_from_mesh(mesh, names)
    if not where.spans_processes():
        return tree
    leaves, treedef = jax.tree.flatten(tree)
    pos = [i for i, a in enumerate(leaves) if _is_array(a)]
    if not pos:
        return tree
    site = next_call_site("arrival", kind, types=False)
    op = _op_name(kind)

    def body(*arrays):
        index = jax.lax.axis_index(names).astype(jnp.int32)
        return tuple(_emit(op, site, where, index, list(arrays), ""))

    spec = P(tuple(token_axes))
    outs = jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec,
                         check_vma=False)(*[leaves[i] for i in pos])
    for i, a in zip(pos, outs):
        leaves[i] = a
    return jax.tree.unflatten(treedef, leaves)


# ----------------------------------------------------------------------------- run time

class ArrivalError(RuntimeError):
    """Raised (inside the program, on every device that made the call) when the peers of
    an EP call on the multi-process CPU path did not all arrive within JAX_EP_TIMEOUT_S,
    or arrived with different arguments. No collective of the call was started."""


def _client():
    from jax._src.distributed import global_state
    client = global_state.client
    if client is None:
        raise ArrivalError("jax_ep: several processes but no jax.distributed client: call "
                           "jax.distributed.initialize() before the EP calls")
    return client


class _Barrier:
    """The host side of one traced barrier (one per EP call in a program)."""

    def __init__(self, op: str, site: int, where: _Where, signature: str):
        self.op, self.site, self.where, self.signature = op, site, where, signature
        self.key = f"{_PREFIX}/{site}/{where.key}"

    def _call(self) -> str:
        info = call_site_info(self.site)
        return f"{self.op} at call site {self.site}" + (f" ({info})" if info else "")

    def __call__(self, index, *_waited):
        self.wait(int(np.asarray(index).reshape(-1)[0]))
        return np.zeros((), np.int32)

    def wait(self, i: int) -> None:
        client = _client()
        limit = timeout_s()
        with _lock:
            n = _rounds.get((self.key, i), 0) + 1
            _rounds[(self.key, i)] = n
        rnd = f"{self.key}/{n}"
        deadline = time.monotonic() + limit
        mine = json.dumps({"sig": self.signature, "pid": jax.process_index()})
        try:
            client.key_value_set(f"{rnd}/{i}", mine)
        except Exception as e:  # noqa: BLE001 - the store raises JaxRuntimeError
            raise ArrivalError(
                f"jax_ep: {self._call()}: mesh position {self.where.position(i)} arrived "
                f"twice in round {n} (two devices claim one position, or the key-value "
                f"store failed): {e}") from None
        decision = self._look(client, rnd, n)
        while decision is None:
            left = deadline - time.monotonic()
            if left <= 0:
                decision = self._time_out(client, rnd, n, limit)
                break
            asked = time.monotonic()
            try:
                decision = client.blocking_key_value_get(f"{rnd}/decision",
                                                         max(1, int(left * 1000)))
            except Exception:  # noqa: BLE001 - DEADLINE_EXCEEDED: check the deadline
                decision = None
                if time.monotonic() - asked < 0.01:
                    time.sleep(0.01)  # an error at once (not the wait): do not spin
        self._follow(json.loads(decision), i, n)

    def _arrivals(self, client, rnd):
        got, decision = {}, None
        for k, v in client.key_value_dir_get(rnd):
            leaf = k.rsplit("/", 1)[-1]
            if leaf == "decision":
                decision = v
            elif leaf.isdigit():
                got[int(leaf)] = json.loads(v)
        return got, decision

    def _look(self, client, rnd, n):
        """The round's decision if there is one or this device can make it, else None."""
        got, decision = self._arrivals(client, rnd)
        if decision is not None:
            return decision
        sigs = {g["sig"] for g in got.values()}
        if len(sigs) > 1:
            return self._decide(client, rnd, n, self._mismatch(got))
        if len(got) == self.where.count:
            return self._decide(client, rnd, n, json.dumps({"go": True}))
        return None

    def _decide(self, client, rnd, n, value):
        """Creates the round's decision unless one exists; returns the one that holds."""
        try:
            client.key_value_set(f"{rnd}/decision", value)
        except Exception:  # noqa: BLE001 - ALREADY_EXISTS: another device decided first
            return client.blocking_key_value_get(f"{rnd}/decision", 10_000)
        if json.loads(value).get("go"):
            self._forget_before(client, n)
        return value

    def _forget_before(self, client, n):
        """Deletes the rounds before round n (every device has left them: all arrived
        at n). Rounds are deleted at each "go", so only the aborted ones since the last
        "go" can be left before n - 1."""
        k = n - 1
        while k >= 1:
            try:
                d = client.key_value_try_get(f"{self.key}/{k}/decision")
            except Exception:  # noqa: BLE001 - NOT_FOUND: deleted already
                return
            client.key_value_delete(f"{self.key}/{k}")
            if json.loads(d).get("go"):
                return
            k -= 1

    def _mismatch(self, got) -> str:
        by_sig: dict = {}
        for i, g in got.items():
            by_sig.setdefault(g["sig"], []).append(i)
        pids = {i: g["pid"] for i, g in got.items()}
        parts = [f"{self.where.describe(pos, pids)}: {sig}"
                 for sig, pos in sorted(by_sig.items(), key=lambda kv: min(kv[1]))]
        missing = [i for i in range(self.where.count) if i not in got]
        later = f" (not arrived yet: {self.where.describe(missing)})" if missing else ""
        msg = (f"jax_ep: {self._call()}: the ranks made this call with different "
               f"arguments: " + " vs ".join(parts) + later
               + ". No rank started its exchange; the call failed on every rank that "
                 "made it.")
        return json.dumps({"abort": msg, "kind": "mismatch", "arrived": sorted(got)})

    def _time_out(self, client, rnd, n, limit):
        got, decision = self._arrivals(client, rnd)
        if decision is not None:
            return decision
        missing = [i for i in range(self.where.count) if i not in got]
        pids = {i: g["pid"] for i, g in got.items()}
        msg = (f"jax_ep: {self._call()} timed out after JAX_EP_TIMEOUT_S = {limit:g} s: "
               f"{len(got)} of {self.where.count} devices of the mesh arrived; did not "
               f"arrive: {self.where.describe(missing)} (arrived: "
               f"{self.where.describe(sorted(got), pids)}). No rank started its exchange; "
               f"the call failed on every rank that made it (a process that reaches it "
               f"later fails at once), and the next call proceeds when every process "
               f"makes it.")
        return self._decide(client, rnd, n, json.dumps(
            {"abort": msg, "kind": "timeout", "arrived": sorted(got)}))

    def _follow(self, decision: dict, i: int, n: int) -> None:
        if decision.get("go"):
            return
        msg = decision.get("abort", "jax_ep: the call was aborted")
        if decision.get("kind") == "timeout" and i not in decision.get("arrived", ()):
            here = self.where.describe([i], {i: jax.process_index()})
            msg = (f"jax_ep: {self._call()}: this rank ({here}) reached the call after "
                   f"its peers had stopped waiting for it; the call failed on every rank "
                   f"that made it. The peers' error: {msg}")
            raise ArrivalError(msg)
        raise (ArrivalError if decision.get("kind") == "timeout" else ValueError)(msg)
