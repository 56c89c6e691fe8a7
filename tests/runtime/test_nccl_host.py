"""The NCCL GIN transport's host side (kernels/internode/nccl_host.cc): it compiles with the
host compiler against the real NCCL headers (the nvidia-nccl-cu13 wheel) and never
references an NCCL symbol (libnccl.so.2 is found with dlsym, so the extension loads where
NCCL is absent); the emulated build's variant compiles against kernels/emu/nccl_emu.h;
and, where the build has it, the bindings answer without a GPU. Without the headers, a
host compiler or the CUDA headers the tests skip, saying which."""
from __future__ import annotations

import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SOURCE = os.path.join(ROOT, "kernels", "internode", "nccl_host.cc")
FLAGS = ["-std=c++17", "-Wall", "-Wextra", "-Werror", "-Wno-unused-parameter"]


def nccl_root() -> str | None:
    """The NCCL install the build uses: JAX_EP_NCCL_ROOT, else the nvidia.nccl package
    (a namespace package in the wheel: no __file__)."""
    root = os.environ.get("JAX_EP_NCCL_ROOT")
    if not root:
        try:
            import nvidia.nccl as m  # the nvidia-nccl-cu13 wheel
        except ImportError:
            return None
        root = os.path.dirname(m.__file__) if getattr(m, "__file__", None) else list(m.__path__)[0]
    return root if os.path.exists(os.path.join(root, "include", "nccl.h")) else None


def cuda_include() -> str | None:
    """Where cuda_runtime.h is (nccl.h includes it): CUDA_HOME, nvcc's toolkit, /usr/local/cuda."""
    nvcc = shutil.which("nvcc")
    candidates = [os.environ.get("CUDA_HOME", ""), os.environ.get("CUDA_PATH", ""),
                  os.path.dirname(os.path.dirname(nvcc)) if nvcc else "", "/usr/local/cuda"]
    for base in candidates:
        inc = os.path.join(base, "include") if base else ""
        if inc and os.path.exists(os.path.join(inc, "cuda_runtime.h")):
            return inc
    return None


def host_compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "")) or shutil.which("c++") or shutil.which("g++")


def real_flags() -> list[str]:
    root, cuda, cxx = nccl_root(), cuda_include(), host_compiler()
    if root is None:
        pytest.skip("no NCCL headers (pip install 'nvidia-nccl-cu13>=2.30', or set JAX_EP_NCCL_ROOT)")
    if cuda is None:
        pytest.skip("no CUDA toolkit headers (cuda_runtime.h), which nccl.h includes")
    if cxx is None:
        pytest.skip("no host C++ compiler")
    return [cxx, *FLAGS, "-I", ROOT, "-isystem", os.path.join(root, "include"), "-isystem", cuda]


def compile_ok(cmd: list[str]) -> None:
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, f"{' '.join(cmd)}\n{r.stdout}{r.stderr}"


def test_compiles_against_the_real_headers():
    compile_ok(real_flags() + ["-fsyntax-only", SOURCE])


def test_object_references_no_nccl_symbol(tmp_path):
    """libnccl is resolved with dlsym only: an undefined ncclX would make the extension
    fail to load where NCCL is not installed."""
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("no nm")
    obj = str(tmp_path / "nccl_host.o")
    compile_ok(real_flags() + ["-c", "-fPIC", "-o", obj, SOURCE])
    undefined = subprocess.run([nm, "-u", obj], capture_output=True, text=True, check=True).stdout
    nccl = [line.split()[-1] for line in undefined.splitlines()
            if line.split() and line.split()[-1].lstrip("_").startswith(("nccl", "pnccl"))]
    assert not nccl, f"nccl_host.cc links NCCL symbols directly: {nccl}"


def test_compiles_against_the_emulated_nccl():
    if not os.path.exists(os.path.join(ROOT, "kernels", "emu", "nccl_emu.h")):
        pytest.skip("kernels/emu/nccl_emu.h (the emulated NCCL) is not in this tree yet")
    cxx = host_compiler()
    if cxx is None:
        pytest.skip("no host C++ compiler")
    # As cmake/emu.cmake builds it: the replacement CUDA headers first, the emulated
    # runtime included ahead of the source.
    compile_ok([cxx, *FLAGS, "-Wno-unknown-pragmas", "-DJAX_EP_EMU=1",
                "-I", os.path.join(ROOT, "kernels", "emu", "include"), "-I", ROOT,
                "-include", os.path.join(ROOT, "kernels", "emu", "emu_cuda.h"),
                "-fsyntax-only", SOURCE])


# ------------------------------------------------------------- the built module, if any

def _nccl_module():
    from jax_ep._src import ext as _ext
    if not _ext.build_info()["nccl"]:
        pytest.skip(f"this build has no NCCL GIN transport (build_info: {_ext.build_info()})")
    mod = _ext.nvshmem_ext()
    if mod is None:
        pytest.skip(f"the internode module does not load here: {_ext.nvshmem_import_error()}")
    return mod


def test_build_info_names_the_headers_version():
    from jax_ep._src import ext as _ext
    info = _ext.build_info()
    assert "nccl" in info and "nccl_version" in info, info
    if info["nccl"]:
        mod = _nccl_module()
        assert info["nccl_version"] == mod.nccl_header_version() >= 23000
    else:
        assert info["nccl_version"] == 0


def test_available_names_the_library_or_the_package():
    mod = _nccl_module()
    ok, why = mod.nccl_available()
    if ok:
        assert why == "" and mod.nccl_version().count(".") == 2, (why, mod.nccl_version())
    else:
        assert "nvidia-nccl-cu13" in why and mod.nccl_version() == "", why


def test_start_checks_its_arguments_before_nccl():
    mod = _nccl_module()
    with pytest.raises(RuntimeError, match="one world rank per local GPU"):
        mod.nccl_start([0, 1], [0], 2, b"\0" * 128, 1 << 20, 2, 8)
    with pytest.raises(RuntimeError, match="num_contexts"):
        mod.nccl_start([0], [0], 2, b"\0" * 128, 1 << 20, 0, 8)
    with pytest.raises(RuntimeError, match="unique id has 3 bytes"):
        mod.nccl_start([0], [0], 2, b"abc", 1 << 20, 2, 8)
    info = mod.nccl_info()
    assert info["started"] is False and info["heap_bytes"] == 0
    mod.nccl_finish([0])  # nothing made: nothing to free


# The emulated GPU's runtime (cmake/emu.cmake's JAX_EP_EMU_SOURCES, less the module) and
# the emulated NVSHMEM and NCCL beside it.
EMU_RUNTIME = ["kernels/emu/emu_fibers.cc", "kernels/emu/emu_scheduler.cc",
               "kernels/emu/emu_memory.cc", "kernels/emu/emu_tma.cc",
               "kernels/emu/emu_counters.cc", "kernels/emu/emu_cuda_api.cc",
               "kernels/emu/nvshmem_emu.cc", "kernels/internode/nvshmem_select.cc",
               "kernels/emu/nccl_emu.cc"]


def test_start_and_finish_on_the_emulated_gpu(tmp_path):
    """Start/Finish end to end over the emulated NCCL (tests/runtime/nccl_host_emu_driver.cc),
    linked as the emulated module is (kernels/emu/emu.ld gathers the device globals)."""
    if not os.path.exists(os.path.join(ROOT, "kernels", "emu", "nccl_emu.h")):
        pytest.skip("kernels/emu/nccl_emu.h (the emulated NCCL) is not in this tree yet")
    cxx = host_compiler()
    if cxx is None:
        pytest.skip("no host C++ compiler")
    wrap = tmp_path / "nccl_host_wrap.cc"  # as the emulated build's kernel wrapper
    wrap.write_text('#include "kernels/emu/emu_cuda.h"\n#include "kernels/internode/nccl_host.cc"\n')
    occ = os.path.join(ROOT, "kernels", "emu", "occupancy_table.inc")
    flags = ["-std=c++17", "-O1", "-fno-strict-aliasing", "-ffp-contract=off",
             "-Wno-unknown-pragmas", "-Wno-unused-parameter", "-DJAX_EP_EMU=1",
             f'-DJEP_EMU_OCCUPANCY_TABLE="{occ}"',
             "-I", os.path.join(ROOT, "kernels", "emu", "include"), "-I", ROOT]
    sources = [os.path.join(ROOT, s) for s in EMU_RUNTIME] + [
        str(wrap), os.path.join(ROOT, "tests", "runtime", "nccl_host_emu_driver.cc")]
    objs = []
    for i, s in enumerate(sources):
        objs.append(str(tmp_path / f"{i}.o"))
        compile_ok([cxx, *flags, "-c", s, "-o", objs[-1]])
    exe = str(tmp_path / "driver")
    compile_ok([cxx, "-o", exe, *objs,
                f"-Wl,-T,{os.path.join(ROOT, 'kernels', 'emu', 'emu.ld')}", "-lpthread"])
    r = subprocess.run([exe], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.rstrip().endswith("OK"), r.stdout + r.stderr
