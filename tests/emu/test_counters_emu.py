"""The emulated GPU's counters (kernels/emu, docs/emulator.md "Counters"): counts of what
the kernels did (launches, blocks, warps, bytes by width and space, fences, release
stores, acquire loads, puts and work requests per QP), never measurements. Expectations
are worked out by hand from the access pattern of each case."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from jax_ep._src import emu as emulator
from jax_ep._src.emu import Emulator, InternodeEmulator, counting, summarize

pytestmark = pytest.mark.emu


def _bytes(c, direction, space):
    """{width: bytes} moved by `direction` (load/store) in `space` (local/peer)."""
    return summarize(c)["bytes"][direction].get(space, {})


@pytest.fixture
def probe_emu():
    Emulator(2, seed=3, resident_blocks=8)  # configures the virtual GPUs
    return emulator.module()


def test_probe_16_byte_helpers_count_bytes_per_gpu_width_and_space(probe_emu):
    """GPU 0 copies 256 bytes into GPU 1 with the 16-byte helpers, 32 threads: 16 loads of
    its own memory and 16 stores into the peer's, one system fence per thread, one release
    store; GPU 1 acquires the flag and moves no bytes."""
    with counting() as c:
        probe_emu.counter_probe(0, 256, threads=32)
    g0, g1 = c.per_device[0], c.per_device[1]
    assert _bytes(g0, "load", "local") == {16: 256}
    assert _bytes(g0, "store", "peer") == {16: 256}
    assert _bytes(g0, "load", "peer") == {} and _bytes(g0, "store", "local") == {}
    assert g0["loads:local:16"] == 16 and g0["stores:peer:16"] == 16
    assert g0["fences:system"] == 32 and g0["release_stores"] == 1
    # the longest chain of one thread: one fence each, one release in thread 0
    assert g0["chain:fences:system"] == 1 and g0["chain:release_stores"] == 1
    assert g0["kernel:ProbeCopyKernel:launches"] == 1
    assert g0["kernel:ProbeCopyKernel:blocks"] == 1
    assert g0["kernel:ProbeCopyKernel:warps"] == 1
    assert g0["kernel:ProbeCopyKernel:threads"] == 32
    # one block made every access: it is the busiest block of each space
    assert g0["block_max:accesses:local"] == 16 and g0["block_max:accesses:peer"] == 16
    assert g1.get("acquire_loads", 0) >= 1 and g1["polls"] >= g1["acquire_loads"]
    assert _bytes(g1, "load", "local") == {} and _bytes(g1, "store", "peer") == {}
    assert "fences:system" not in g1 and "release_stores" not in g1
    # the totals are the sum over the virtual GPUs
    assert c.total["store_bytes:peer:16"] == 256
    assert c.total["fences:system"] == 32


@pytest.mark.parametrize("n,src_offset,width", [(256, 0, 16), (256, 4, 4), (100, 0, 4),
                                                (254, 2, 2), (255, 1, 1)])
def test_probe_device_copy_counts_the_width_the_alignment_allows(probe_emu, n, src_offset, width):
    """devcopy::CopyBytes takes the widest access both pointers and the length allow; the
    threads' shares add up to the row, whatever the stride (48 threads: two warps)."""
    with counting() as c:
        probe_emu.counter_probe(1, n, threads=48, src_offset=src_offset)
    g0 = c.per_device[0]
    assert _bytes(g0, "load", "local") == {width: n}
    assert _bytes(g0, "store", "peer") == {width: n}
    assert g0[f"stores:peer:{width}"] == n // width
    assert g0["kernel:ProbeCopyKernel:warps"] == 2
    assert g0["fences:system"] == 48
    assert g0["chain:fences:system"] == 1


@pytest.mark.parametrize("blocks,busiest", [(2, 8), (3, 6)])
def test_busiest_block_is_the_maximum_over_blocks(probe_emu, blocks, busiest):
    """256 bytes in 16-byte vectors split into contiguous shares of 2 blocks (8 + 8) or 3
    (5 + 5 + 6): the busiest block made 8 (or 6) of the 16 loads and of the 16 stores, not
    their sum; the totals do not change."""
    with counting() as c:
        probe_emu.counter_probe(0, 256, threads=32, blocks=blocks)
    g0 = c.per_device[0]
    assert g0["kernel:ProbeCopyKernel:blocks"] == blocks
    assert g0["loads:local:16"] == 16 and g0["stores:peer:16"] == 16
    assert g0["block_max:accesses:local"] == busiest
    assert g0["block_max:accesses:peer"] == busiest


def test_chains_add_up_over_launches(probe_emu):
    """Two launches in one stream: their chains add (they run one after the other)."""
    with counting() as c:
        probe_emu.counter_probe(0, 64)
        probe_emu.counter_probe(0, 64)
    assert c.per_device[0]["chain:fences:system"] == 2
    assert c.per_device[0]["block_max:accesses:peer"] == 2 * 64 // 16  # so do busiest blocks
    assert c.per_device[0]["kernel:ProbeCopyKernel:launches"] == 2
    assert c.per_device[0]["store_bytes:peer:16"] == 128


def test_reset_and_device_argument(probe_emu):
    probe_emu.counter_probe(0, 64)
    emulator.reset_counters()
    assert emulator.counters(0).get("store_bytes:peer:16", 0) == 0
    with pytest.raises(ValueError, match="device"):
        emulator.counters(10_000)


def _one_row_case(R, H):
    """T=1 per rank, top-1: rank r's token goes to the one expert of rank (r + 1) % R."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((R, 1, H)).astype(ml_dtypes.bfloat16)
    idx = np.array([[[(r + 1) % R]] for r in range(R)], np.int32)
    w = np.ones((R, 1, 1), np.float32)
    return x, idx, w


def test_intranode_one_row_crosses_nvlink_once_at_16_bytes():
    """Intranode normal mode, R=2, T=1, one expert per rank, H=64 bf16 (128-byte rows):
    dispatch moves each rank's row into its peer exactly once, 16 bytes at a time, so the
    16-byte peer traffic is one row per rank; combine brings each row back once. Doubling
    the tokens doubles it (the count follows the data)."""
    R, H = 2, 64
    row = H * 2
    emu = Emulator(R, seed=4, resident_blocks=8)
    emu.setup(tokens=2, capacity=4, row_bytes=row, topk=1)
    x, idx, w = _one_row_case(R, H)
    with counting() as c:
        d = emu.dispatch(x, idx, w, num_experts=R, capacity=4)
    for r in range(R):
        assert _bytes(c.per_device[r], "store", "peer").get(16, 0) + \
            _bytes(c.per_device[r], "load", "peer").get(16, 0) == row, r
    assert c.total["store_bytes:peer:16"] + c.total.get("load_bytes:peer:16", 0) == R * row
    assert (d["num_recv"] == 1).all()
    y = d["recv_x"]
    with counting() as c2:
        emu.combine(y, d["send_row"])
    assert c2.total.get("store_bytes:peer:16", 0) + c2.total.get("load_bytes:peer:16", 0) == R * row
    # two tokens per rank: twice the rows across NVLink
    x2 = np.concatenate([x, x], axis=1)
    with counting() as c3:
        emu.dispatch(x2, np.concatenate([idx, idx], 1), np.concatenate([w, w], 1),
                     num_experts=R, capacity=4)
    assert c3.total["store_bytes:peer:16"] + c3.total.get("load_bytes:peer:16", 0) == 2 * R * row


def test_internode_direct_one_row_is_one_rdma_payload_per_rank():
    """Direct internode mode, 2 nodes of 1 GPU, T=1 top-1 to the other rank: each rank's
    RDMA puts carry its row, and every RDMA put is at least one work request on a QP."""
    R, H = 2, 64
    row = H * 2
    em = InternodeEmulator(R, gpus_per_node=1, num_ports=2, qps_per_port=1, seed=2, heap_mib=4)
    x, idx, w = _one_row_case(R, H)
    with counting() as c:
        em.dispatch(x, idx, w, num_experts=R, capacity=4, mode="direct")
    s = summarize(c.total)
    assert s["puts"]["rdma"]["bytes"] >= R * row
    assert "peer" not in s["puts"]  # one GPU per node: nothing over NVLink by put
    assert sum(q["puts"] for q in s["qps"].values()) == s["puts"]["rdma"]["puts"]
    assert s["puts"]["rdma"]["wrs"] >= s["puts"]["rdma"]["puts"]
    for r in range(R):
        assert c.per_device[r]["puts:rdma"] >= 1, r


def test_bench_emulated_prints_counts_labelled_as_counts(tmp_path, capsys):
    """`python -m jax_ep.bench --emulated`: a table labelled as counts (not measurements)
    and JSON with the totals and each GPU's counters; settable shapes."""
    import json

    from jax_ep.bench import exchange as bench

    path = tmp_path / "counts.json"
    rep = bench.main(["--emulated", "--modes", "intranode", "--ranks", "2", "--tokens", "1",
                      "--hidden", "64", "--topk", "1", "--experts", "2", "--json", str(path)])
    out = capsys.readouterr().out
    assert "COUNTED by the emulated GPU" in out and "not measurements" in out
    saved = json.loads(path.read_text())
    assert saved["kind"] == "emulated_counts" and "not measurements" in saved["note"]
    rows = {r["op"]: r for r in rep["results"]}
    assert set(rows) == {"dispatch", "combine"}
    for r in rows.values():
        assert r["mode"] == "intranode" and r["gpus"] == 2 and len(r["per_device"]) == 2
        assert r["shape"]["ranks"] == 2 and r["shape"]["hidden"] == 64
        assert r["launches"] >= 2 and r["max_blocks_per_launch"] >= 1
    # every token of one rank goes to the other's expert or its own: at most 2 rows of
    # 128 bytes cross NVLink per op, and dispatch's 16-byte peer traffic is whole rows
    p16 = rows["dispatch"]["counters"].get("store_bytes:peer:16", 0) + \
        rows["dispatch"]["counters"].get("load_bytes:peer:16", 0)
    assert p16 % 128 == 0 and p16 <= 2 * 128
