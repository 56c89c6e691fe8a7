"""Per-QP LAG TX port affinity and RoCE UDP source port: the mlx5 PRM command fields.

On an mlx5 RoCE LAG (one RDMA device `mlx5_bond_0` over two member ports), a QP created
by a GPU-initiated transport bypasses the Linux bond's transmit hash; the member it sends
on is its QP context's `lag_tx_port_affinity` (1-based member; 0 = the firmware's
choice). NVSHMEM's IBGDA (3.8) creates its RC QPs as DevX objects and moves them
RST->INIT->RTR->RTS with `mlx5dv_devx_obj_modify` PRM commands; it sets no affinity and
the same UDP source port (0xC000) on every RC QP, so switches cannot spread them either.

jax-ep changes those commands on their way to the device (`xla_ffi/internode/
lag_shim.cc`, loaded before NVSHMEM so its `mlx5dv_devx_obj_modify` is the one NVSHMEM's
transport binds to, and armed only while NVSHMEM starts), and then issues one RTS->RTS
modify per QP with the affinity again (some firmware only honours it there). A command
the device refuses with the shim's change is sent again as NVSHMEM wrote it, and the
refusal is recorded (`patched` bits below). This module is the Python statement of
exactly which bits those commands set, used by the tests (synthetic PRM buffers,
compared with the shim's C code) and by the bootstrap's decision logic.

Layout (mlx5 PRM, big-endian bit numbering: bit 0 is the MSB of byte 0):

- every QP modify command (`rst2init_qp_in`, `init2rtr_qp_in`, `rtr2rts_qp_in`,
  `rts2rts_qp_in`): opcode bits [0, 16), qpn bits [0x48, 0x60), opt_param_mask bits
  [0x80, 0xa0), the QP context `qpc` from bit 0xc0 (byte 24), 0x740 bits long;
- in `qpc`: `lag_tx_port_affinity` bits [0x4, 0x8) (low nibble of its first byte);
  `primary_address_path` from bit 0xc0 of qpc, in which `udp_sport` is bits
  [0x110, 0x120);
- `rts2rts_qp_in` also has `opt_param_mask_95_32` (64 bits) at bit 0x840 (byte 264).

The affinity goes only where every device takes it: RST->INIT's qpc (the whole context
is given there, no mask bit) and RTS->RTS with opt_param_mask bit LAG_TX_AFF = 1 << 15.
INIT->RTR takes that bit only on devices reporting the HCA capability
`init2_lag_tx_port_affinity` (the Linux driver, drivers/infiniband/hw/mlx5/qp.c, checks
it), which the shim cannot see, so INIT->RTR's affinity and bit 15 are never touched.
The UDP source port in RTS->RTS is bit 2 of `opt_param_mask_95_32`. In INIT->RTR the
address path is mandatory, so its `udp_sport` needs no mask bit.
"""
from __future__ import annotations

import contextlib
import dataclasses

__all__ = ["OP_RST2INIT", "OP_INIT2RTR", "OP_RTR2RTS", "OP_RTS2RTS", "CMD_BYTES",
           "QPC_BIT", "set_bits", "get_bits", "rts2rts_cmd", "patch_modify_cmd",
           "affinity_for", "udp_sport_for", "fields_of", "LagAssignment", "assign"]

OP_CREATE_QP = 0x500
OP_RST2INIT = 0x502
OP_INIT2RTR = 0x503
OP_RTR2RTS = 0x504
OP_RTS2RTS = 0x505

# bit offsets in a QP modify command
OPCODE_BIT, OPCODE_W = 0x00, 16
QPN_BIT, QPN_W = 0x48, 24
OPT_MASK_BIT, OPT_MASK_W = 0x80, 32
QPC_BIT = 0xC0
QPC_BITS = 0x740
OPT_MASK_95_32_BIT, OPT_MASK_95_32_W = 0x840, 64
CMD_BYTES = (0x880) // 8  # rts2rts_qp_in up to and including opt_param_mask_95_32

# bit offsets inside qpc
LAG_AFF_BIT, LAG_AFF_W = 0x4, 4
ADS_BIT = 0xC0  # primary_address_path
UDP_SPORT_BIT, UDP_SPORT_W = ADS_BIT + 0x110, 16

OPTPAR_LAG_TX_AFF = 1 << 15
OPT32_UDP_SPORT = 1 << 2

# the shim's per-QP `patched` bits
PATCHED_RST2INIT_AFFINITY = 1   # affinity in RST->INIT's qpc, accepted
PATCHED_INIT2RTR_SPORT = 2      # UDP source port in INIT->RTR, accepted
PATCHED_RTS2RTS_AFFINITY = 4    # the shim's RTS->RTS with the affinity, accepted
REFUSED_RST2INIT_AFFINITY = 8   # RST->INIT refused with the affinity; sent without it
REFUSED_INIT2RTR_SPORT = 16     # INIT->RTR refused with the source port; sent without it

ROCE_SPORT_MIN = 0xC000  # RoCEv2 source ports live in the dynamic range 49152-65535


def set_bits(buf: bytearray, bit: int, width: int, value: int) -> None:
    """Writes `value` into `width` bits of `buf` starting at big-endian bit `bit`."""
    if value < 0 or value >= (1 << width):
        raise ValueError(f"value {value} does not fit in {width} bits")
    end = bit + width
    if end > len(buf) * 8:
        raise ValueError(f"field [{bit}, {end}) is past the buffer ({len(buf)} bytes)")
    first, last = bit // 8, (end - 1) // 8
    n = last - first + 1
    word = int.from_bytes(buf[first:last + 1], "big")
    shift = n * 8 - (end - first * 8)
    mask = ((1 << width) - 1) << shift
    word = (word & ~mask) | (value << shift)
    buf[first:last + 1] = word.to_bytes(n, "big")


def get_bits(buf, bit: int, width: int) -> int:
    end = bit + width
    first, last = bit // 8, (end - 1) // 8
    n = last - first + 1
    word = int.from_bytes(bytes(buf[first:last + 1]), "big")
    return (word >> (n * 8 - (end - first * 8))) & ((1 << width) - 1)


def fields_of(cmd) -> dict:
    """The fields this module reads or writes, decoded from a command buffer."""
    out = {"opcode": get_bits(cmd, OPCODE_BIT, OPCODE_W), "qpn": get_bits(cmd, QPN_BIT, QPN_W),
           "opt_param_mask": get_bits(cmd, OPT_MASK_BIT, OPT_MASK_W),
           "lag_tx_port_affinity": get_bits(cmd, QPC_BIT + LAG_AFF_BIT, LAG_AFF_W),
           "udp_sport": get_bits(cmd, QPC_BIT + UDP_SPORT_BIT, UDP_SPORT_W)}
    if len(cmd) * 8 >= OPT_MASK_95_32_BIT + OPT_MASK_95_32_W:
        out["opt_param_mask_95_32"] = get_bits(cmd, OPT_MASK_95_32_BIT, OPT_MASK_95_32_W)
    return out


def _check_affinity(affinity: int) -> int:
    if not 0 <= int(affinity) <= 15:
        raise ValueError(f"affinity must be a 1-based LAG member in [1, 15] (0: firmware "
                         f"default), got {affinity}")
    return int(affinity)


def _check_sport(sport: int | None) -> int | None:
    if sport is not None and not ROCE_SPORT_MIN <= int(sport) <= 0xFFFF:
        raise ValueError(f"udp_sport must be in [0xC000, 0xFFFF], got {sport}")
    return None if sport is None else int(sport)


def rts2rts_cmd(qpn: int, affinity: int | None = None, udp_sport: int | None = None) -> bytes:
    """An RTS->RTS modify (`rts2rts_qp_in`, CMD_BYTES long) that sets the QP's LAG TX
    port affinity and/or its RoCE UDP source port, nothing else."""
    if not 0 <= int(qpn) < (1 << 24):
        raise ValueError(f"qpn must fit in 24 bits, got {qpn}")
    if affinity is None and udp_sport is None:
        raise ValueError("give affinity, udp_sport or both")
    buf = bytearray(CMD_BYTES)
    set_bits(buf, OPCODE_BIT, OPCODE_W, OP_RTS2RTS)
    set_bits(buf, QPN_BIT, QPN_W, int(qpn))
    mask = 0
    if affinity is not None:
        set_bits(buf, QPC_BIT + LAG_AFF_BIT, LAG_AFF_W, _check_affinity(affinity))
        mask |= OPTPAR_LAG_TX_AFF
    set_bits(buf, OPT_MASK_BIT, OPT_MASK_W, mask)
    if udp_sport is not None:
        set_bits(buf, QPC_BIT + UDP_SPORT_BIT, UDP_SPORT_W, _check_sport(udp_sport))
        set_bits(buf, OPT_MASK_95_32_BIT, OPT_MASK_95_32_W, OPT32_UDP_SPORT)
    return bytes(buf)


def patch_modify_cmd(cmd: bytearray, affinity: int | None,
                     udp_sport: int | None) -> list[str]:
    """Changes a QP modify command the transport is about to issue, in place, as the
    shim does: RST->INIT gets the affinity in its qpc (no mask bit needed at that
    transition); INIT->RTR gets the UDP source port in its primary address path and
    nothing else (its affinity and opt_param_mask stay as sent). Other commands are left
    alone. Returns the fields changed."""
    if len(cmd) * 8 < QPC_BIT + QPC_BITS:
        return []
    op = get_bits(cmd, OPCODE_BIT, OPCODE_W)
    changed = []
    if op == OP_RST2INIT and affinity:
        set_bits(cmd, QPC_BIT + LAG_AFF_BIT, LAG_AFF_W, _check_affinity(affinity))
        changed.append("lag_tx_port_affinity")
    elif op == OP_INIT2RTR and udp_sport is not None:
        set_bits(cmd, QPC_BIT + UDP_SPORT_BIT, UDP_SPORT_W, _check_sport(udp_sport))
        changed.append("udp_sport")
    return changed


# --- which QP goes where ----------------------------------------------------------------

def affinity_for(index: int, members: int, policy: str = "alternate") -> int:
    """1-based LAG member for the `index`-th RC QP of a device (0: firmware's choice)."""
    if policy == "none":
        return 0
    if policy != "alternate":
        raise ValueError(f"policy must be 'none' or 'alternate', got {policy!r}")
    if members < 1:
        raise ValueError(f"members must be >= 1, got {members}")
    return _ext().lag_affinity(int(index), 1, int(members))


def udp_sport_for(index: int, base: int = ROCE_SPORT_MIN) -> int:
    """A distinct RoCEv2 UDP source port for the `index`-th RC QP (wraps in 0xC000..)."""
    return _ext().lag_source_port(int(index), int(base))


def _ext():
    # the shim's rule itself (xla_ffi/internode/lag_rule.h), through the bindings
    from jax_ep import _jax_ep_ext  # type: ignore[attr-defined]
    return _jax_ep_ext


@dataclasses.dataclass(frozen=True)
class LagAssignment:
    """Where the shim puts a device's RC QPs: QP created `index`-th gets member
    `affinity` (1-based) and UDP source port `udp_sport`."""

    index: int
    affinity: int
    udp_sport: int


def assign(num_qps: int, members: int, policy: str = "alternate",
           base: int = ROCE_SPORT_MIN) -> list[LagAssignment]:
    """The shim's assignment for `num_qps` RC QPs in creation order."""
    return [LagAssignment(i, affinity_for(i, members, policy), udp_sport_for(i, base))
            for i in range(num_qps)]


# --- the shim (xla_ffi/internode/lag_shim.cc, built as libjax_ep_lag_shim.so) -------------

SHIM_NAME = "libjax_ep_lag_shim.so"


def shim_path() -> str | None:
    """Where the built shim is (next to the extension), or None."""
    import os

    from jax_ep import config
    override = config.current().lag_shim  # JAX_EP_LAG_SHIM
    if override:
        return override if os.path.isfile(override) else None
    try:
        from jax_ep import _jax_ep_ext  # type: ignore[attr-defined]
        here = os.path.dirname(_jax_ep_ext.__file__)
    except ImportError:
        here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for d in (here, os.path.dirname(os.path.dirname(os.path.abspath(__file__)))):
        p = os.path.join(d, SHIM_NAME)
        if os.path.isfile(p):
            return p
    return None


class Shim:
    """The loaded shim (ctypes). Load it before NVSHMEM starts: its mlx5dv_devx_obj_*
    must be in the global symbol scope when NVSHMEM dlopens its IBGDA transport.

    It changes QPs only while armed, so arm it just around NVSHMEM's initialisation:

        shim.configure(members=2, group=world - 1, devices=["mlx5_bond_0"], arm=False)
        with shim.armed():
            nvshmem_init()
        shim.table()
    """

    def __init__(self, path: str):
        import ctypes

        self.path = path
        self.lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        c = ctypes
        self.lib.jax_ep_lag_patch.argtypes = [c.c_void_p, c.c_size_t, c.c_int, c.c_int]
        self.lib.jax_ep_lag_rts2rts.argtypes = [c.c_void_p, c.c_size_t, c.c_uint32, c.c_int,
                                                c.c_int]
        self.lib.jax_ep_lag_rts2rts.restype = c.c_size_t
        self.lib.jax_ep_lag_configure.argtypes = [c.c_int] * 3
        self.lib.jax_ep_lag_devices.argtypes = [c.c_char_p]
        for name in ("jax_ep_lag_arm", "jax_ep_lag_disarm"):
            getattr(self.lib, name).argtypes = []
        self.lib.jax_ep_lag_armed.argtypes = []
        self.lib.jax_ep_lag_table.argtypes = [c.c_void_p] * 5 + [c.c_int]
        self.lib.jax_ep_lag_device.argtypes = [c.c_int, c.c_char_p, c.c_int]

    def patch(self, cmd: bytearray, affinity: int, sport: int) -> int:
        import ctypes

        buf = (ctypes.c_uint8 * len(cmd)).from_buffer(cmd)
        return int(self.lib.jax_ep_lag_patch(ctypes.addressof(buf), len(cmd), int(affinity),
                                             int(sport)))

    def rts2rts(self, qpn: int, affinity: int, sport: int) -> bytes:
        import ctypes

        out = (ctypes.c_uint8 * CMD_BYTES)()
        n = self.lib.jax_ep_lag_rts2rts(ctypes.addressof(out), CMD_BYTES, qpn, affinity, sport)
        return bytes(out[:n])

    def configure(self, members: int, group: int = 1, sport_base: int = ROCE_SPORT_MIN,
                  devices=None, arm: bool = True, init2rtr_affinity=None) -> None:
        """Sets what the shim does to the RC QPs created while it is armed and forgets
        earlier records: `members` LAG members alternated per `group` QPs (0: no
        affinity), UDP source ports from `sport_base` (0: unchanged), only on the RDMA
        devices named in `devices` (None: every device). `arm` opens the window now,
        for callers that configure right before NVSHMEM starts and `disable()` after.

        `init2rtr_affinity` is accepted and ignored: the shim never sets the affinity at
        INIT->RTR, whatever a caller asks (see the module's docstring)."""
        del init2rtr_affinity
        names = [] if devices is None else [str(d) for d in devices]
        if any("," in d or not d for d in names):
            raise ValueError(f"devices must be non-empty names without ',', got {names}")
        if self.lib.jax_ep_lag_devices(",".join(names).encode()) != 0:
            raise ValueError(f"the shim refused devices={names} (at most 16 names of "
                             f"fewer than 64 characters)")
        rc = self.lib.jax_ep_lag_configure(int(members), int(group), int(sport_base))
        if rc != 0:
            raise ValueError(f"the shim refused members={members} group={group} "
                             f"sport_base={sport_base:#x}")
        if arm:
            self.arm()

    def arm(self) -> None:
        """From now on, RC QPs created (on the configured devices) are taken."""
        self.lib.jax_ep_lag_arm()

    def disarm(self) -> None:
        """From now on the shim takes no new QP and changes no command; the table stays."""
        self.lib.jax_ep_lag_disarm()

    def disable(self) -> None:
        self.disarm()

    def is_armed(self) -> bool:
        return bool(self.lib.jax_ep_lag_armed())

    @contextlib.contextmanager
    def armed(self):
        """Armed inside the `with` block (NVSHMEM's initialisation), disarmed after it
        however it ends."""
        self.arm()
        try:
            yield self
        finally:
            self.disarm()

    def table(self, max_qps: int = 1 << 16) -> list[dict]:
        """Per RC QP taken since configure, in creation order: qpn, affinity, udp_sport,
        patched (the PATCHED_* / REFUSED_* bits), the status of the RTS2RTS re-apply
        (-1 not issued, 0 ok, else the device's refusal) and the RDMA device the QP was
        created on ("ctx:<address>" where libibverbs' name is not available)."""
        import ctypes

        n = self.lib.jax_ep_lag_table(None, None, None, None, None, 0)
        n = min(int(n), max_qps)
        arrs = [(ctypes.c_uint32 * n)()] + [(ctypes.c_int32 * n)() for _ in range(4)]
        self.lib.jax_ep_lag_table(*[ctypes.addressof(a) for a in arrs], n)
        keys = ("qpn", "affinity", "udp_sport", "patched", "rts2rts_status")
        out = [{k: int(a[i]) for k, a in zip(keys, arrs)} for i in range(n)]
        buf = ctypes.create_string_buffer(64)
        for i, row in enumerate(out):
            k = self.lib.jax_ep_lag_device(i, buf, 64)
            row["device"] = buf.value.decode(errors="replace") if k >= 0 else None
        return out


_shim: Shim | None = None


def load_shim(path: str | None = None) -> Shim | None:
    """Loads the shim once (RTLD_GLOBAL); None when it is not built."""
    global _shim
    if _shim is None:
        p = path or shim_path()
        if p is None:
            return None
        _shim = Shim(p)
    return _shim
