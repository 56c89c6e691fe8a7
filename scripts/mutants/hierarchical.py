"""Planted mistakes in kernels/internode/hierarchical_kernels.cu (see scripts/mutants/__init__.py for the fields)."""
from __future__ import annotations

from . import Mutant
from ._paths import *  # noqa: F401,F403

MUTANTS = [
    # ---------------------------------------------------------- internode hierarchical
    Mutant("hier_credit_early", HIER,
           "        Tr::signal(transport::Set(v.credit + g.node, static_cast<uint64_t>(c + 1),",
           "        Tr::signal(transport::Set(v.credit + g.node, static_cast<uint64_t>(c + 2),",
           (T_HIER, "-k", "small_rings"),
           "credit returned early: the sender overwrites a ring slot not yet forwarded"),
    Mutant("hier_source_credit_early", HIER,
           "                                          : pos[k] / kRdmaChunkRows;",
           "                                          : (pos[k] + kRdmaChunkRows - 1) / kRdmaChunkRows;",
           (T_HIER, "-k", "small_rings"),
           "the combine source credits the chunk it is still reading: the forwarder "
           "overwrites partials not yet summed"),
    Mutant("hier_source_window_overfills_ring", HIER,
           "              if (wl[l] + 1 > kNvlRingRows) fits = false;\n",
           "",
           (T_HIER, "-k", "small_rings"),
           "a source window takes more rows of an NVLink ring than it has free slots: it waits "
           "for rows its pusher can only write once the window itself frees the ring"),
    Mutant("hier_source_window_overspans_stream", HIER,
           "          if (o / kRdmaChunkRows - pos[k] / kRdmaChunkRows + 1 > kRdmaRingChunks) fits = false;\n",
           "",
           (T_HIER, "-k", "small_rings"),
           "a source window spans more chunks of a node's stream than the forwarder may put "
           "before the window's own credit"),
    Mutant("hier_source_head_past_window", HIER,
           "      if (sb == 0) StoreRel(HeadW(v, g, tid, g.node), nvl_head[tid]);",
           "      if (sb == 0) StoreRel(HeadW(v, g, tid, g.node), nvl_head[tid] + 1);",
           (T_HIER, "-k", "small_rings"),
           "the source's head release frees one slot more than its windows read: the pusher "
           "overwrites a row not yet summed"),
    Mutant("hier_source_item_row_unshifted", HIER,
           "              it[n++] = make_int2(l, static_cast<int>(nvl_head[l]) + wl[l]);",
           "              it[n++] = make_int2(l, static_cast<int>(nvl_head[l]));",
           (T_HIER, "-k", "matches_reference or small_rings"),
           "a window's tokens all read the first row of an own-node ring past the head"),
    Mutant("hier_source_join_skipped", HIER,
           "        for (int b = 1; b < B && !s_stop; ++b) {",
           "        for (int b = B; b < B && !s_stop; ++b) {",
           (T_HIER, "-k", "own_node"),
           "block 0 frees a window's rows without waiting for the other source blocks: the "
           "pushers overwrite rows a block has not summed yet"),
    Mutant("hier_source_join_one_window_behind", HIER,
           "          if (!WaitAtLeast(g, [w] { return LoadAcq(w); }, mark, g.rank, kKindSource, b))",
           "          if (!WaitAtLeast(g, [w] { return LoadAcq(w); }, mark - 1, g.rank, kKindSource, b))",
           (T_HIER, "-k", "own_node"),
           "block 0 frees window w once the other blocks have summed window w - 1"),
    Mutant("hier_source_columns_gap", HIER,
           "  const int64_t v0 = nvec * sb / B, v1 = nvec * (sb + 1) / B;",
           "  const int64_t v0 = nvec * sb / B + 1, v1 = nvec * (sb + 1) / B;",
           (T_HIER, "-k", "split_the_columns"),
           "each source block's column slice starts one vector late: those columns of the "
           "output are never written"),
    Mutant("hier_fwd_join_skipped", HIER,
           "      else if (JoinParts(g, done, fp * cq, mark))",
           "      else if (JoinParts(g, done, 1, mark))",
           (T_HIER, "-k", "role_parts"),
           "the rail forwarder's part 0 credits a chunk without waiting for the other parts: "
           "the sender overwrites rows a lagging part has not forwarded yet"),
    Mutant("hier_fwd_join_one_chunk_behind", HIER,
           "      else if (JoinParts(g, done, fp * cq, mark))",
           "      else if (JoinParts(g, done, fp * cq, mark - 1))",
           (T_HIER, "-k", "role_parts"),
           "part 0 credits chunk c once the other parts are done with chunk c - 1"),
    Mutant("hier_send_closing_one_part", HIER,
           "    if (ch % sp == p)\n",
           "    if (ch % sp == 0)\n",
           (T_HIER, "-k", "matches_reference or role_parts"),
           "only the QPs of part 0 get the stream's closing signal (part 0 sends it for every "
           "QP of its own) while the other parts' QPs never close"),
    Mutant("hier_send_skips_its_chunk", HIER,
           "    for (int64_t c = c0; c <= c1 && !mine && any != 0; ++c) mine = c % sp == p;",
           "    for (int64_t c = c0; c < c1 && !mine && any != 0; ++c) mine = c % sp == p;",
           (T_HIER, "-k", "matches_reference or role_parts"),
           "a sender part skips 32 tokens whose rows start a chunk of its own only in the last "
           "chunk they touch: that chunk's first rows are never written"),
    Mutant("hier_fwd_receivers_overlap", HIER,
           "  for (int l = p; l < g.G; l += fp) own |= 1u << l;",
           "  for (int l = p; l < g.G; l += 1) own |= 1u << l;",
           (T_HIER, "-k", "matches_reference or role_parts"),
           "forwarder parts share receivers: a ring gets two writers that each count its "
           "slots"),
    Mutant("hier_cfwd_join_skipped", HIER,
           "      else ok = JoinParts(g, done, cp, mark) ? 1 : 0;",
           "      else ok = JoinParts(g, done, 1, mark) ? 1 : 0;",
           (T_HIER, "-k", "role_parts"),
           "the combine forwarder's part 0 puts a chunk without waiting for the other parts: "
           "their columns of the partials go out unwritten"),
    Mutant("hier_cfwd_head_past_chunk", HIER,
           "        StoreRel(HeadW(v, g, lane, n), head);\n        pub = head;",
           "        StoreRel(HeadW(v, g, lane, n), head + 1);\n        pub = head;",
           (T_HIER, "-k", "role_parts or small_rings_wrap"),
           "the combine forwarder frees one ring slot more than its chunks summed: a pusher "
           "overwrites a row a part has not read yet"),
    Mutant("hier_cfwd_columns_gap", HIER,
           "  const int64_t v0 = nvec * p / cp, v1 = nvec * (p + 1) / cp;",
           "  const int64_t v0 = nvec * p / cp + 1, v1 = nvec * (p + 1) / cp;",
           (T_HIER, "-k", "role_parts"),
           "each combine forwarder part's column slice starts one vector late: those columns "
           "of the node partials are never written"),
    Mutant("hier_chunk_wrong_qp", HIER,
           "  const int q = ChunkQp(g, peer, c);\n  Tr::put_signal_warp(",
           "  const int q = ChunkQp(g, peer, c + 1);\n  Tr::put_signal_warp(",
           (T_HIER, "-k", "matches_reference or small_rings"),
           "wrong QP: a chunk signals the word of another QP than its reader waits on"),
    Mutant("hier_stream_words_not_reset", HIER,
           "      ok = 0;\n    }\n    *w = 0;",
           "      ok = 0;\n    }",
           (T_HIER, "-k", "small_rings"),
           "data words not reset by their reader: the next call of the half sees stale counts"),
    Mutant("hier_counts_zeroed", HIER,
           "      counts_out[i] = failed ? -1 : v.counts[(i / g.R) * cs + i % g.R];",
           "      counts_out[i] = 0;",
           (T_HIER, "-k", "matches_reference"),
           "count zeroed: the dispatch handle loses its count matrix"),
    Mutant("hier_chunk_release_dropped", HIER,
           "    // the chunk's rows: one release per ring, before the credit frees them\n"
           "    if (!NvlFlush(g, &f, &cols)) return;\n",
           "",
           (T_HIER, "-k", "matches_reference or small_rings"),
           "the rail forwarder never publishes a chunk's NVLink rows (only a full ring is "
           "flushed): the receivers wait for rows already written"),
    Mutant("hier_push_release_one_row", HIER,
           "        else if (JoinParts(g, done, pp, mark)) StoreRel(tw, tl + cnt);",
           "        else if (JoinParts(g, done, pp, mark)) StoreRel(tw, tl + 1);",
           (T_HIER, "-k", "matches_reference or small_rings"),
           "the combine pusher's one release per batch publishes one row of the batch"),
    Mutant("hier_push_batch_past_room", HIER,
           "      batch = room >= want ? want : 0;",
           "      batch = want;",
           (T_HIER, "-k", "matches_reference or small_rings"),
           "the combine pusher writes its batch whether or not the ring has room: it "
           "overwrites rows the reader has not released"),
    Mutant("hier_push_waits_for_empty_ring", HIER,
           "      const long long want = n - next < kPushRows ? n - next : kPushRows;",
           "      const long long want = n - next < kNvlRingRows ? n - next : kNvlRingRows;",
           (T_HIER, "-k", "small_rings"),
           "the combine pusher waits for a whole free ring: a reader that holds rows "
           "unreleased while it waits for the next one never gets it"),
    Mutant("hier_push_batch_what_is_free", HIER,
           "      batch = room >= want ? want : 0;",
           "      batch = want < room ? want : room;",
           (T_HIER, "-k", "half_a_ring"),
           "the combine pusher writes whatever the ring has free (no wait for room for a "
           "batch): once the ring is full it publishes a few rows per system fence"),
    Mutant("hier_push_tail_before_parts", HIER,
           "        else if (JoinParts(g, done, pp, mark)) StoreRel(tw, tl + cnt);",
           "        else if (JoinParts(g, done, 1, mark)) StoreRel(tw, tl + cnt);",
           (T_HIER, "-k", "role_parts or small_rings_wrap"),
           "the combine pusher's part 0 releases a batch without waiting for the other parts: "
           "the reader sums slices of rows they have not written yet"),
    Mutant("hier_push_part_marks_another_word", HIER,
           "        if (part != 0) StoreRel(done + part, mark);",
           "        if (part != 0) StoreRel(done + 1, mark);",
           (T_HIER, "-k", "role_parts or small_rings_wrap"),
           "every pusher part past 0 marks part 1's word: part 0 waits for parts 2 and up "
           "until the timeout"),
    Mutant("hier_partial_not_rounded", HIER,
           "      for (int i = 0; i < V; ++i) a[i] += rounds ? RoundTo<E>(p[i]) : p[i];",
           "      for (int i = 0; i < V; ++i) a[i] += p[i];",
           (T_HIER, "-k", "partials_rounded or matches_reference"),
           "the source's own-node partial is not rounded to the row dtype (the other nodes' "
           "partials are): not the order of kernels/common/combine_order.h"),
    Mutant("hier_partial_rank_order_reversed", HIER,
           "    LoadF<E, V>(rp[k], x0, f);",
           "    LoadF<E, V>(rp[n - 1 - k], x0, f);",
           (T_HIER, "-k", "matches_reference or small_rings"),
           "the forwarder sums its node's rows in descending rank order"),
    # ---- SM budget (configs.h InternodeModeSms, HierCombineFit)
    Mutant("hier_budget_below_roles_accepted", HIER,
           "  if (ModeSmSetting(kModeHierarchical) > 0 && least > sms)\n",
           "  if (false && least > sms)\n",
           (T_HIER, "-k", "sms_below"),
           "a hierarchical_sms below what holds the dispatch's role warps is silently raised "
           "instead of refused, naming the setting"),
    Mutant("hier_count_items_one_block", HIER,
           "  for (int b = blockIdx.x; b < g.R + g.N; b += gridDim.x) {  // block-uniform",
           "  for (int b = blockIdx.x; b < g.R + g.N; b += g.R + g.N) {  // block-uniform",
           (T_HIER, "-k", "sms_budget"),
           "the count kernel, cut to the mode's SMs, does each block's first item only: "
           "ranks and nodes past the grid are never counted"),
    # ---------------------------------------------- NVLink rings (weak visibility of peer stores)
    # The fences matter where lanes other than the releasing one copy a row's bytes: rows
    # of 64 payload bytes or more (partials_rounded, H = 32 bf16); with shorter rows the
    # lanes that copy are the lanes that release, and a release drains its own lane.
    Mutant("hier_nvl_flush_no_fence", HIER,
           "  if (!__any_sync(kFull, dirty)) return true;\n  __threadfence_system();\n",
           "  if (!__any_sync(kFull, dirty)) return true;\n",
           (T_HIER, "-k", "partials_rounded or matches_reference or small_rings"),
           "removed fence: the forwarder's lanes' row stores into a peer's NVLink ring are not "
           "ordered before the tail's release (only the releasing lane's are)"),
    Mutant("hier_push_no_fence", HIER,
           "      // the batch's rows, then one release of the tail (one fence per lane per batch)\n"
           "      __threadfence_system();\n",
           "      // the batch's rows, then one release of the tail (one fence per lane per batch)\n",
           (T_HIER, "-k",
            "partials_rounded or matches_reference or small_rings or source_blocks_split or "
            "pushers_write"),
           "removed fence: the combine pusher's row stores into the forwarder's ring are not "
           "ordered before the tail's release (a stale row in some interleavings; the "
           "pushers' fence chain always)"),
    Mutant("hier_forward_slot_word_unordered", HIER,
           "        devcopy::CopyLanded(dst + m0, row + m0, g.stride - m0, Lane(), 32);\n"
           "        __syncwarp();\n",
           "        devcopy::CopyLanded(dst + m0, row + m0, g.stride - m0, Lane(), 32);\n",
           (T_HIER, "-k", "matches_reference or small_rings"),
           "dropped barrier: lane 0's slot word and the lane copying that part of the row race, "
           "the row's old word (-1) can land last"),
    Mutant("hier_fwd_tail_before_columns", HIER,
           "      else ok = JoinParts(g, c->words, c->cq, mark) ? 1 : 0;",
           "      else ok = 1;",
           (T_HIER, "-k", "role_parts"),
           "a forwarder's column part 0 releases a ring's tail without waiting for the other "
           "column parts: the receiver copies slices a lagging part has not written"),
    Mutant("hier_fwd_column_marks_another_word", HIER,
           "      if (c->q != 0) StoreRel(c->words + c->q, mark);",
           "      if (c->q != 0) StoreRel(c->words + 1, mark);",
           (T_HIER, "-k", "role_parts"),
           "every column part marks part 1's word: part 0 waits for the others' marks until "
           "the timeout (or takes part 1's for theirs)"),
    Mutant("hier_fwd_columns_one_slice_twice", HIER,
           "  ColumnSlice(g.prow, q, cq, &c.b0, &c.b1);",
           "  ColumnSlice(g.prow, q > 0 ? q - 1 : 0, cq, &c.b0, &c.b1);",
           (T_HIER, "-k", "matches_reference or role_parts"),
           "column part q copies part q - 1's slice: one slice of every forwarded row is "
           "never written"),
    Mutant("hier_nvl_flush_fence_gpu_scope", HIER,
           "  if (!__any_sync(kFull, dirty)) return true;\n  __threadfence_system();\n",
           "  if (!__any_sync(kFull, dirty)) return true;\n  __threadfence();\n",
           (T_HIER, "-k", "partials_rounded or matches_reference or small_rings"),
           "the forwarder's fence at .gpu scope (__threadfence): its lanes' row stores into a "
           "peer's NVLink ring (another GPU) are not ordered before the tail's release"),
]
