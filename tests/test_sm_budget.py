"""The SM budget per mode (kernels/common/configs.h kEpModes, kInternodeSmPresets): the
settings intranode_sms, hierarchical_sms, direct_sms and low_latency_sms (JAX_EP_*_SMS)
are read by jax_ep.config, reach C++ through set_settings, and decide the grids the
launchers compute (mode_sms: the same functions the launchers call); the defaults hold
DeepEP V2's budgets at EP 8x2 (at most 12 SMs for an internode mode, 24 for intranode);
bad values raise, naming the setting and its variable. The emulated runs with other
budgets are in tests/emu/test_internode_emu.py and test_internode_hier_emu.py."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from jax_ep import config
from jax_ep._src.ext import require_ext

MODES = ("intranode", "hierarchical", "direct", "low_latency")


def test_modes_and_presets_come_from_the_header():
    ext = require_ext()
    d = ext.settings_defaults()
    modes = [m["mode"] for m in d["sm_modes"]]
    assert tuple(modes) == MODES
    for m in d["sm_modes"]:
        assert config.ENV[m["setting"]] == m["env"], m  # one name on both sides
        assert m["setting"] in config.KERNEL_SETTINGS
    rows = d["internode_sm_presets"]
    assert [r["max_ranks"] for r in rows] == sorted(r["max_ranks"] for r in rows)
    # every rank count picks the first row that holds it, as the launchers do
    for R in (2, 16, 17, 64, 65, 1000):
        row = next(r for r in rows if R <= r["max_ranks"])
        got = ext.mode_sms(R, device_sms=132)
        for m in ("hierarchical", "direct", "low_latency"):
            assert got[m] == min(row[m], 132 - d["reserved_sms"]), (R, m, got)


def test_defaults_at_ep8x2():
    """16 ranks (8 GPUs x 2 nodes) on a 132-SM GPU: the normal internode modes at most 12
    SMs, intranode (its 8 GPUs of a node) at most 24; the low-latency mode the whole EP
    budget (its decode steps are latency-bound, as DeepEP's low-latency kernels)."""
    ext = require_ext()
    assert all(config.current().kernel_settings()[f"{m}_sms"] is None for m in MODES)
    got = ext.mode_sms(16, device_sms=132, num_qps=8)
    assert max(got["hierarchical"], got["direct"]) <= 12, got
    d = ext.settings_defaults()
    assert got["low_latency"] == 132 - d["reserved_sms"], got
    assert ext.mode_sms(8, device_sms=132)["intranode"] <= 24
    assert got["intranode"] <= 24
    # the direct send: RDMA CTAs and NVLink CTAs within the budget, more NVLink CTAs than
    # the 4 of before, every QP owned by an RDMA CTA
    assert got["direct_rdma_ctas"] + got["direct_nvlink_ctas"] == got["direct"]
    assert got["direct_nvlink_ctas"] > 4 and 1 <= got["direct_rdma_ctas"] <= 8


@pytest.mark.parametrize("mode", MODES)
def test_setting_reaches_cpp_and_the_grids(mode):
    ext = require_ext()
    name = f"{mode}_sms"
    before = ext.mode_sms(16, device_sms=132)[mode]
    want = 2 if before != 2 else 4
    with config.override(**{name: want}):
        assert ext.settings()[name] == want
        assert ext.mode_sms(16, device_sms=132)[mode] == want
        # the whole budget (num_sms, JAX_EP_NUM_SMS) still caps a mode's (intranode keeps
        # one channel of two blocks at least, configs.h FitPresetToSms)
        with config.override(num_sms=1):
            assert ext.mode_sms(16, device_sms=132)[mode] == (2 if mode == "intranode" else 1)
    assert ext.settings()[name] is None
    assert ext.mode_sms(16, device_sms=132)[mode] == before


def test_intranode_setting_only_lowers_the_preset():
    """The intranode group's buffers are sized for its preset's channels: the setting cuts
    a launch's blocks (to whole channels of two) but never raises them."""
    ext = require_ext()
    preset = ext.mode_sms(8, device_sms=132)["intranode"]
    with config.override(intranode_sms=10):
        assert ext.mode_sms(8, device_sms=132)["intranode"] == 10
    with config.override(intranode_sms=preset + 40):
        assert ext.mode_sms(8, device_sms=132)["intranode"] == preset


@pytest.mark.parametrize("sms,rdma,nvl", [(12, 4, 8), (2, 1, 1), (1, 1, 0), (30, 8, 22)])
def test_direct_split(sms, rdma, nvl):
    """8 QPs: about half the budget posts (whole QPs per RDMA CTA), the rest copies; one SM
    posts and copies in the same CTA."""
    ext = require_ext()
    with config.override(direct_sms=sms):
        got = ext.mode_sms(64, device_sms=132, num_qps=8)
        assert (got["direct_rdma_ctas"], got["direct_nvlink_ctas"]) == (rdma, nvl), got
        alone = ext.mode_sms(64, device_sms=132, num_qps=8, nvlink_peers=False)
        assert alone["direct_rdma_ctas"] == min(8, sms) and alone["direct_nvlink_ctas"] == 0


@pytest.mark.parametrize("bad", [0, -3, "many", 2.5, 100000])
@pytest.mark.parametrize("mode", MODES)
def test_bad_values_name_the_setting(mode, bad):
    name = f"{mode}_sms"
    with pytest.raises(ValueError, match=name):
        config.update(name, bad)
    var = config.ENV[name]
    with pytest.raises(ValueError, match=var):
        config.from_env({var: str(bad)})
    # C++ refuses one that bypasses the config, naming the setting and its variable
    if isinstance(bad, int):
        with pytest.raises(ValueError, match=f"{name} \\({var}\\)"):
            require_ext().set_settings({name: bad})
    assert config.current().kernel_settings()[name] is None


def test_environment_reaches_cpp():
    env = dict(os.environ, JAX_EP_DIRECT_SMS="7", JAX_EP_HIERARCHICAL_SMS="9",
               JAX_PLATFORMS="cpu")
    code = ("import jax_ep; from jax_ep._src.ext import ext; s = ext.settings(); "
            "m = ext.mode_sms(16); print(s['direct_sms'], s['hierarchical_sms'], "
            "m['direct'], m['hierarchical'])")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["7", "9", "7", "9"]
    env["JAX_EP_LOW_LATENCY_SMS"] = "0"
    r = subprocess.run([sys.executable, "-c", "import jax_ep"], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "JAX_EP_LOW_LATENCY_SMS" in r.stderr, r.stderr[-2000:]
