#!/usr/bin/env python3
"""docs/performance.md's "Latency-aware model" tables, regenerated from stored counts:

    python scripts/latency_table.py                      # print both tables
    python scripts/latency_table.py --which before       # print one (before | after | both)
    python scripts/latency_table.py --write              # write both between their marks

Two sets of counts, each the emulated GPU's at small shapes: "before", the kernels as they
were when the latency-aware model was introduced (docs/model_counts/before/latency_*.json),
and "after", today's kernels (docs/model_counts/latency_*.json). Each file is written by
`python -m jax_ep.bench --emulated --model-only --targets <target> --model-tokens T --json
docs/model_counts/latency_<target>.json`; each target is remodelled here by today's model
(jax_ep.bench.emulated.model_entry), both the roofline ("old") and the latency-aware one
("new"), so a change of a constant or of the model shows in both tables without counting
again. MODEL numbers, not measurements.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "docs", "performance.md")
# which -> (the folder of its stored counts, the marks its table sits between in DOC)
SETS = {
    "before": (os.path.join(ROOT, "docs", "model_counts", "before"),
               ("<!-- latency:begin -->", "<!-- latency:end -->")),
    "after": (os.path.join(ROOT, "docs", "model_counts"),
              ("<!-- latency-after:begin -->", "<!-- latency-after:end -->")),
}
COUNTS = SETS["after"][0]
MARKS = SETS["before"][1]
ORDER = ("intranode", "hierarchical_2x8", "direct_2x8", "internode_ll")


def count_files(which="after"):
    """The stored counts of one set (`which`: before | after)."""
    return sorted(glob.glob(os.path.join(SETS[which][0], "latency_*.json")))


def entries(settings=(), which="after"):
    """Each stored target of one set remodelled with today's code (and `settings`,
    --model-set's)."""
    sys.path.insert(0, ROOT)
    from jax_ep.bench import emulated as be

    k = be.model_constants(list(settings))
    out = {}
    for path in count_files(which):
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
            met = v["ops"].get(op)
            rows.append(
                f"| {name} | {op} | {e['counted_at'][0]['tokens']} | {rate(name, old)} | "
                f"{rate(name, new)} | {new['bound']} | {int(new['sms'])} | "
                f"{fl['local']:.0f}, {fl['peer']:.0f} | {ch['local']:.0f} / {ch['peer']:.0f} / "
                f"{ch['rdma']:.0f} | {v['target']} | "
                f"{'n/a' if met is None else ('yes' if met else 'no')} |")
    return "\n".join(rows)


def block(doc, which):
    """The text between one set's marks in `doc` (stripped)."""
    m = SETS[which][1]
    return doc[doc.index(m[0]) + len(m[0]):doc.index(m[1])].strip()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--which", choices=("before", "after", "both"), default="both",
                   help="which table to print (--write writes both)")
    p.add_argument("--write", action="store_true", help="write both tables into " + DOC)
    p.add_argument("--model-set", action="append", default=[], metavar="NAME=VALUE")
    a = p.parse_args(argv)
    names = ("before", "after") if a.write or a.which == "both" else (a.which,)
    tables = {w: table(entries(a.model_set, w)) for w in names}
    if not a.write:
        print("\n\n".join(f"{w}:\n{t}" if len(tables) > 1 else t for w, t in tables.items()))
        return tables
    doc = open(DOC).read()
    for w, t in tables.items():
        m = SETS[w][1]
        i, j = doc.index(m[0]) + len(m[0]), doc.index(m[1])
        doc = doc[:i] + "\n" + t + "\n" + doc[j:]
    with open(DOC, "w") as f:
        f.write(doc)
    print(f"wrote {DOC}")
    return tables


if __name__ == "__main__":
    main()
