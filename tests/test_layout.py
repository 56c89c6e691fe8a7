"""The package's structure: the import graph of `jax_ep` (read from the source with
`ast`) has no cycle, no backend imports the contract (`jax_ep.ops`), and `ops.py` holds
no custom call of its own."""
from __future__ import annotations

import ast
import pathlib

import pytest

PKG = pathlib.Path(__file__).resolve().parents[1] / "jax_ep"


def _module_name(path: pathlib.Path, root: pathlib.Path) -> str:
    rel = path.relative_to(root.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(tree: ast.AST, module: str, is_package: bool, known: set) -> set:
    """jax_ep modules `module` imports anywhere (top level or inside functions)."""
    out = set()
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module or ""
            # `from pkg import mod` names a module; `from mod import name` names mod.
            names = [f"{stem}.{a.name}" if f"{stem}.{a.name}" in known else stem
                     for a in node.names]
        else:
            continue
        for n in names:
            while n and n not in known:
                n = n.rpartition(".")[0]
            if n and n != module:
                out.add(n)
    return out


def import_graph(root: pathlib.Path = PKG) -> dict:
    files = {_module_name(p, root): p for p in root.rglob("*.py")}
    known = set(files)
    graph = {}
    for name, path in files.items():
        tree = ast.parse(path.read_text(), str(path))
        graph[name] = _imports(tree, name, path.name == "__init__.py", known)
    return graph


def find_cycle(graph: dict):
    """One import cycle as a list of modules, or None. A package importing its own
    submodules is not a cycle by itself (Python runs the package first)."""
    state = {}
    stack = []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if n.startswith(m + "."):
                continue  # a module importing its parent package: the package ran first
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state:
                c = visit(m)
                if c:
                    return c
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state:
            c = visit(n)
            if c:
                return c
    return None


def test_the_package_has_no_import_cycle():
    graph = import_graph()
    assert "jax_ep.ops" in graph and "jax_ep._src.backends.reference" in graph
    assert find_cycle(graph) is None, f"import cycle: {' -> '.join(find_cycle(graph))}"


def test_no_backend_imports_the_contract():
    graph = import_graph()
    backends = [m for m in graph if m.startswith("jax_ep._src.backends.")]
    assert {"jax_ep._src.backends.reference", "jax_ep._src.backends.ffi",
            "jax_ep._src.backends.internode"} <= set(backends)
    offenders = {m: sorted(graph[m]) for m in backends if "jax_ep.ops" in graph[m]}
    assert not offenders, f"backends must not import jax_ep.ops: {offenders}"


def test_ops_makes_no_custom_call():
    assert "ffi_call" not in (PKG / "ops.py").read_text()


def test_every_backend_has_the_same_functions():
    import inspect

    from jax_ep._src import backends
    want = {"layout": ["topk_idx", "cfg"], "dispatch": ["x", "topk_idx", "topk_weights", "cfg"],
            "combine": ["y", "handle", "cfg"], "gather": ["g", "handle", "cfg"]}
    for name, mod in backends.MODULES.items():
        for fn, params in want.items():
            got = list(inspect.signature(getattr(mod, fn)).parameters)
            assert got == params, f"backends.{name}.{fn}{tuple(got)} != {tuple(params)}"


def test_public_names_keep_working():
    import jax_ep
    import jax_ep.cuda
    import jax_ep.nvshmem_bootstrap
    from jax_ep.network import transport
    from jax_ep import cuda, nvshmem_bootstrap as nvshmem
    assert jax_ep.cuda is cuda and callable(jax_ep.cuda.setup)
    assert jax_ep.nvshmem_bootstrap is nvshmem and callable(nvshmem.initialize)
    assert jax_ep.TransportConfig is transport.TransportConfig


def test_the_top_level_holds_the_public_modules_only():
    """At most 16 modules directly in jax_ep/, none of them private: internals live in
    jax_ep/_src, benchmarks in jax_ep/bench."""
    top = sorted(p.name for p in PKG.glob("*.py"))
    assert len(top) <= 16, top
    assert not [n for n in top if n.startswith("_") and n != "__init__.py"], top


@pytest.mark.parametrize("old,new", [
    ("jax_ep.backends.internode", "jax_ep._src.backends.internode"),
    ("jax_ep.runtime.cuda", "jax_ep.cuda"),
    ("jax_ep.model", "jax_ep.bench.perf_model"),
    ("jax_ep.sharded_low_latency", "jax_ep._src.sharded_low_latency"),
])
def test_moved_paths_still_import_with_a_warning(old, new):
    import importlib
    import sys
    import warnings

    import jax_ep  # noqa: F401  (installs the finder)
    sys.modules.pop(old, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mod = importlib.import_module(old)
    assert mod is importlib.import_module(new)
    assert any(issubclass(w.category, DeprecationWarning) and new in str(w.message)
               for w in caught), [str(w.message) for w in caught]


# The checker itself must be able to fail: a planted cycle and a planted backend import.

def _write(root: pathlib.Path, files: dict):
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)


def test_the_checker_finds_a_planted_cycle(tmp_path):
    root = tmp_path / "jax_ep"
    _write(root, {"__init__.py": "", "ops.py": "from jax_ep._src.backends import ffi\n",
                  "_src/__init__.py": "", "_src/backends/__init__.py": "", "_src/backends/ffi.py": "from jax_ep import ops\n"})
    graph = import_graph(root)
    assert graph["jax_ep._src.backends.ffi"] == {"jax_ep.ops"}
    cycle = find_cycle(graph)
    assert cycle is not None and "jax_ep.ops" in cycle and "jax_ep._src.backends.ffi" in cycle


def test_the_checker_sees_imports_inside_functions(tmp_path):
    root = tmp_path / "jax_ep"
    _write(root, {"__init__.py": "", "ops.py": "import jax_ep._src.backends.ffi\n",
                  "_src/__init__.py": "", "_src/backends/__init__.py": "",
                  "_src/backends/ffi.py": "def f():\n    from ... import ops\n    return ops\n"})
    graph = import_graph(root)
    assert "jax_ep.ops" in graph["jax_ep._src.backends.ffi"]
    assert find_cycle(graph) is not None


@pytest.mark.parametrize("src", ["from jax_ep._src.common import Cfg\n", "import numpy\n"])
def test_the_checker_passes_acyclic_code(tmp_path, src):
    root = tmp_path / "jax_ep"
    _write(root, {"__init__.py": "", "_src/__init__.py": "", "_src/common.py": "",
                  "ops.py": src})
    assert find_cycle(import_graph(root)) is None
