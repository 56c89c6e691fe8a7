"""One process of the NCCL start-up agreement test (tests/test_nccl_bootstrap_mp.py).

Run as: python tests/mp_nccl_worker.py PROCESS_ID NUM_PROCESSES PORT SCENARIO TIMEOUT_S
Each process has 4 CPU devices and runs jax_ep.nccl_bootstrap.initialize through the real
jax.distributed key-value store with a stand-in runtime (no GPU, no NCCL): what the
native Start would get is printed as one `START {json}` line; a failure as `ERROR {json}`.

SCENARIO: "agree" (both alike), "mismatch" (process 1 with another TransportConfig),
"absent" (process 1 never calls initialize; it waits past the timeout, then exits).
"""
from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

DEVICES_PER_PROCESS = 4


class StandInRuntime:
    """The native calls, recorded: unique_id gives 128 random bytes."""

    def __init__(self):
        self.started = None

    def unique_id(self) -> bytes:
        return os.urandom(128)

    def start(self, ordinals, ranks, world, uid, heap_bytes, num_contexts, gpus_per_node):
        self.started = dict(ordinals=list(ordinals), ranks=list(ranks), world=world,
                            uid=bytes(uid).hex(), heap_bytes=heap_bytes,
                            num_contexts=num_contexts, gpus_per_node=gpus_per_node)

    def finish(self, ordinals):
        pass


def main(pid: int, nproc: int, port: int, scenario: str, timeout_s: float) -> int:
    import mp_init
    jax = mp_init.start(pid, nproc, port, DEVICES_PER_PROCESS)
    from jax_ep import nccl_bootstrap
    from jax_ep.network.transport import TransportConfig

    if scenario == "absent" and pid == 1:
        # joins the CPU backend (every process's client starts together), then never
        # arrives at the start-up within process 0's timeout
        jax.devices()
        time.sleep(timeout_s + 1.5)
        print("ABSENT", flush=True)
        return 0
    cfg = TransportConfig(num_ports=1 if (scenario == "mismatch" and pid == 1) else 2)
    rt = StandInRuntime()
    t0 = time.monotonic()
    try:
        st = nccl_bootstrap.initialize(heap_bytes=1 << 20, config=cfg, runtime=rt,
                                       timeout_s=timeout_s)
    except nccl_bootstrap.NcclBootstrapError as e:
        print("ERROR " + json.dumps({"error": str(e), "elapsed_s": time.monotonic() - t0}),
              flush=True)
        return 0
    assert st.ranks == tuple(rt.started["ranks"])
    print("START " + json.dumps(rt.started), flush=True)
    return 0


if __name__ == "__main__":
    a = sys.argv[1:]
    sys.exit(main(int(a[0]), int(a[1]), int(a[2]), a[3], float(a[4])))
