"""Final table and JSON of scripts/gpu_check.sh: reads the stage records it wrote
(WORK/stages.tsv: stage, name, status, rc, seconds, budget) and each stage's extras in
WORK (sN.json, sN.xml junit reports, sN_*.json, sN.tools, sN.timeouts, mps.status and
the MPS daemon's logs), writes OUT/gpu_check.json (with the junit reports themselves,
the reason of every time-out and the MPS status: what a rerun needs, in one file of the
8 that come back) and OUT/summary.txt, and prints the table. The overall verdict is
"pass" only when every stage ran and passed. Standard library only, so it
works whatever state the build is in.

    python3 scripts/gpu_check_report.py WORK OUT
"""
from __future__ import annotations

import glob
import json
import os
import sys
import xml.etree.ElementTree as ET


def _junit(path: str) -> dict:
    """Counts and the failing/skipped test names of a pytest junit report."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError) as e:
        return {"error": f"unreadable junit report: {e}"}
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    res = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0, "failed": [], "skips": []}
    for s in suites:
        for k in ("tests", "failures", "errors", "skipped"):
            res[k] += int(s.get(k, 0))
        for case in s.iter("testcase"):
            name = f"{case.get('classname', '')}::{case.get('name', '')}"
            for tag in ("failure", "error"):
                el = case.find(tag)
                if el is not None:
                    res["failed"].append({"test": name, "message": (el.get("message") or "")[:500]})
            sk = case.find("skipped")
            if sk is not None:
                res["skips"].append({"test": name, "reason": (sk.get("message") or "")[:300]})
    res["passed"] = res["tests"] - res["failures"] - res["errors"] - res["skipped"]
    return res


_MAX_XML = 200_000
_MAX_LOG = 20_000


def _read(path: str, limit: int) -> str:
    """The file's text, its last `limit` characters when longer."""
    try:
        with open(path, errors="replace") as f:
            text = f.read()
    except OSError as e:
        return f"unreadable: {e}"
    return text if len(text) <= limit else "[...]" + text[-limit:]


def _mps(work: str) -> dict:
    """The MPS start status per stage and the tail of the daemon's logs."""
    res = {}
    status = os.path.join(work, "mps.status")
    if os.path.exists(status):
        res["status"] = _read(status, _MAX_LOG).splitlines()
    for path in sorted(glob.glob(os.path.join(work, "mps_log", "*.log"))):
        res[os.path.basename(path)] = _read(path, _MAX_LOG)
    return res


def overall(rows) -> str:
    """"pass", "FAIL" (a stage failed or timed out), "not verified" (a stage did not run:
    a tool or a library missing, neither a failure nor green), or "planned" (a dry run)."""
    statuses = [r["status"] for r in rows]
    if any(s.startswith(("FAIL", "timeout")) for s in statuses):
        return "FAIL"
    if any(s.startswith("not run") for s in statuses):
        return "not verified (not run: " + ", ".join(
            r["name"] for r in rows if r["status"].startswith("not run")) + ")"
    if any(s == "planned" for s in statuses):
        return "planned (dry run)"
    return "pass" if rows else "FAIL"


def _extras(work: str, n: str) -> dict:
    out = {}
    for path in sorted(glob.glob(os.path.join(work, f"s{n}*.json"))):
        key = os.path.basename(path)[:-5]
        try:
            with open(path) as f:
                out[key] = json.load(f)
        except (OSError, ValueError) as e:
            out[key] = {"error": f"unreadable: {e}"}
    for path in sorted(glob.glob(os.path.join(work, f"s{n}*.xml"))):
        key = os.path.basename(path)[:-4]
        out[key + "_junit"] = _junit(path)
        out[key + "_junit_xml"] = _read(path, _MAX_XML)  # the report itself, for a rerun
    timeouts = os.path.join(work, f"s{n}.timeouts")
    if os.path.exists(timeouts):
        with open(timeouts) as f:
            out["timeouts"] = [dict(zip(("what", "reason"), ln.split("\t", 1)))
                               for ln in f.read().splitlines() if ln.strip()]
    tools = os.path.join(work, f"s{n}.tools")
    if os.path.exists(tools):
        with open(tools) as f:
            out["tools"] = [dict(zip(("tool", "rc", "seconds", "status"), ln.split("\t")))
                            for ln in f.read().splitlines() if ln.strip()]
    return out


def _detail(status: str, extra: dict) -> str:
    base = _detail_base(extra)
    if "timeouts" in extra:  # which box ran out comes first
        to = "; ".join(f"{t['what']}: {t['reason']}" for t in extra["timeouts"])
        return f"TIMED OUT {to}" + (f" | {base}" if base else "")
    return base


def _detail_base(extra: dict) -> str:
    for v in extra.values():
        if isinstance(v, dict) and "tests" in v and "passed" in v:
            d = f"{v['passed']} passed, {v['failures'] + v['errors']} failed, {v['skipped']} skipped"
            if v["failed"]:
                d += "; first failure: " + v["failed"][0]["test"].split("::")[-1]
            return d
    if "tools" in extra:
        return ", ".join(f"{t['tool']}: {t['status']}" for t in extra["tools"])
    info = extra.get("s1", {})
    if isinstance(info, dict) and "build_info" in info:
        b = info["build_info"]
        return (f"cuda={b.get('cuda')} nvshmem={b.get('nvshmem')} archs={','.join(b.get('cuda_archs', []))}"
                f" jax={info.get('jax')} nvshmem_wheel={info.get('nvshmem_wheel')}")
    return ""


def _all_skipped(status: str, extra: dict) -> str:
    """A stage whose pytest runs all passed but ran no test (every one skipped, e.g. no GPU
    visible) proved nothing: "not run", with the first skip's reason."""
    if status != "pass":
        return status
    reports = [v for v in extra.values() if isinstance(v, dict) and "passed" in v]
    if reports and sum(v["tests"] for v in reports) > 0 and \
            sum(v["passed"] for v in reports) == 0:
        skips = [s for v in reports for s in v["skips"]]
        why = skips[0]["reason"][:120] if skips else "no test ran"
        return f"not run (every test skipped: {why})"
    return status


def main(argv) -> int:
    work, out = argv[1], argv[2]
    rows = []
    try:
        with open(os.path.join(work, "stages.tsv")) as f:
            for ln in f.read().splitlines():
                if ln.strip():
                    n, name, status, rc, secs, budget = ln.split("\t")[:6]
                    rows.append(dict(stage=int(n), name=name, status=status, rc=rc,
                                     seconds=int(secs), budget=int(budget)))
    except OSError:
        pass
    extras = {}
    for r in rows:
        extras[r["stage"]] = extra = _extras(work, str(r["stage"]))
        r["status"] = _all_skipped(r["status"], extra)
        r["detail"] = _detail(r["status"], extra)
    result = {"overall": overall(rows), "mps": _mps(work), "stages": []}
    for r in rows:
        result["stages"].append(dict(r, results=extras[r["stage"]]))
    with open(os.path.join(out, "gpu_check.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    head = ("stage", "name", "status", "seconds", "detail")
    table = [head] + [(str(r["stage"]), r["name"], r["status"], f"{r['seconds']}/{r['budget']}",
                       r["detail"]) for r in rows]
    widths = [max(len(t[i]) for t in table) for i in range(4)]
    lines = []
    for i, t in enumerate(table):
        lines.append(" | ".join(c.ljust(w) for c, w in zip(t[:4], widths)) + " | " + t[4])
        if i == 0:
            lines.append("-+-".join("-" * w for w in widths) + "-+-------")
    text = f"overall: {result['overall']}\n" + "\n".join(lines)
    with open(os.path.join(out, "summary.txt"), "w") as f:
        f.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
