// What the signature tables of xla_ffi/common/op_tables.h become: per signature a struct
// jax_ep::sig::<Sig> (operand and result positions, the attributes as one struct that XLA
// decodes with XLA_FFI_REGISTER_STRUCT_ATTR_DECODING, the FFI binding, a description for
// Python), and per target row the handler definition (JEP_FFI_DEFINE_TARGET), its
// declaration and its registration. A handler's function keeps its positional parameters
// (context, operands, results, then each attribute); the binding calls it with the
// decoded attribute struct spread into them, so a table and a function that disagree do
// not compile.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>

#include "xla/ffi/api/ffi.h"
#include "xla_ffi/common/op_tables.h"

// ---- list helpers: an X-macro entry may emit ", item"; JEP_TAIL drops the first comma ----
#define JEP_TAIL(...) JEP_TAIL_I(__VA_ARGS__)
#define JEP_TAIL_I(first, ...) __VA_ARGS__

// ---- the table's types ----
#define JEP_FFI_T_ANY ::xla::ffi::AnyBuffer
#define JEP_FFI_T_S32 ::xla::ffi::Buffer<::xla::ffi::S32>
#define JEP_FFI_T_F32 ::xla::ffi::Buffer<::xla::ffi::F32>
#define JEP_FFI_T_PRED ::xla::ffi::Buffer<::xla::ffi::PRED>
#define JEP_FFI_T_I64 int64_t
#define JEP_FFI_T_I64S ::xla::ffi::Span<const int64_t>

// ---- the contexts a handler takes first ----
#define JEP_FFI_CTX_NONE
#define JEP_FFI_CTX_RUN_ID .Ctx<::xla::ffi::RunId>()
#define JEP_FFI_CTX_STREAM .Ctx<::xla::ffi::PlatformStream<cudaStream_t>>()
#define JEP_FFI_CTX_CUDA \
  .Ctx<::xla::ffi::PlatformStream<cudaStream_t>>().Ctx<::xla::ffi::DeviceOrdinal>()

// ---- traits ----
#define JEP_FFI_TRAIT_NONE static_cast<::xla::ffi::Traits>(0)
#define JEP_FFI_TRAIT_GRAPH_SAFE ::xla::ffi::Traits::kCmdBufferCompatible
#define JEP_FFI_TRAIT_NAME_NONE ""
#define JEP_FFI_TRAIT_NAME_GRAPH_SAFE "COMMAND_BUFFER_COMPATIBLE"

// ---- per-entry expansions (X(kind, name, type) -> JEP_SIG_<what>_<kind>(name, type)) ----
#define JEP_SIG_NOTHING(name, t)

// operand and result positions: enum entries
#define JEP_SIG_IN(kind, name, t) JEP_SIG_IN_##kind(name, t)
#define JEP_SIG_IN_ARG(name, t) name,
#define JEP_SIG_IN_REST JEP_SIG_NOTHING
#define JEP_SIG_IN_RET JEP_SIG_NOTHING
#define JEP_SIG_IN_ATTR JEP_SIG_NOTHING
#define JEP_SIG_IN_OPT_ATTR JEP_SIG_NOTHING
#define JEP_SIG_OUT(kind, name, t) JEP_SIG_OUT_##kind(name, t)
#define JEP_SIG_OUT_ARG JEP_SIG_NOTHING
#define JEP_SIG_OUT_REST JEP_SIG_NOTHING
#define JEP_SIG_OUT_RET(name, t) name,
#define JEP_SIG_OUT_ATTR JEP_SIG_NOTHING
#define JEP_SIG_OUT_OPT_ATTR JEP_SIG_NOTHING

// the attribute struct's members, and the same as a tuple
#define JEP_SIG_MEMBER(kind, name, t) JEP_SIG_MEMBER_##kind(name, t)
#define JEP_SIG_MEMBER_ARG JEP_SIG_NOTHING
#define JEP_SIG_MEMBER_REST JEP_SIG_NOTHING
#define JEP_SIG_MEMBER_RET JEP_SIG_NOTHING
#define JEP_SIG_MEMBER_ATTR(name, t) JEP_FFI_T_##t name;
#define JEP_SIG_MEMBER_OPT_ATTR(name, t) std::optional<JEP_FFI_T_##t> name;
#define JEP_SIG_FIELD(kind, name, t) JEP_SIG_FIELD_##kind(name, t)
#define JEP_SIG_FIELD_ARG JEP_SIG_NOTHING
#define JEP_SIG_FIELD_REST JEP_SIG_NOTHING
#define JEP_SIG_FIELD_RET JEP_SIG_NOTHING
#define JEP_SIG_FIELD_ATTR(name, t) , std::make_tuple(name)
#define JEP_SIG_FIELD_OPT_ATTR(name, t) , std::make_tuple(name)
#define JEP_SIG_OPTIONAL(kind, name, t) JEP_SIG_OPTIONAL_##kind(name, t)
#define JEP_SIG_OPTIONAL_ARG JEP_SIG_NOTHING
#define JEP_SIG_OPTIONAL_REST JEP_SIG_NOTHING
#define JEP_SIG_OPTIONAL_RET JEP_SIG_NOTHING
#define JEP_SIG_OPTIONAL_ATTR JEP_SIG_NOTHING
#define JEP_SIG_OPTIONAL_OPT_ATTR(name, t) || true

// the FFI binding after the context: operands and results (attributes: one struct)
#define JEP_SIG_BIND(kind, name, t) JEP_SIG_BIND_##kind(name, t)
#define JEP_SIG_BIND_ARG(name, t) .template Arg<JEP_FFI_T_##t>()
#define JEP_SIG_BIND_REST(name, t) .RemainingArgs()
#define JEP_SIG_BIND_RET(name, t) .template Ret<JEP_FFI_T_##t>()
#define JEP_SIG_BIND_ATTR JEP_SIG_NOTHING
#define JEP_SIG_BIND_OPT_ATTR JEP_SIG_NOTHING

// a decoder's operands and results, in the binding's order (the emulated GPU's invoker)
#define JEP_SIG_DECODE(kind, name, t) JEP_SIG_DECODE_##kind(name, t)
#define JEP_SIG_DECODE_ARG(name, t) , std::make_tuple(src.template Arg<JEP_FFI_T_##t>(In::name, #name))
#define JEP_SIG_DECODE_REST(name, t) , std::make_tuple(src.Rest(In::count))
#define JEP_SIG_DECODE_RET(name, t) , std::make_tuple(src.template Ret<JEP_FFI_T_##t>(Out::name, #name))
#define JEP_SIG_DECODE_ATTR JEP_SIG_NOTHING
#define JEP_SIG_DECODE_OPT_ATTR JEP_SIG_NOTHING
#define JEP_SIG_DECODE_ATTRS(kind, name, t) JEP_SIG_DECODE_ATTRS_##kind(name, t)
#define JEP_SIG_DECODE_ATTRS_ARG JEP_SIG_NOTHING
#define JEP_SIG_DECODE_ATTRS_REST JEP_SIG_NOTHING
#define JEP_SIG_DECODE_ATTRS_RET JEP_SIG_NOTHING
#define JEP_SIG_DECODE_ATTRS_ATTR(name, t) src.template Attr<JEP_FFI_T_##t>(#name),
#define JEP_SIG_DECODE_ATTRS_OPT_ATTR(name, t) src.template OptAttr<JEP_FFI_T_##t>(#name),

// XLA's struct decoding of the attributes
#define JEP_SIG_STRUCT_MEMBER(kind, name, t) JEP_SIG_STRUCT_MEMBER_##kind(name, t)
#define JEP_SIG_STRUCT_MEMBER_ARG JEP_SIG_NOTHING
#define JEP_SIG_STRUCT_MEMBER_REST JEP_SIG_NOTHING
#define JEP_SIG_STRUCT_MEMBER_RET JEP_SIG_NOTHING
#define JEP_SIG_STRUCT_MEMBER_ATTR(name, t) , ::xla::ffi::StructMember<JEP_FFI_T_##t>(#name)
#define JEP_SIG_STRUCT_MEMBER_OPT_ATTR JEP_SIG_NOTHING

// the description: v(kind, name, type) per entry
#define JEP_SIG_DESCRIBE(kind, name, t) v(#kind, #name, #t);

// Defines struct jax_ep::sig::Sig from its table (inside namespace jax_ep::sig).
#define JEP_SIG_DEFINE(Sig, TABLE)                                                      \
  struct Sig {                                                                          \
    static constexpr const char* kName = #Sig;                                          \
    struct In {                                                                         \
      enum : size_t { TABLE(JEP_SIG_IN) count };                                        \
    };                                                                                  \
    struct Out {                                                                        \
      enum : size_t { TABLE(JEP_SIG_OUT) count };                                       \
    };                                                                                  \
    struct Attrs {                                                                      \
      TABLE(JEP_SIG_MEMBER)                                                             \
      auto fields() const { return std::tuple_cat(std::tuple<>() TABLE(JEP_SIG_FIELD)); } \
    };                                                                                  \
    /* With an optional attribute the handler takes the attributes as a dictionary. */  \
    static constexpr bool kDictionary = false TABLE(JEP_SIG_OPTIONAL);                  \
    using AttrsType = std::conditional_t<kDictionary, ::xla::ffi::Dictionary, Attrs>;   \
    template <typename B>                                                               \
    static auto Bind(B b) {                                                             \
      return std::move(b) TABLE(JEP_SIG_BIND).template Attrs<AttrsType>();              \
    }                                                                                   \
    /* (operands..., results..., Attrs) from a source of buffers and attributes. */     \
    template <typename Src>                                                             \
    static auto Decode(const Src& src) {                                                \
      return std::tuple_cat(std::tuple<>() TABLE(JEP_SIG_DECODE),                       \
                            std::make_tuple(Attrs{TABLE(JEP_SIG_DECODE_ATTRS)}));       \
    }                                                                                   \
    template <typename V>                                                               \
    static void Describe(V&& v) {                                                       \
      TABLE(JEP_SIG_DESCRIBE)                                                           \
    }                                                                                   \
  };

// Registers XLA's decoding of Sig::Attrs (at global scope; not for dictionary signatures).
#define JEP_SIG_REGISTER_ATTRS(Sig, TABLE)                    \
  XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(::jax_ep::sig::Sig::Attrs, \
                                        JEP_TAIL(TABLE(JEP_SIG_STRUCT_MEMBER)));

namespace jax_ep {
namespace sig {
JEP_ALL_SIGNATURES(JEP_SIG_DEFINE)
}  // namespace sig

namespace ffi_table {

// Calls `f` with every value but the last, then the last one's fields (an attribute
// struct) or the last one itself (an ffi::Dictionary).
template <typename F, typename Tuple, size_t... I>
decltype(auto) CallSpread(F f, Tuple& all, std::index_sequence<I...>) {
  auto& last = std::get<sizeof...(I)>(all);
  if constexpr (std::is_same_v<std::decay_t<decltype(last)>, ::xla::ffi::Dictionary>) {
    return f(std::get<I>(all)..., last);
  } else {
    return std::apply([&](const auto&... fields) { return f(std::get<I>(all)..., fields...); },
                      last.fields());
  }
}

template <typename F, typename... Xs>
decltype(auto) CallUnpacked(F f, Xs... xs) {
  auto all = std::make_tuple(std::move(xs)...);
  return CallSpread(f, all, std::make_index_sequence<sizeof...(Xs) - 1>{});
}

}  // namespace ffi_table
}  // namespace jax_ep

// Every signature without optional attributes decodes its attributes as one struct.
JEP_SIG_REGISTER_ATTRS(Layout, JEP_OP_LAYOUT)
JEP_SIG_REGISTER_ATTRS(Dispatch, JEP_OP_DISPATCH)
JEP_SIG_REGISTER_ATTRS(Combine, JEP_OP_COMBINE)
JEP_SIG_REGISTER_ATTRS(Gather, JEP_OP_GATHER)
JEP_SIG_REGISTER_ATTRS(LLDispatchSend, JEP_OP_LL_DISPATCH_SEND)
JEP_SIG_REGISTER_ATTRS(LLDispatchSendFp8, JEP_OP_LL_DISPATCH_SEND_FP8)
JEP_SIG_REGISTER_ATTRS(LLDispatchRecv, JEP_OP_LL_DISPATCH_RECV)
JEP_SIG_REGISTER_ATTRS(LLDispatchRecvFp8, JEP_OP_LL_DISPATCH_RECV_FP8)
JEP_SIG_REGISTER_ATTRS(LLCombineSend, JEP_OP_LL_COMBINE_SEND)
JEP_SIG_REGISTER_ATTRS(LLCombineRecv, JEP_OP_LL_COMBINE_RECV)
JEP_SIG_REGISTER_ATTRS(HarnessDispatch, JEP_OP_HARNESS_DISPATCH)
JEP_SIG_REGISTER_ATTRS(HarnessCombine, JEP_OP_HARNESS_COMBINE)
JEP_SIG_REGISTER_ATTRS(HarnessGather, JEP_OP_HARNESS_GATHER)
JEP_SIG_REGISTER_ATTRS(LLHarnessDispatchSend, JEP_OP_LL_HARNESS_DISPATCH_SEND)
JEP_SIG_REGISTER_ATTRS(LLHarnessDispatchRecv, JEP_OP_LL_HARNESS_DISPATCH_RECV)
JEP_SIG_REGISTER_ATTRS(LLHarnessCombineSend, JEP_OP_LL_HARNESS_COMBINE_SEND)
JEP_SIG_REGISTER_ATTRS(LLHarnessCombineRecv, JEP_OP_LL_HARNESS_COMBINE_RECV)
JEP_SIG_REGISTER_ATTRS(InternodeDispatch, JEP_OP_INTERNODE_DISPATCH)
JEP_SIG_REGISTER_ATTRS(InternodeCombine, JEP_OP_INTERNODE_COMBINE)
JEP_SIG_REGISTER_ATTRS(InternodeGather, JEP_OP_INTERNODE_GATHER)
JEP_SIG_REGISTER_ATTRS(InternodeHierDispatch, JEP_OP_INTERNODE_HIER_DISPATCH)
JEP_SIG_REGISTER_ATTRS(InternodeHierCombine, JEP_OP_INTERNODE_HIER_COMBINE)
JEP_SIG_REGISTER_ATTRS(InternodeHierGather, JEP_OP_INTERNODE_HIER_GATHER)
JEP_SIG_REGISTER_ATTRS(InternodeLLDispatchSend, JEP_OP_INTERNODE_LL_DISPATCH_SEND)
JEP_SIG_REGISTER_ATTRS(InternodeLLDispatchSendFp8, JEP_OP_INTERNODE_LL_DISPATCH_SEND_FP8)
JEP_SIG_REGISTER_ATTRS(InternodeLLDispatchRecv, JEP_OP_INTERNODE_LL_DISPATCH_RECV)
JEP_SIG_REGISTER_ATTRS(InternodeLLDispatchRecvFp8, JEP_OP_INTERNODE_LL_DISPATCH_RECV_FP8)
JEP_SIG_REGISTER_ATTRS(InternodeLLCombineSend, JEP_OP_INTERNODE_LL_COMBINE_SEND)
JEP_SIG_REGISTER_ATTRS(InternodeLLCombineRecv, JEP_OP_INTERNODE_LL_COMBINE_RECV)

// ---- per target row ----

// Defines the handler `Symbol` (extern "C") of a target row: the signature's binding after
// the row's context, the row's traits, calling `Impl`.
#define JEP_FFI_DEFINE_TARGET(target, Sig, Symbol, Impl, CTX, TRAITS)                     \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(                                                          \
      Symbol,                                                                              \
      ([](auto... xs) { return ::jax_ep::ffi_table::CallUnpacked(Impl, std::move(xs)...); }), \
      ::jax_ep::sig::Sig::Bind(::xla::ffi::Ffi::Bind() JEP_FFI_CTX_##CTX),                 \
      {JEP_FFI_TRAIT_##TRAITS});

#define JEP_FFI_DECLARE_TARGET(target, Sig, Symbol, Impl, CTX, TRAITS) \
  XLA_FFI_DECLARE_HANDLER_SYMBOL(Symbol);

// Inside a function with `add(const char* target, void* handler)` in scope.
#define JEP_FFI_ADD_TARGET(target, Sig, Symbol, Impl, CTX, TRAITS) \
  add(target, reinterpret_cast<void*>(::jax_ep::Symbol));

// Defines the handlers of a target table and `void AddFn(const RegisterFn& add)`, which adds
// them (inside namespace jax_ep, with RegisterFn of xla_ffi/cuda/cuda_registrations.h).
#define JEP_FFI_DEFINE_TARGETS_WITH_ADDER(TARGETS, AddFn) \
  TARGETS(JEP_FFI_DEFINE_TARGET)                          \
  void AddFn(const RegisterFn& add) { TARGETS(JEP_FFI_ADD_TARGET) }
