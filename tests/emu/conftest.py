"""The internode matrix on both transports: a module that names the `transport` fixture
(pytestmark usefixtures) runs each of its tests over the emulated NVSHMEM and over the
emulated NCCL GIN, with ids `nvshmem` and `nccl`. A test of one transport's own machinery
says so with `@pytest.mark.transport_only("nvshmem")` and runs on that one alone."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import internode_emu_util  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "transport_only(name): run on that transport alone")


def pytest_generate_tests(metafunc):
    if "transport" in metafunc.fixturenames:
        only = metafunc.definition.get_closest_marker("transport_only")
        params = list(only.args) if only else list(internode_emu_util.TRANSPORTS)
        metafunc.parametrize("transport", params, indirect=True, ids=params)


@pytest.fixture
def transport(request):
    old = internode_emu_util.DEFAULT["transport"]
    internode_emu_util.DEFAULT["transport"] = request.param
    yield request.param
    internode_emu_util.DEFAULT["transport"] = old
