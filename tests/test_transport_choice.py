"""The internode transport's choice: the `transport` setting (JAX_EP_TRANSPORT), the auto
rule (choose_transport), transport_report()'s keys, the errors naming what to install
when a selected transport's library is missing, `import jax_ep` with neither library,
the native seam (jax_ep._src.nccl_native) and the NCCL start-up's pieces in one process
(world ranks, the agreement through a key-value store, initialize with a stand-in)."""
from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import threading
import time
import types

import pytest

import jax_ep
from jax_ep import config, nccl_bootstrap
from jax_ep._src import libraries, nccl_native
from jax_ep.network.transport import TransportConfig
from jax_ep.network.transport_choice import choose_transport

NCCL_PIP = 'pip install "nvidia-nccl-cu13>=2.30,<3"'


# ----------------------------------------------------------------------------- the setting

def test_setting_default_and_values():
    assert config.from_env({}).transport == "auto"
    assert config.from_env({"JAX_EP_TRANSPORT": ""}).transport == "auto"
    for v, want in (("nvshmem", "nvshmem"), ("NCCL", "nccl"), (" auto ", "auto")):
        assert config.from_env({"JAX_EP_TRANSPORT": v}).transport == want
    assert config.ENV["transport"] == "JAX_EP_TRANSPORT"


@pytest.mark.parametrize("bad", ["ib", "gin", "1"])
def test_bad_setting_names_the_variable(bad):
    with pytest.raises(ValueError, match=r"JAX_EP_TRANSPORT must be one of .*nvshmem.*nccl"):
        config.from_env({"JAX_EP_TRANSPORT": bad})
    with pytest.raises(ValueError, match="transport"):
        config.update("transport", bad)
    with pytest.raises(ValueError, match="transport"):
        choose_transport(bad)


# ----------------------------------------------------------------------------- auto rule

# (setting, local GPUs, NVSHMEM usable, fabric class) -> transport, words in the reason
ROWS = [
    ("auto", 1, True, "ib-multiport", "nvshmem", "one GPU per process"),
    ("auto", 1, True, "roce-multiport", "nvshmem", "roce-multiport"),
    ("auto", 1, True, "single-port", "nvshmem", "NVSHMEM present"),
    ("auto", 0, True, "unknown", "nvshmem", "unknown"),
    ("auto", 8, True, "ib-multiport", "nccl", "drives 8 GPUs"),
    ("auto", 2, True, "roce-lag", "nccl", "drives 2 GPUs"),
    ("auto", 1, False, "ib-multiport", "nccl", "NVSHMEM is missing"),
    ("auto", 1, True, "roce-lag", "nccl", "roce-lag"),
    ("nvshmem", 8, False, "roce-lag", "nvshmem", "JAX_EP_TRANSPORT"),
    ("nccl", 1, True, "ib-multiport", "nccl", "JAX_EP_TRANSPORT"),
]


@pytest.mark.parametrize("setting,gpus,nvshmem,fabric,want,why", ROWS)
def test_auto_rule(setting, gpus, nvshmem, fabric, want, why):
    c = choose_transport(setting, local_gpus=gpus, nvshmem_available=nvshmem,
                         fabric_class=fabric, nvshmem_why="no nvidia-nvshmem-cu13")
    assert (c.transport, c.setting) == (want, setting)
    assert why in c.reason, c.reason
    if want == "nccl" and not nvshmem and setting == "auto":
        assert "no nvidia-nvshmem-cu13" in c.reason
    assert c.to_json() == {"transport": want, "reason": c.reason, "setting": setting}


def test_auto_rule_reads_the_setting_and_detects_what_is_not_given(monkeypatch):
    with config.override(transport="nccl"):
        assert choose_transport().transport == "nccl"
    # CPU only: no GPU, NVSHMEM absent from this build -> detected as missing
    monkeypatch.setattr(libraries, "package_version", lambda p: None)
    monkeypatch.setattr(libraries, "_loaded_nvshmem_version", lambda: None)
    with config.override(transport="auto"):
        c = choose_transport(fabric_class="ib-multiport")
    assert c.transport == "nccl" and "NVSHMEM is missing" in c.reason, c.reason


# ----------------------------------------------------------------------------- libraries

@pytest.fixture
def no_libraries(monkeypatch):
    """Neither wheel installed, no library loaded, no native binding."""
    real = importlib.metadata.version

    def version(name):
        if name in (libraries.NCCL_PACKAGE, libraries.NVSHMEM_PACKAGE):
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "version", version)
    monkeypatch.setattr(libraries, "_loaded_nccl_version", lambda: None)
    monkeypatch.setattr(libraries, "_loaded_nvshmem_version", lambda: None)
    monkeypatch.setattr(nccl_native, "_candidates", lambda: [])


def _with(monkeypatch, *, nccl=None, nvshmem=None, build=None):
    versions = {libraries.NCCL_PACKAGE: nccl, libraries.NVSHMEM_PACKAGE: nvshmem}
    monkeypatch.setattr(libraries, "package_version", lambda p: versions.get(p))
    if build is not None:
        monkeypatch.setattr(libraries, "build_flags", lambda: dict(build))


def test_missing_nccl_names_the_package(no_libraries):
    lib = libraries.nccl_library({"nccl": True})
    assert lib["available"] is False and lib["version"] is None
    assert lib["package"] == "nvidia-nccl-cu13"
    with pytest.raises(jax_ep.TransportUnavailableError) as e:
        libraries.require("nccl", lib)
    assert NCCL_PIP in str(e.value) and "jax-ep[cuda]" in str(e.value)
    assert isinstance(e.value, ImportError)


def test_missing_nvshmem_names_the_package(no_libraries):
    lib = libraries.nvshmem_library({"nvshmem": True})
    assert lib["available"] is False
    with pytest.raises(jax_ep.TransportUnavailableError,
                       match=r"nvidia-nvshmem-cu13>=3\.8.*jax-ep\[cuda\]"):
        libraries.require("nvshmem", lib)


def test_old_nccl_and_a_build_without_nccl(no_libraries, monkeypatch):
    _with(monkeypatch, nccl="2.27.7")
    lib = libraries.nccl_library({"nccl": True})
    assert not lib["available"] and "2.27.7 is older than 2.30" in lib["why"]
    assert NCCL_PIP in lib["why"]
    _with(monkeypatch, nccl="2.32.6")
    lib = libraries.nccl_library({})  # build_info without 'nccl': not built
    assert lib["available"] and not lib["built"] and lib["version"] == "2.32.6"
    with pytest.raises(jax_ep.TransportUnavailableError, match=r"build_info\(\)\['nccl'\]"):
        libraries.require("nccl", lib)
    assert libraries.require("nccl", libraries.nccl_library({"nccl": True}))["built"]
    with pytest.raises(ValueError, match="'nvshmem' or 'nccl'"):
        libraries.require("ib")


def test_native_check_decides_where_bound(no_libraries, monkeypatch):
    fake = types.SimpleNamespace(nccl_available=lambda: (False, "libnccl.so.2 not found"),
                                 nccl_version=lambda: "")
    monkeypatch.setattr(nccl_native, "_candidates", lambda: [("fake", fake)])
    _with(monkeypatch, nccl="2.32.6")
    lib = libraries.nccl_library({"nccl": True})
    assert not lib["available"] and "libnccl.so.2 not found" in lib["why"]


def test_report_keys(no_libraries, monkeypatch):
    _with(monkeypatch, nccl="2.32.6",
          build={"cpu": True, "cuda": False, "nvshmem": False, "nvshmem_qp_api": False})
    with config.override(transport="auto"):
        rep = jax_ep.transport_report(local_gpus=1, fabric_class="ib-multiport")
    for k in ("transport", "reason", "setting", "ready", "missing", "nvshmem", "nccl",
              "build_info", "qp_path", "ports"):  # and the NVSHMEM wire report's keys
        assert k in rep, k
    assert (rep["transport"], rep["setting"]) == ("nccl", "auto")
    assert "NVSHMEM is missing" in rep["reason"]
    for lib in ("nvshmem", "nccl"):
        assert {"available", "version", "package"} <= set(rep[lib])
    assert {"available": True, "version": "2.32.6", "package": "nvidia-nccl-cu13",
            "built": False, "started": False}.items() <= rep["nccl"].items()
    assert rep["nvshmem"]["package"] == "nvidia-nvshmem-cu13"
    assert rep["build_info"]["nccl"] is False  # missing key -> False
    assert rep["ready"] is False and "build_info()['nccl']" in rep["missing"]
    json.dumps(rep)  # JSON-able
    assert jax_ep.build_info()["nccl"] in (True, False)


def test_report_of_an_explicit_nvshmem_without_it(no_libraries):
    with config.override(transport="nvshmem"):
        rep = jax_ep.transport_report(local_gpus=1, fabric_class="ib-multiport")
    assert rep["transport"] == "nvshmem" and not rep["ready"]
    assert "nvidia-nvshmem-cu13" in rep["missing"]


_NO_LIBS = r"""
import importlib.metadata, json, sys
sys.modules["nvidia.nccl"] = None
sys.modules["nvidia.nvshmem"] = None
sys.modules["jax_ep._jax_ep_nvshmem"] = None
_real = importlib.metadata.version
def version(name):
    if name in ("nvidia-nccl-cu13", "nvidia-nvshmem-cu13"):
        raise importlib.metadata.PackageNotFoundError(name)
    return _real(name)
importlib.metadata.version = version
import jax_ep
from jax_ep import nccl_bootstrap
rep = jax_ep.transport_report()
try:
    nccl_bootstrap.NativeRuntime()
    err = None
except jax_ep.TransportUnavailableError as e:
    err = str(e)
print(json.dumps({"transport": rep["transport"], "reason": rep["reason"],
                  "ready": rep["ready"], "missing": rep["missing"],
                  "nccl": rep["nccl"]["available"], "nvshmem": rep["nvshmem"]["available"],
                  "error": err}))
"""


def test_import_without_either_library():
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_EP_TRANSPORT="auto")
    r = subprocess.run([sys.executable, "-c", _NO_LIBS], env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["nccl"] is False and got["nvshmem"] is False
    assert got["transport"] == "nccl" and "NVSHMEM is missing" in got["reason"]
    assert got["ready"] is False and NCCL_PIP in got["missing"]
    assert got["error"] and NCCL_PIP in got["error"] and "jax-ep[cuda]" in got["error"]


# ----------------------------------------------------------------------------- native seam

def test_native_binding_missing_is_named(monkeypatch):
    monkeypatch.setattr(nccl_native, "_candidates", lambda: [("jax_ep._jax_ep_ext", object())])
    with pytest.raises(NotImplementedError, match=r"`nccl_start`.*jax_ep\._jax_ep_ext"):
        nccl_native.start([0], [0], 1, b"\0" * 128, 1, 1, 1)
    assert not nccl_native.has("nccl_unique_id") and not nccl_native.started()


def test_native_calls_pass_their_arguments():
    calls = []
    fake = types.SimpleNamespace(
        __name__="fake",
        nccl_unique_id=lambda: b"u" * 128,
        nccl_start=lambda *a: calls.append(a) or "",
        nccl_finish=lambda o: "ncclCommDestroy: unhandled cuda error",
        nccl_started=lambda: True)
    nccl_native.use(fake)
    try:
        assert nccl_native.unique_id() == b"u" * 128
        nccl_native.start((0, 1), (4, 5), 8, b"u" * 128, 1 << 20, 8, 4)
        nccl_native.start((0,), (4,), 8, b"u" * 128, 1 << 20, 8, 4, low_latency=(16, 256, 2, 8))
        assert calls == [([0, 1], [4, 5], 8, b"u" * 128, 1 << 20, 8, 4, []),
                         ([0], [4], 8, b"u" * 128, 1 << 20, 8, 4, [16, 256, 2, 8])]
        with pytest.raises(nccl_native.NcclNativeError, match="ncclCommDestroy"):
            nccl_native.finish([0, 1])
        assert nccl_native.started()
        fake.nccl_unique_id = lambda: b"short"
        with pytest.raises(nccl_native.NcclNativeError, match="5 bytes"):
            nccl_native.unique_id()
    finally:
        nccl_native.use(None)


# ----------------------------------------------------------------------------- start-up

def _dev(i, p, hw):
    return types.SimpleNamespace(id=i, process_index=p, local_hardware_id=hw, platform="gpu")


def test_world_ranks_follow_processes_then_list_order():
    # a device list that interleaves the processes: ranks still form a block per process
    devs = [_dev(0, 0, 0), _dev(1, 1, 0), _dev(2, 0, 1), _dev(3, 1, 1)]
    assert nccl_bootstrap.world_ranks(devs, 0) == ([0, 1], [0, 1], 4)
    assert nccl_bootstrap.world_ranks(devs, 1) == ([0, 1], [2, 3], 4)
    one = [_dev(i, i, 0) for i in range(3)]  # one process per GPU
    assert nccl_bootstrap.world_ranks(one, 2) == ([0], [2], 3)


class MemoryKV:
    """jax.distributed's key-value calls, in memory (blocking gets with a timeout)."""

    def __init__(self):
        self.d, self.cv = {}, threading.Condition()

    def key_value_set_bytes(self, k, v):
        with self.cv:
            self.d[k] = bytes(v)
            self.cv.notify_all()

    def blocking_key_value_get_bytes(self, k, timeout_ms):
        with self.cv:
            if not self.cv.wait_for(lambda: k in self.d, timeout_ms / 1000):
                raise TimeoutError(f"DEADLINE_EXCEEDED: {k}")
            return self.d[k]

    def wait_at_barrier(self, k, timeout_ms):
        pass


def _plan_all(kv, cfgs, world=8, per=4, timeout_s=5.0, errors=None):
    out, uids = [None] * len(cfgs), []

    def one(p):
        try:
            out[p] = nccl_bootstrap.plan_start(
                kv, process=p, num_processes=len(cfgs), ordinals=range(per),
                ranks=range(p * per, p * per + per), world=world, config=cfgs[p],
                heap_bytes=1 << 20, num_contexts=cfgs[p].num_qps, gpus_per_node=per,
                make_unique_id=lambda: uids.append(1) or os.urandom(128),
                timeout_s=timeout_s, key="t", error=(errors or {}).get(p))
        except Exception as e:  # noqa: BLE001
            out[p] = e
    ts = [threading.Thread(target=one, args=(p,)) for p in range(len(cfgs))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout_s + 10)
    return out, uids


def test_plan_start_agrees_in_memory():
    (a, b), uids = _plan_all(MemoryKV(), [TransportConfig()] * 2)
    assert a.unique_id == b.unique_id and uids == [1]  # made once, by process 0
    assert a.rank_sets == b.rank_sets == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert (a.world, a.ranks, b.ranks) == (8, (0, 1, 2, 3), (4, 5, 6, 7))


def test_plan_start_failures_are_named_everywhere_and_make_no_unique_id():
    (a, b), uids = _plan_all(MemoryKV(), [TransportConfig(), TransportConfig(chunk_bytes=4096)])
    for e in (a, b):
        assert isinstance(e, nccl_bootstrap.NcclBootstrapError)
        assert "process 1 has transport_config.chunk_bytes=4096 where process 0 has 65536" \
            in str(e) and "transport_config_hash" in str(e)
    (a, b), uids2 = _plan_all(MemoryKV(), [TransportConfig()] * 2,
                              errors={1: "the NCCL transport needs GPU devices"})
    assert all("process 1: the NCCL transport needs GPU devices" in str(e) for e in (a, b))
    (a, b), _ = _plan_all(MemoryKV(), [TransportConfig()] * 2, world=12, per=4)
    assert all("do not cover the world of 12 ranks" in str(e) for e in (a, b))
    assert uids == uids2 == []


def test_plan_start_without_the_peer_ends_in_time():
    t0 = time.monotonic()
    with pytest.raises(nccl_bootstrap.NcclBootstrapError,
                       match=r"process 1 did not publish .* within 0\.5 s"):
        nccl_bootstrap.plan_start(
            MemoryKV(), process=0, num_processes=2, ordinals=[0], ranks=[0], world=2,
            config=TransportConfig(), heap_bytes=1, num_contexts=8, gpus_per_node=1,
            make_unique_id=lambda: b"\0" * 128, timeout_s=0.5, key="t")
    assert time.monotonic() - t0 < 3


def test_initialize_one_process_with_a_stand_in(monkeypatch):
    import jax

    class RT:
        def __init__(self):
            self.args, self.finished = None, None

        def unique_id(self):
            return b"\1" * 128

        def start(self, *a):
            self.args = a

        def finish(self, ordinals):
            self.finished = ordinals

    rt = RT()
    devs = jax.devices()
    assert not nccl_bootstrap.is_initialized()
    st = nccl_bootstrap.initialize(heap_bytes=4096, runtime=rt, client=MemoryKV(),
                                   timeout_s=5, devices=devs, process=0, num_processes=1,
                                   config=TransportConfig(num_ports=1, qps_per_port=2))
    try:
        n = len(devs)
        assert rt.args == (list(range(n)), list(range(n)), n, b"\1" * 128, 4096, 2,
                           n if n > 1 else 1)
        assert st.ranks == tuple(range(n)) and nccl_bootstrap.state() is st
        assert nccl_bootstrap.initialize(heap_bytes=1024, runtime=rt) is st  # smaller: no-op
        with pytest.raises(nccl_bootstrap.NcclBootstrapError, match="already running"):
            nccl_bootstrap.initialize(heap_bytes=8192, runtime=rt)
        assert jax_ep.transport_report(local_gpus=1, fabric_class="unknown")["nccl"][
            "started"] is True
    finally:
        nccl_bootstrap.finalize()
    assert rt.finished == list(range(n)) and not nccl_bootstrap.is_initialized()
