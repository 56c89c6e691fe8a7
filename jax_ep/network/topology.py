"""Node topology of the EP group and the choice of internode mode.

Ranks are numbered node-major: rank r sits on node `r // gpus_per_node` at local index
`r % gpus_per_node`. The hierarchical mode sends a token over RDMA at most once per
destination node, to its *rail peer* there (the GPU with the sender's local index), and
forwards it over NVLink inside that node; it needs this numbering.

Where the topology comes from, first match wins:
  1. `JAX_EP_GPUS_PER_NODE` (tests, and several NVSHMEM PEs on one GPU arranged as
     virtual nodes: 4 PEs with `JAX_EP_GPUS_PER_NODE=2` are 2 "nodes" of 2);
  2. the processes' local ranks (one per global rank, as `jax.distributed` or the
     launcher reports them): a node starts where the local rank goes back to 0;
  3. the launcher's local size (`LOCAL_WORLD_SIZE`, `OMPI_COMM_WORLD_LOCAL_SIZE`,
     `SLURM_NTASKS_PER_NODE`), assuming node-major numbering.

Modes: "direct" (every GPU puts to every GPU), "hierarchical" (above) and "auto":
hierarchical when there are several nodes with several GPUs each, direct otherwise.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Mapping, Sequence

__all__ = ["Topology", "MODES", "MODE_ENV", "GPUS_PER_NODE_ENV", "from_local_ranks",
           "detect", "choose_mode", "mode_from_env", "HIERARCHICAL_VERIFIED",
           "local_ranks_from_hosts", "combine_node_size"]

MODES = ("direct", "hierarchical", "auto")
MODE_ENV = "JAX_EP_INTERNODE_MODE"
GPUS_PER_NODE_ENV = "JAX_EP_GPUS_PER_NODE"
# Launchers' "processes on this node" variables (torchrun, Open MPI, Slurm), read when
# neither the override nor the local ranks are given.
LAUNCHER_LOCAL_SIZE = ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE",
                       "SLURM_NTASKS_PER_NODE")


@dataclasses.dataclass(frozen=True)
class Topology:
    """`num_ranks` ranks in `num_ranks // gpus_per_node` nodes of `gpus_per_node`."""

    num_ranks: int
    gpus_per_node: int

    def __post_init__(self):
        for name in ("num_ranks", "gpus_per_node"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        if self.num_ranks % self.gpus_per_node:
            raise ValueError(
                f"gpus_per_node ({self.gpus_per_node}) must divide num_ranks "
                f"({self.num_ranks}): every node must hold the same number of ranks")

    @property
    def num_nodes(self) -> int:
        return self.num_ranks // self.gpus_per_node

    def node_of(self, rank: int) -> int:
        return self._check(rank) // self.gpus_per_node

    def local_of(self, rank: int) -> int:
        return self._check(rank) % self.gpus_per_node

    def rank_of(self, node: int, local: int) -> int:
        if not 0 <= node < self.num_nodes:
            raise ValueError(f"node must be in [0, {self.num_nodes}), got {node}")
        if not 0 <= local < self.gpus_per_node:
            raise ValueError(f"local must be in [0, {self.gpus_per_node}), got {local}")
        return node * self.gpus_per_node + local

    def rail_peer(self, rank: int, node: int) -> int:
        """The rank on `node` with `rank`'s local index (where its RDMA traffic lands)."""
        return self.rank_of(node, self.local_of(rank))

    def _check(self, rank: int) -> int:
        if not 0 <= rank < self.num_ranks:
            raise ValueError(f"rank must be in [0, {self.num_ranks}), got {rank}")
        return rank


def from_local_ranks(local_ranks: Sequence[int]) -> Topology:
    """Topology from every global rank's local rank (index on its node), in global order.

    A node is a run 0, 1, ..., G-1; every node must have the same G (the kernels number
    ranks node-major). Anything else is a ValueError naming `local_ranks`.
    """
    lr = [int(v) for v in local_ranks]
    if not lr:
        raise ValueError("local_ranks must not be empty")
    nodes, cur = [], []
    for r, v in enumerate(lr):
        if v == 0 and cur:
            nodes.append(cur)
            cur = []
        if v != len(cur):
            raise ValueError(
                f"local_ranks must be runs 0, 1, ..., G-1 in global rank order (node-major "
                f"numbering); rank {r} has local rank {v}, expected {len(cur)}")
        cur.append(v)
    nodes.append(cur)
    sizes = sorted({len(n) for n in nodes})
    if len(sizes) != 1:
        raise ValueError(f"local_ranks give nodes of different sizes {sizes}; every node "
                         f"must hold the same number of ranks")
    return Topology(len(lr), sizes[0])


def local_ranks_from_hosts(hosts: Sequence[str]) -> list[int]:
    """Every global rank's local rank from its host name (one per rank, in global order,
    e.g. all-gathered through `jax.distributed`'s key-value store at bootstrap): its index
    among the earlier ranks on the same host. Feed the result to `from_local_ranks`, which
    checks the numbering is node-major."""
    seen: dict[str, int] = {}
    out = []
    for h in hosts:
        out.append(seen.get(h, 0))
        seen[h] = seen.get(h, 0) + 1
    return out


def _env_gpus_per_node(environ: Mapping[str, str] | None) -> int | None:
    """The setting gpus_per_node (JAX_EP_GPUS_PER_NODE; jax_ep.config) for `environ`
    (None: this process's settings)."""
    from jax_ep import config
    return config.settings_for(environ).gpus_per_node


def _env_node_size(num_ranks: int, env: Mapping[str, str]) -> int | None:
    """`JAX_EP_GPUS_PER_NODE` when set (it must divide `num_ranks`), else None."""
    g = _env_gpus_per_node(env)
    if g is not None and num_ranks % g:
        raise ValueError(f"{GPUS_PER_NODE_ENV}={g} must divide the number of ranks "
                         f"({num_ranks})")
    return g


def detect(num_ranks: int, local_ranks: Sequence[int] | None = None,
           environ: Mapping[str, str] | None = None) -> Topology:
    """The EP group's topology: `JAX_EP_GPUS_PER_NODE` if set, else `local_ranks`, else
    a launcher's local size (LAUNCHER_LOCAL_SIZE, when it divides the ranks), else one
    node (every rank on one node)."""
    g = _env_node_size(num_ranks, environ)
    if g is not None:
        return Topology(num_ranks, g)
    env = os.environ if environ is None else environ
    if local_ranks is not None:
        topo = from_local_ranks(local_ranks)
        if topo.num_ranks != num_ranks:
            raise ValueError(f"local_ranks has {topo.num_ranks} entries for {num_ranks} ranks")
        return topo
    for var in LAUNCHER_LOCAL_SIZE:  # this process's node size, as its launcher says
        raw = env.get(var, "").strip()
        if raw.isdigit() and int(raw) >= 1 and num_ranks % int(raw) == 0:
            return Topology(num_ranks, int(raw))
    return Topology(num_ranks, num_ranks)


def combine_node_size(num_ranks: int, platform: str | None = None,
                      local_ranks: Sequence[int] | None = None,
                      environ: Mapping[str, str] | None = None) -> int:
    """G of combine's summation order (kernels/common/combine_order.h): a token's rows are
    summed per node of G ranks, then over nodes. `JAX_EP_GPUS_PER_NODE` if set; else one
    node (G = num_ranks) on `platform` "cpu"; else `detect`'s node size (local ranks, a
    launcher's local size), so the reference backend sums as the internode kernels do."""
    g = _env_node_size(num_ranks, environ)
    if g is not None:
        return g
    if platform == "cpu":
        return num_ranks
    return detect(num_ranks, local_ranks, environ).gpus_per_node


# Whether a GPU run has verified the hierarchical kernels (README "verified on" table, docs/verification.md).
# Until then "auto" never picks them; mode="hierarchical" still runs them on request.
HIERARCHICAL_VERIFIED = False


def choose_mode(requested: str | None, topo: Topology,
                hierarchical_available: bool = True,
                hierarchical_verified: bool | None = None) -> str:
    """"direct" or "hierarchical" for `requested` ("direct", "hierarchical", "auto" or
    None = "auto") on `topo`. "auto" is hierarchical only when the hierarchical kernels
    have been verified on hardware (`hierarchical_verified`, default
    HIERARCHICAL_VERIFIED), the build has them (`hierarchical_available`) and there are
    several nodes with several GPUs each (then a token crosses the network once per node,
    not per GPU); direct otherwise."""
    mode = "auto" if requested is None else str(requested).strip().lower()
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {requested!r}")
    if mode == "auto":
        if hierarchical_verified is None:
            hierarchical_verified = HIERARCHICAL_VERIFIED
        several = topo.num_nodes > 1 and topo.gpus_per_node > 1
        pick = several and hierarchical_available and hierarchical_verified
        return "hierarchical" if pick else "direct"
    return mode


def mode_from_env(default: str | None, environ: Mapping[str, str] | None = None) -> str:
    """The setting internode_mode (`JAX_EP_INTERNODE_MODE`; jax_ep.config, validated
    naming the variable) for `environ` (None: this process's settings) if set, else
    `default`."""
    from jax_ep import config
    mode = config.settings_for(environ).internode_mode
    if mode is None:
        return "auto" if default is None else default
    return mode
