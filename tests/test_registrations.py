"""The CUDA targets Python registers as CUDA-graph (command-buffer) compatible are exactly
those whose C++ handlers declare the trait: read from the handler sources, so a new
handler cannot be left out of one list (or a harness target slip into it)."""
import pathlib
import re

from jax_ep._src import ext as _ext

ROOT = pathlib.Path(__file__).resolve().parents[1]
TRAIT = "kCmdBufferCompatible"


def _macro_args(text, start):
    """The text between the '(' at `start` and its matching ')'."""
    depth = 0
    for i in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return text[start + 1:i]
    raise ValueError("unbalanced parentheses")


def graph_safe_targets(sources: dict[str, str]) -> set[str]:
    """Targets registered (add("name", ...Handler)) with a handler whose definition
    declares the trait, directly or through a #define (handlers may be defined in one
    file and registered in another)."""
    handlers, adds = {}, []
    for path, text in sources.items():
        trait_macros = {m.group(1) for m in re.finditer(
            r"#define\s+(\w+)\s+\{[^}]*" + TRAIT, text)}
        for m in re.finditer(r"XLA_FFI_DEFINE_HANDLER(?:_SYMBOL)?\s*\(\s*(\w+)", text):
            body = _macro_args(text, text.index("(", m.start()))
            safe = TRAIT in body or any(re.search(rf"\b{t}\b", body) for t in trait_macros)
            assert handlers.get(m.group(1), safe) == safe, f"{m.group(1)} defined twice"
            handlers[m.group(1)] = safe
        adds += re.findall(r'add\("(\w+)",\s*reinterpret_cast<void\*>\((\w+)\)\)', text)
    return {target for target, handler in adds if handlers.get(handler)}


def _gpu_sources():
    return {str(p): p.read_text() for d in ("cuda", "internode")
            for p in sorted((ROOT / "xla_ffi" / d).glob("*.cc"))}


def test_python_graph_safe_list_equals_the_handlers_traits():
    declared = graph_safe_targets(_gpu_sources())
    assert declared == set(_ext._GRAPH_SAFE), (
        sorted(declared - set(_ext._GRAPH_SAFE)), sorted(set(_ext._GRAPH_SAFE) - declared))
    assert not any("harness" in t for t in declared)  # the harness allocates and syncs


def test_reader_sees_a_trait_through_a_define_and_ignores_handlers_without_it():
    src = """
    #define SAFE {ffi::Traits::kCmdBufferCompatible}
    XLA_FFI_DEFINE_HANDLER(kA, AImpl, ffi::Ffi::Bind().Arg<ffi::AnyBuffer>(), SAFE);
    XLA_FFI_DEFINE_HANDLER_SYMBOL(B, BImpl, ffi::Ffi::Bind().Ret<ffi::AnyBuffer>(),
                                  {ffi::Traits::kCmdBufferCompatible});
    XLA_FFI_DEFINE_HANDLER_SYMBOL(C, CImpl, ffi::Ffi::Bind().Attr<int64_t>("n"));
    void Add(const RegisterFn& add) {
      add("t_a", reinterpret_cast<void*>(kA));
      add("t_b", reinterpret_cast<void*>(B));
      add("t_c", reinterpret_cast<void*>(C));
    }"""
    assert graph_safe_targets({"x.cc": src}) == {"t_a", "t_b"}
    # A planted mistake: the trait dropped from one handler is seen.
    assert graph_safe_targets({"x.cc": src.replace("SAFE);", ");")}) == {"t_b"}
