"""The recorded QP handle -> device table decides the stripe (several NICs per PE,
multi-plane): NVSHMEM may lay the handles out [NIC 0 QPs | NIC 1 QPs], and the bootstrap
reorders the kernels' handle array (runtime set_qp_order) so logical QP q is on port
q % num_ports whatever that layout. Host-level, on a synthetic table recorded by a
stand-in for the DevX shim; a stand-in runtime permutes from the creation order as the
extension's SetQpOrder does."""
from __future__ import annotations

import pytest

import jax_ep

from jax_ep.network import fabric as fb
from jax_ep.network import lag_affinity as la
from jax_ep.network.transport import TransportConfig

from test_fabric import GPU, StandInClient, StandInRuntime, tree

WORLD = 3  # each handle owns WORLD - 1 RC QPs in the shim's record
CFG = TransportConfig(num_ports=2, qps_per_port=2)
# two default QPs, then 4 handles laid out [mlx5_0 | mlx5_0 | mlx5_1 | mlx5_1]
DEVS = ["mlx5_0"] * 2 + ["mlx5_0"] * 4 + ["mlx5_1"] * 4
CREATED = [100, 101, 102, 103]


class Shim:
    def configure(self, **kw):
        pass

    def disable(self):
        pass

    def table(self):
        return [{"qpn": i, "affinity": 0, "udp_sport": 0, "patched": 0,
                 "rts2rts_status": -1, "device": d} for i, d in enumerate(DEVS)]


class Runtime:
    """Handles in creation order; set_qp_order permutes from it (as SetQpOrder does)."""

    def __init__(self, reorders=True):
        self.handles = list(CREATED)
        self.reorders = reorders
        self.orders = []

    def qp_handles(self):
        return list(self.handles)

    def set_qp_order(self, order):
        self.orders.append(list(order))
        if self.reorders:
            self.handles = [CREATED[i] for i in order]


def _device_of(handle):
    """The device the shim recorded for a handle's QPs (independent of the table code)."""
    per = WORLD - 1
    base = len(DEVS) - per * len(CREATED)
    i = CREATED.index(handle)
    devs = set(DEVS[base + i * per: base + (i + 1) * per])
    assert len(devs) == 1
    return devs.pop()


@pytest.fixture
def fabric(monkeypatch):
    monkeypatch.setattr(la, "load_shim", lambda path=None: Shim())
    monkeypatch.setattr(fb, "_said", set())
    s = fb.setup_for_bootstrap(CFG, {"JAX_EP_SYSFS": tree("ib_dualport")}, 0, 1, None,
                               key_prefix="k", timeout_ms=10, gpu=GPU)
    s.world = WORLD
    fb.after_nvshmem_start()
    yield s
    monkeypatch.setattr(fb, "_setup", None)


def _stripe(rt):
    return [_device_of(h) for h in rt.qp_handles()]


def test_the_recorded_order_is_applied(fabric):
    rt = Runtime()
    assert _stripe(rt) == ["mlx5_0", "mlx5_0", "mlx5_1", "mlx5_1"]  # NVSHMEM's layout
    order = fb.apply_handle_order(rt, fabric.config)
    assert order == [0, 2, 1, 3] and rt.orders == [order]
    # logical QP q is on port q % 2: the plan's stripe is the wire's
    assert _stripe(rt) == ["mlx5_0", "mlx5_1", "mlx5_0", "mlx5_1"]
    t = fb.recorded_qp_table(fabric.config, rt.qp_handles())
    assert [r["handle"] for r in t] == [100, 102, 101, 103]
    assert [r["device"] for r in t] == ["mlx5_0", "mlx5_1"] * 2
    assert all(r["on_plan"] for r in t)


def test_a_dropped_reorder_is_seen(fabric):
    rt = Runtime(reorders=False)
    fb.apply_handle_order(rt, fabric.config)
    assert _stripe(rt) != ["mlx5_0", "mlx5_1", "mlx5_0", "mlx5_1"]
    t = fb.recorded_qp_table(fabric.config, rt.qp_handles())
    assert not all(r["on_plan"] for r in t)


def test_round_robin_layout_needs_no_reorder(fabric, monkeypatch):
    monkeypatch.setattr(Shim, "table", lambda self: [
        {"qpn": i, "affinity": 0, "udp_sport": 0, "patched": 0, "rts2rts_status": -1,
         "device": d} for i, d in enumerate(
             ["mlx5_0"] * 2 + ["mlx5_0"] * 2 + ["mlx5_1"] * 2 + ["mlx5_0"] * 2
             + ["mlx5_1"] * 2)])
    fb.after_nvshmem_start()
    rt = Runtime()
    assert fb.apply_handle_order(rt, fabric.config) == [0, 1, 2, 3]
    assert rt.orders == []


def test_a_table_that_cannot_carry_the_plan_is_said(fabric, monkeypatch):
    monkeypatch.setattr(Shim, "table", lambda self: [
        {"qpn": i, "affinity": 0, "udp_sport": 0, "patched": 0, "rts2rts_status": -1,
         "device": "mlx5_0"} for i in range(10)])
    monkeypatch.setattr(fb, "_said", set())
    with pytest.warns(UserWarning):
        fb.after_nvshmem_start()
    rt = Runtime()
    with pytest.warns(UserWarning, match="cannot carry the plan"):
        assert fb.apply_handle_order(rt, fabric.config) is None
    assert rt.orders == [] and fabric.handle_order is None


def test_the_bootstrap_applies_the_order(monkeypatch):
    """nvshmem.initialize() calls apply_handle_order after NVSHMEM started: a stand-in
    runtime whose table is laid out [0, 0, 1, 1] ends with its handles reordered."""
    from jax_ep import nvshmem_bootstrap as nb

    class Rt(Runtime, StandInRuntime):
        pass

    Client = StandInClient
    laid = [{"wire_port": p, "handle": h} for p, h in zip((0, 0, 1, 1), CREATED)]
    monkeypatch.setattr(fb, "recorded_qp_table",
                        lambda cfg, handles: [dict(r) for r in laid])
    monkeypatch.setattr(nb, "_state", None)
    monkeypatch.setattr(nb, "_check_one_process_per_gpu", lambda: None)
    jax_ep.config.update("gpu_pci_bus_id", GPU)
    rt = Rt()
    env = {"JAX_EP_SYSFS": tree("ib_dualport"), "JAX_EP_GPU_PCI_BUS_ID": GPU}
    nb.initialize(heap_bytes=64 << 20, num_ranks=1, runtime=rt, client=Client(),
                  environ=env, config=CFG)
    assert rt.orders == [[0, 2, 1, 3]]
    assert rt.handles == [100, 102, 101, 103]
    monkeypatch.setattr(nb, "_state", None)
    monkeypatch.setattr(fb, "_setup", None)
