// The FFI signature of every jax_ep custom call, stated once. Everything that needs an op's
// operands, results or attributes is produced from these tables (xla_ffi/common/ffi_table.h):
// the XLA FFI binding of its handlers (operands in table order, the attributes decoded as
// one struct), the emulated GPU's invoker (xla_ffi/emu/emu_call.h), and the description
// Python reads through `_jax_ep_ext.ffi_signatures()` to build each custom call's operand
// list and keyword attributes (jax_ep's ffi_call wrappers). Adding an operand is one edit
// here (plus the handler's parameter it becomes).
//
// Signature tables: JEP_OP_<NAME>(X) calls X(kind, name, type) once per entry, in the
// handler's parameter order:
//   X(ARG, name, T)       an operand                 T: ANY (ffi::AnyBuffer) or S32/F32/PRED
//   X(REST, name, ANY)    any number of trailing operands (ffi::RemainingArgs)
//   X(RET, name, T)       a result, T as for ARG
//   X(ATTR, name, A)      an attribute               A: I64 (int64_t) or I64S (int64[] span)
//   X(OPT_ATTR, name, A)  an attribute the caller may leave out (the op then takes the
//                         attributes as an ffi::Dictionary and reads them itself)
// Operands come before results, attributes last (they are decoded as one struct).
//
// Target tables: JEP_<FAMILY>_TARGETS(T) calls T(target, Sig, Symbol, Impl, Ctx, Traits) for
// each handler a source file defines: the FFI target name, the signature (JEP_OP_<Sig>
// through its struct jax_ep::sig::Sig), the handler's C symbol, the function it calls, the
// context it takes first (NONE, RUN_ID, STREAM: the platform stream, CUDA: the stream and
// the device ordinal) and its traits (GRAPH_SAFE: command-buffer (CUDA graph) compatible,
// never synchronizes with the host; NONE). Python registers each CUDA target with the
// traits named here (they reach it through ffi_signatures()).
#pragma once

// ---------------------------------------------------------------------------------------
// Signatures. Pieces several ops share come first.

// Every collective on the CPU and intranode CUDA transports: this rank and its EP group.
#define JEP_OPERANDS_RANK_GROUP(X) X(ARG, rank, S32) X(ARG, group, S32)

// The nine results of a dispatch (intranode and its virtual-rank harness).
#define JEP_RESULTS_DISPATCH(X)                                                    \
  X(RET, recv_x, ANY) X(RET, recv_topk_idx, S32) X(RET, recv_topk_weights, F32)    \
  X(RET, num_recv, S32) X(RET, num_dropped, S32)                                   \
  X(RET, num_recv_tokens_per_expert, S32) X(RET, src_rank, S32)                    \
  X(RET, src_index, S32)

// A low-latency dispatch's receive half, after recv_x (and recv_scales with FP8).
#define JEP_RESULTS_LL_RECV(X)                                                     \
  X(RET, recv_count, S32) X(RET, src_rank, S32) X(RET, src_index, S32)             \
  X(RET, first_row, S32) X(RET, row_count, S32)

// ---- intranode: CPU (xla_ffi/cpu) and CUDA (xla_ffi/cuda) ----

#define JEP_OP_LAYOUT(X)                                                           \
  X(ARG, topk_idx, S32)                                                            \
  X(RET, num_tokens_per_rank, S32) X(RET, num_tokens_per_expert, S32)              \
  X(RET, is_token_in_rank, PRED)                                                   \
  X(ATTR, num_experts, I64) X(ATTR, num_ranks, I64)

#define JEP_OP_DISPATCH(X)                                                         \
  X(ARG, x, ANY) X(ARG, topk_idx, S32) X(ARG, topk_weights, F32)                   \
  JEP_OPERANDS_RANK_GROUP(X)                                                       \
  JEP_RESULTS_DISPATCH(X) X(RET, send_row, S32)                                    \
  X(ATTR, num_experts, I64) X(ATTR, num_ranks, I64) X(ATTR, capacity, I64)         \
  X(ATTR, call_site, I64)

#define JEP_OP_COMBINE(X)                                                          \
  X(ARG, y, ANY) X(ARG, send_row, S32) JEP_OPERANDS_RANK_GROUP(X)                  \
  X(RET, out, ANY)                                                                 \
  X(ATTR, num_ranks, I64) X(ATTR, call_site, I64)

// The CPU's combine also adds up to two [T, H] bias arrays and takes the node size of
// combine's summation order (kernels/common/combine_order.h; absent: one node).
#define JEP_OP_COMBINE_CPU(X)                                                      \
  X(ARG, y, ANY) X(ARG, send_row, S32) JEP_OPERANDS_RANK_GROUP(X)                  \
  X(REST, bias, ANY)                                                               \
  X(RET, out, ANY)                                                                 \
  X(ATTR, num_ranks, I64) X(ATTR, call_site, I64) X(OPT_ATTR, gpus_per_node, I64)

#define JEP_OP_GATHER(X)                                                           \
  X(ARG, g, ANY) X(ARG, src_rank, S32) X(ARG, src_index, S32)                      \
  JEP_OPERANDS_RANK_GROUP(X)                                                       \
  X(RET, out, ANY)                                                                 \
  X(ATTR, num_ranks, I64) X(ATTR, call_site, I64)

// Low-latency mode, real ranks (CPU, and CUDA under the same names).
#define JEP_OP_LL_DISPATCH_SEND(X)                                                 \
  X(ARG, x, ANY) X(ARG, topk_idx, S32)                                             \
  X(RET, stage_x, ANY) X(RET, stage_idx, S32) X(RET, expert_count, S32)            \
  X(ATTR, num_experts, I64) X(ATTR, num_ranks, I64) X(ATTR, max_tokens, I64)       \
  X(ATTR, call_site, I64)

#define JEP_OP_LL_DISPATCH_SEND_FP8(X) JEP_OP_LL_DISPATCH_SEND(X) X(ATTR, round_scale, I64)

#define JEP_OPERANDS_LL_STAGED(X)                                                  \
  X(ARG, stage_x, ANY) X(ARG, stage_idx, S32) X(ARG, expert_count, S32)            \
  JEP_OPERANDS_RANK_GROUP(X)

#define JEP_ATTRS_LL(X)                                                            \
  X(ATTR, num_experts, I64) X(ATTR, num_ranks, I64) X(ATTR, max_tokens, I64)       \
  X(ATTR, call_site, I64)

#define JEP_OP_LL_DISPATCH_RECV(X)                                                 \
  JEP_OPERANDS_LL_STAGED(X) X(RET, recv_x, ANY) JEP_RESULTS_LL_RECV(X) JEP_ATTRS_LL(X)

#define JEP_OP_LL_DISPATCH_RECV_FP8(X)                                             \
  JEP_OPERANDS_LL_STAGED(X) X(RET, recv_x, ANY) X(RET, recv_scales, F32)           \
  JEP_RESULTS_LL_RECV(X) JEP_ATTRS_LL(X)

#define JEP_OP_LL_COMBINE_SEND(X)                                                  \
  X(ARG, y, ANY) X(ARG, first_row, S32) X(ARG, row_count, S32)                     \
  X(RET, stage, ANY) X(RET, status, S32)                                           \
  X(ATTR, num_ranks, I64) X(ATTR, max_tokens, I64) X(ATTR, rows_per_dest, I64)     \
  X(ATTR, call_site, I64)

#define JEP_OP_LL_COMBINE_RECV(X)                                                  \
  X(ARG, stage, ANY) X(ARG, status, S32) X(ARG, topk_idx, S32)                     \
  X(ARG, topk_weights, F32) JEP_OPERANDS_RANK_GROUP(X)                             \
  X(RET, out, ANY) JEP_ATTRS_LL(X)

// ---- CUDA virtual-rank harness (every operand and result stacked over R ranks) ----

// Per-rank call sites (empty: all 1), each rank on its own stream, a rank left out (-1).
#define JEP_ATTRS_HARNESS(X)                                                       \
  X(ATTR, call_sites, I64S) X(ATTR, concurrent, I64) X(ATTR, absent_rank, I64)

#define JEP_OP_HARNESS_DISPATCH(X)                                                 \
  X(ARG, x, ANY) X(ARG, topk_idx, S32) X(ARG, topk_weights, F32)                   \
  JEP_RESULTS_DISPATCH(X) X(RET, send_row, S32)                                    \
  X(ATTR, num_experts, I64) X(ATTR, capacity, I64) JEP_ATTRS_HARNESS(X)

#define JEP_OP_HARNESS_COMBINE(X)                                                  \
  X(ARG, y, ANY) X(ARG, send_row, S32) X(RET, out, ANY) JEP_ATTRS_HARNESS(X)

#define JEP_OP_HARNESS_GATHER(X)                                                   \
  X(ARG, g, ANY) X(ARG, src_rank, S32) X(ARG, src_index, S32) X(RET, out, ANY)     \
  JEP_ATTRS_HARNESS(X)

#define JEP_ATTRS_LL_HARNESS(X)                                                    \
  X(ATTR, num_experts, I64) X(ATTR, max_tokens, I64) X(ATTR, topk_max, I64)

#define JEP_OP_LL_HARNESS_DISPATCH_SEND(X)                                         \
  X(ARG, x, ANY) X(ARG, topk_idx, S32) X(RET, token, S32) JEP_ATTRS_LL_HARNESS(X)

#define JEP_OP_LL_HARNESS_DISPATCH_RECV(X)                                         \
  X(ARG, token, S32) X(RET, recv_x, ANY) JEP_RESULTS_LL_RECV(X) JEP_ATTRS_LL_HARNESS(X)

#define JEP_OP_LL_HARNESS_COMBINE_SEND(X)                                          \
  X(ARG, y, ANY) X(ARG, first_row, S32) X(ARG, row_count, S32) X(RET, token, S32)  \
  JEP_ATTRS_LL_HARNESS(X)

#define JEP_OP_LL_HARNESS_COMBINE_RECV(X)                                          \
  X(ARG, token, S32) X(ARG, topk_idx, S32) X(ARG, topk_weights, F32)               \
  X(RET, out, ANY) JEP_ATTRS_LL_HARNESS(X)

// ---- internode (NVSHMEM): direct and hierarchical modes ----

#define JEP_ATTRS_TRANSPORT(X)                                                     \
  X(ATTR, num_ports, I64) X(ATTR, qps_per_port, I64) X(ATTR, chunk_bytes, I64)     \
  X(ATTR, call_site, I64)

#define JEP_OP_INTERNODE_DISPATCH(X)                                               \
  X(ARG, x, ANY) X(ARG, topk_idx, S32) X(ARG, topk_weights, F32)                   \
  JEP_RESULTS_DISPATCH(X) X(RET, counts, S32) X(RET, send_slot, S32)               \
  X(ATTR, num_experts, I64) X(ATTR, num_ranks, I64) X(ATTR, rank, I64)             \
  X(ATTR, capacity, I64) JEP_ATTRS_TRANSPORT(X)

// Combine (y[C, H] -> out[T, H]) and its transpose gather (g[T, H] -> out[C, H]).
#define JEP_ATTRS_INTERNODE_HANDLE(X)                                              \
  X(ATTR, num_ranks, I64) X(ATTR, rank, I64) X(ATTR, capacity, I64)                \
  X(ATTR, topk, I64) JEP_ATTRS_TRANSPORT(X)

#define JEP_OP_INTERNODE_COMBINE(X)                                                \
  X(ARG, y, ANY) X(ARG, counts, S32) X(ARG, send_slot, S32) X(RET, out, ANY)       \
  JEP_ATTRS_INTERNODE_HANDLE(X) X(ATTR, gpus_per_node, I64)

#define JEP_OP_INTERNODE_GATHER(X)                                                 \
  X(ARG, g, ANY) X(ARG, counts, S32) X(ARG, send_slot, S32) X(RET, out, ANY)       \
  JEP_ATTRS_INTERNODE_HANDLE(X)

#define JEP_OP_INTERNODE_HIER_DISPATCH(X)                                          \
  JEP_OP_INTERNODE_DISPATCH(X) X(ATTR, gpus_per_node, I64)

// src_index[C] is the dispatch handle's: it orders the rows a node's forwarder merges.
#define JEP_OP_INTERNODE_HIER_COMBINE(X)                                           \
  X(ARG, y, ANY) X(ARG, counts, S32) X(ARG, send_slot, S32) X(ARG, src_index, S32) \
  X(RET, out, ANY) JEP_ATTRS_INTERNODE_HANDLE(X) X(ATTR, gpus_per_node, I64)

#define JEP_OP_INTERNODE_HIER_GATHER(X)                                            \
  JEP_OP_INTERNODE_GATHER(X) X(ATTR, gpus_per_node, I64)

// ---- internode (NVSHMEM) low-latency mode: the send half's token (int32[2]) is the
// receive half's operand ----

#define JEP_ATTRS_INTERNODE_LL_GROUP(X)                                            \
  X(ATTR, num_experts, I64) X(ATTR, num_ranks, I64) X(ATTR, rank, I64)             \
  X(ATTR, max_tokens, I64)

#define JEP_ATTRS_INTERNODE_LL_PORTS(X)                                            \
  X(ATTR, num_ports, I64) X(ATTR, qps_per_port, I64) X(ATTR, call_site, I64)

#define JEP_ATTRS_INTERNODE_LL(X) JEP_ATTRS_INTERNODE_LL_GROUP(X) JEP_ATTRS_INTERNODE_LL_PORTS(X)

#define JEP_OP_INTERNODE_LL_DISPATCH_SEND(X)                                       \
  X(ARG, x, ANY) X(ARG, topk_idx, S32) X(RET, token, S32) JEP_ATTRS_INTERNODE_LL(X)

#define JEP_OP_INTERNODE_LL_DISPATCH_SEND_FP8(X)                                   \
  JEP_OP_INTERNODE_LL_DISPATCH_SEND(X) X(ATTR, round_scale, I64)

#define JEP_OP_INTERNODE_LL_DISPATCH_RECV(X)                                       \
  X(ARG, token, S32) X(RET, recv_x, ANY) JEP_RESULTS_LL_RECV(X)                    \
  JEP_ATTRS_INTERNODE_LL(X)

#define JEP_OP_INTERNODE_LL_DISPATCH_RECV_FP8(X)                                   \
  X(ARG, token, S32) X(RET, recv_x, ANY) X(RET, recv_scales, F32)                  \
  JEP_RESULTS_LL_RECV(X) JEP_ATTRS_INTERNODE_LL(X)

#define JEP_OP_INTERNODE_LL_COMBINE_SEND(X)                                        \
  X(ARG, y, ANY) X(ARG, first_row, S32) X(ARG, row_count, S32) X(RET, token, S32)  \
  JEP_ATTRS_INTERNODE_LL_GROUP(X) X(ATTR, rows_per_dest, I64)                      \
  JEP_ATTRS_INTERNODE_LL_PORTS(X)

#define JEP_OP_INTERNODE_LL_COMBINE_RECV(X)                                        \
  X(ARG, token, S32) X(ARG, topk_idx, S32) X(ARG, topk_weights, F32)               \
  X(RET, out, ANY) JEP_ATTRS_INTERNODE_LL(X)

// Every signature: S(Sig, TABLE) (Sig names the struct jax_ep::sig::Sig).
#define JEP_ALL_SIGNATURES(S)                                                      \
  S(Layout, JEP_OP_LAYOUT)                                                         \
  S(Dispatch, JEP_OP_DISPATCH)                                                     \
  S(Combine, JEP_OP_COMBINE)                                                       \
  S(CombineCpu, JEP_OP_COMBINE_CPU)                                                \
  S(Gather, JEP_OP_GATHER)                                                         \
  S(LLDispatchSend, JEP_OP_LL_DISPATCH_SEND)                                       \
  S(LLDispatchSendFp8, JEP_OP_LL_DISPATCH_SEND_FP8)                                \
  S(LLDispatchRecv, JEP_OP_LL_DISPATCH_RECV)                                       \
  S(LLDispatchRecvFp8, JEP_OP_LL_DISPATCH_RECV_FP8)                                \
  S(LLCombineSend, JEP_OP_LL_COMBINE_SEND)                                         \
  S(LLCombineRecv, JEP_OP_LL_COMBINE_RECV)                                         \
  S(HarnessDispatch, JEP_OP_HARNESS_DISPATCH)                                      \
  S(HarnessCombine, JEP_OP_HARNESS_COMBINE)                                        \
  S(HarnessGather, JEP_OP_HARNESS_GATHER)                                          \
  S(LLHarnessDispatchSend, JEP_OP_LL_HARNESS_DISPATCH_SEND)                        \
  S(LLHarnessDispatchRecv, JEP_OP_LL_HARNESS_DISPATCH_RECV)                        \
  S(LLHarnessCombineSend, JEP_OP_LL_HARNESS_COMBINE_SEND)                          \
  S(LLHarnessCombineRecv, JEP_OP_LL_HARNESS_COMBINE_RECV)                          \
  S(InternodeDispatch, JEP_OP_INTERNODE_DISPATCH)                                  \
  S(InternodeCombine, JEP_OP_INTERNODE_COMBINE)                                    \
  S(InternodeGather, JEP_OP_INTERNODE_GATHER)                                      \
  S(InternodeHierDispatch, JEP_OP_INTERNODE_HIER_DISPATCH)                         \
  S(InternodeHierCombine, JEP_OP_INTERNODE_HIER_COMBINE)                           \
  S(InternodeHierGather, JEP_OP_INTERNODE_HIER_GATHER)                             \
  S(InternodeLLDispatchSend, JEP_OP_INTERNODE_LL_DISPATCH_SEND)                    \
  S(InternodeLLDispatchSendFp8, JEP_OP_INTERNODE_LL_DISPATCH_SEND_FP8)             \
  S(InternodeLLDispatchRecv, JEP_OP_INTERNODE_LL_DISPATCH_RECV)                    \
  S(InternodeLLDispatchRecvFp8, JEP_OP_INTERNODE_LL_DISPATCH_RECV_FP8)             \
  S(InternodeLLCombineSend, JEP_OP_INTERNODE_LL_COMBINE_SEND)                      \
  S(InternodeLLCombineRecv, JEP_OP_INTERNODE_LL_COMBINE_RECV)

// ---------------------------------------------------------------------------------------
// Targets, per source file that defines their handlers.

// xla_ffi/cpu/cpu_handlers.cc (platform "cpu")
#define JEP_CPU_TARGETS(T)                                                                 \
  T("jax_ep_layout", Layout, LayoutCpuHandler, LayoutImpl, NONE, NONE)                     \
  T("jax_ep_dispatch", Dispatch, DispatchCpuHandler, DispatchImpl, RUN_ID, NONE)           \
  T("jax_ep_combine", CombineCpu, CombineCpuHandler, CombineImpl, RUN_ID, NONE)            \
  T("jax_ep_gather", Gather, GatherCpuHandler, GatherImpl, RUN_ID, NONE)

// xla_ffi/cpu/low_latency_handlers.cc (platform "cpu")
#define JEP_CPU_LL_TARGETS(T)                                                              \
  T("jax_ep_ll_dispatch_send", LLDispatchSend, LowLatencyDispatchSendCpuHandler,           \
    DispatchSendImpl, NONE, NONE)                                                          \
  T("jax_ep_ll_dispatch_recv", LLDispatchRecv, LowLatencyDispatchRecvCpuHandler,           \
    DispatchRecvImpl, RUN_ID, NONE)                                                        \
  T("jax_ep_ll_dispatch_send_fp8", LLDispatchSendFp8, LowLatencyDispatchSendFp8CpuHandler, \
    DispatchSendFp8Impl, NONE, NONE)                                                       \
  T("jax_ep_ll_dispatch_recv_fp8", LLDispatchRecvFp8, LowLatencyDispatchRecvFp8CpuHandler, \
    DispatchRecvFp8Impl, RUN_ID, NONE)                                                     \
  T("jax_ep_ll_combine_send", LLCombineSend, LowLatencyCombineSendCpuHandler,              \
    CombineSendImpl, NONE, NONE)                                                           \
  T("jax_ep_ll_combine_recv", LLCombineRecv, LowLatencyCombineRecvCpuHandler,              \
    CombineRecvImpl, RUN_ID, NONE)

// xla_ffi/cuda/cuda_handlers.cc (platform "CUDA"). The harness allocates its buffers
// lazily, so it is not command-buffer compatible.
#define JEP_CUDA_TARGETS(T)                                                                \
  T("jax_ep_layout", Layout, LayoutCudaHandler, LayoutImpl, CUDA, GRAPH_SAFE)              \
  T("jax_ep_dispatch", Dispatch, DispatchCudaHandler, DispatchImpl, CUDA, GRAPH_SAFE)      \
  T("jax_ep_combine", Combine, CombineCudaHandler, CombineImpl, CUDA, GRAPH_SAFE)          \
  T("jax_ep_gather", Gather, GatherCudaHandler, GatherImpl, CUDA, GRAPH_SAFE)              \
  T("jax_ep_harness_dispatch", HarnessDispatch, HarnessDispatchHandler,                    \
    HarnessDispatchImpl, CUDA, NONE)                                                       \
  T("jax_ep_harness_combine", HarnessCombine, HarnessCombineHandler, HarnessCombineImpl,   \
    CUDA, NONE)                                                                            \
  T("jax_ep_harness_gather", HarnessGather, HarnessGatherHandler, HarnessGatherImpl, CUDA, \
    NONE)

// xla_ffi/cuda/low_latency_handlers.cc (platform "CUDA"): the virtual-rank harness
// (allocates on first use: not command-buffer compatible), then the real ranks under the
// CPU's names.
#define JEP_CUDA_LL_TARGETS(T)                                                             \
  T("jax_ep_ll_harness_dispatch_send", LLHarnessDispatchSend,                              \
    LowLatencyHarnessDispatchSendHandler, DispatchSendImpl, CUDA, NONE)                    \
  T("jax_ep_ll_harness_dispatch_recv", LLHarnessDispatchRecv,                              \
    LowLatencyHarnessDispatchRecvHandler, DispatchRecvImpl, CUDA, NONE)                    \
  T("jax_ep_ll_harness_combine_send", LLHarnessCombineSend,                                \
    LowLatencyHarnessCombineSendHandler, CombineSendImpl, CUDA, NONE)                      \
  T("jax_ep_ll_harness_combine_recv", LLHarnessCombineRecv,                                \
    LowLatencyHarnessCombineRecvHandler, CombineRecvImpl, CUDA, NONE)                      \
  T("jax_ep_ll_dispatch_send", LLDispatchSend, LowLatencyDispatchSendCudaHandler,          \
    RankDispatchSendImpl, CUDA, GRAPH_SAFE)                                                \
  T("jax_ep_ll_dispatch_recv", LLDispatchRecv, LowLatencyDispatchRecvCudaHandler,          \
    RankDispatchRecvImpl, CUDA, GRAPH_SAFE)                                                \
  T("jax_ep_ll_dispatch_send_fp8", LLDispatchSendFp8, LowLatencyDispatchSendFp8CudaHandler,\
    RankDispatchSendFp8Impl, CUDA, GRAPH_SAFE)                                             \
  T("jax_ep_ll_dispatch_recv_fp8", LLDispatchRecvFp8, LowLatencyDispatchRecvFp8CudaHandler,\
    RankDispatchRecvFp8Impl, CUDA, GRAPH_SAFE)                                             \
  T("jax_ep_ll_combine_send", LLCombineSend, LowLatencyCombineSendCudaHandler,             \
    RankCombineSendImpl, CUDA, GRAPH_SAFE)                                                 \
  T("jax_ep_ll_combine_recv", LLCombineRecv, LowLatencyCombineRecvCudaHandler,             \
    RankCombineRecvImpl, CUDA, GRAPH_SAFE)

// xla_ffi/internode/internode_handlers.cc (platform "CUDA", NVSHMEM builds)
#define JEP_INTERNODE_TARGETS(T)                                                           \
  T("jax_ep_internode_dispatch", InternodeDispatch, InternodeDispatchHandler,              \
    DispatchImpl, STREAM, GRAPH_SAFE)                                                      \
  T("jax_ep_internode_combine", InternodeCombine, InternodeCombineHandler, CombineImpl,    \
    STREAM, GRAPH_SAFE)                                                                    \
  T("jax_ep_internode_gather", InternodeGather, InternodeGatherHandler, GatherImpl,        \
    STREAM, GRAPH_SAFE)

// xla_ffi/internode/hierarchical_handlers.cc (platform "CUDA", NVSHMEM builds)
#define JEP_INTERNODE_HIER_TARGETS(T)                                                      \
  T("jax_ep_internode_hier_dispatch", InternodeHierDispatch, InternodeHierDispatchHandler, \
    DispatchImpl, STREAM, GRAPH_SAFE)                                                      \
  T("jax_ep_internode_hier_combine", InternodeHierCombine, InternodeHierCombineHandler,    \
    CombineImpl, STREAM, GRAPH_SAFE)                                                       \
  T("jax_ep_internode_hier_gather", InternodeHierGather, InternodeHierGatherHandler,       \
    GatherImpl, STREAM, GRAPH_SAFE)

// xla_ffi/internode/low_latency_handlers.cc (platform "CUDA", NVSHMEM builds)
#define JEP_INTERNODE_LL_TARGETS(T)                                                        \
  T("jax_ep_internode_ll_dispatch_send", InternodeLLDispatchSend,                          \
    InternodeLLDispatchSendHandler, DispatchSendImpl, STREAM, GRAPH_SAFE)                  \
  T("jax_ep_internode_ll_dispatch_recv", InternodeLLDispatchRecv,                          \
    InternodeLLDispatchRecvHandler, DispatchRecvImpl, STREAM, GRAPH_SAFE)                  \
  T("jax_ep_internode_ll_dispatch_send_fp8", InternodeLLDispatchSendFp8,                   \
    InternodeLLDispatchSendFp8Handler, DispatchSendFp8Impl, STREAM, GRAPH_SAFE)            \
  T("jax_ep_internode_ll_dispatch_recv_fp8", InternodeLLDispatchRecvFp8,                   \
    InternodeLLDispatchRecvFp8Handler, DispatchRecvFp8Impl, STREAM, GRAPH_SAFE)            \
  T("jax_ep_internode_ll_combine_send", InternodeLLCombineSend,                            \
    InternodeLLCombineSendHandler, CombineSendImpl, STREAM, GRAPH_SAFE)                    \
  T("jax_ep_internode_ll_combine_recv", InternodeLLCombineRecv,                            \
    InternodeLLCombineRecvHandler, CombineRecvImpl, STREAM, GRAPH_SAFE)
