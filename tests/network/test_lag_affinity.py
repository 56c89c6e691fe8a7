"""LAG TX port affinity and RoCE UDP source port: the PRM fields (Python and the C shim
on synthetic command buffers), and the shim interposing a transport's libmlx5 calls
(a fake libmlx5 that checks QP states and can refuse fields, a fake transport and a fake
libibverbs built here; no RDMA hardware)."""

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from jax_ep.network import lag_affinity as la

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHIM_SRC = os.path.join(ROOT, "xla_ffi", "internode", "lag_shim.cc")
SHIM_MAP = os.path.join(ROOT, "xla_ffi", "internode", "lag_shim.map")
LA_PY = os.path.join(ROOT, "jax_ep", "network", "lag_affinity.py")

needs_cxx = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")


# --- the bit layout, by hand -------------------------------------------------------------

def test_field_offsets_by_hand():
    # qpc starts at byte 24; lag_tx_port_affinity is the low nibble of its first byte
    cmd = bytearray(la.CMD_BYTES)
    la.set_bits(cmd, la.QPC_BIT + la.LAG_AFF_BIT, la.LAG_AFF_W, 2)
    assert cmd[24] == 0x02 and sum(cmd) == 2
    # udp_sport: primary address path at qpc bit 0xc0 (byte 24 + 24), field at 0x110
    # of it (byte 34): absolute bytes 82..83, big-endian
    cmd = bytearray(la.CMD_BYTES)
    la.set_bits(cmd, la.QPC_BIT + la.UDP_SPORT_BIT, la.UDP_SPORT_W, 0xC0DE)
    assert cmd[82:84] == b"\xc0\xde" and sum(cmd) == 0xC0 + 0xDE
    # qpn: 24 bits at bit 0x48 -> bytes 9..11; opcode bytes 0..1
    cmd = bytearray(la.CMD_BYTES)
    la.set_bits(cmd, la.QPN_BIT, la.QPN_W, 0x123456)
    la.set_bits(cmd, la.OPCODE_BIT, la.OPCODE_W, la.OP_RTS2RTS)
    assert cmd[9:12] == b"\x12\x34\x56" and cmd[0:2] == b"\x05\x05"
    assert la.CMD_BYTES == 272


def test_set_bits_neighbours_untouched_and_errors():
    cmd = bytearray(b"\xff" * 32)
    la.set_bits(cmd, 4, 4, 0)  # the low nibble only
    assert cmd[0] == 0xF0 and cmd[1:] == b"\xff" * 31
    assert la.get_bits(cmd, 0, 4) == 0xF
    with pytest.raises(ValueError, match="fit"):
        la.set_bits(cmd, 0, 4, 16)
    with pytest.raises(ValueError, match="past the buffer"):
        la.set_bits(cmd, 250, 16, 1)


def test_rts2rts_affinity_command():
    cmd = la.rts2rts_cmd(0xABCDE, affinity=2)
    f = la.fields_of(cmd)
    assert f["opcode"] == 0x505 and f["qpn"] == 0xABCDE
    assert f["opt_param_mask"] == 1 << 15  # MLX5_QP_OPTPAR_LAG_TX_AFF
    assert f["lag_tx_port_affinity"] == 2 and f["udp_sport"] == 0
    assert f["opt_param_mask_95_32"] == 0
    # nothing else set: opcode + qpn + mask + affinity bytes only
    rest = bytearray(cmd)
    for off, n in ((0, 2), (9, 3), (16, 4), (24, 1)):
        rest[off:off + n] = bytes(n)
    assert not any(rest)


def test_rts2rts_sport_command():
    cmd = la.rts2rts_cmd(7, udp_sport=0xC005)
    f = la.fields_of(cmd)
    assert f["opt_param_mask"] == 0 and f["opt_param_mask_95_32"] == 1 << 2
    assert f["udp_sport"] == 0xC005 and f["lag_tx_port_affinity"] == 0
    assert cmd[264:272] == b"\x00" * 7 + b"\x04"
    with pytest.raises(ValueError, match="udp_sport"):
        la.rts2rts_cmd(7, udp_sport=0x1234)
    with pytest.raises(ValueError, match="affinity"):
        la.rts2rts_cmd(7, affinity=16)
    with pytest.raises(ValueError, match="qpn"):
        la.rts2rts_cmd(1 << 24, affinity=1)
    with pytest.raises(ValueError, match="give"):
        la.rts2rts_cmd(1)


def _nvshmem_like(op, sport=0xC000, qpn=0x4242):
    """A modify command as a transport issues it: RC QP, fixed UDP source port."""
    cmd = bytearray(la.CMD_BYTES)
    la.set_bits(cmd, la.OPCODE_BIT, la.OPCODE_W, op)
    la.set_bits(cmd, la.QPN_BIT, la.QPN_W, qpn)
    la.set_bits(cmd, la.OPT_MASK_BIT, la.OPT_MASK_W, 0x0A)  # some mask bits already set
    if op == la.OP_INIT2RTR:
        la.set_bits(cmd, la.QPC_BIT + la.UDP_SPORT_BIT, la.UDP_SPORT_W, sport)
    return cmd


def test_patch_modify_cmd():
    rst = _nvshmem_like(la.OP_RST2INIT)
    assert la.patch_modify_cmd(rst, 2, 0xC003) == ["lag_tx_port_affinity"]
    assert la.fields_of(rst)["lag_tx_port_affinity"] == 2
    assert la.fields_of(rst)["opt_param_mask"] == 0x0A  # no mask bit at RST->INIT
    # INIT->RTR: the source port only; its affinity and mask stay as the transport sent
    rtr = _nvshmem_like(la.OP_INIT2RTR)
    assert la.patch_modify_cmd(rtr, 1, 0xC003) == ["udp_sport"]
    f = la.fields_of(rtr)
    assert f["udp_sport"] == 0xC003 and f["lag_tx_port_affinity"] == 0
    assert f["opt_param_mask"] == 0x0A
    rts = _nvshmem_like(la.OP_RTR2RTS)
    before = bytes(rts)
    assert la.patch_modify_cmd(rts, 1, 0xC003) == [] and bytes(rts) == before
    assert la.patch_modify_cmd(bytearray(16), 1, 0xC003) == []  # too short: untouched


def test_assignment_alternates_and_sports_distinct():
    a = la.assign(6, 2)
    assert [x.affinity for x in a] == [1, 2, 1, 2, 1, 2]
    assert [x.udp_sport for x in a] == [0xC000 + i for i in range(6)]
    assert [x.affinity for x in la.assign(3, 2, "none")] == [0, 0, 0]
    assert la.udp_sport_for(0x4000) == 0xC000  # wraps inside the dynamic range
    with pytest.raises(ValueError, match="policy"):
        la.affinity_for(0, 2, "hash")


# --- the C shim against the Python statement ----------------------------------------------

def _build(tmp, name, src, extra=()):
    path = os.path.join(tmp, name)
    cpp = os.path.join(tmp, name + ".cc")
    with open(cpp, "w") as f:
        f.write(src)
    subprocess.run(["g++", "-std=c++17", "-O1", "-fPIC", "-shared", "-o", path, cpp, *extra],
                   check=True, capture_output=True)
    return path


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    if shutil.which("g++") is None:
        pytest.skip("needs g++")
    tmp = str(tmp_path_factory.mktemp("lag"))
    shim = os.path.join(tmp, la.SHIM_NAME)
    subprocess.run(["g++", "-std=c++17", "-O2", "-fPIC", "-shared", "-Wall", "-Wextra",
                    "-Werror", "-Wno-unused-parameter", "-I", ROOT, "-o", shim, SHIM_SRC,
                    f"-Wl,--version-script={SHIM_MAP}", "-ldl"], check=True)
    map_ = os.path.join(tmp, "mlx5.map")
    with open(map_, "w") as f:
        f.write("MLX5_1.7 { global: mlx5dv_devx_obj_create; mlx5dv_devx_obj_modify; "
                "fake_*; local: *; };\n")
    _build(tmp, "libmlx5.so.1", FAKE_MLX5, [f"-Wl,--version-script={map_}",
                                              "-Wl,-soname,libmlx5.so.1"])
    os.symlink("libmlx5.so.1", os.path.join(tmp, "libmlx5.so"))
    _build(tmp, "libibverbs.so.1", FAKE_IBVERBS, ["-Wl,-soname,libibverbs.so.1"])
    _build(tmp, "libfake_transport.so", FAKE_TRANSPORT, [f"-L{tmp}", "-lmlx5",
                                                         f"-Wl,-rpath,{tmp}"])
    return tmp


# A fake libmlx5: numbers QPs from 0x100, keeps each QP's state and refuses a command
# given in the wrong state (an RTS2RTS before RTS fails, as on a device); logs every
# modify with its status. fake_refuse(bits) makes it a device that answers bad_param to
# 1: an RST2INIT whose qpc names a LAG port, 2: an RTS2RTS with opt_param bit 15,
# 4: an INIT2RTR with bit 15 or an affinity (no init2_lag_tx_port_affinity capability).
FAKE_MLX5 = textwrap.dedent(r"""
    #include <cstdint>
    #include <cstring>
    #include <cstdlib>
    #include <vector>
    struct Obj { uint32_t qpn; int state; };  // 0 RST, 1 INIT, 2 RTR, 3 RTS
    struct Entry { std::vector<uint8_t> cmd; int status; uint32_t qpn; };
    static std::vector<Entry> g_log;
    static uint32_t g_next = 0x100;
    static int g_refuse = 0;
    static uint32_t bits(const uint8_t* p, int bit, int w) {
      uint32_t v = 0;
      for (int i = 0; i < w; ++i) v = (v << 1) | ((p[(bit + i) / 8] >> (7 - (bit + i) % 8)) & 1);
      return v;
    }
    extern "C" void* mlx5dv_devx_obj_create(void*, const void* in, size_t inlen, void* out,
                                            size_t outlen) {
      Obj* o = new Obj{g_next++, 0};
      uint8_t* q = static_cast<uint8_t*>(out);
      if (outlen >= 16) { q[9] = o->qpn >> 16; q[10] = o->qpn >> 8; q[11] = o->qpn; }
      return o;
    }
    static int check(Obj* o, const uint8_t* p) {
      uint32_t op = bits(p, 0, 16), mask = bits(p, 0x80, 32), aff = bits(p, 0xC4, 4);
      static const int from[] = {0, 1, 2, 3}, to[] = {1, 2, 3, 3};
      if (op < 0x502 || op > 0x505) return 22;
      int k = op - 0x502;
      if (o->state != from[k]) return 22;
      if (op == 0x505 && bits(p, 0x48, 24) != o->qpn) return 22;
      if ((g_refuse & 1) && op == 0x502 && aff) return 22;
      if ((g_refuse & 2) && op == 0x505 && (mask & (1u << 15))) return 22;
      if ((g_refuse & 4) && op == 0x503 && ((mask & (1u << 15)) || aff)) return 22;
      o->state = to[k];
      return 0;
    }
    extern "C" int mlx5dv_devx_obj_modify(void* obj, const void* in, size_t inlen, void*,
                                          size_t) {
      const uint8_t* p = static_cast<const uint8_t*>(in);
      Obj* o = static_cast<Obj*>(obj);
      int st = check(o, p);
      g_log.push_back(Entry{std::vector<uint8_t>(p, p + inlen), st, o->qpn});
      return st;
    }
    extern "C" void fake_refuse(int bits_) { g_refuse = bits_; }
    extern "C" int fake_log_count() { return (int)g_log.size(); }
    extern "C" int fake_log_get(int i, uint8_t* buf, int cap, int* status, uint32_t* qpn) {
      int n = (int)g_log[i].cmd.size(); if (n > cap) n = cap;
      std::memcpy(buf, g_log[i].cmd.data(), n);
      *status = g_log[i].status; *qpn = g_log[i].qpn; return n;
    }
""")

# ibv_get_device_name for the fake transport's devices (the first member of a device)
FAKE_IBVERBS = textwrap.dedent(r"""
    struct FakeDev { const char* name; };
    extern "C" const char* ibv_get_device_name(void* d) {
      return static_cast<FakeDev*>(d)->name;
    }
""")

# What NVSHMEM's IBGDA does, reduced: create RC QPs (QP i on device i % ndev), then
# RST2INIT, INIT2RTR with UDP source port 0xC000, RTR2RTS, through libmlx5's exported
# names; a QP whose transition fails is given up (NVSHMEM aborts its init). Returns how
# many transitions failed.
FAKE_TRANSPORT = textwrap.dedent(r"""
    #include <cstdint>
    #include <cstring>
    extern "C" void* mlx5dv_devx_obj_create(void*, const void*, size_t, void*, size_t);
    extern "C" int mlx5dv_devx_obj_modify(void*, const void*, size_t, void*, size_t);
    static void op(uint8_t* c, int o) { std::memset(c, 0, 272); c[0] = o >> 8; c[1] = o & 0xff; }
    struct FakeDev { const char* name; };
    struct FakeCtx { FakeDev* device; };
    static FakeDev g_dev[4] = {{"mlx5_bond_0"}, {"mlx5_1"}, {"mlx5_2"}, {"mlx5_3"}};
    static FakeCtx g_ctx[4] = {{&g_dev[0]}, {&g_dev[1]}, {&g_dev[2]}, {&g_dev[3]}};
    static int modify(void* obj, const uint8_t* cmd) {
      uint8_t out[16];
      return mlx5dv_devx_obj_modify(obj, cmd, 272, out, sizeof(out));
    }
    extern "C" int fake_transport_run(int nqps, int st, int ndev) {
      void* objs[64]; uint8_t cmd[272], out[16];
      int failed = 0;
      for (int i = 0; i < nqps; ++i) {
        op(cmd, 0x500); cmd[24 + 1] = (uint8_t)st;   // qpc.st
        objs[i] = mlx5dv_devx_obj_create(&g_ctx[i % ndev], cmd, sizeof(cmd), out, sizeof(out));
      }
      for (int i = 0; i < nqps; ++i) {
        op(cmd, 0x502);
        if (modify(objs[i], cmd)) { ++failed; continue; }
        op(cmd, 0x503); cmd[82] = 0xC0; cmd[83] = 0x00;
        if (modify(objs[i], cmd)) { ++failed; continue; }
        op(cmd, 0x504);
        if (modify(objs[i], cmd)) ++failed;
      }
      return failed;
    }
""")


@needs_cxx
def test_c_patch_equals_python(built):
    shim = la.Shim(os.path.join(built, la.SHIM_NAME))
    for op in (la.OP_RST2INIT, la.OP_INIT2RTR, la.OP_RTR2RTS, la.OP_RTS2RTS):
        for aff, sport in ((1, 0xC001), (2, 0xFFFF), (0, 0xC000)):
            a, b = _nvshmem_like(op), _nvshmem_like(op)
            la.patch_modify_cmd(a, aff, sport)
            shim.patch(b, aff, sport)
            assert bytes(a) == bytes(b), (op, aff, sport)
            if op == la.OP_INIT2RTR:
                assert la.fields_of(b)["opt_param_mask"] == 0x0A
                assert la.fields_of(b)["lag_tx_port_affinity"] == 0
    for qpn, aff, sport in ((5, 2, None), (0xFFFFFF, None, 0xC00F), (9, 1, 0xD000)):
        assert shim.rts2rts(qpn, aff or 0, sport or 0) == la.rts2rts_cmd(qpn, aff, sport)


# Runs in a fresh process (the shim must be in the global scope before the transport
# binds libmlx5), loading lag_affinity.py by path so that no jax import is paid. The
# spec: shim (load it), mlx5_first (libmlx5 global before the shim), ibverbs (the fake
# libibverbs loaded: device names), refuse (fake_refuse bits), configure (keyword
# arguments of Shim.configure, or null) and steps: ["run", nqps, st, ndev], ["arm"],
# ["disarm"], ["armed_run", nqps, st, ndev] (the run inside `with shim.armed()`).
RUN = textwrap.dedent(r"""
    import ctypes, importlib.util, json, sys
    tmp, la_py, spec = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    m = importlib.util.spec_from_file_location("lag_affinity", la_py)
    la = sys.modules["lag_affinity"] = importlib.util.module_from_spec(m)
    m.loader.exec_module(la)
    if spec.get("ibverbs"):
        ctypes.CDLL(tmp + "/libibverbs.so.1", mode=ctypes.RTLD_GLOBAL)
    if spec.get("mlx5_first"):
        ctypes.CDLL("libmlx5.so.1", mode=ctypes.RTLD_GLOBAL)
    shim = la.Shim(tmp + "/libjax_ep_lag_shim.so") if spec.get("shim") else None
    if shim and spec.get("configure") is not None:
        shim.configure(**spec["configure"])
    mlx5 = ctypes.CDLL("libmlx5.so.1")
    mlx5.fake_refuse(int(spec.get("refuse", 0)))
    tr = ctypes.CDLL(tmp + "/libfake_transport.so")  # RTLD_LOCAL, like NVSHMEM's dlopen
    fails, marks, armed = [], [], []
    for step in spec.get("steps", [["run", 4, 0, 1]]):
        if step[0] == "arm":
            shim.arm()
        elif step[0] == "disarm":
            shim.disarm()
        elif step[0] == "armed_run":
            with shim.armed():
                armed.append(shim.is_armed())
                fails.append(tr.fake_transport_run(*step[1:]))
            armed.append(shim.is_armed())
        else:
            fails.append(tr.fake_transport_run(*step[1:]))
        marks.append(mlx5.fake_log_count())
    log = []
    st, qpn = ctypes.c_int(), ctypes.c_uint32()
    for i in range(mlx5.fake_log_count()):
        b = (ctypes.c_uint8 * 300)()
        n = mlx5.fake_log_get(i, b, 300, ctypes.byref(st), ctypes.byref(qpn))
        log.append(dict(la.fields_of(bytes(b[:n])), status=st.value, obj=qpn.value))
    print(json.dumps({"log": log, "table": shim.table() if shim else None, "fails": fails,
                      "marks": marks, "armed": armed}))
""")

FABRIC_LIKE = {"members": 2, "group": 2, "sport_base": 0xC000, "init2rtr_affinity": True}


def _run(built, shim=True, configure=FABRIC_LIKE, **spec):
    env = dict(os.environ, LD_LIBRARY_PATH=built)
    spec = dict(spec, shim=shim, configure=configure)
    out = subprocess.run([sys.executable, "-c", RUN, built, LA_PY, json.dumps(spec)],
                         env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def _ops(log):
    return [e["opcode"] for e in log]


@needs_cxx
def test_init2rtr_never_carries_the_affinity(built):
    # configured as the bootstrap does (it still passes init2rtr_affinity=True), on a
    # device without the INIT2RTR capability: no INIT2RTR may name a LAG port or set
    # opt_param bit 15, and so none of the transport's transitions fails
    r = _run(built, refuse=4)
    rtrs = [e for e in r["log"] if e["opcode"] == la.OP_INIT2RTR]
    assert len(rtrs) == 4
    assert all(e["lag_tx_port_affinity"] == 0 for e in rtrs), rtrs
    assert all(not e["opt_param_mask"] & la.OPTPAR_LAG_TX_AFF for e in rtrs), rtrs
    assert r["fails"] == [0]
    assert all(e["status"] == 0 for e in r["log"])


@needs_cxx
def test_affinity_in_rst2init_and_rts2rts_after_rts(built):
    r = _run(built)
    log, table = r["log"], r["table"]
    assert r["fails"] == [0] and all(e["status"] == 0 for e in log)
    # group=2: QPs 0,1 on member 1, QPs 2,3 on member 2; distinct source ports
    assert [t["affinity"] for t in table] == [1, 1, 2, 2]
    assert [t["udp_sport"] for t in table] == [0xC000, 0xC001, 0xC002, 0xC003]
    assert [t["qpn"] for t in table] == [0x100, 0x101, 0x102, 0x103]
    want = la.PATCHED_RST2INIT_AFFINITY | la.PATCHED_INIT2RTR_SPORT | \
        la.PATCHED_RTS2RTS_AFFINITY
    assert all(t["patched"] == want and t["rts2rts_status"] == 0 for t in table)
    # per QP: RST2INIT, INIT2RTR, RTR2RTS, then the shim's RTS2RTS (the fake refuses an
    # RTS2RTS given before RTS, so its status 0 says it came after)
    assert _ops(log) == [0x502, 0x503, 0x504, 0x505] * 4
    for k in range(4):
        rst, rtr, rts, again = log[4 * k:4 * k + 4]
        aff = table[k]["affinity"]
        assert {e["obj"] for e in (rst, rtr, rts, again)} == {0x100 + k}
        assert rst["lag_tx_port_affinity"] == aff and rst["opt_param_mask"] == 0
        assert rtr["udp_sport"] == 0xC000 + k and rtr["lag_tx_port_affinity"] == 0
        assert rtr["opt_param_mask"] == 0
        assert rts["lag_tx_port_affinity"] == 0  # RTR2RTS itself untouched
        assert again["qpn"] == 0x100 + k and again["lag_tx_port_affinity"] == aff
        assert again["opt_param_mask"] == la.OPTPAR_LAG_TX_AFF


@needs_cxx
@pytest.mark.parametrize("refuse", [1 | 2, 2], ids=["rst2init_and_rts2rts", "rts2rts"])
def test_refused_affinity_runs_on_and_is_recorded(built, refuse):
    r = _run(built, refuse=refuse)
    log, table = r["log"], r["table"]
    assert r["fails"] == [0]  # every transition the transport asked for succeeded
    # the QPs reached RTS: each RTR2RTS was accepted
    assert [e["status"] for e in log if e["opcode"] == la.OP_RTR2RTS] == [0] * 4
    for k, t in enumerate(table):
        assert t["rts2rts_status"] not in (0, -1)  # the refusal, recorded
        assert not t["patched"] & la.PATCHED_RTS2RTS_AFFINITY
        # the source ports stay: a hashing LAG still spreads the flows
        assert t["patched"] & la.PATCHED_INIT2RTR_SPORT and t["udp_sport"] == 0xC000 + k
        mine = [e for e in log if e["obj"] == 0x100 + k]
        rtr = [e for e in mine if e["opcode"] == la.OP_INIT2RTR]
        assert [e["udp_sport"] for e in rtr] == [0xC000 + k]
        rst = [e for e in mine if e["opcode"] == la.OP_RST2INIT]
        if refuse & 1:
            # refused with the affinity, then sent as the transport wrote it
            assert [(e["lag_tx_port_affinity"], e["status"]) for e in rst] == \
                [(t["affinity"], 22), (0, 0)]
            assert t["patched"] & la.REFUSED_RST2INIT_AFFINITY
            assert not t["patched"] & la.PATCHED_RST2INIT_AFFINITY
        else:
            assert [e["status"] for e in rst] == [0]
            assert t["patched"] & la.PATCHED_RST2INIT_AFFINITY


@needs_cxx
def test_a_refusal_in_the_table_is_said_by_the_bootstrap(built, monkeypatch):
    # the table a refusing device leaves, read by the bootstrap: a warning, no error
    from jax_ep.network import fabric as fb
    from jax_ep.network.transport import TransportConfig

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from test_fabric import GPU, tree

    table = _run(built, refuse=1 | 2)["table"]

    class Recorded:
        def configure(self, **kw):
            pass

        def disable(self):
            pass

        def table(self):
            return table

    monkeypatch.setattr(la, "load_shim", lambda path=None: Recorded())
    monkeypatch.setattr(fb, "_said", set())
    monkeypatch.setattr(fb, "_setup", None)
    s = fb.setup_for_bootstrap(TransportConfig(num_ports=2, qps_per_port=2),
                               {"JAX_EP_SYSFS": tree("roce_bond")}, 0, 1, None,
                               key_prefix="k", timeout_ms=10, gpu=GPU)
    s.world = 3
    with pytest.warns(UserWarning, match="did not reach 4 of 4 RC QPs.*RTS2RTS status 22"):
        fb.after_nvshmem_start()


@needs_cxx
def test_qps_outside_the_armed_window_are_untouched(built):
    cfg = dict(FABRIC_LIKE, arm=False)
    r = _run(built, configure=cfg, steps=[["run", 2, 0, 1], ["arm"], ["run", 2, 0, 1],
                                          ["disarm"], ["run", 2, 0, 1],
                                          ["armed_run", 2, 0, 1], ["run", 2, 0, 1]])
    log, marks = r["log"], r["marks"]
    assert r["fails"] == [0] * 5 and r["armed"] == [True, False]
    windows = [log[a:b] for a, b in zip([0] + marks, marks)]
    before, inside, after, ctx, last = (windows[i] for i in (0, 2, 4, 5, 6))
    for untouched in (before, after, last):
        assert _ops(untouched) == [0x502, 0x503, 0x504] * 2
        assert all(e["lag_tx_port_affinity"] == 0 and e["opt_param_mask"] == 0
                   for e in untouched)
        assert all(e["udp_sport"] == 0xC000 for e in untouched if e["opcode"] == 0x503)
    for armed in (inside, ctx):
        assert _ops(armed) == [0x502, 0x503, 0x504, 0x505] * 2
    # only the QPs created while armed are in the table, numbered across both windows
    assert [t["qpn"] for t in r["table"]] == [0x102, 0x103, 0x106, 0x107]
    assert [t["affinity"] for t in r["table"]] == [1, 1, 2, 2]


@needs_cxx
def test_only_the_configured_devices_qps_are_taken(built):
    cfg = dict(FABRIC_LIKE, group=1, devices=["mlx5_bond_0"])
    r = _run(built, configure=cfg, ibverbs=True, steps=[["run", 4, 0, 2]])
    assert r["fails"] == [0]
    # QPs 0x100, 0x102 on mlx5_bond_0 (taken, alternating), 0x101, 0x103 on mlx5_1
    assert [(t["qpn"], t["device"], t["affinity"]) for t in r["table"]] == \
        [(0x100, "mlx5_bond_0", 1), (0x102, "mlx5_bond_0", 2)]
    other = [e for e in r["log"] if e["obj"] in (0x101, 0x103)]
    assert _ops(other) == [0x502, 0x503, 0x504] * 2
    assert all(e["lag_tx_port_affinity"] == 0 for e in other)
    assert all(e["udp_sport"] == 0xC000 for e in other if e["opcode"] == 0x503)
    # without device names (no libibverbs loaded) a filter takes nothing
    r = _run(built, configure=cfg, steps=[["run", 4, 0, 2]])
    assert r["table"] == [] and all(e["lag_tx_port_affinity"] == 0 for e in r["log"])


@needs_cxx
def test_shim_window_and_configure_in_process(built):
    import warnings

    shim = la.Shim(os.path.join(built, la.SHIM_NAME))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the bootstrap's keyword is taken silently
        shim.configure(members=2, group=1, init2rtr_affinity=True)
    assert shim.is_armed()
    shim.disable()
    assert not shim.is_armed()
    shim.configure(members=2, arm=False)
    assert not shim.is_armed()
    with pytest.raises(RuntimeError, match="boom"):
        with shim.armed():
            assert shim.is_armed()
            raise RuntimeError("boom")
    assert not shim.is_armed()
    with pytest.raises(ValueError, match="devices"):
        shim.configure(members=2, devices=["a,b"], arm=False)
    with pytest.raises(ValueError, match="devices"):
        shim.configure(members=2, devices=[f"d{i}" for i in range(17)], arm=False)
    with pytest.raises(ValueError, match="members"):
        shim.configure(members=16, arm=False)
    assert not shim.is_armed()


@needs_cxx
def test_without_shim_nothing_changes(built):
    # the checks above can fail: without the shim the transport's commands go out as is
    log = _run(built, shim=False)["log"]
    assert _ops(log) == [0x502, 0x503, 0x504] * 4
    assert all(e["lag_tx_port_affinity"] == 0 for e in log)
    assert all(e["udp_sport"] == 0xC000 for e in log if e["opcode"] == 0x503)


@needs_cxx
def test_shim_leaves_non_rc_qps_alone(built):
    r = _run(built, steps=[["run", 4, 5, 1]])  # DCI-like service type: not taken
    assert r["table"] == []
    assert _ops(r["log"]) == [0x502, 0x503, 0x504] * 4
    assert all(e["lag_tx_port_affinity"] == 0 for e in r["log"])


def test_installed_shim_exports_the_versioned_names():
    p = la.shim_path()
    if p is None:
        pytest.skip("the shim is not built in this install (make build)")
    if os.path.getmtime(p) < os.path.getmtime(SHIM_SRC):
        pytest.skip("the installed shim is older than lag_shim.cc (make build)")
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("no nm")
    syms = subprocess.run([nm, "-D", "--defined-only", p], capture_output=True, text=True,
                          check=True).stdout
    assert "mlx5dv_devx_obj_create@@MLX5_1.7" in syms
    assert "mlx5dv_devx_obj_modify@@MLX5_1.7" in syms
    for name in ("jax_ep_lag_arm", "jax_ep_lag_disarm", "jax_ep_lag_devices"):
        assert name + "@@JAX_EP_LAG_1" in syms
    exported = [l.split()[-1] for l in syms.splitlines() if " T " in l]
    assert all(s.startswith(("mlx5dv_devx_obj_", "jax_ep_lag_")) for s in exported), exported
    cmd = _nvshmem_like(la.OP_INIT2RTR)
    ref = bytearray(cmd)
    la.patch_modify_cmd(ref, 2, 0xC009)
    la.Shim(p).patch(cmd, 2, 0xC009)
    assert cmd == ref


@needs_cxx
def test_shim_records_devices_only(built):
    # members 0, no source port: nothing changes on the wire, the devices are recorded
    cfg = {"members": 0, "group": 2, "sport_base": 0}
    r = _run(built, configure=cfg, steps=[["run", 4, 0, 2]])
    assert _ops(r["log"]) == [0x502, 0x503, 0x504] * 4
    assert all(e["lag_tx_port_affinity"] == 0 for e in r["log"])
    assert all(e["udp_sport"] == 0xC000 for e in r["log"] if e["opcode"] == 0x503)
    devs = [t["device"] for t in r["table"]]
    assert len(set(devs)) == 2 and devs[0] == devs[2] != devs[1] == devs[3]
    assert all(t["patched"] == 0 and t["rts2rts_status"] == -1 for t in r["table"])


@needs_cxx
def test_libmlx5_bound_first_is_visible_in_the_table(built):
    # libmlx5 global before the shim: the transport binds to it, the shim sees no QP
    # (the bootstrap then says the affinity did not reach the QPs)
    r = _run(built, mlx5_first=True)
    assert r["table"] == []
    assert all(e["lag_tx_port_affinity"] == 0 for e in r["log"])
