"""NVSHMEM start-up safety (jax_ep.nvshmem_bootstrap): the values every process must share
are agreed through the jax.distributed key-value store before any NVSHMEM call, so a
mismatch or a missing process fails on every process with a message that names it; an
NVSHMEM some other library started is adopted only when the device state can be set up;
the host library must be the release the device library came from; a stuck collective
step becomes an error naming the step. NVSHMEM itself is replaced by stand-ins."""
from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from jax_ep import nvshmem_bootstrap as nb
from jax_ep.network.transport import TransportConfig

ROOT = pathlib.Path(__file__).resolve().parents[2]


class _KV:
    """A key-value store as jax.distributed's client has it (bytes values)."""

    def __init__(self, preset=None):
        self.kv = dict(preset or {})

    def key_value_set_bytes(self, k, v):
        assert k not in self.kv, f"key {k} set twice"
        self.kv[k] = v

    def blocking_key_value_get_bytes(self, k, timeout_ms):
        if k not in self.kv:
            raise RuntimeError(f"DEADLINE_EXCEEDED: {k}")
        return self.kv[k]

    def wait_at_barrier(self, name, timeout_ms):
        pass


def _params(**over):
    p = nb.startup_params(cfg=TransportConfig(num_ports=2, qps_per_port=2).resolve({}),
                          qp_api=True, heap_bytes=64 << 20, sym_bytes=64 << 20, ll=None,
                          env={"NVSHMEM_IBGDA_NUM_RC_PER_PE": "2"}, versions=(30800, 30800),
                          adopt=False)
    p.update(over)
    return p


def _publish(kv, key, p, params, error=None):
    kv.kv[f"{key}/{p}"] = json.dumps({"params": params, "error": error}).encode()


def test_agreement_names_the_process_and_value_that_differ():
    kv = _KV()
    _publish(kv, "k", 0, _params())
    _publish(kv, "k", 2, _params(qps_per_port=4, nvshmem_version="3.8.0/3.9.0"))
    with pytest.raises(nb.NvshmemBootstrapError) as e:
        nb.agree(kv, 1, 3, _params(), error=None, timeout_s=1, key="k")
    msg = str(e.value)
    assert "process 2 has qps_per_port=4 where process 0 has 2" in msg
    assert "process 2 has nvshmem_version='3.8.0/3.9.0'" in msg
    assert "process 1" not in msg  # the caller agrees with process 0
    assert "no NVSHMEM call" in msg


def test_agreement_compares_nested_values_and_passes_when_equal():
    kv = _KV()
    _publish(kv, "k", 0, _params())
    nb.agree(kv, 1, 2, _params(), error=None, timeout_s=1, key="k")  # equal: no error
    kv = _KV()
    _publish(kv, "k", 0, _params())
    env = dict(_params()["nvshmem_env"], NVSHMEM_IBGDA_NUM_RC_PER_PE="99")
    with pytest.raises(nb.NvshmemBootstrapError,
                       match=r"process 1 has nvshmem_env.NVSHMEM_IBGDA_NUM_RC_PER_PE='99' "
                             r"where process 0 has '2'"):
        nb.agree(kv, 1, 2, _params(nvshmem_env=env), error=None, timeout_s=1, key="k")


def test_a_missing_process_is_named():
    kv = _KV()
    _publish(kv, "k", 0, _params())
    with pytest.raises(nb.NvshmemBootstrapError, match="process 2 did not publish .* 0.5 s"):
        nb.agree(kv, 1, 3, _params(), error=None, timeout_s=0.5, key="k")


def test_a_local_failure_fails_every_process():
    kv = _KV()
    _publish(kv, "k", 0, _params(), error="the NVSHMEM heap does not fit")
    with pytest.raises(nb.NvshmemBootstrapError,
                       match="not started on any process.*process 0: the NVSHMEM heap"):
        nb.agree(kv, 1, 2, _params(), error=None, timeout_s=1, key="k")


class _Rt:
    def __init__(self, status=0, versions=(30800, 30800), init=None):
        self.status, self._versions, self.calls = status, versions, []
        self._init = init

    def qp_api_available(self):
        return True

    def init_status(self):
        return self.status

    def versions(self):
        return self._versions

    def unique_id(self):
        self.calls.append("unique_id")
        return b"\0" * 128

    def init(self, *a):
        self.calls.append("init")
        if self._init:
            self._init()

    def finalize(self):
        self.calls.append("finalize")


@pytest.fixture
def one_device(monkeypatch):
    import jax

    monkeypatch.setattr(jax, "local_devices", lambda: [jax.devices()[0]])
    yield
    nb.finalize()


def test_running_nvshmem_is_not_adopted_without_device_state(one_device):
    cfg = TransportConfig(num_ports=1, qps_per_port=2)
    env = dict(cfg.resolve({}).nvshmem_env(), NVSHMEM_SYMMETRIC_SIZE=str(1 << 30))
    rt = _Rt(status=2)  # NVSHMEM already running; this runtime cannot set up device state
    with pytest.raises(nb.NvshmemBootstrapError, match="device state.*before anything else"):
        nb.initialize(heap_bytes=64 << 20, runtime=rt, client=_KV(), environ=env,
                      config=cfg)
    assert rt.calls == [] and not nb.is_initialized()  # refused before any NVSHMEM call
    assert nb.adopt_refusal(rt) is not None
    rt.can_init_device_state = lambda: True
    assert nb.adopt_refusal(rt) is None


def test_host_library_of_another_release_is_refused(one_device):
    rt = _Rt(versions=(30800, 30900))
    with pytest.raises(nb.NvshmemBootstrapError, match=r"host library is 3\.9\.0.*3\.8\.0.*"
                                                       r"nvidia-nvshmem-cu13==3\.8\.\*"):
        nb.initialize(heap_bytes=64 << 20, runtime=rt, client=_KV(), environ={})
    assert rt.calls == []
    assert nb.version_mismatch(30800, 30803) is None  # patch releases mix
    assert nb.version_mismatch(30800, -1) is None     # unknown: not checked


def test_watchdog_names_the_stuck_step(one_device, monkeypatch):
    fired = []
    monkeypatch.setattr(nb, "_on_stuck", fired.append)
    rt = _Rt(init=lambda: time.sleep(1.0))  # a collective whose peer never comes
    nb.initialize(heap_bytes=64 << 20, runtime=rt, client=_KV(), environ={}, timeout_s=0.3)
    assert len(fired) == 1, fired
    assert "'NVSHMEM start (nvshmemx_init_attr" in fired[0] and "0.3 s" in fired[0]
    assert "process 0" in fired[0]
    nb.finalize()
    fired.clear()
    nb.initialize(heap_bytes=64 << 20, runtime=_Rt(), client=_KV(), environ={},
                  timeout_s=5)
    time.sleep(0.1)
    assert fired == []  # a step that returns in time cancels its watchdog


def test_qp_path_is_reported_truthfully(one_device):
    assert nb.qp_path_from(False, [5, 6]) == "fallback"
    assert nb.qp_path_from(True, [1, 1, 1, 1]) == "default handles"
    assert nb.qp_path_from(True, [0, 1]) == "default handles"
    assert nb.qp_path_from(True, [7, 8]) == "qp_api"
    rt = _Rt()
    rt.qp_handles = lambda: [1, 1]
    with pytest.warns(UserWarning, match="default QP handles"):
        st = nb.initialize(heap_bytes=64 << 20, runtime=rt, client=_KV(), environ={},
                           config=TransportConfig(num_ports=1, qps_per_port=2))
    assert st.qp_path == "default handles"


# --- two processes, the real jax.distributed key-value store ------------------------------

_WORKER = textwrap.dedent(r"""
    import json, os, sys
    import jax
    rank, port, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                               process_id=rank, initialization_timeout=60)
    from jax._src import distributed
    client = distributed.global_state.client
    from jax_ep import nvshmem_bootstrap as nb
    from jax_ep.network.transport import TransportConfig

    class Rt:
        calls = []
        def qp_api_available(self): return True
        def init_status(self): return 0
        def versions(self): return (30800, 30800)
        def unique_id(self):
            self.calls.append("unique_id"); return b"\0" * 128
        def init(self, *a): self.calls.append("init")
        def finalize(self): self.calls.append("finalize")

    rt = Rt()
    err = ""
    if mode == "missing" and rank == 1:
        # joins the JAX backend but never starts NVSHMEM; waits until process 0 is done
        jax.devices()
        client.blocking_key_value_get("test/done", 120_000)
    else:
        qps = 4 if (mode == "mismatch" and rank == 1) else 2
        try:
            nb.initialize(heap_bytes=64 << 20, runtime=rt, environ={}, timeout_s=4,
                          config=TransportConfig(num_ports=1, qps_per_port=qps))
        except nb.NvshmemBootstrapError as e:
            err = str(e)
        if rank == 0:
            client.key_value_set("test/done", "1")
    print("RESULT " + json.dumps({"err": err, "calls": rt.calls}), flush=True)
    jax.distributed.shutdown()
""")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(tmp_path, mode):
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_FLAGS", "JAX_EP_"))}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(port), mode],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for r in range(2)]
    out = []
    for p in procs:
        try:
            so, se = p.communicate(timeout=150)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"workers ({mode}) did not finish in 150 s")
        line = [x for x in so.splitlines() if x.startswith("RESULT ")]
        assert p.returncode == 0 and line, so + se[-3000:]
        out.append(json.loads(line[0][len("RESULT "):]))
    return out


@pytest.mark.slow
def test_two_processes_with_different_qps_both_fail_before_nvshmem(tmp_path):
    r0, r1 = _run(tmp_path, "mismatch")
    for r in (r0, r1):
        assert "process 1 has qps_per_port=4 where process 0 has 2" in r["err"], r
        assert r["calls"] == []  # no unique id, no init: nothing NVSHMEM ran


@pytest.mark.slow
def test_a_process_that_never_comes_is_named_by_its_peer(tmp_path):
    r0, r1 = _run(tmp_path, "missing")
    assert "process 1 did not publish its start-up settings within 4 s" in r0["err"], r0
    assert r0["calls"] == []
