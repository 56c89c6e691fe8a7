"""NVSHMEM bootstrap logic: two CPU processes with the real jax.distributed key-value
store; only the NVSHMEM calls themselves are mocked (the Runtime seam)."""

import json
import os
import pathlib
import socket
import subprocess
import sys
import textwrap

import pytest

from jax_ep import nvshmem_bootstrap as nb
from jax_ep.network.transport import TransportConfig

ROOT = pathlib.Path(__file__).resolve().parents[2]

_WORKER = textwrap.dedent(r"""
    import json, os, sys
    import jax
    rank, port = int(sys.argv[1]), int(sys.argv[2])
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                               process_id=rank, initialization_timeout=60)
    from jax_ep import nvshmem_bootstrap as nb
    from jax_ep.network.transport import TransportConfig

    class FakeRuntime:
        def __init__(self):
            self.calls = []
        def unique_id(self):
            self.calls.append("unique_id")
            return os.urandom(128)
        def init(self, rank, world, uid, heap_bytes, num_qps, use_qp_api, adopt):
            self.calls.append(["init", rank, world, uid.hex(), heap_bytes, num_qps,
                               use_qp_api, adopt])
        def qp_api_available(self):
            return True
        def init_status(self):
            return 0
        def finalize(self):
            self.calls.append("finalize")

    # a value the user set is kept; every process must set the same (the start-up
    # agreement refuses processes that differ: tests/runtime/test_startup_agreement.py)
    env = {"NVSHMEM_IBGDA_NUM_RC_PER_PE": "99"}
    rt = FakeRuntime()
    import jax_ep
    jax_ep.config.update("qps_per_port", 3)  # as JAX_EP_QPS_PER_PORT=3 at start-up
    s1 = nb.initialize(max_tokens=64, hidden=128, topk=4, capacity=100, runtime=rt,
                       environ=env, config=TransportConfig(num_ports=2, qps_per_port=1))
    again = nb.initialize(heap_bytes=s1.heap_bytes // 2, runtime=rt, environ=env)
    err = ""
    try:
        nb.initialize(heap_bytes=s1.heap_bytes * 2, runtime=rt, environ=env)
    except nb.NvshmemBootstrapError as e:
        err = str(e)
    nb.finalize()
    s2 = nb.initialize(heap_bytes=1 << 20, runtime=rt, environ=dict())
    nb.finalize()
    print("RESULT " + json.dumps({
        "rank": s1.rank, "world": s1.world, "heap": s1.heap_bytes, "same": again is s1,
        "err": err, "env": env, "calls": rt.calls, "rank2": s2.rank,
        "expected_heap": nb.heap_bytes_for(num_ranks=2, max_tokens=64, capacity=100,
                                           hidden=128, topk=4)}))
    sys.stdout.flush()
    jax.distributed.shutdown()
""")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    script = tmp_path_factory.mktemp("boot") / "worker.py"
    script.write_text(_WORKER)
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_FLAGS", "JAX_EP_"))}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(port)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    out = []
    for p in procs:
        try:
            so, se = p.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("bootstrap workers did not finish in 90 s")
        assert p.returncode == 0, se[-3000:]
        line = [x for x in so.splitlines() if x.startswith("RESULT ")]
        assert line, so + se[-3000:]
        out.append(json.loads(line[0][len("RESULT "):]))
    return out


def test_unique_id_shared_through_kv_store(two_processes):
    r0, r1 = two_processes
    assert (r0["rank"], r1["rank"], r0["world"], r1["world"]) == (0, 1, 2, 2)
    # only process 0 creates the id; both init with the same 128 bytes
    assert r0["calls"][0] == "unique_id" and "unique_id" not in r1["calls"][:1]
    init0 = [c for c in r0["calls"] if isinstance(c, list)]
    init1 = [c for c in r1["calls"] if isinstance(c, list)]
    assert len(init0) == len(init1) == 2  # once, then again after finalize
    assert init0[0][3] == init1[0][3] and len(bytes.fromhex(init0[0][3])) == 128
    assert init0[1][3] == init1[1][3] != init0[0][3]  # a fresh id per generation
    assert [c[1:3] for c in init0] == [[0, 2], [0, 2]] and [c[1:3] for c in init1] == [[1, 2]] * 2


def test_heap_sized_once_and_qps_from_config(two_processes):
    for r in two_processes:
        assert r["heap"] == r["expected_heap"]
        assert r["same"] is True  # a smaller request is a no-op
        assert "already running" in r["err"] and "largest capacity" in r["err"]
        init = [c for c in r["calls"] if isinstance(c, list)][0]
        assert init[4] == r["heap"]
        assert init[5] == 6  # 2 ports x JAX_EP_QPS_PER_PORT=3 overrides qps_per_port=1
        assert init[6] is True and init[7] is False  # QP handles; NVSHMEM not yet running
        assert r["calls"].count("finalize") == 2
        assert r["env"]["NVSHMEM_SYMMETRIC_SIZE"] == str(r["heap"])
        assert r["env"]["NVSHMEM_IB_ENABLE_IBGDA"] == "1"
        assert r["env"]["NVSHMEM_ENABLE_MULTI_PORT"] == "1"
        # the coordinator is 127.0.0.1: NVSHMEM's start-up sockets on the loopback
        assert r["env"]["NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME"] == "lo"
    # a value the user set is kept (with a warning), not overwritten
    assert two_processes[1]["env"]["NVSHMEM_IBGDA_NUM_RC_PER_PE"] == "99"
    assert two_processes[0]["env"]["NVSHMEM_IBGDA_NUM_RC_PER_PE"] == "99"


class _Client:
    def __init__(self):
        self.kv = {}

    def key_value_set_bytes(self, k, v):
        self.kv[k] = v

    def blocking_key_value_get_bytes(self, k, timeout_ms):
        return self.kv[k]

    def wait_at_barrier(self, name, timeout_ms):
        pass


class _Rt:
    def unique_id(self):
        return b"\0" * 128

    def init(self, *a):
        pass

    def finalize(self):
        pass


def test_needs_jax_distributed(monkeypatch):
    monkeypatch.setattr(nb, "_kv_client", lambda: None)
    with pytest.raises(nb.NvshmemBootstrapError, match="jax.distributed.initialize"):
        nb.initialize(heap_bytes=1 << 20, runtime=_Rt(), environ={})


def test_one_process_per_gpu_is_a_clear_error(monkeypatch):
    import jax

    monkeypatch.setattr(jax, "local_devices", lambda: [jax.devices()[0]] * 2)
    with pytest.raises(nb.NvshmemBootstrapError, match="one process per GPU"):
        nb.initialize(heap_bytes=1 << 20, runtime=_Rt(), client=_Client(), environ={})
    assert not nb.is_initialized()


def test_bad_unique_id_and_missing_sizes(monkeypatch):
    import jax

    monkeypatch.setattr(jax, "local_devices", lambda: [jax.devices()[0]])

    class Short(_Rt):
        def unique_id(self):
            return b"x"

    with pytest.raises(nb.NvshmemBootstrapError, match="128"):
        nb.initialize(heap_bytes=1 << 20, runtime=Short(), client=_Client(), environ={})
    with pytest.raises(ValueError, match="heap_bytes"):
        nb.initialize(runtime=_Rt(), client=_Client(), environ={})
    assert not nb.is_initialized()


def test_extension_runtime_without_nvshmem_says_how_to_get_it(monkeypatch):
    from jax_ep._src import ext as _ext
    # the NVSHMEM module could not load (libnvshmem_host.so.3 missing), as on a CPU host
    monkeypatch.setattr(_ext, "nvshmem_ext", lambda load=True: None)
    monkeypatch.setattr(_ext, "nvshmem_import_error",
                        lambda: "libnvshmem_host.so.3: cannot open shared object file")
    with pytest.raises(nb.NvshmemBootstrapError, match="libnvshmem_host.so.3.*nvshmem-cu13"):
        nb.ExtensionRuntime()


def test_heap_bytes_hand_checked():
    from jax_ep._src import ext as _ext
    # R=2, T=1024, C=2048, H=1024, K=2, bf16 x, f32 y: a dispatch row is 2048 bytes, 2 ids,
    # 2 weights and the token index (to 16: 2080), a combine row 4096; a rank sends at
    # most T * min(K, R) = 2048 rows. Signals [4 kinds][2 sources][64 QPs] uint64 first.
    L = _ext.require_ext().internode_heap_layout(2, 1024, 2048, 1024, 2, 2, 4)
    assert (L["dispatch_row_stride"], L["combine_row_stride"]) == (2080, 4096)
    assert (L["sigs"], L["hdr"], L["counts"], L["recv"]) == (0, 4096, 4096 + 256, 4096 + 512)
    assert L["back"] == L["recv"] + 2048 * 2080
    assert L["stage"] == L["back"] + 2048 * 4096
    assert L["cstage"] == L["stage"] + 2048 * 2080
    assert L["total"] == L["cstage"] + 2048 * 4096 == 25301504
    # two halves and 32 MiB of slack, in 2 MiB units: 50603008 + 32 MiB -> 41 x 2 MiB
    assert nb.heap_bytes_for(num_ranks=2, max_tokens=1024, capacity=2048, hidden=1024,
                             topk=2) == 41 * (2 << 20)
    assert nb.heap_bytes_for(num_ranks=2, max_tokens=4, hidden=8, topk=2) == \
        nb.heap_bytes_for(num_ranks=2, max_tokens=4, capacity=8, hidden=8, topk=2)
    with pytest.raises(ValueError, match="topk"):
        nb.heap_bytes_for(num_ranks=2, max_tokens=4, hidden=8, topk=0)


# --- QP API fallback, NVSHMEM already running, memory headroom, exit ----------------------

class _Rec(_Rt):
    def __init__(self, qp_api=True, status=0):
        self.qp_api, self.status, self.inits = qp_api, status, []

    def qp_api_available(self):
        return self.qp_api

    def init_status(self):
        return self.status

    def init(self, *a):
        self.inits.append(a)


@pytest.fixture
def one_device(monkeypatch):
    import jax

    monkeypatch.setattr(jax, "local_devices", lambda: [jax.devices()[0]])
    yield
    nb.finalize()


def test_without_qp_api_runs_one_port_and_says_so(one_device, capsys):
    rt = _Rec(qp_api=False)
    env = {}
    with pytest.warns(UserWarning, match="ONE port"):
        st = nb.initialize(heap_bytes=64 << 20, runtime=rt, client=_Client(), environ=env,
                           config=TransportConfig(num_ports=2, qps_per_port=2))
    assert st.config.num_ports == 1 and st.qp_api is False
    assert rt.inits[0][4:] == (2, False, False)  # 1 port x 2 QPs, no handles, fresh start
    assert env["NVSHMEM_ENABLE_MULTI_PORT"] == "0"
    assert "nvshmemx_qp_create" in capsys.readouterr().err


def test_already_running_nvshmem_is_adopted_only_with_matching_settings(one_device):
    cfg = TransportConfig(num_ports=2, qps_per_port=2)
    with pytest.raises(nb.NvshmemBootstrapError, match="already initialised") as e:
        nb.initialize(heap_bytes=64 << 20, runtime=_Rec(status=2), client=_Client(),
                      environ={}, config=cfg)
    assert "NVSHMEM_IBGDA_NUM_RC_PER_PE=2" in str(e.value)
    assert "NVSHMEM_SYMMETRIC_SIZE=" in str(e.value)
    env = dict(cfg.nvshmem_env(), NVSHMEM_SYMMETRIC_SIZE=str(128 << 20))
    rt = _Rec(status=2)
    rt.can_init_device_state = lambda: True  # a runtime that sets up the device state
    rt.device_state = []
    rt.init_device_state = lambda: rt.device_state.append(len(rt.inits))
    st = nb.initialize(heap_bytes=64 << 20, runtime=rt, client=_Client(), environ=env,
                       config=cfg)
    assert st.adopted is True and rt.inits[0][6] is True  # adopt=True reaches the runtime
    assert rt.device_state == [1]  # right after the adopting init
    assert nb.adopt_check({"A": "1"}, {"A": "2"}) == ["A=1"]


def test_heap_headroom_next_to_xla_preallocation():
    gib = 1 << 30
    # 80 GiB GPU, XLA took 75%: 20 GiB left
    assert nb.heap_headroom_error(8 * gib, 60 * gib, {}) is None
    msg = nb.heap_headroom_error(24 * gib, 60 * gib, {})
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION=0.69" in msg
    assert nb.heap_headroom_error(24 * gib, 60 * gib,
                                  {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}) is None
    assert nb.heap_headroom_error(24 * gib, None, {}) is None


def test_nothing_collective_at_exit(one_device):
    rt = _Rec()
    finalized = []
    rt.finalize = lambda: finalized.append(1)
    nb.initialize(heap_bytes=64 << 20, runtime=rt, client=_Client(), environ={})
    nb._forget_at_exit()
    assert finalized == [] and not nb.is_initialized()
    import atexit  # noqa: F401 - the registered hook is the non-collective one
    assert nb.finalize.__doc__ and "Not called at exit" in nb.finalize.__doc__
