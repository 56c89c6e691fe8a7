"""NVSHMEM's bootstrap interface (jax_ep.network.bootstrap_iface): the interface that routes
to jax.distributed's coordinator, read from a fake /proc/net/route in the kernel's format
(hex fields little-endian), a value the user set kept, loopback, and no route said with
the fix; then through the bootstrap (the environment NVSHMEM reads, transport_report)."""

import pytest

from jax_ep.network import bootstrap_iface as bi
from jax_ep.network import fabric as fb
from jax_ep.network.transport import TransportConfig

ENV = "NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME"
HEADER = "Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT"

# Listed as the kernel lists them, the default route first and the /16 before the /24
# inside it, so neither the first match nor the first line gives the right answer:
#   default via 192.168.1.1 dev eth0 metric 100;  192.168.1.0/24 dev eth0
#   10.0.0.0/16 dev ib0;  10.0.5.0/24 dev bond0;  172.17.0.0/16 dev docker0
ROUTES = [
    "eth0\t00000000\t0101A8C0\t0003\t0\t0\t100\t00000000\t0\t0\t0",
    "eth0\t0001A8C0\t00000000\t0001\t0\t0\t100\t00FFFFFF\t0\t0\t0",
    "ib0\t0000000A\t00000000\t0001\t0\t0\t0\t0000FFFF\t0\t0\t0",
    "bond0\t0005000A\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0",
    "docker0\t000011AC\t00000000\t0001\t0\t0\t0\t0000FFFF\t0\t0\t0",
]


def table(tmp_path, lines=ROUTES, name="route"):
    p = tmp_path / name
    p.write_text("\n".join([HEADER] + [ln + "    " for ln in lines]) + "\n")
    return str(p)


def no_dns(host):
    raise AssertionError(f"resolved {host!r}: an IP address needs no lookup")


def unknown_host(host):
    raise OSError("Name or service not known")


def test_hex_fields_are_little_endian(tmp_path):
    routes = bi.read_routes(table(tmp_path))
    assert [(r.iface, str(r.network)) for r in routes] == [
        ("eth0", "0.0.0.0/0"), ("eth0", "192.168.1.0/24"), ("ib0", "10.0.0.0/16"),
        ("bond0", "10.0.5.0/24"), ("docker0", "172.17.0.0/16")]
    assert str(routes[0].gateway) == "192.168.1.1"


@pytest.mark.parametrize("coordinator,ifname,why", [
    ("10.0.5.7:1234", "bond0", "route to 10.0.5.0/24"),   # the /24 inside the /16
    ("10.0.9.1:1234", "ib0", "route to 10.0.0.0/16"),
    ("192.168.1.20:1234", "eth0", "route to 192.168.1.0/24"),
    ("172.17.0.2:1234", "docker0", "route to 172.17.0.0/16"),
    ("8.8.8.8:1234", "eth0", "default route via 192.168.1.1"),  # the default route last
    ("10.0.5.7", "bond0", "route to 10.0.5.0/24"),        # no port
])
def test_the_interface_routing_to_the_coordinator(tmp_path, coordinator, ifname, why):
    env = {}
    b = bi.choose(coordinator, env, route_table=table(tmp_path), resolve=no_dns)
    assert (b.ifname, b.source, b.warning) == (ifname, "route", None), b.reason
    assert why in b.reason and coordinator in b.reason
    assert b.env() == {ENV: ifname} and env == {}  # choose reads the environment only


def test_a_host_name_is_resolved_to_ipv4(tmp_path):
    asked = []

    def resolve(host):
        asked.append(host)
        return "10.0.5.9"

    b = bi.choose("node0.cluster:8476", {}, route_table=table(tmp_path), resolve=resolve)
    assert asked == ["node0.cluster"] and (b.ifname, b.address) == ("bond0", "10.0.5.9")


def test_longest_prefix_then_lower_metric_and_unusable_routes_skipped(tmp_path):
    lines = [
        "eth0\t00000000\t0101A8C0\t0003\t0\t0\t200\t00000000\t0\t0\t0",
        "eth1\t00000000\t0102A8C0\t0003\t0\t0\t50\t00000000\t0\t0\t0",   # lower metric
        "ib1\t0005000A\t00000000\t0000\t0\t0\t0\t00FFFFFF\t0\t0\t0",    # not up
        "*\t0005000A\t00000000\t0201\t0\t0\t0\t00FFFFFF\t0\t0\t0",      # reject
        "ib0\t0000000A\t00000000\t0001\t0\t0\t0\t0000FFFF\t0\t0\t0",
        "junk line",
    ]
    path = table(tmp_path, lines)
    assert bi.choose("10.0.5.7:1", {}, route_table=path, resolve=no_dns).ifname == "ib0"
    assert bi.choose("8.8.8.8:1", {}, route_table=path, resolve=no_dns).ifname == "eth1"


def test_a_value_the_user_set_is_kept(tmp_path, monkeypatch):
    env = {ENV: "ens9"}
    b = bi.choose("10.0.5.7:1234", env, route_table=table(tmp_path), resolve=no_dns)
    assert (b.ifname, b.source, b.warning) == ("ens9", "user", None)
    assert b.env() == {} and env == {ENV: "ens9"}
    # through the bootstrap: jax_ep sets nothing, so nothing overrides it
    monkeypatch.setattr(fb, "_said", set())
    s = fb.setup_for_bootstrap(TransportConfig(), env, 0, 2, None, key_prefix="k",
                               timeout_ms=10, coordinator="10.0.5.7:1234",
                               route_table=table(tmp_path))
    assert ENV not in s.env and s.bootstrap_iface.source == "user"


@pytest.mark.parametrize("coordinator,resolved", [
    ("127.0.0.1:1234", None), ("localhost:1234", "127.0.0.1"),
    ("myhost:1234", "127.0.1.1"), ("[::1]:1234", None)])
def test_loopback_is_lo(tmp_path, coordinator, resolved):
    # one host: no routing table needed (the local routes are not in it anyway)
    b = bi.choose(coordinator, {}, route_table=str(tmp_path / "absent"),
                  resolve=(lambda h: resolved) if resolved else no_dns)
    assert (b.ifname, b.source, b.warning) == ("lo", "loopback", None), b.reason
    assert b.env() == {ENV: "lo"}


def test_no_route_is_said_and_leaves_it_unset(tmp_path):
    lan_only = table(tmp_path, ROUTES[1:])  # no default route
    b = bi.choose("8.8.8.8:1234", {}, route_table=lan_only, resolve=no_dns)
    assert (b.ifname, b.source, b.env()) == (None, "none", {})
    assert "no route" in b.warning and "8.8.8.8" in b.warning
    assert f"Fix: set {ENV}=" in b.warning


@pytest.mark.parametrize("coordinator,resolve,route,said", [
    ("nohost:1", unknown_host, "route", "resolves to no IPv4 address"),
    ("10.0.5.7:1", no_dns, "absent", "cannot be read"),
    ("[fe80::1]:1", no_dns, "route", "IPv6"),
    (None, no_dns, "route", "no jax.distributed coordinator"),
])
def test_what_cannot_be_decided_is_a_warning_not_a_crash(tmp_path, coordinator, resolve,
                                                         route, said):
    table(tmp_path)
    b = bi.choose(coordinator, {}, route_table=str(tmp_path / route), resolve=resolve)
    assert (b.ifname, b.env()) == (None, {}) and said in b.warning, b.warning


def test_bootstrap_says_no_route_once_with_several_processes(tmp_path, monkeypatch):
    monkeypatch.setattr(fb, "_said", set())
    env = {"JAX_EP_ROUTE_TABLE": table(tmp_path, ROUTES[1:])}
    with pytest.warns(UserWarning, match=f"no route .*Fix: set {ENV}="):
        s = fb.setup_for_bootstrap(TransportConfig(), env, 0, 2, None, key_prefix="k",
                                   timeout_ms=10, coordinator="8.8.8.8:1234")
    assert ENV not in s.env and any("no route" in m for m in s.messages)
    # one process reaches itself on any interface: nothing to say
    monkeypatch.setattr(fb, "_said", set())
    s = fb.setup_for_bootstrap(TransportConfig(), env, 0, 1, None, key_prefix="k",
                               timeout_ms=10, coordinator="8.8.8.8:1234")
    assert s.messages == [] and s.bootstrap_iface.source == "none"


def test_the_coordinator_comes_from_jax_distributed(monkeypatch):
    from jax._src import distributed

    monkeypatch.setattr(distributed.global_state, "coordinator_address", "10.0.5.7:8476")
    assert bi.jax_coordinator() == "10.0.5.7:8476"
    monkeypatch.setattr(distributed.global_state, "coordinator_address", None)
    assert bi.jax_coordinator() is None


def test_initialize_sets_it_and_transport_report_says_why(tmp_path, monkeypatch):
    from jax_ep._src.backends import internode
    from jax_ep import nvshmem_bootstrap as nb

    from test_fabric import StandInClient as Client, StandInRuntime

    class Rt(StandInRuntime):
        seen = None

        def unique_id(self):
            Rt.seen = env.get(ENV)  # what NVSHMEM reads when it makes the unique id
            return super().unique_id()

    monkeypatch.setattr(nb, "_state", None)
    monkeypatch.setattr(nb, "_check_one_process_per_gpu", lambda: None)
    monkeypatch.setattr(bi, "jax_coordinator", lambda: "10.0.5.7:8476")
    env = {"JAX_EP_ROUTE_TABLE": table(tmp_path), "JAX_EP_FABRIC": "off"}
    st = nb.initialize(heap_bytes=64 << 20, num_ranks=1, runtime=Rt(), client=Client(),
                       environ=env)
    assert Rt.seen == env[ENV] == st.env[ENV] == "bond0"
    rep = internode.transport_report()["bootstrap_interface"]
    assert (rep["ifname"], rep["source"], rep["address"]) == ("bond0", "route", "10.0.5.7")
    assert "10.0.5.0/24" in rep["reason"]
    nb.finalize()


def test_the_start_up_agreement_ignores_the_per_node_interface():
    from jax_ep import nvshmem_bootstrap as nb

    cfg = TransportConfig(num_ports=2, qps_per_port=2).resolve({})

    def params(ifname):
        return nb.startup_params(cfg=cfg, qp_api=True, heap_bytes=1, sym_bytes=1, ll=None,
                                 env=dict(cfg.nvshmem_env(), **{ENV: ifname}),
                                 versions=(30800, 30800), adopt=False)

    assert params("bond0") == params("eth0")  # one node's bond0 is another's eth0
