"""NVSHMEM without custom QPs: `nvshmemx_qp_create` returns NVSHMEMX_QP_DEFAULT for every
handle (the remote transport is not IBGDA), and a default handle's puts travel on the QP
of their CTA (IBGDA's RC map by CTA), so one logical QP's puts may pass each other. The
emulated NVSHMEM does both; the bootstrap's Init must refuse on every rank with an error
naming the NVSHMEM setting, never run to wrong data.

The handle-less path (an NVSHMEM host library without nvshmemx_qp_create) puts through
NVSHMEM's own QPs, also per CTA here: every mode must still match the reference there."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from internode_emu_util import InternodeEmu  # noqa: E402
from test_internode_emu import Case, inputs  # noqa: E402
from test_internode_hier_emu import round_trip  # noqa: E402

pytestmark = pytest.mark.emu


@pytest.mark.parametrize("R,G", [(4, 2), (4, 1)])
def test_default_handles_are_refused_on_every_rank(R, G):
    with pytest.raises(RuntimeError) as e:
        InternodeEmu(R, gpus_per_node=G, num_ports=2, qps_per_port=1, seed=3,
                     default_handles=True)
    msg = str(e.value)
    for r in range(R):  # every rank says it, not only the first
        assert f"rank {r}: jax_ep internode: nvshmemx_qp_create(2) returned " \
               f"NVSHMEMX_QP_DEFAULT" in msg, msg
    assert "NVSHMEM_IB_ENABLE_IBGDA=1" in msg


def test_one_default_handle_is_refused_too():
    """One logical QP on a default handle still spreads over the CTAs' QPs."""
    with pytest.raises(RuntimeError, match="NVSHMEMX_QP_DEFAULT"):
        InternodeEmu(2, gpus_per_node=1, num_ports=1, qps_per_port=1, seed=3,
                     default_handles=True)


@pytest.mark.parametrize("mode,G", [("direct", 1), ("hierarchical", 2)])
def test_handle_less_puts_on_per_cta_qps_stay_correct(mode, G):
    """Without the QP API every put takes NVSHMEM's QP of its CTA, and those QPs are
    delivered in any order against each other: the results still match the reference bit
    for bit (the modes order data before counts with quiet or per-block signals)."""
    c = Case("percta", R=4, T=8, H=32, K=2, E=8, C=24, chunk=64)
    em = InternodeEmu(c.R, gpus_per_node=G, num_ports=2, qps_per_port=2, chunk_bytes=64,
                      seed=11, qp_api=False, max_delay=200)
    x, idx, w, y, g = inputs(c)
    if mode == "direct":
        from internode_emu_util import reference
        ref = reference(x, idx, w, y, g, E=c.E, C=c.C)
        outs, errs = em.dispatch(x, idx, w, num_experts=c.E, capacity=c.C, mode=mode)
        assert errs == [""] * c.R, errs
        for r in range(c.R):
            assert np.array_equal(outs[r]["recv_x"], ref["recv_x"][r]), r
    else:
        round_trip(em, mode, x, idx, w, y, g, E=c.E, C=c.C, K=c.K)
    log, _ = em.log()
    blocks = {r["block"] for r in log if r["qp"] < 0 and r["src"] // G != r["dst"] // G}
    assert len(blocks) > 1, "the case must put from several CTAs to show the per-CTA QPs"
