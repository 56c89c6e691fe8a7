"""NVSHMEM's bootstrap interface: which network interface its start-up sockets use
(`NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME`).

NVSHMEM's unique-id bootstrap has process 0 listen on one interface and put that
interface's address into the unique id; every other process connects to it. Left to
itself NVSHMEM takes the first interface it likes, which on a host with several NICs, or
in a container, can be one the other nodes cannot reach: start-up then waits until
jax-ep's start-up watchdog (`initialize`'s timeout_s) ends it.

jax-ep knows an address every process reaches: `jax.distributed`'s coordinator. So,
unless the user set the variable, the bootstrap sets it to the interface this host sends
to the coordinator through:

- the coordinator's host (`host:port`, `[v6]:port`) is resolved to an IPv4 address;
- a loopback address (127.0.0.0/8; every process on this host) gives `lo`;
- otherwise the route is looked up in Linux's main routing table (`/proc/net/route`):
  the longest prefix that holds the address wins, the default route (prefix 0) last,
  ties by the lower metric, then by the table's order;
- no route, no IPv4 address or no readable table gives a warning and leaves the
  variable unset (NVSHMEM's own choice).

`/proc/net/route`: one route per line after a header, whitespace separated; Iface,
Destination, Gateway, Flags, RefCnt, Use, Metric, Mask, ... Destination, Gateway and
Mask are 8 hex digits of the 32-bit value in the host's byte order (little-endian on
x86 and Arm: 192.168.0.0 is `0000A8C0`); Flags is hex (1 = up, 0x200 = reject).
"""
from __future__ import annotations

import dataclasses
import ipaddress
import socket
import struct

__all__ = ["ENV", "ROUTE_TABLE", "Route", "BootstrapInterface", "parse_routes",
           "read_routes", "route_to", "coordinator_host", "resolve_ipv4", "jax_coordinator",
           "choose"]

ENV = "NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME"
ROUTE_TABLE = "/proc/net/route"
_RTF_UP = 0x0001
_RTF_REJECT = 0x0200
_LOOPBACK = ipaddress.IPv4Network("127.0.0.0/8")


@dataclasses.dataclass(frozen=True)
class Route:
    iface: str
    network: ipaddress.IPv4Network
    gateway: ipaddress.IPv4Address
    flags: int
    metric: int


def _le_address(field: str) -> ipaddress.IPv4Address:
    """'0000A8C0' (the kernel's host-order hex, little-endian) -> 192.168.0.0."""
    return ipaddress.IPv4Address(struct.pack("<I", int(field, 16)))


def parse_routes(text: str) -> list[Route]:
    """The usable routes of a `/proc/net/route` text, in the table's order: lines that
    are not routes (the header, junk, a mask that is not a prefix) and routes that are
    down, rejecting or on no interface are left out."""
    out = []
    for line in text.splitlines():
        f = line.split()
        if len(f) < 8 or f[0] == "Iface":
            continue
        try:
            dest, gw, mask = _le_address(f[1]), _le_address(f[2]), _le_address(f[7])
            flags, metric = int(f[3], 16), int(f[6])
            net = ipaddress.IPv4Network(f"{dest}/{mask}", strict=False)
        except ValueError:
            continue
        if f[0] == "*" or not flags & _RTF_UP or flags & _RTF_REJECT:
            continue
        out.append(Route(f[0], net, gw, flags, metric))
    return out


def read_routes(path: str = ROUTE_TABLE) -> list[Route]:
    """`parse_routes` of the file at `path` (OSError when it cannot be read)."""
    with open(path) as fh:
        return parse_routes(fh.read())


def route_to(address: str, routes: list[Route]) -> Route | None:
    """The route the kernel takes to `address` (IPv4): longest prefix, then the lower
    metric, then the earlier line; None when no route holds it."""
    ip = ipaddress.IPv4Address(address)
    best = None
    for r in routes:
        if ip not in r.network:
            continue
        if best is None or (r.network.prefixlen, -r.metric) > (best.network.prefixlen,
                                                                -best.metric):
            best = r
    return best


def coordinator_host(address: str) -> str:
    """The host of a coordinator address: 'node0:1234' -> 'node0', '[fe80::1]:1234' ->
    'fe80::1'; an address without a port (or a bare IPv6 address) is the host."""
    a = address.strip()
    if a.startswith("["):
        return a[1:a.find("]")] if "]" in a else a[1:]
    if a.count(":") == 1:
        return a.split(":", 1)[0]
    return a


def resolve_ipv4(host: str) -> str:
    """The first IPv4 address of `host` (OSError when it has none)."""
    infos = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)
    if not infos:
        raise OSError(f"no IPv4 address for {host!r}")
    return infos[0][4][0]


def jax_coordinator() -> str | None:
    """The coordinator address `jax.distributed.initialize` was given (None before)."""
    try:
        from jax._src import distributed
    except Exception:  # noqa: BLE001 - no jax, or one without this module
        return None
    return getattr(distributed.global_state, "coordinator_address", None) or None


@dataclasses.dataclass(frozen=True)
class BootstrapInterface:
    """What `choose` decided about NVSHMEM's bootstrap interface."""

    ifname: str | None        # the variable's value (the user's, or jax-ep's); None: unset
    source: str               # "user" | "loopback" | "route" | "none" (left unset)
    reason: str               # why, in words
    coordinator: str | None = None  # jax.distributed's coordinator address
    address: str | None = None      # its IPv4 address
    warning: str | None = None      # when left unset: what to say, with the fix

    def env(self) -> dict:
        """What jax-ep sets: the variable where jax-ep chose it, nothing otherwise."""
        return {ENV: self.ifname} if self.source in ("loopback", "route") else {}

    def to_json(self) -> dict:
        return {"variable": ENV, "ifname": self.ifname, "source": self.source,
                "reason": self.reason, "coordinator": self.coordinator,
                "address": self.address}


def _unset(why: str, coordinator=None, address=None) -> BootstrapInterface:
    warn = (f"jax_ep: {why}, so {ENV} is left unset and NVSHMEM picks the interface its "
            f"start-up listens on itself; on a host with several NICs (or in a container) "
            f"process 0 may then give an address the other nodes cannot reach, and "
            f"'NVSHMEM start' waits for its watchdog. Fix: set {ENV}=<the interface this "
            f"node reaches the other nodes through> on every process")
    return BootstrapInterface(None, "none", why, coordinator, address, warn)


def choose(coordinator: str | None, environ, *, route_table: str | None = None,
           resolve=resolve_ipv4) -> BootstrapInterface:
    """NVSHMEM's bootstrap interface for this process (see the module docstring).

    coordinator: `jax.distributed`'s coordinator address ('host:port'); environ: the
    environment NVSHMEM will read (a value there is kept); route_table: the routing
    table's path (default /proc/net/route); resolve: host -> IPv4 address (raises
    OSError). Never raises: what could not be decided is said in `warning`.
    """
    user = environ.get(ENV)
    if user is not None:  # even empty: a value in the environment is the user's
        return BootstrapInterface(user, "user", f"{ENV}={user} is set in the environment",
                                  coordinator)
    if not coordinator:
        return _unset("no jax.distributed coordinator address is known")
    host = coordinator_host(str(coordinator))
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        ip = None
    if ip is not None and ip.version == 6:
        if ip.is_loopback:
            return BootstrapInterface("lo", "loopback", f"the coordinator {coordinator} is "
                                      f"on this host's loopback (one host)", coordinator, host)
        return _unset(f"the coordinator {coordinator} is an IPv6 address (jax_ep looks "
                      f"up IPv4 routes only)", coordinator)
    try:
        addr = str(ip) if ip is not None else resolve(host)
        ip = ipaddress.IPv4Address(addr)
    except (OSError, ValueError, UnicodeError) as e:
        return _unset(f"the coordinator host {host!r} ({coordinator}) resolves to no IPv4 "
                      f"address ({e})", coordinator)
    if ip in _LOOPBACK:
        return BootstrapInterface("lo", "loopback", f"the coordinator {coordinator} "
                                  f"({ip}) is on this host's loopback (one host)",
                                  coordinator, str(ip))
    path = route_table or ROUTE_TABLE
    try:
        routes = read_routes(path)
    except (OSError, UnicodeDecodeError) as e:
        return _unset(f"the routing table {path} cannot be read ({e})", coordinator, str(ip))
    r = route_to(str(ip), routes)
    if r is None:
        return _unset(f"no route in {path} leads to the coordinator {coordinator} ({ip})",
                      coordinator, str(ip))
    kind = "the default route" if r.network.prefixlen == 0 else f"the route to {r.network}"
    via = f" via {r.gateway}" if int(r.gateway) else ""
    return BootstrapInterface(r.iface, "route", f"{kind}{via} on {r.iface} leads to the "
                              f"coordinator {coordinator} ({ip}) (from {path})",
                              coordinator, str(ip))
