"""Every poll loop in the kernels reads the memory it waits on through a poll helper.

A GPU may serve a plain or volatile load of a word another GPU writes from a stale line
(and the compiler may hoist a plain one out of the loop), and a plain load orders nothing
after it, so what the word guards can be read older than the word. The emulated GPU
cannot show either (it does not reorder or cache loads: docs/emulator.md, "What only
hardware shows"), so this is checked in the source instead: in a loop that waits (its body
sleeps or reads the clock), the loop's condition and the conditions of its `if`s read
memory only through the helpers that poll with an acquire or bypass L1
(`peer::load_acquire`, `wait_geq`, `load_cg*`, the transport's `fetch`, NVSHMEM's waits)
or read this GPU's own stop word (a device global `g_*` or the `stop` argument, written by
this GPU's own atomics)."""
from __future__ import annotations

import glob
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCES = sorted(glob.glob(os.path.join(ROOT, "kernels", "cuda", "*.cu")) +
                 glob.glob(os.path.join(ROOT, "kernels", "cuda", "*.cuh")) +
                 glob.glob(os.path.join(ROOT, "kernels", "internode", "*.cu")) +
                 glob.glob(os.path.join(ROOT, "kernels", "internode", "*.cuh")))

# Calls whose reads are polls (or not reads of a peer's words at all).
_HELPERS = re.compile(
    r"\b(?:peer::)?(?:load_acquire|wait_geq|load_cg\w*|fetch|nvshmem_\w*wait\w*|WaitAtLeast|"
    r"mbar_wait|global_timer_ns|NowNs|atomic\w+|__\w+_sync|ll_failed|[Ff]ailed|read)\s*\(")
# A volatile read of this GPU's own stop word.
_OWN_STOP = re.compile(r"\*\s*reinterpret_cast<\s*const\s+volatile\s+\w+\s*\*\s*>\s*\(\s*(?:&\s*g_\w+|stop)\s*\)")
_PLAIN = [
    (re.compile(r"\bvolatile\b"), "a volatile load"),
    (re.compile(r"(?:^|[(!=<>&|,?:]\s*)\*\s*[A-Za-z_(]"), "a plain dereference"),
    (re.compile(r"->"), "a plain load through ->"),
    (re.compile(r"\w\s*\["), "a plain indexed load"),
]


def _strip_comments(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


def _balanced(text: str, i: int, open_: str, close: str) -> int:
    """Index just past the bracket that closes the one at text[i]."""
    depth = 0
    for j in range(i, len(text)):
        if text[j] == open_:
            depth += 1
        elif text[j] == close:
            depth -= 1
            if depth == 0:
                return j + 1
    return len(text)


def _drop_calls(expr: str) -> str:
    """The expression with every helper call (and its arguments) taken out."""
    while True:
        m = _HELPERS.search(expr)
        if m is None:
            return expr
        end = _balanced(expr, m.end() - 1, "(", ")")
        expr = expr[:m.start()] + " 0 " + expr[end:]


def waiting_loops(text: str) -> list[tuple[int, list[str]]]:
    """(line, conditions) of each loop that waits: its condition and its ifs' conditions."""
    text = _strip_comments(text)
    out = []
    for m in re.finditer(r"\b(while|for)\s*\(", text):
        cond_end = _balanced(text, m.end() - 1, "(", ")")
        cond = text[m.end():cond_end - 1]
        if not text[cond_end:].lstrip().startswith("{"):
            continue  # a one-statement loop (a scan, not a wait), or a do-while's tail
        body_start = cond_end + text[cond_end:].index("{")
        body = text[body_start:_balanced(text, body_start, "{", "}")]
        if not re.search(r"__nanosleep\s*\(|global_timer_ns\s*\(|clock64\s*\(|NowNs\s*\(", cond + body):
            continue  # not a wait
        if m.group(1) == "for":
            parts = cond.split(";")
            cond = parts[1] if len(parts) == 3 else ""
        conds = [cond]
        for im in re.finditer(r"\bif\s*\(", body):
            conds.append(body[im.end():_balanced(body, im.end() - 1, "(", ")") - 1])
        out.append((text.count("\n", 0, m.start()) + 1, conds))
    return out


def poll_loop_violations(text: str, name: str = "<source>") -> list[str]:
    """`name:line: what` for each condition of a waiting loop that reads memory plainly."""
    out = []
    for line, conds in waiting_loops(text):
        for c in conds:
            c = _drop_calls(_OWN_STOP.sub(" 0 ", c))
            for pat, what in _PLAIN:
                if pat.search(c):
                    out.append(f"{name}:{line}: {what} in a poll loop's condition: {c.strip()[:100]}")
                    break
    return out


@pytest.mark.parametrize("path", SOURCES, ids=[os.path.relpath(p, ROOT) for p in SOURCES])
def test_poll_loops_read_through_the_helpers(path):
    with open(path) as f:
        bad = poll_loop_violations(f.read(), os.path.relpath(path, ROOT))
    assert bad == [], "\n".join(bad)


def test_the_kernels_have_poll_loops_to_check():
    """The scan sees the kernels' waits (a scan that finds none checks nothing)."""
    waits = 0
    for path in SOURCES:
        with open(path) as f:
            waits += len(waiting_loops(f.read()))
    assert waits >= 8


@pytest.mark.parametrize("loop", [
    "while (*reinterpret_cast<const volatile uint64_t*>(flag) < v) { __nanosleep(64); }",
    "while (*flag < v) { __nanosleep(64); }",
    "while (true) { if (hdr->tail[ch] > k) break; __nanosleep(64); }",
    "for (;;) { if (ring[3] != 0) return; if (peer::global_timer_ns() > t) return; }",
    "while (load_acquire(f) < v) { if (*reinterpret_cast<const volatile int32_t*>(peer_stop) != 0) "
    "return false; __nanosleep(64); }",
])
def test_a_planted_plain_poll_is_found(loop):
    assert poll_loop_violations("void f() { " + loop + " }"), loop


@pytest.mark.parametrize("loop", [
    "while (peer::load_acquire(flag) < v) { __nanosleep(64); }",
    "while (load_acquire(f) < v) { if (stop != nullptr && *reinterpret_cast<const volatile int32_t*>(stop) != 0) "
    "return false; __nanosleep(64); }",
    "while (Transport::fetch(sig) < 1) { if (peer::global_timer_ns() - t0 > to) return; }",
    "while (s < n && scratch[s] <= i) ++s;",
])
def test_a_helper_poll_passes(loop):
    assert poll_loop_violations("void f() { " + loop + " }") == [], loop
