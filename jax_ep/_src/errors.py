"""`jax_ep.check_errors()`: one check for every GPU backend.

The GPU kernels never stop the host: a failed call (a peer that timed out, ranks in
different calls, ids out of range) is recorded on the device and its outputs are
poisoned (float rows NaN and counts -1 on the internode path). This module reads the
records of every backend this process used (the CUDA intranode buffers of
`jax_ep.cuda`, the NVSHMEM internode transport) and raises one `EPError` naming the
rank, the training step and the call sites involved. Call it every N steps and before
every checkpoint::

    for step in range(num_steps):
        state = train_step(state, batch)
        if step % 100 == 0:
            jax_ep.check_errors(step=step)

It waits for this process's GPUs (the CUDA check synchronises them); on CPU-only builds
and processes that used no GPU backend it returns at once.
"""
from __future__ import annotations

import re

__all__ = ["EPError", "check_errors", "collect_errors"]

_last_step: int | None = None


class EPError(RuntimeError):
    """A GPU EP call failed. Attributes: messages (one per record), backends (which
    backend recorded each), rank (EP rank / NVSHMEM PE, None if unknown), process
    (jax.process_index()), step and since_step (the error happened after since_step,
    at or before step; None if not given), call_sites ({id: where it was traced})."""

    def __init__(self, messages, backends, *, rank, process, step, since_step, call_sites):
        self.messages, self.backends = list(messages), list(backends)
        self.rank, self.process = rank, process
        self.step, self.since_step, self.call_sites = step, since_step, dict(call_sites)
        where = f"process {process}" + (f", EP rank {rank}" if rank is not None else "")
        if step is None:
            when = "before this check"
        elif since_step is None:
            when = f"at or before step {step}"
        else:
            when = f"after step {since_step}, at or before step {step}"
        lines = [f"jax_ep: {len(self.messages)} EP error(s) on {where}, {when}:"]
        lines += [f"  [{b}] {m}" for b, m in zip(self.backends, self.messages)]
        for site, info in self.call_sites.items():
            lines.append(f"  call site {site}: {info or 'not traced in this process'}")
        super().__init__("\n".join(lines))


_SITE_PATTERNS = (re.compile(r"call_site=(-?\d+)"), re.compile(r"call site (-?\d+)"),
                  re.compile(r"this rank's (-?\d+)"))


def _sites_in(messages) -> dict:
    from jax_ep._src.common import call_site_info
    out = {}
    for m in messages:
        for pat in _SITE_PATTERNS:
            for v in pat.findall(m):
                if int(v) > 0:
                    out[int(v)] = call_site_info(int(v))
    return out


def _cuda_messages(clear: bool) -> list[str]:
    from jax_ep._src import ext as _ext
    ext = _ext.ext
    if ext is None or not hasattr(ext, "cuda_check_errors"):
        return []
    return [str(m) for m in ext.cuda_check_errors(bool(clear))]


def _internode_messages() -> list[str]:
    from jax_ep._src import ext as _ext
    ext = _ext.nvshmem_ext(load=False)
    if ext is None or not hasattr(ext, "internode_error"):
        return []
    msg = str(ext.internode_error())
    return [msg] if msg else []


def collect_errors(clear: bool = True, *, sources=None) -> list[tuple[str, str]]:
    """[(backend, message)] recorded by every GPU backend of this process; [] if none.
    `sources` ({backend: callable(clear) -> [message]}) replaces the backends (tests)."""
    if sources is None:
        sources = {"cuda": _cuda_messages, "internode": lambda clear: _internode_messages()}
    out = []
    for name, fn in sources.items():
        out += [(name, m) for m in fn(clear)]
    return out


def check_errors(step: int | None = None, *, clear: bool = True, sources=None) -> None:
    """Raises `EPError` if any GPU EP call of this process failed since the last check
    (see the module docstring); `step` is the training step just run, for the message.
    clear: clear the CUDA intranode records (the internode record is sticky for the
    process's life: NVSHMEM must restart)."""
    global _last_step
    import jax

    errors = collect_errors(clear, sources=sources)
    since = _last_step
    if step is not None:
        _last_step = int(step)
    if not errors:
        return
    from jax_ep import nvshmem_bootstrap as nvshmem
    st = nvshmem.state()
    rank = st.rank if st is not None else None
    backends, messages = zip(*errors)
    raise EPError(messages, backends, rank=rank, process=jax.process_index(), step=step,
                  since_step=since, call_sites=_sites_in(messages))
