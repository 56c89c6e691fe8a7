"""Out-of-bounds writes into a peer's buffer are caught: under AddressSanitizer (`make
test-emu-asan`) a kernel of one virtual GPU storing one byte past the end of another
virtual GPU's buffer is reported as a heap-buffer-overflow (each cudaMalloc is its own
allocation of exactly the size asked). The planted write runs in a child process, as the
sanitizer aborts the process it reports in."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from jax_ep._src.emu import Emulator, module

pytestmark = pytest.mark.emu

_CHILD = ("import sys; from jax_ep._src.emu import Emulator, module; Emulator(2, seed=1); "
          "module().peer_store_probe(n=100, at=int(sys.argv[1])); print('STORED')")


def _under_asan() -> bool:
    return "libasan" in os.environ.get("LD_PRELOAD", "")


def _run(at: int):
    return subprocess.run([sys.executable, "-c", _CHILD, str(at)], capture_output=True,
                          text=True, timeout=300, env=dict(os.environ))


def test_an_in_bounds_peer_store_runs():
    r = _run(99)
    assert r.returncode == 0 and "STORED" in r.stdout, r.stderr[-2000:]


def test_the_probe_checks_its_arguments():
    Emulator(2, seed=1)
    with pytest.raises(ValueError, match="peer_store_probe"):
        module().peer_store_probe(n=0, at=0)


@pytest.mark.skipif(not _under_asan(), reason="needs the AddressSanitizer build (make test-emu-asan)")
def test_an_out_of_bounds_peer_store_is_reported():
    r = _run(100)  # one byte past the end of GPU 1's 100-byte buffer
    assert r.returncode != 0 and "STORED" not in r.stdout
    assert "heap-buffer-overflow" in r.stderr, r.stderr[-3000:]
    assert "PeerStoreKernel" in r.stderr or "PeerStoreProbe" in r.stderr, r.stderr[-3000:]
