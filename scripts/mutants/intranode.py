"""Planted mistakes in kernels/cuda/intranode_kernels.cu (see scripts/mutants/__init__.py for the fields)."""
from __future__ import annotations

from . import Mutant
from ._paths import *  # noqa: F401,F403

QUICK = (T_INTRA, "-k", "test_dispatch_combine_gather and not full")
RINGS = (T_INTRA, "-k", "rings")
GATHER = (T_INTRA, "-k", "gather_ or rings")
BULK = (T_INTRA, "-k", "bulk")

MUTANTS = [
    # --------------------------------------------------------- intranode dispatch
    Mutant("dispatch_counts_zeroed", INTRA,
           "site == kSiteFailed ? 0 : s_run[j]", "0", QUICK,
           "a count zeroed: receivers see no rows from this source"),
    Mutant("dispatch_bad_id_not_told", INTRA,
           "peer::store(&ph->bad_ids[me], s_bad ? static_cast<int64_t>(s_n) : int64_t{0});",
           "peer::store(&ph->bad_ids[me], int64_t{0});",
           (T_INTRA, "-k", "bad_id_is_recorded"),
           "the verdict of the value check left out of the header: a bad id is recorded "
           "on its own rank only, and its peers go on as if nothing happened"),
    Mutant("dispatch_receiver_base_off_by_one", INTRA,
           "for (int s = 0; s < me; ++s) b += peer::load_volatile(&hdr->counts[s][threadIdx.x]);",
           "for (int s = 0; s <= me; ++s) b += peer::load_volatile(&hdr->counts[s][threadIdx.x]);",
           QUICK, "off-by-one in an offset: send_row points past this source's rows"),
    Mutant("dispatch_credit_wait_one_epoch_short", INTRA,
           "wait_all(a.c, hdr->credit, s_n - 1, kOpDispatch);",
           "wait_all(a.c, hdr->credit, s_n - 2, kOpDispatch);",
           (T_INTRA, "-k", "pipelined or rings"),
           "credit taken an epoch early: a sender starts the next epoch while its receiver "
           "still reads this one's counts and rings"),
    Mutant("last_block_counter_bound", INTRA,
           "    s_last = prev == gridDim.x - 1;\n    if (s_last) {\n      h->done[counter] = 0;\n"
           "      peer::fence_data();\n    }\n  }\n  __syncthreads();\n  return s_last;\n}",
           "    s_last = prev == gridDim.x - 2;\n    if (s_last) {\n      h->done[counter] = 0;\n"
           "      peer::fence_data();\n    }\n  }\n  __syncthreads();\n  return s_last;\n}",
           (T_INTRA, "tests/emu/test_preemption_emu.py", "-k",
            "one_channel or every_block or pipelined or rings or preempted_peer"),
           "off-by-one: the block closing the epoch is not the last to finish (a failed "
           "call's outputs are not emptied when the error comes from a later block)"),
    # --------------------------------------------------------- intranode combine
    Mutant("combine_row_wait_skipped", INTRA,
           "  if (peer::load_acquire(tail) > pos) return true;\n"
           "  if (peer::wait_geq(tail, pos + 1, c.timeout_ns, &g_intranode_stop)) return true;",
           "  return true;\n  if (peer::wait_geq(tail, pos + 1, c.timeout_ns, &g_intranode_stop)) return true;",
           (T_INTRA, "-k", "test_dispatch_combine_gather or seeds_agree or rings"),
           "skipped wait: rows are summed before they arrive"),
    Mutant("combine_request_lo_off_by_one", INTRA,
           "peer::store(&ph->c_req_lo[ch][me], first);", "peer::store(&ph->c_req_lo[ch][me], first + 1);",
           QUICK, "off-by-one in the requested rows"),
    Mutant("combine_self_wrong_row", INTRA,
           "(static_cast<int64_t>(s_lo[lane]) + j_l) * a.row_bytes;",
           "(static_cast<int64_t>(s_lo[lane]) + j_l + 1) * a.row_bytes;",
           QUICK, "a token owner sums the next row of its own y in place of its own row"),
    Mutant("combine_waits_for_own_row", INTRA,
           "for (uint32_t m = valid & ~(1u << me); m != 0 && good; m &= m - 1) {",
           "for (uint32_t m = valid; m != 0 && good; m &= m - 1) {",
           QUICK, "a summing warp waits for its own row in ring (ch, me), which no sender "
           "fills (own rows stay in y): the call times out"),
    Mutant("combine_drains_own_ring", INTRA,
           "  if (warp < R && warp != me && lane == 0) {", "  if (warp < R && lane == 0) {",
           QUICK, "the drain at the end waits on ring (ch, me), which no sender fills: the "
           "call times out"),
    Mutant("combine_self_rows_through_ring", INTRA,
           "  if (d == me) return;\n", "  if (false) return;\n",
           RINGS, "a rank's own rows also copied into ring (ch, me), which nobody reads or "
           "hands back: the ring counters move (and a full ring's sender times out)"),
    # --------------------------------------------------------- rings (dispatch and combine)
    Mutant("dispatch_early_credit", INTRA,
           "    if (lane == 0) peer::signal(head, k);",
           "    if (lane == 0) peer::signal(head, k + chunk);",
           RINGS, "early credit: a chunk of slots handed back before they are read (the sender "
           "overwrites rows the receiver reads next)"),
    Mutant("ring_tail_published_before_data", ENGINE,
           "  peer::fence_data();\n  g.sync();\n  if (g.tid == 0) peer::signal(flag, value);",
           "  g.sync();\n  if (g.tid == 0) peer::signal(flag, value);",
           (T_INTRA, "-k", "rings or seeds_agree or test_dispatch_combine_gather"),
           "tail published before the lanes' rows are fenced: the receiver reads stale slots"),
    Mutant("dispatch_wrong_ring_slot", INTRA,
           "      const uint64_t slot = k % Q;\n      group_copy<CopySrc::kReadOnly, kU>",
           "      const uint64_t slot = (k + 1) % Q;\n      group_copy<CopySrc::kReadOnly, kU>",
           RINGS, "wrong ring slot: the sender writes the slot after the one the receiver reads"),
    Mutant("combine_wrong_ring_slot", INTRA,
           "src[lane] = area + lane * rb + (pos % Q) * stride;",
           "src[lane] = area + lane * rb + ((pos + 1) % Q) * stride;",
           RINGS, "wrong ring slot: the token owner sums the next slot's row"),
    Mutant("combine_early_credit", INTRA,
           "const uint64_t h = s_base[tid] + static_cast<uint64_t>(s_used[tid]);",
           "const uint64_t h = s_base[tid] + static_cast<uint64_t>(s_used[tid]) + 1;",
           RINGS, "early credit: one slot more handed back than the chunk consumed"),
    Mutant("combine_send_ignores_credit", INTRA,
           "      if (!warp_wait_counter(a.c, &hdr->c_ring.head[ch][d], k - Q + 1, d, kOpCombine, &credit)) break;",
           "      credit = k - Q + 1;",
           RINGS, "a full ring not waited for: the sender overwrites rows not yet summed"),
    # --------------------------------------------------------- channel blocks' roles
    Mutant("dispatch_warps_send_to_even_ranks", INTRA,
           "    dispatch_send<kU>(a, ch, warp, s_fail, n, sm);",
           "    dispatch_send<kU>(a, ch, warp & ~1, s_fail, n, sm);",
           QUICK, "the sending warp of an odd rank sends to the even rank below it: the odd "
           "ranks' rings get nothing and the even ones' two writers"),
    Mutant("combine_both_halves_send_to_even_ranks", INTRA,
           "    if (d < R) combine_send<kU>(a, ch, d, s_fail_send);",
           "    if (d < R) combine_send<kU>(a, ch, d & ~1, s_fail_send);",
           QUICK, "both blocks of a channel answer the even ranks: the odd ones' sums miss rows"),
    Mutant("dispatch_unsplit_odd_block_sends", INTRA,
           "const bool sends = split || (blockIdx.x & 1) == 0,",
           "const bool sends = true,",
           (T_INTRA, "-k", "both_sides"),
           "past kMaxSplitSendRanks, block 2ch + 1 sends to every rank too: two writers per "
           "ring, and its warps never receive"),
    Mutant("combine_recv_barrier_short", INTRA,
           "    // Every warp's reads of the chunk's slots are done: hand them back.\n"
           "    peer::sync_threads(kRecvBarrier, rthreads);",
           "    // Every warp's reads of the chunk's slots are done: hand them back.\n"
           "    peer::sync_threads(kRecvBarrier, rthreads - 32);",
           RINGS, "the receiving warps' barrier one warp short: a chunk's slots go back "
           "before its last warp read them"),
    Mutant("combine_recv_barrier_waits_for_senders", INTRA,
           "    // Every warp's reads of the chunk's slots are done: hand them back.\n"
           "    peer::sync_threads(kRecvBarrier, rthreads);",
           "    // Every warp's reads of the chunk's slots are done: hand them back.\n"
           "    __syncthreads();",
           RINGS, "the summing warps meet at the whole block's barrier: they wait for the "
           "sending warps beside them, which wait for credits from other ranks' summing "
           "warps (a deadlock once the rings fill)"),
    Mutant("dispatch_self_rows_uncounted", INTRA,
           "        if (local >= 0 && local < el) atomicAdd(&a.recv_per_expert[local], 1);\n      }\n"
           "      if (lane == 0) {\n        a.src_rank[rr] = me;",
           "      }\n      if (lane == 0) {\n        a.src_rank[rr] = me;",
           QUICK, "a rank's own rows (written straight into the outputs) left out of its "
           "per-expert counts"),
    Mutant("dispatch_self_wrong_source_index", INTRA,
           "        a.src_index[rr] = tt;", "        a.src_index[rr] = tt + 1;",
           QUICK, "a rank's own rows name the next token as their source"),
    Mutant("dispatch_receiver_waits_on_own_ring", INTRA,
           "receives && src >= 0 && src < R && src != me)", "receives && src >= 0 && src < R)",
           QUICK, "a receiving warp waits on ring (ch, me), which no sender fills (own rows "
           "skip the rings): the call times out"),
    Mutant("dispatch_self_rows_through_ring", INTRA,
           "  if (d == me) {\n    dispatch_self<kU>(a, ch, fail, sm);", "  if (false) {\n    dispatch_self<kU>(a, ch, fail, sm);",
           QUICK, "a rank's own rows go into ring (ch, me), which no receiving warp reads: "
           "they never reach the outputs"),
    Mutant("dispatch_fill_skips_first_row", INTRA,
           "for (int i = kept + blockIdx.x * nw + warp; i < a.C; i += gridDim.x * nw)\n",
           "for (int i = kept + 1 + blockIdx.x * nw + warp; i < a.C; i += gridDim.x * nw)\n",
           QUICK, "the first row past the received ones is not filled"),
    # --------------------------------------------------------- dispatch's bulk copies (TMA)
    Mutant("bulk_load_not_waited", COMMON,
           "    if (!peer::mbar_wait(st.mbar[b], (st.phase >> b) & 1u, st.timeout_ns)) {\n"
           "      st.failed = true;\n      return false;\n    }\n", "",
           BULK, "a piece is stored from shared memory without waiting for its load"),
    Mutant("bulk_wait_wrong_parity", COMMON,
           "(st.phase >> b) & 1u, st.timeout_ns)", "((st.phase >> b) & 1u) ^ 1u, st.timeout_ns)",
           BULK, "the wait asks for the phase before (done already): it returns before the "
           "load lands"),
    Mutant("bulk_piece_reused_before_read", COMMON,
           "      peer::bulk_wait_read<0>();  // piece p - 1's store has read buf[b ^ 1]\n", "",
           BULK, "piece p + 1 loads into the buffer piece p - 1's store may still read"),
    Mutant("bulk_row_start_not_waited", COMMON,
           "  // The previous row's last stores have read the pieces.\n  peer::bulk_wait_read<0>();\n",
           "",
           BULK, "a row's first piece loads into a buffer the previous row's last store may "
           "still read"),
    Mutant("bulk_next_piece_wrong_offset", COMMON,
           "src + static_cast<size_t>(p + 1) * st.bytes", "src + static_cast<size_t>(p) * st.bytes",
           BULK, "piece p + 1 loads piece p's bytes again"),
    Mutant("bulk_zero_first_piece_only", COMMON,
           "for (size_t off = 0; off < n; off += zbytes)", "for (size_t off = 0; off < zbytes; off += zbytes)",
           BULK, "an empty row gets zeros in its first piece only"),
    Mutant("bulk_stores_not_waited_at_exit", INTRA,
           "  peer::bulk_wait_all();\n  if (last_block(a.c, kDoneDispatchChannel)) {",
           "  if (last_block(a.c, kDoneDispatchChannel)) {",
           BULK, "a block finishes with its bulk stores in flight: its shared memory may go "
           "to another block before they read it"),
    Mutant("bulk_stage_of_wrong_source", INTRA,
           "  BulkStage st = dispatch_stage(a, sm, s);", "  BulkStage st = dispatch_stage(a, sm, 0);",
           BULK, "two receiving warps of a block share one source's staging pieces and "
           "mbarriers"),
    Mutant("dispatch_two_blocks_one_channel", INTRA,
           "const int ch = split ? static_cast<int>(blockIdx.x) :",
           "const int ch = split ? static_cast<int>(blockIdx.x >> 1) :",
           QUICK, "blocks 2ch and 2ch + 1 both take channel ch (a block per channel is the "
           "design): two writers and two readers per ring, and the odd channels' tokens "
           "never sent"),
    # --------------------------------------------------------- intranode gather (cached dispatch)
    Mutant("gather_self_wrong_token", INTRA,
           "g + static_cast<int64_t>(a.src_index[i]) * a.row_bytes", "g + static_cast<int64_t>(a.src_index[i] + 1) * a.row_bytes",
           GATHER, "a rank's own rows (copied straight from g) taken from the next token"),
    Mutant("gather_self_rows_through_rings", INTRA,
           "  if (s == me) {\n    gather_self<kU>(a, lo, cnt, fail);", "  if (false) {\n    gather_self<kU>(a, lo, cnt, fail);",
           GATHER, "a rank's own rows asked for through rings (ch, me), which no sending "
           "warp answers: the call times out"),
    Mutant("gather_sender_answers_itself", INTRA,
           "if (q < R && q != me) gather_send<kU>(a, ch, q, n);", "if (q < R) gather_send<kU>(a, ch, q, n);",
           GATHER, "a sending warp waits for its own rank's ids, which gather_self never "
           "posts: the call times out"),
    Mutant("gather_both_halves_send_to_even_ranks", INTRA,
           "    const int q = split ? 2 * warp + half : warp;", "    const int q = split ? 2 * warp : warp;",
           GATHER, "both blocks of a channel answer the even ranks: the odd ones' ids go "
           "unanswered (and the even ones' rings get two writers)"),
    Mutant("gather_unsplit_odd_block_sends", INTRA,
           "ChannelSendWarps(R) : 0, rw0 = ChannelRecvWarp0(R);\n  const int rnw = ChannelRecvWarps(R);",
           "ChannelSendWarps(R) : ChannelSendWarps(R), rw0 = ChannelRecvWarp0(R);\n  const int rnw = ChannelRecvWarps(R);",
           (T_INTRA, "-k", "both_sides"),
           "past kMaxSplitSendRanks, gather's block 2ch + 1 answers every rank too: two "
           "writers per ring, and its warps never receive"),
    Mutant("gather_recv_barrier_waits_for_senders", INTRA,
           "      atomicAdd(&s_cnt[s], 1);\n    }\n    peer::sync_threads(kRecvBarrier, rthreads);",
           "      atomicAdd(&s_cnt[s], 1);\n    }\n    __syncthreads();",
           GATHER, "gather's receiving warps meet at the whole block's barrier: they wait for "
           "the sending warps beside them, which wait for other ranks' receivers to ask"),
    Mutant("gather_recv_barrier_short", INTRA,
           "      atomicAdd(&s_cnt[s], 1);\n    }\n    peer::sync_threads(kRecvBarrier, rthreads);",
           "      atomicAdd(&s_cnt[s], 1);\n    }\n    peer::sync_threads(kRecvBarrier, rthreads - 32);",
           GATHER, "gather's receiving warps' barrier one warp short: a source's range is "
           "read before the last warp counted its rows"),
    Mutant("gather_early_credit", INTRA,
           "if (posted < end && room >= (want < chunk ? want : chunk)) post(k + Q < end ? k + Q : end);",
           "if (posted < end && room >= (want < chunk ? want : chunk)) post(k + Q + 1 < end ? k + Q + 1 : end);",
           GATHER, "early credit: an id posted a slot ahead of the rows read (the sender "
           "overwrites the row the receiver reads next)"),
    Mutant("gather_first_ids_overrun", INTRA,
           "post(end - base < Q ? end : base + Q);", "post(end - base <= Q ? end : base + Q + 1);",
           GATHER, "more first ids than ring slots: the last overwrites the first one's slot "
           "and its row the first row's"),
    Mutant("gather_wrong_data_slot", INTRA,
           "      char* dst = dbase + (j % Q) * stride;",
           "      char* dst = dbase + ((j + 1) % Q) * stride;",
           GATHER, "wrong ring slot: the sender writes the slot after the one the receiver reads"),
    Mutant("gather_wrong_id_slot", INTRA,
           "peer::store(&ids[j % Q], a.src_index[lo + static_cast<int64_t>(j - base)]);",
           "peer::store(&ids[(j + 1) % Q], a.src_index[lo + static_cast<int64_t>(j - base)]);",
           GATHER, "wrong request slot: the sender reads another row's token id"),
    Mutant("gather_tail_ahead_of_rows", INTRA,
           "      if (j + 1 - published >= chunk) {\n        publish_tail(tail, j + 1);",
           "      if (j + 1 - published >= chunk) {\n        publish_tail(tail, j + 2);",
           GATHER, "tail before data: a row counted as written before it is"),
    Mutant("gather_ids_read_before_posted", INTRA,
           "if (!warp_wait_counter(a.c, posted, k + 1, q, kOpGather, &avail)) break;",
           "if (!warp_wait_counter(a.c, posted, k, q, kOpGather, &avail)) break;\n"
           "      avail = k + 1;",
           GATHER, "skipped wait: the sender reads a request slot before its id is posted"),
    Mutant("gather_skipped_arrival_signal", INTRA,
           "    peer::signal(&qh->g_arr_epoch[ch][me], n);", "", QUICK,
           "skipped signal: receivers never learn the sender's call site and time out"),
    Mutant("gather_count_off_by_one", INTRA,
           "peer::store(&sh->g_req_n[ch][me], cnt);", "peer::store(&sh->g_req_n[ch][me], cnt + 1);",
           GATHER, "off-by-one count: the sender waits for an id that never comes"),
    Mutant("gather_range_not_checked", INTRA,
           "if (rtid < R && s_cnt[rtid] > 0 && s_hi[rtid] - s_lo[rtid] + 1 != s_cnt[rtid]) {",
           "if (rtid < R && s_cnt[rtid] > 0 && s_hi[rtid] - s_lo[rtid] + 1 != s_cnt[rtid] && false) {",
           (T_INTRA, "-k", "gather_foreign"),
           "a foreign handle's broken range taken as contiguous: wrong rows, nothing reported"),
    Mutant("gather_epoch_not_advanced", INTRA,
           "    if (threadIdx.x == 0) hdr->seq[kOpGather] = n;", "", GATHER,
           "the epoch kept: the next call reads the last one's counts and sites"),
    Mutant("gather_failed_rank_sends_rows", INTRA,
           "  uint64_t k = fail ? end : base, published = base, avail = base;",
           "  uint64_t k = base, published = base, avail = base;",
           (T_INTRA, "-k", "gather_call_site or gather_rank"),
           "a failed sender still streams rows to a receiver that skipped its ring (it waits "
           "for ids that never come)"),
    # ------------------------------------ hardware rules: fence scope, async proxy, TMA, loads
    # A .gpu fence orders nothing for another GPU (PTX ISA, Memory Consistency Model,
    # "Scope"): the emulator's .gpu fences leave a thread's peer stores buffered.
    Mutant("fence_data_gpu_scope", PEER,
           "__device__ __forceinline__ void fence_data() { __threadfence_system(); }",
           "__device__ __forceinline__ void fence_data() { __threadfence(); }",
           (T_INTRA, "-k", "rings or seeds_agree or test_dispatch_combine_gather"),
           "fence_data at .gpu scope: the lanes' row stores into a peer's ring are not "
           "ordered before the tail's release as the peer sees them"),
    Mutant("ring_tail_fence_gpu_scope", ENGINE,
           "  peer::fence_data();\n  g.sync();\n  if (g.tid == 0) peer::signal(flag, value);",
           "  __threadfence();\n  g.sync();\n  if (g.tid == 0) peer::signal(flag, value);",
           (T_INTRA, "-k", "rings or seeds_agree or test_dispatch_combine_gather"),
           "the fence before a ring's tail at .gpu scope (__threadfence): the receiver, "
           "another GPU, reads stale slots"),
    Mutant("bulk_no_shared_proxy_fence", INTRA,
           "  peer::fence_bulk_shared();  // the zeros and mbarriers, before any bulk copy uses them\n",
           "",
           BULK, "no fence.mbarrier_init / fence.proxy.async.shared: the bulk copies may see "
           "the mbarriers uninitialized and the zero piece's garbage (emulator fault)"),
    Mutant("bulk_no_global_proxy_fence", INTRA,
           "      if (bulk) peer::fence_bulk_global();  // the rows the tail covers, for the bulk loads\n",
           "",
           BULK, "no fence.proxy.async.global after the tail's acquire: the bulk loads (async "
           "proxy) read ring rows older than the tail says (stale bytes in some seeds)"),
    Mutant("aligned16_relaxed_to_8", COMMON,
           "return ((reinterpret_cast<uintptr_t>(a) | reinterpret_cast<uintptr_t>(b) | n) & 15u) == 0;",
           "return ((reinterpret_cast<uintptr_t>(a) | reinterpret_cast<uintptr_t>(b) | n) & 7u) == 0;",
           (T_INTRA, "-k", "full and fp8"),
           "8-byte alignment taken for 16: 72-byte FP8 rows go as bulk copies, which must be "
           "16-byte aligned and sized (a misaligned-address fault)"),
    Mutant("bulk_expect_tx_too_many_bytes", PEER,
           "  mbar_arrive_expect_tx(mbar, n);\n  bulk_load_tx(smem, src, n, mbar);",
           "  mbar_arrive_expect_tx(mbar, n + 16);\n  bulk_load_tx(smem, src, n, mbar);",
           BULK, "expect_tx announces more bytes than the copy lands: the phase never "
           "completes (a hang on a GPU; the bounded wait times out)"),
    Mutant("bulk_expect_tx_too_few_bytes", PEER,
           "  mbar_arrive_expect_tx(mbar, n);\n  bulk_load_tx(smem, src, n, mbar);",
           "  mbar_arrive_expect_tx(mbar, n / 2);\n  bulk_load_tx(smem, src, n, mbar);",
           BULK, "expect_tx announces fewer bytes than the copy lands: the phase completes "
           "before the piece has landed and the rest counts against the next phase"),
    Mutant("combine_ring_read_nc", INTRA,
           "if (rr[u] >= 0) q[u] = engine_load16<CopySrc::kPeerWritten>(src[rr[u]] + c * 16);",
           "if (rr[u] >= 0) q[u] = engine_load16<CopySrc::kReadOnly>(src[rr[u]] + c * 16);",
           RINGS, "a ring row (written by a peer while the kernel runs) read through the "
           "non-coherent path: a slot reused by a later row may read the earlier one"),
    Mutant("wait_geq_plain_poll", PEER,
           "  while (load_acquire(flag) < value) {",
           "  while (*reinterpret_cast<const volatile uint64_t*>(flag) < value) {",
           (T_LINT,), "a poll through a volatile load: no acquire (what the flag guards may be "
           "read older) and a stale line may be served (the emulator reorders no loads; the "
           "source lint finds it)"),
]
