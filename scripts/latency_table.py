#!/usr/bin/env python3
"""docs/performance.md's "Latency-aware model" table, regenerated from stored counts:

    python scripts/latency_table.py            # print the table
    python scripts/latency_table.py --write    # write it between the latency marks

The counts are the emulated GPU's at small shapes (docs/model_counts/latency_*.json, each
written by `python -m jax_ep.bench --emulated --model-only --targets <target> --model-tokens T
--json docs/model_counts/latency_<target>.json`); each target is remodelled here by today's
model (jax_ep.bench.emulated.model_entry), both the roofline ("old") and the latency-aware
one ("new"), so a change of a constant or of the model shows in the table without counting
again. MODEL numbers, not measurements.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COUNTS = os.path.join(ROOT, "docs", "model_counts")
DOC = os.path.join(ROOT, "docs", "performance.md")
MARKS = ("<!-- latency:begin -->", "<!-- latency:end -->")
ORDER = ("intranode", "hierarchical_2x8", "direct_2x8", "internode_ll")


def entries(settings=()):
    """Each stored target remodelled with today's code (and `settings`, --model-set's)."""
    sys.path.insert(0, ROOT)
    from jax_ep.bench import emulated as be

    k = be.model_constants(list(settings))
    out = {}
    for path in sorted(glob.glob(os.path.join(COUNTS, "latency_*.json"))):
        with open(path) as f:
            for e in json.load(f)["model"]["entries"]:
                if "points" in e:
                    out[e["target"]] = be.model_entry(e["target"], e["points"], k)
    return [out[n] for n in ORDER if n in out]


def rate(name, o):
    """The op's rate as the issue states its target: NVLink GB/s intranode, RDMA GB/s per
    GPU internode, microseconds for low latency."""
    if name == "internode_ll":
        return f"{o['time_s'] * 1e6:.1f} us"
    if name == "intranode":
        return f"{o['nvlink_fraction'] * 450:.1f} GB/s ({o['nvlink_fraction']:.2f})"
    return f"{o['rdma_GBps']:.1f} GB/s"


def table(es) -> str:
    rows = ["| target | op | counted at T | old model (roofline) | new model (latency-aware) "
            "| new: bound | SMs | B in flight / warp (local, peer) | longest chain: rounds "
            "local / peer / RDMA | issue-46 target | met (new) |",
            "|---|---|---:|---:|---:|---|---:|---:|---:|---|---|"]
    for e in es:
        name = e["target"]
        v = e["latency_verdict"]
        for op in ("dispatch", "combine"):
            old, new = e["ops"][op], e["latency_ops"][op]
            fl, ch = new["inflight_bytes_per_warp"], new["longest_rounds"]
            old_rate = (f"{old['time_s'] * 1e6:.1f} us" if name == "internode_ll" else
                        f"{old['nvlink_fraction'] * 450:.1f} GB/s ({old['nvlink_fraction']:.2f})"
                        if name == "intranode" else f"{old['rdma_GBps']:.1f} GB/s")
            met = v["ops"].get(op)
            rows.append(
                f"| {name} | {op} | {e['counted_at'][0]['tokens']} | {old_rate} | "
                f"{rate(name, new)} | {new['bound']} | {int(new['sms'])} | "
                f"{fl['local']:.0f}, {fl['peer']:.0f} | {ch['local']:.0f} / {ch['peer']:.0f} / "
                f"{ch['rdma']:.0f} | {v['target']} | "
                f"{'n/a' if met is None else ('yes' if met else 'no')} |")
    return "\n".join(rows)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--write", action="store_true", help="write the table into " + DOC)
    p.add_argument("--model-set", action="append", default=[], metavar="NAME=VALUE")
    a = p.parse_args(argv)
    t = table(entries(a.model_set))
    if not a.write:
        print(t)
        return t
    doc = open(DOC).read()
    i, j = doc.index(MARKS[0]) + len(MARKS[0]), doc.index(MARKS[1])
    with open(DOC, "w") as f:
        f.write(doc[:i] + "\n" + t + "\n" + doc[j:])
    print(f"wrote {DOC}")
    return t


if __name__ == "__main__":
    main()
