"""One process per host over NCCL GIN, laid out as JAX runs it: 2 emulated hosts of 4
virtual GPUs, each host one process that makes its 4 communicators in one NCCL group and
starts the internode runtime on each of its devices (internode::StartOverNccl, what
jax_ep.nccl_bootstrap calls), then the handlers of each local device. Direct,
hierarchical and low-latency modes, bit-exact against the reference backend. NVSHMEM
cannot run this layout (one PE per process): the test is NCCL's alone."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from emu_intranode_util import ll_reference  # noqa: E402
from internode_emu_util import InternodeEmu  # noqa: E402
from test_internode_emu import Case, run_round_trip  # noqa: E402
from test_internode_hier_emu import data, round_trip  # noqa: E402
from test_internode_ll_emu import check_round, inputs as ll_inputs, one_round  # noqa: E402

pytestmark = pytest.mark.emu
HOSTS, G = 2, 4
R = HOSTS * G


def per_host(**kw):
    return InternodeEmu(R, gpus_per_node=G, transport="nccl", gpus_per_process=G, **kw)


def test_direct_one_process_per_host():
    c = Case("per_host", R=R, G=G, T=6, H=16, K=3, E=16, C=40, seed=5)
    run_round_trip(c, em=per_host(num_ports=2, qps_per_port=1, chunk_bytes=64, seed=6))


def test_hierarchical_one_process_per_host():
    T, H, K = 6, 16, 3
    E, C = 2 * R, R * T
    em = per_host(num_ports=2, qps_per_port=1, seed=7)
    rng = np.random.default_rng(7)
    round_trip(em, "hierarchical", *data(rng, R, T, H, K, E, C, np.float32), E=E, C=C, K=K)


def test_low_latency_one_process_per_host():
    """The low-latency area made at the start, in each window past the heap halves (as
    jax_ep.nccl_bootstrap.initialize(low_latency=...) asks)."""
    S, H, K, E, M = 4, 8, 2, 16, 6
    em = per_host(num_ports=2, qps_per_port=1, seed=8,
                  low_latency=dict(max_tokens=M, row_bytes=H * 2, topk=K, num_experts=E))
    rng = np.random.default_rng(8)
    x, idx, w, y = ll_inputs(R, S, H, K, E, M, "bf16", rng)
    got, rpd = one_round(em, x, idx, w, y, K=K)
    check_round(got, ll_reference(x, idx, w, y, E=E, M=M, rows_per_dest=rpd), "per host: ")
    assert em.errors() == [""] * R


def test_each_device_is_its_own_rank():
    """The process's 4 devices are 4 ranks of one world (not one rank): a handler call on
    one of them is refused when told another rank, naming the GPU's own."""
    em = per_host(num_ports=2, qps_per_port=1, seed=9)
    c = Case("rank", R=R, G=G, T=2, H=8, K=2, E=16, C=16)
    x = np.zeros((R, c.T, c.H), np.float32)
    idx = np.zeros((R, c.T, c.K), np.int32)
    w = np.ones((R, c.T, c.K), np.float32)
    _, errs = em.dispatch(x, idx, w, num_experts=c.E, capacity=c.C,
                          per_rank_attrs=[dict(rank=(r + 1) % R) for r in range(R)])
    assert all("this GPU is rank" in e and "NCCL" in e for e in errs), errs


def test_uneven_process_refused():
    with pytest.raises(ValueError, match="must divide"):
        InternodeEmu(R, gpus_per_node=G, transport="nccl", gpus_per_process=3)


def test_too_few_contexts_named():
    """NCCL grants fewer GIN contexts than the plan's QPs: the start fails on every process
    with how many it gave and what lowers the plan."""
    with pytest.raises(RuntimeError, match="QPS_PER_PORT|qps_per_port"):
        per_host(num_ports=2, qps_per_port=2, max_contexts=2)
