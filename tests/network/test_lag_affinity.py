"""LAG TX port affinity and RoCE UDP source port: the PRM fields (Python and the C shim
on synthetic command buffers), and the shim interposing a transport's libmlx5 calls
(a fake libmlx5 and a fake transport built here; no RDMA hardware)."""

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
    rtr = _nvshmem_like(la.OP_INIT2RTR)
    assert la.patch_modify_cmd(rtr, 1, 0xC003) == ["udp_sport", "lag_tx_port_affinity"]
    f = la.fields_of(rtr)
    assert f["udp_sport"] == 0xC003 and f["lag_tx_port_affinity"] == 1
    assert f["opt_param_mask"] == 0x0A | (1 << 15)
    rtr2 = _nvshmem_like(la.OP_INIT2RTR)
    assert la.patch_modify_cmd(rtr2, 1, 0xC003, init2rtr_affinity=False) == ["udp_sport"]
    assert la.fields_of(rtr2)["opt_param_mask"] == 0x0A
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
                    "-Werror", "-Wno-unused-parameter", "-o", shim, SHIM_SRC,
                    f"-Wl,--version-script={SHIM_MAP}", "-ldl"], check=True)
    # a fake libmlx5: records every modify command, numbers QPs from 0x100
    map_ = os.path.join(tmp, "mlx5.map")
    with open(map_, "w") as f:
        f.write("MLX5_1.7 { global: mlx5dv_devx_obj_create; mlx5dv_devx_obj_modify; "
                "fake_*; local: *; };\n")
    _build(tmp, "libmlx5.so.1", FAKE_MLX5, [f"-Wl,--version-script={map_}",
                                              "-Wl,-soname,libmlx5.so.1"])
    os.symlink("libmlx5.so.1", os.path.join(tmp, "libmlx5.so"))
    _build(tmp, "libfake_transport.so", FAKE_TRANSPORT, [f"-L{tmp}", "-lmlx5",
                                                         f"-Wl,-rpath,{tmp}"])
    return tmp


FAKE_MLX5 = textwrap.dedent(r"""
    #include <cstdint>
    #include <cstring>
    #include <cstdlib>
    #include <vector>
    static std::vector<std::vector<uint8_t>> g_log;
    static uint32_t g_next = 0x100;
    static void set_qpn(uint8_t* out, uint32_t q) {
      out[9] = q >> 16; out[10] = q >> 8; out[11] = q;
    }
    extern "C" void* mlx5dv_devx_obj_create(void*, const void* in, size_t inlen, void* out,
                                            size_t outlen) {
      if (outlen >= 16) set_qpn(static_cast<uint8_t*>(out), g_next++);
      return std::malloc(8);
    }
    extern "C" int mlx5dv_devx_obj_modify(void*, const void* in, size_t inlen, void*, size_t) {
      const uint8_t* p = static_cast<const uint8_t*>(in);
      g_log.emplace_back(p, p + inlen);
      return 0;
    }
    extern "C" int fake_log_count() { return (int)g_log.size(); }
    extern "C" int fake_log_get(int i, uint8_t* buf, int cap) {
      int n = (int)g_log[i].size(); if (n > cap) n = cap;
      std::memcpy(buf, g_log[i].data(), n); return n;
    }
""")

# What NVSHMEM's IBGDA does, reduced: create RC QPs, then RST2INIT, INIT2RTR with UDP
# source port 0xC000, RTR2RTS, through libmlx5's exported names.
FAKE_TRANSPORT = textwrap.dedent(r"""
    #include <cstdint>
    #include <cstring>
    extern "C" void* mlx5dv_devx_obj_create(void*, const void*, size_t, void*, size_t);
    extern "C" int mlx5dv_devx_obj_modify(void*, const void*, size_t, void*, size_t);
    static void op(uint8_t* c, int o) { std::memset(c, 0, 272); c[0] = o >> 8; c[1] = o & 0xff; }
    struct FakeCtx { void* device; };
    static FakeCtx g_ctx[4];
    extern "C" int fake_transport_run(int nqps, int st, int ndev) {
      void* objs[64]; uint8_t cmd[272], out[16];
      for (int i = 0; i < nqps; ++i) {
        op(cmd, 0x500); cmd[24 + 1] = (uint8_t)st;   // qpc.st
        objs[i] = mlx5dv_devx_obj_create(&g_ctx[i % ndev], cmd, sizeof(cmd), out, sizeof(out));
      }
      for (int i = 0; i < nqps; ++i) {
        op(cmd, 0x502); mlx5dv_devx_obj_modify(objs[i], cmd, sizeof(cmd), out, sizeof(out));
        op(cmd, 0x503); cmd[82] = 0xC0; cmd[83] = 0x00;
        mlx5dv_devx_obj_modify(objs[i], cmd, sizeof(cmd), out, sizeof(out));
        op(cmd, 0x504); mlx5dv_devx_obj_modify(objs[i], cmd, sizeof(cmd), out, sizeof(out));
      }
      return 0;
    }
""")


@needs_cxx
def test_c_patch_equals_python(built):
    shim = la.Shim(os.path.join(built, la.SHIM_NAME))
    for op in (la.OP_RST2INIT, la.OP_INIT2RTR, la.OP_RTR2RTS, la.OP_RTS2RTS):
        for aff, sport, i2r in ((1, 0xC001, True), (2, 0xFFFF, False), (0, 0xC000, True)):
            a, b = _nvshmem_like(op), _nvshmem_like(op)
            la.patch_modify_cmd(a, aff, sport, init2rtr_affinity=i2r)
            shim.patch(b, aff, sport, i2r)
            assert bytes(a) == bytes(b), (op, aff, sport, i2r)
    for qpn, aff, sport in ((5, 2, None), (0xFFFFFF, None, 0xC00F), (9, 1, 0xD000)):
        assert shim.rts2rts(qpn, aff or 0, sport or 0) == la.rts2rts_cmd(qpn, aff, sport)


RUN = textwrap.dedent(r"""
    import ctypes, json, sys
    from jax_ep.network import lag_affinity as la
    tmp, load_shim_first = sys.argv[1], sys.argv[2] == "1"
    st, ndev, members = int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    if sys.argv[6] == "1":  # libmlx5 already in the global scope before the shim
        ctypes.CDLL("libmlx5.so.1", mode=ctypes.RTLD_GLOBAL)
    shim = la.Shim(tmp + "/libjax_ep_lag_shim.so") if load_shim_first else None
    if shim: shim.configure(members=members, group=2, sport_base=0xC000 if members else 0,
                            init2rtr_affinity=True)
    tr = ctypes.CDLL(tmp + "/libfake_transport.so")  # RTLD_LOCAL, like NVSHMEM's dlopen
    tr.fake_transport_run(4, st, ndev)
    m = ctypes.CDLL("libmlx5.so.1")
    log = []
    for i in range(m.fake_log_count()):
        b = (ctypes.c_uint8 * 300)(); n = m.fake_log_get(i, b, 300)
        log.append(la.fields_of(bytes(b[:n])))
    print(json.dumps({"log": log, "table": shim.table() if shim else None}))
""")


def _run(built, shim_first, st=0, ndev=1, members=2, mlx5_global_first=False):
    env = dict(os.environ, LD_LIBRARY_PATH=built, PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, "-c", RUN, built, "1" if shim_first else "0",
                          str(st), str(ndev), str(members),
                          "1" if mlx5_global_first else "0"], env=env, capture_output=True,
                         text=True, check=True)
    import json
    return json.loads(out.stdout)


@needs_cxx
def test_shim_interposes_transport(built):
    r = _run(built, True)
    log, table = r["log"], r["table"]
    # group=2: QPs 0,1 on member 1, QPs 2,3 on member 2; distinct source ports
    assert [t["affinity"] for t in table] == [1, 1, 2, 2]
    assert [t["udp_sport"] for t in table] == [0xC000, 0xC001, 0xC002, 0xC003]
    assert [t["qpn"] for t in table] == [0x100, 0x101, 0x102, 0x103]
    assert all(t["patched"] == 1 | 2 | 4 and t["rts2rts_status"] == 0 for t in table)
    # per QP: RST2INIT, INIT2RTR, RTR2RTS, then the shim's RTS2RTS
    assert [e["opcode"] for e in log] == [0x502, 0x503, 0x504, 0x505] * 4
    for k in range(4):
        rst, rtr, rts, again = log[4 * k:4 * k + 4]
        aff = table[k]["affinity"]
        assert rst["lag_tx_port_affinity"] == aff
        assert rtr["udp_sport"] == 0xC000 + k and rtr["lag_tx_port_affinity"] == aff
        assert rtr["opt_param_mask"] == 1 << 15
        assert rts["lag_tx_port_affinity"] == 0  # RTR2RTS itself untouched
        assert again["qpn"] == 0x100 + k and again["lag_tx_port_affinity"] == aff
        assert again["opt_param_mask"] == 1 << 15


@needs_cxx
def test_without_shim_nothing_changes(built):
    # the check above can fail: without the shim the transport's commands go out as is
    log = _run(built, False)["log"]
    assert [e["opcode"] for e in log] == [0x502, 0x503, 0x504] * 4
    assert all(e["lag_tx_port_affinity"] == 0 for e in log)
    assert all(e["udp_sport"] == 0xC000 for e in log if e["opcode"] == 0x503)


@needs_cxx
def test_shim_leaves_non_rc_qps_alone(built):
    r = _run(built, True, st=5)  # DCI-like service type: not recorded, not patched
    assert r["table"] == []
    assert [e["opcode"] for e in r["log"]] == [0x502, 0x503, 0x504] * 4
    assert all(e["lag_tx_port_affinity"] == 0 for e in r["log"])


def test_installed_shim_exports_the_versioned_names():
    p = la.shim_path()
    if p is None:
        pytest.skip("the shim is not built in this install (make build)")
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("no nm")
    syms = subprocess.run([nm, "-D", "--defined-only", p], capture_output=True, text=True,
                          check=True).stdout
    assert "mlx5dv_devx_obj_create@@MLX5_1.7" in syms
    assert "mlx5dv_devx_obj_modify@@MLX5_1.7" in syms
    exported = [l.split()[-1] for l in syms.splitlines() if " T " in l]
    assert all(s.startswith(("mlx5dv_devx_obj_", "jax_ep_lag_")) for s in exported), exported
    cmd = _nvshmem_like(la.OP_INIT2RTR)
    ref = bytearray(cmd)
    la.patch_modify_cmd(ref, 2, 0xC009)
    la.Shim(p).patch(cmd, 2, 0xC009, True)
    assert cmd == ref


@needs_cxx
def test_shim_records_devices_only(built):
    # members 0, no source port: nothing changes on the wire, the devices are recorded
    r = _run(built, True, ndev=2, members=0)
    assert [e["opcode"] for e in r["log"]] == [0x502, 0x503, 0x504] * 4
    assert all(e["lag_tx_port_affinity"] == 0 for e in r["log"])
    assert all(e["udp_sport"] == 0xC000 for e in r["log"] if e["opcode"] == 0x503)
    devs = [t["device"] for t in r["table"]]
    assert len(set(devs)) == 2 and devs[0] == devs[2] != devs[1] == devs[3]
    assert all(t["patched"] == 0 and t["rts2rts_status"] == -1 for t in r["table"])


@needs_cxx
def test_libmlx5_bound_first_is_visible_in_the_table(built):
    # libmlx5 global before the shim: the transport binds to it, the shim sees no QP
    # (the bootstrap then says the affinity did not reach the QPs)
    r = _run(built, True, mlx5_global_first=True)
    assert r["table"] == []
    assert all(e["lag_tx_port_affinity"] == 0 for e in r["log"])
