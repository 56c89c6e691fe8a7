"""The FFI targets' signatures come from one C++ table per op (xla_ffi/common/op_tables.h):
the handlers' bindings, the emulator's invokers and Python's operand and attribute lists
(`_ext.ffi_signatures()`, `_ext.ffi_arguments`) are all made from it. These tests check
that every built handler has a row, that Python builds its calls from the rows (a call that
leaves an operand out or names one the handler lacks fails with the target and the name),
and what the traits say."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_ep._src import ext as _ext

pytestmark = pytest.mark.skipif(_ext.ext is None, reason="no compiled extension")


def _built():
    """{platform: targets} of the handlers compiled into this build (NVSHMEM's too)."""
    built = {p: set(t) for p, t in _ext.ext.registrations().items()}
    if _ext.nvshmem_built() and _ext.nvshmem_ext() is not None:
        built.setdefault("CUDA", set()).update(_ext.nvshmem_ext().registrations()["CUDA"])
    return built


def test_every_built_handler_has_a_signature():
    sigs = _ext.ffi_signatures()
    for platform, targets in _built().items():
        assert targets <= set(sigs[platform]), (platform, targets - set(sigs[platform]))


def test_the_cpu_and_cuda_tables_share_the_intranode_names():
    sigs = _ext.ffi_signatures()
    assert set(sigs["cpu"]) < set(sigs["CUDA"])
    for name, cpu in sigs["cpu"].items():
        cuda = sigs["CUDA"][name]
        if name == "jax_ep_combine":  # the CPU kernel also adds bias and takes a node size
            assert cpu.variadic == "bias" and cuda.variadic is None
            assert [a for a in cpu.attrs if not a[2]] == [("gpus_per_node", "i64", False)]
            assert cpu.operands == cuda.operands
            continue
        assert (cpu.operands, cpu.results, cpu.attrs) == (cuda.operands, cuda.results,
                                                          cuda.attrs), name


def test_traits_graph_safe_on_cuda_but_the_harness():
    """The CUDA handlers never allocate or wait for the host, so XLA may capture them in
    CUDA graphs; the harness allocates lazily. Python registers the table's traits."""
    sigs = _ext.ffi_signatures()
    for name, sig in sigs["CUDA"].items():
        assert sig.graph_safe == ("harness" not in name), name
    assert not any(sig.traits for sig in sigs["cpu"].values())


def test_missing_operand_is_an_error_naming_it_and_the_target():
    named = dict(x=1, topk_idx=2, rank=3, group=4, num_experts=8, num_ranks=2, capacity=4,
                 call_site=1)
    with pytest.raises(TypeError, match=r"jax_ep_dispatch \(cpu\): missing topk_weights"):
        _ext.ffi_arguments("jax_ep_dispatch", named, "cpu")
    with pytest.raises(TypeError, match="jax_ep_dispatch .*no operand or attribute bias"):
        _ext.ffi_arguments("jax_ep_dispatch", dict(named, topk_weights=5, bias=()), "cpu")
    del named["capacity"]
    with pytest.raises(TypeError, match="jax_ep_dispatch .*missing capacity"):
        _ext.ffi_arguments("jax_ep_dispatch", dict(named, topk_weights=5), "cpu")


def test_arguments_follow_the_table_order_and_types():
    sig = _ext.ffi_signature("jax_ep_combine", "cpu")
    named = {n: i for i, n in enumerate(reversed(sig.operands))}
    operands, attrs = _ext.ffi_arguments(
        "jax_ep_combine", dict(named, bias=("b0", "b1"), call_site=3, num_ranks=2), "cpu")
    assert operands == [named[n] for n in sig.operands] + ["b0", "b1"]
    assert attrs == {"num_ranks": 2, "call_site": 3}  # the optional one left out
    assert all(type(v) is np.int64 for v in attrs.values())
    _, attrs = _ext.ffi_arguments(
        "jax_ep_harness_combine", dict(y=0, send_row=1, call_sites=[1, 2], concurrent=True,
                                       absent_rank=-1), "CUDA")
    assert attrs["call_sites"].dtype == np.int64 and attrs["concurrent"] == 1


def test_a_call_with_an_operand_left_out_fails_before_xla():
    """A wrapper that disagrees with the table (here: one operand short) stops at trace
    time with the operand's name, not inside XLA's decoder."""
    idx = jnp.asarray([[0, 4]] * 4, jnp.int32)  # experts 0-3 on rank 0, 4-7 on rank 1
    results = (jax.ShapeDtypeStruct((2,), jnp.int32), jax.ShapeDtypeStruct((8,), jnp.int32),
               jax.ShapeDtypeStruct((4, 2), jnp.bool_))
    call = _ext.ffi_call("jax_ep_layout", results, platform="cpu")
    with pytest.raises(TypeError, match="jax_ep_layout .*missing topk_idx"):
        jax.jit(lambda i: call(num_experts=8, num_ranks=2))(idx)
    with pytest.raises(TypeError, match="jax_ep_layout .*returns 3 results"):
        _ext.ffi_call("jax_ep_layout", results[:2], platform="cpu")
    _ext.registered_platforms()
    per_rank, per_expert, in_rank = jax.jit(
        lambda i: call(topk_idx=i, num_experts=8, num_ranks=2))(idx)
    assert per_rank.tolist() == [4, 4] and in_rank.all()


def test_python_names_only_table_targets():
    """Every target name the package passes to a custom call is a row of the tables."""
    import pathlib
    names = set().union(*map(set, _ext.ffi_signatures().values()))
    root = pathlib.Path(_ext.__file__).resolve().parents[1]
    used = set()
    for path in root.rglob("*.py"):
        text = path.read_text()
        used |= set(re.findall(r'(?:ep_call|ffi_call)\(\s*"(jax_ep_\w+)"', text))
    assert used and used <= names, sorted(used - names)
