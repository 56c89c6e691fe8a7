"""The normal-mode intranode kernels' failed state, read from the sources (no GPU here).

The device error record keeps only the first error, and a bad topk id or a foreign handle
(recorded, repaired, not fatal) can be that first error. So the state that decides "this
GPU has failed: move no data, send kSiteFailed" must be a word of its own that every
protocol error sets (timeout, rank mismatch, call-site mismatch, failed peer), read by
every skip decision, and cleared where the record is cleared. Each check below is also
run on a planted mistake, which it must catch."""
from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
KERNELS = ROOT / "kernels" / "cuda" / "intranode_kernels.cu"
BUFFER = ROOT / "kernels" / "cuda" / "intranode_buffer.h"
HARNESS = ROOT / "xla_ffi" / "cuda" / "cuda_harness.cc"

RECORD = "g_intranode_error"
FAILED = "g_intranode_failed"


def _body(text: str, name: str) -> str:
    """The body of the function defined as `... name(...) {`, between its braces."""
    m = re.search(rf"\b{name}\s*\([^;{{]*\)\s*(?:const\s*)?\{{", text)
    assert m is not None, f"no definition of {name}"
    depth, start = 0, m.end() - 1
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start + 1:i]
    raise ValueError(f"unbalanced braces in {name}")


def _lift_body(cu: str) -> str:
    """The body of ClearIntranodeFailure's definition (comments name it too)."""
    i = cu.index("cudaError_t ClearIntranodeFailure() {")
    return _body(cu[i:], "ClearIntranodeFailure")


def _calls(text: str, name: str) -> list[str]:
    """Argument lists of every call `name(...)` (definitions included)."""
    out = []
    for m in re.finditer(rf"\b{name}\s*\(", text):
        depth = 0
        for i in range(m.end() - 1, len(text)):
            depth += {"(": 1, ")": -1}.get(text[i], 0)
            if depth == 0:
                out.append(text[m.end():i])
                break
    return out


def protocol_codes(buffer_h: str) -> set[str]:
    """The codes IsProtocolError accepts (intranode_buffer.h)."""
    codes = set(re.findall(r"code\s*==\s*(kErr\w+)", _body(buffer_h, "IsProtocolError")))
    assert codes, "IsProtocolError names no codes"
    return codes


def check_kernels(cu: str, buffer_h: str) -> list[str]:
    """Violations of the failed-state rules in intranode_kernels.cu ([] when none)."""
    bad = []
    codes = protocol_codes(buffer_h)
    # 1. Errors are recorded only through report(), which sets the failed state for every
    #    protocol code (not only for a timeout), outside the first-error record.
    for args in _calls(cu, "record_error"):
        target = args.split(",")[0].strip().lstrip("&")
        if target not in (RECORD, FAILED):
            bad.append(f"record_error into an unknown record: {target}")
    outside = cu.replace(_body(cu, "report"), "")
    if re.search(r"\brecord_error\s*\(", outside):
        bad.append("an error is recorded outside report()")
    rep = _body(cu, "report")
    guard = re.search(r"if\s*\(\s*IsProtocolError\s*\(\s*code\s*\)\s*\)\s*\{?([^}]*)", rep)
    if guard is None or not re.search(rf"record_error\s*\(\s*&{FAILED}\b", guard.group(1)):
        bad.append("report() does not set the failed state for every protocol error")
    if re.search(rf"&{FAILED}\b", rep.replace(guard.group(1) if guard else "", "")):
        bad.append("report() sets the failed state outside its IsProtocolError guard")
    # Every protocol code reported at all goes through report() (checked above), so the
    # guard covers it; each must also appear, or the rule is about codes nobody sends.
    sent = {a.split(",")[1].strip() for a in _calls(cu, "report") if "," in a}
    missing = codes - sent
    if missing:
        bad.append(f"protocol codes never reported: {sorted(missing)}")
    # 2. failed() reads the failed state, never the first-error record's code.
    fb = _body(cu, "failed")
    if FAILED not in fb:
        bad.append("failed() does not read the failed state")
    if RECORD in fb or "IsProtocolError" in fb:
        bad.append("failed() decides from the first-error record")
    # 3. Every skip decision goes through failed(): no kernel reads the record's code.
    for name in ("site_to_send", "wait_and_check"):
        if not re.search(r"\bfailed\s*\(\s*\)", _body(cu, name)):
            bad.append(f"{name}() does not ask failed()")
    reads = [m.start() for m in re.finditer(rf"\b{RECORD}\s*\.\s*code", cu)]
    if reads:
        bad.append(f"the first-error record's code is read {len(reads)} time(s)")
    skips = re.findall(r"s_fail\s*=\s*([^;]+);", cu)
    if len(skips) < 5 or any("failed()" not in s and "wait_and_check(" not in s for s in skips):
        bad.append(f"a kernel's skip decision bypasses failed(): {skips}")
    # 4. Clearing the record (check_errors) leaves the failed state: the headers are out
    #    of step after a protocol error, so only reset() (ClearIntranodeFailure, after the
    #    headers are zeroed) may lift it and the stop word.
    rd = _body(cu, "ReadIntranodeError")
    if re.search(rf"\b{FAILED}\b", rd):
        bad.append("ReadIntranodeError touches the failed state")
    lift = _lift_body(cu)
    if not (re.search(rf"ReadErrorSymbol\s*\(\s*{FAILED}\s*,[^;]*,\s*true\s*\)", lift)
            and "g_intranode_stop" in lift):
        bad.append("ClearIntranodeFailure does not clear the failed state and the stop word")
    return bad


def check_harness(cc: str) -> list[str]:
    """check_errors must read the failed state before the clearing read of the record
    (which clears both) and report a protocol error hidden behind a value error."""
    body = _body(cc, "CheckErrors")
    i, j = body.find("ReadIntranodeFailure("), body.find("ReadIntranodeError(")
    bad = []
    if i < 0:
        bad.append("check_errors never reads the failed state")
    elif i > j:
        bad.append("check_errors reads the failed state after clearing it")
    elif not re.search(r"IsProtocolError\s*\(\s*rec\.code\s*\)", body):
        bad.append("check_errors does not report a protocol error behind a value error")
    return bad


@pytest.fixture(scope="module")
def sources():
    return KERNELS.read_text(), BUFFER.read_text(), HARNESS.read_text()


def test_every_protocol_error_sets_the_failed_state_and_skips_read_it(sources):
    cu, buf, _ = sources
    assert protocol_codes(buf) == {"kErrTimeout", "kErrRankMismatch", "kErrCallSite",
                                   "kErrPeerFailed"}
    assert check_kernels(cu, buf) == []


def test_check_errors_reports_the_failure_behind_a_bad_id(sources):
    assert check_harness(sources[2]) == []


# The mistakes each check must catch, planted into the current sources.
def _plant_first_error_failed(cu):  # the old code: failed() from the record's first error
    body = _body(cu, "failed")
    return cu.replace(body, f"\n  return IsProtocolError(*reinterpret_cast<const volatile "
                            f"int32_t*>(&{RECORD}.code));\n", 1)


def _plant_timeout_only(cu):  # only a timeout sets the failed state
    return cu.replace("if (IsProtocolError(code)) {", "if (code == kErrTimeout) {", 1)


def _plant_clear_drops_flag(cu):  # the old code: check_errors lifted the failed state
    rd = _body(cu, "ReadIntranodeError")
    out = rd.replace("return ReadErrorSymbol(g_intranode_error, out, clear);",
                     "ErrorRecord f{};\n  if (clear) ReadErrorSymbol(" + FAILED + ", &f, true);\n"
                     "  return ReadErrorSymbol(g_intranode_error, out, clear);", 1)
    assert out != rd
    return cu.replace(rd, out, 1)


def _plant_reset_keeps_flag(cu):  # reset() no longer lifts the failed state
    lift = _lift_body(cu)
    out = re.sub(rf"ReadErrorSymbol\s*\(\s*{FAILED}\s*,\s*&failure\s*,\s*true\s*\)",
                 f"ReadErrorSymbol({FAILED}, &failure, false)", lift)
    assert out != lift
    return cu.replace(lift, out, 1)


def _plant_direct_record(cu):  # a new path records a protocol error around report()
    body = _body(cu, "check_identity")
    out = body.replace("report(c, kErrRankMismatch,",
                       "record_error(&g_intranode_error, c.host_err, kErrRankMismatch, c.me,", 1)
    assert out != body
    return cu.replace(body, out, 1)


def _plant_kernel_reads_record(cu):  # a kernel decides from the record directly
    old = "s_fail = failed();  // then this rank asks for nothing"
    assert old in cu
    return cu.replace(old, f"s_fail = IsProtocolError({RECORD}.code);", 1)


def _plant_site_from_record(cu):
    body = _body(cu, "site_to_send")
    return cu.replace(body, f"\n  return {RECORD}.code == kErrTimeout ? kSiteFailed : "
                            f"c.call_site;\n", 1)


PLANTED = {
    "failed_reads_first_error": _plant_first_error_failed,
    "flag_set_by_timeout_only": _plant_timeout_only,
    "clear_drops_flag": _plant_clear_drops_flag,
    "reset_keeps_flag": _plant_reset_keeps_flag,
    "record_outside_report": _plant_direct_record,
    "kernel_reads_record": _plant_kernel_reads_record,
    "site_from_record": _plant_site_from_record,
}


@pytest.mark.parametrize("name", sorted(PLANTED))
def test_planted_mistake_is_caught(sources, name):
    cu, buf, _ = sources
    planted = PLANTED[name](cu)
    assert planted != cu
    assert check_kernels(planted, buf) != []


def test_planted_harness_mistakes_are_caught(sources):
    cc = sources[2]
    body = _body(cc, "CheckErrors")
    no_read = body.replace("Check(ReadIntranodeFailure(&failure), "
                           "\"reading the intranode failed state\");", "")
    assert no_read != body and check_harness(cc.replace(body, no_read)) != []
    late = body.replace("Check(ReadIntranodeFailure(&failure), "
                        "\"reading the intranode failed state\");", "")
    late = late.replace("if (rec.code != kErrNone) out.push_back(DescribeError(rec, i));\n"
                        "    // A protocol",
                        "if (rec.code != kErrNone) out.push_back(DescribeError(rec, i));\n"
                        "    ReadIntranodeFailure(&failure);\n    // A protocol", 1)
    assert "ReadIntranodeFailure(&failure);" in late
    assert check_harness(cc.replace(body, late)) == ["check_errors reads the failed state "
                                                     "after clearing it"]
