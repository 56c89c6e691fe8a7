"""EP custom calls are ordered in the program: each has its own call-site id (XLA cannot
merge two), and the two independent combines of dispatch's transpose are chained through
an optimization barrier, so they never run at once. Checked on the program lowered for
CUDA (and for CPU). (They are not marked side-effecting: that would forbid remat.)"""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import jax_ep
from conftest import ep_mesh

R, T, H, K, E = 4, 6, 8, 2, 8
EP_TARGET = re.compile(r"custom_call @(jax_ep_(?:internode_)?(?:dispatch|combine|gather))\(")
_LINE = re.compile(r"^\s*(%[\w#:]+)\s*=\s*(.*)$")


def _program(platform: str) -> str:
    mesh = ep_mesh(R)

    def f(x, idx, w):
        def loss(x, w):
            rx, _, rw, h = jax_ep.dispatch(x, idx, w, num_experts=E, axis_name="ep",
                                           backend="ffi")
            y = rx * jnp.sum(rw, axis=1, keepdims=True)
            return jnp.sum(jax_ep.combine(y, h, backend="ffi"))
        value, grads = jax.value_and_grad(loss, argnums=(0, 1))(x, w)
        return grads[0] * value, grads[1]

    g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("ep"), out_specs=(P("ep"),) * 2))
    x = jnp.ones((R * T, H), jnp.float32)
    idx = jnp.zeros((R * T, K), jnp.int32).at[:, 1].set(5)
    w = jnp.ones((R * T, K), jnp.float32)
    with jax_ep.config.override(collective_stream=False):  # the calls inline, one function
        return g.trace(x, idx, w).lower(lowering_platforms=(platform,)).as_text()


def ep_calls(hlo: str) -> list[dict]:
    """Every EP custom call in program order: {'name', 'target', 'operands', 'site'}."""
    calls = []
    for line in hlo.splitlines():
        m, t = _LINE.match(line), EP_TARGET.search(line)
        if not (m and t):
            continue
        args = line[t.end():line.index(")", t.end())]
        calls.append({"name": m.group(1).split(":")[0], "target": t.group(1),
                      "operands": [a.strip() for a in args.split(",")],
                      "site": (re.findall(r"call_site = (\d+) : i64", line) or [None])[0]})
    return calls


def chained(hlo: str, first: str, operand: str) -> bool:
    """Whether `operand` depends on `first` (an EP call's result) through any ops: the
    chain runs through optimization barriers, directly or via the program's EP token."""
    deps: dict[str, set] = {}
    for line in hlo.splitlines():
        m = _LINE.match(line)
        if not m:
            continue
        name = m.group(1).split(":")[0]
        used = {name} if name == first else set()
        for n in re.findall(r"%[\w]+", m.group(2)):
            used |= deps.get(n, set()) | ({n} if n == first else set())
        deps[name] = used
    return first in deps.get(operand.split("#")[0], set())


def _root(hlo: str, operand: str) -> str:
    """`operand` followed back through optimization barriers (output i is input i)."""
    base, _, idx = operand.partition("#")
    for line in hlo.splitlines():
        m = _LINE.match(line)
        if m and m.group(1).split(":")[0] == base and "optimization_barrier" in m.group(2):
            ins = m.group(2).split("optimization_barrier")[1].split(":")[0].split(",")
            return _root(hlo, ins[int(idx or 0)].strip())
    return operand


def check_ordered(hlo: str) -> list[str]:
    """Problems found: EP calls without a call-site id or sharing one (mergeable), and
    combines in the transpose of one dispatch that are not chained."""
    calls = ep_calls(hlo)
    problems = [f"{c['target']} {c['name']} has no call_site" for c in calls
                if c["site"] is None]
    sites = [c["site"] for c in calls if c["site"] is not None]
    problems += [f"call_site {s} is shared" for s in sorted(set(sites)) if sites.count(s) > 1]
    combines = [c for c in calls if c["target"].endswith("combine")]
    # Combines reading the same handle array after the forward one: dispatch's transpose.
    by_handle = {}
    for c in combines:
        by_handle.setdefault(_root(hlo, c["operands"][1]), []).append(c)
    for group in by_handle.values():
        for a, b in zip(group[1:], group[2:]):
            if not chained(hlo, a["name"], b["operands"][0]):
                problems.append(f"{b['name']} may run concurrently with {a['name']}")
    return problems


@pytest.mark.parametrize("platform", ["cuda", "cpu"])
def test_every_ep_call_is_ordered(platform):
    hlo = _program(platform)
    calls = ep_calls(hlo)
    targets = [c["target"] for c in calls]
    assert targets.count("jax_ep_dispatch") == 1 and targets.count("jax_ep_gather") == 1
    assert targets.count("jax_ep_combine") == 3  # forward, and two in dispatch's transpose
    assert check_ordered(hlo) == []


def test_the_checker_catches_a_shared_site_and_a_missing_chain():
    hlo = _program("cuda")
    first, second = [c["site"] for c in ep_calls(hlo)][:2]
    shared = hlo.replace(f"call_site = {second} : i64", f"call_site = {first} : i64", 1)
    assert any("shared" in p for p in check_ordered(shared))
    # Feed the last combine the barrier's input instead of its output: no chain left.
    last = [c for c in ep_calls(hlo) if c["target"] == "jax_ep_combine"][-1]
    barrier = next(ln for ln in hlo.splitlines() if "optimization_barrier" in ln)
    raw = _LINE.match(barrier).group(2).split("optimization_barrier")[1].split(":")[0]
    unchained_operand = raw.split(",")[1].strip()
    broken = hlo.replace(f"@jax_ep_combine({last['operands'][0]},",
                         f"@jax_ep_combine({unchained_operand},")
    assert any("concurrently" in p for p in check_ordered(broken))


def test_internode_calls_are_ordered(monkeypatch):
    """The same program on the internode targets (NVSHMEM state faked as PE 1 of R)."""
    from jax_ep import nvshmem_bootstrap, ops
    from jax_ep.network.transport import TransportConfig

    st = nvshmem_bootstrap.BootstrapState(rank=1, world=R, heap_bytes=1 << 30,
                                          config=TransportConfig(), env={})
    monkeypatch.setattr(nvshmem_bootstrap, "_state", st)
    monkeypatch.setattr(ops, "resolve_backend", lambda backend: "internode")
    hlo = _program("cuda")
    targets = [c["target"] for c in ep_calls(hlo)]
    assert targets.count("jax_ep_internode_dispatch") == 1
    assert targets.count("jax_ep_internode_gather") == 1
    assert targets.count("jax_ep_internode_combine") == 3
    assert check_ordered(hlo) == []
