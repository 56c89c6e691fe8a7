"""`python -m jax_ep.bench --mode low_latency --virtual-ranks`: the GPU harness path of the
low-latency benchmark, run here with the harness replaced by the reference backend under
shard_map (same stacked shapes), so the plumbing (programs, inputs, bytes, floors) is
checked without a GPU."""
import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_ep
from jax_ep import low_latency as ll
from jax_ep._src import ext as _ext
from jax_ep.bench import exchange as bench


def _stand_in_harness(monkeypatch, calls):
    def mesh_of(R):
        return jax.make_mesh((R,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,),
                             devices=jax.devices()[:R])

    def dispatch(x, idx, *, num_experts, max_tokens_per_rank):
        R, T, H = x.shape
        calls.append(("dispatch", x.dtype, x.shape))

        def per_rank(x, idx):
            # The harness moves rows as bytes; the stand-in moves FP8 values as bfloat16,
            # which holds every e4m3 value exactly.
            moved = x[0].astype(jax.numpy.bfloat16) if x.dtype.itemsize == 1 else x[0]
            recv, cnt, h = ll.dispatch(moved, idx[0], num_experts=num_experts,
                                       axis_name="ep", backend="reference",
                                       max_tokens_per_rank=max_tokens_per_rank)
            return tuple(a[None] for a in (recv.astype(x.dtype), cnt, h.src_rank,
                                           h.src_index, h.first_row, h.row_count))

        return jax.shard_map(per_rank, mesh=mesh_of(R), in_specs=P("ep"),
                             out_specs=P("ep"))(x, idx)

    def combine(y, idx, w, first, count, *, num_experts, max_tokens_per_rank):
        R, T, K = idx.shape
        calls.append(("combine", y.dtype, y.shape))

        def per_rank(y, idx, w, first, count):
            empty = np.full(y.shape[1:3], -1, np.int32)
            h = ll.LowLatencyHandle(empty, empty, first[0], count[0], num_experts, R,
                                    max_tokens_per_rank, "ep", T, K)
            return ll.combine(y[0], idx[0], w[0], h, backend="reference")[None]

        return jax.shard_map(per_rank, mesh=mesh_of(R), in_specs=P("ep"),
                             out_specs=P("ep"))(y, idx, w, first, count)

    monkeypatch.setattr(ll, "harness_dispatch", dispatch)
    monkeypatch.setattr(ll, "harness_combine", combine)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(jax_ep.cuda, "available", lambda: True)
    monkeypatch.setattr(_ext, "registered_platforms", lambda: frozenset({"cpu", "gpu"}))


ARGS = ["--mode", "low_latency", "--ranks", "4", "--tokens", "8", "--hidden", "256",
        "--topk", "2", "--experts", "8", "--repeats", "1", "--warmup", "0",
        "--input-sets", "1", "--memcpy-mib", "1"]


def test_virtual_ranks_run_every_op_through_the_harness(monkeypatch, tmp_path):
    calls = []
    _stand_in_harness(monkeypatch, calls)
    out = tmp_path / "ll.json"
    report = bench.main(ARGS + ["--virtual-ranks", "--backends", "ffi,reference",
                                "--json", str(out)])
    assert report["config"]["virtual_ranks"] is True
    assert {r["op"] for r in report["results"]} == {"dispatch", "dispatch_fp8", "combine",
                                                    "roundtrip"}
    assert {r["backend"] for r in report["results"]} == {"ffi"}
    assert "harness" in report["skipped_backends"]["reference"]
    # Stacked per rank; FP8 moves the e4m3 values and the float32 scales (H / 128 wide).
    assert ("dispatch", np.dtype(jax.numpy.bfloat16), (4, 8, 256)) in calls
    assert ("dispatch", np.dtype(jax.numpy.float8_e4m3fn), (4, 8, 256)) in calls
    assert ("dispatch", np.dtype(np.float32), (4, 8, 2)) in calls
    assert ("combine", np.dtype(jax.numpy.bfloat16), (4, 2, 4 * 8, 256)) in calls
    disp = next(r for r in report["results"] if r["op"] == "dispatch")
    assert disp["rows_bytes"] == 4 * 8 * 2 * 256 * 2
    assert "reversal" in report["memcpy"]["method"]  # the device copy floor, not memcpy
    assert report["ffi_roundtrip_over_output_floor"] > 0 and out.exists()


def test_virtual_ranks_off_a_gpu_is_an_error():
    with pytest.raises(SystemExit, match="--virtual-ranks"):
        bench.main(ARGS + ["--virtual-ranks"])
