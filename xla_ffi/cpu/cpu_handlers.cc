// Decode and validate buffers, meet the peers of this EP group through the in-process
// rendezvous, and call the CPU kernels on their buffers.
#include "xla_ffi/cpu/cpu_handlers.h"

#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cpu/cpu_rendezvous.h"
#include "xla_ffi/cpu/cpu_exchange.h"
#include "xla_ffi/common/ffi_helpers.h"

namespace ffi = xla::ffi;

namespace jax_ep {
namespace {

ffi::Error LayoutImpl(ffi::Buffer<ffi::S32> topk_idx, ffi::ResultBuffer<ffi::S32> per_rank,
                      ffi::ResultBuffer<ffi::S32> per_expert,
                      ffi::ResultBuffer<ffi::PRED> in_rank, int64_t num_experts,
                      int64_t num_ranks) {
  auto d = topk_idx.dimensions();
  if (d.size() != 2) return Invalid("topk_idx must be [T, K], got " + Dims(d));
  if (num_ranks < 1 || num_experts % num_ranks != 0)
    return Invalid("num_experts must be a positive multiple of num_ranks");
  RoutingShape s{static_cast<int>(num_ranks), static_cast<int>(num_experts),
                 static_cast<int>(d[0]), static_cast<int>(d[1]), 0};
  std::string err = CheckTopkIds(topk_idx.typed_data(), s.num_tokens, s.topk, s.num_experts);
  if (!err.empty()) return Invalid(err);
  LayoutCpu(topk_idx.typed_data(), s, per_rank->typed_data(), per_expert->typed_data(),
            in_rank->typed_data());
  return ffi::Error::Success();
}

ffi::Future DispatchImpl(ffi::RunId run_id, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> topk_idx,
                        ffi::Buffer<ffi::F32> topk_weights, ffi::Buffer<ffi::S32> rank_buf,
                        ffi::Buffer<ffi::S32> group_buf, ffi::Result<ffi::AnyBuffer> recv_x,
                        ffi::ResultBuffer<ffi::S32> recv_idx,
                        ffi::ResultBuffer<ffi::F32> recv_w,
                        ffi::ResultBuffer<ffi::S32> num_recv,
                        ffi::ResultBuffer<ffi::S32> num_dropped,
                        ffi::ResultBuffer<ffi::S32> recv_per_expert,
                        ffi::ResultBuffer<ffi::S32> src_rank,
                        ffi::ResultBuffer<ffi::S32> src_index,
                        ffi::ResultBuffer<ffi::S32> send_row, int64_t num_experts,
                        int64_t num_ranks, int64_t capacity, int64_t call_site) {
  auto xd = x.dimensions();
  if (xd.size() != 2) return Failed(Invalid("x must be [T, H], got " + Dims(xd)));
  auto id = topk_idx.dimensions();
  if (id.size() != 2) return Failed(Invalid("topk_idx must be [T, K], got " + Dims(id)));
  const int64_t T = xd[0], H = xd[1], K = id[1], R = num_ranks, C = capacity;
  std::string err = ExpectShape("topk_idx", id, {T, K});
  if (err.empty()) err = ExpectShape("topk_weights", topk_weights.dimensions(), {T, K});
  if (err.empty()) err = ExpectShape("recv_x", recv_x->dimensions(), {C, H});
  if (err.empty()) err = ExpectShape("send_row", send_row->dimensions(), {T, R});
  if (!err.empty()) return Failed(Invalid(err));
  if (R < 1 || num_experts % R != 0)
    return Failed(Invalid("num_experts must be a multiple of num_ranks"));
  if (C < 1) return Failed(Invalid("capacity must be >= 1"));
  const int rank = Scalar(rank_buf);
  const int group = Scalar(group_buf);
  RoutingShape s{static_cast<int>(R), static_cast<int>(num_experts), static_cast<int>(T),
                 static_cast<int>(K), static_cast<int>(C)};
  const size_t row_bytes = static_cast<size_t>(H) * ffi::ByteWidth(x.element_type());

  PeerBuffers mine;
  mine.in[0] = x.untyped_data();
  mine.in[1] = topk_idx.typed_data();
  mine.in[2] = topk_weights.typed_data();
  mine.meta[0] = T;
  mine.meta[1] = H;
  mine.meta[2] = K;
  mine.meta[3] = static_cast<int64_t>(x.element_type());
  mine.meta[4] = C;
  mine.meta[5] = num_experts;
  mine.error = CheckTopkIds(topk_idx.typed_data(), s.num_tokens, s.topk, s.num_experts);
  mine.counts.assign(R, 0);
  if (mine.error.empty()) TokensPerRankCpu(topk_idx.typed_data(), s, mine.counts.data());
  struct Outs {
    void* recv_x;
    int32_t *recv_idx, *src_rank, *src_index, *num_recv, *num_dropped, *per_expert, *send_row;
    float* recv_w;
    const int32_t* topk_idx;
  } o{recv_x->untyped_data(), recv_idx->typed_data(),  src_rank->typed_data(),
      src_index->typed_data(), num_recv->typed_data(), num_dropped->typed_data(),
      recv_per_expert->typed_data(), send_row->typed_data(), recv_w->typed_data(),
      topk_idx.typed_data()};
  return Exchange(run_id, call_site, rank, group, static_cast<int>(R), std::move(mine),
                  [=](const std::vector<PeerBuffers>& peers) -> std::string {
                    std::vector<const void*> px(R);
                    std::vector<const int32_t*> pi(R);
                    std::vector<const float*> pw(R);
                    std::vector<int32_t> counts(R * R);
                    for (int j = 0; j < R; ++j) {
                      px[j] = peers[j].in[0];
                      pi[j] = static_cast<const int32_t*>(peers[j].in[1]);
                      pw[j] = static_cast<const float*>(peers[j].in[2]);
                      for (int r = 0; r < R; ++r) counts[j * R + r] = peers[j].counts[r];
                    }
                    DispatchRecvCpu(rank, s, row_bytes, px.data(), pi.data(), pw.data(),
                                    counts.data(), o.recv_x, o.recv_idx, o.recv_w, o.src_rank,
                                    o.src_index, o.num_recv, o.num_dropped, o.per_expert);
                    DispatchSendRowsCpu(rank, s, o.topk_idx, counts.data(), o.send_row);
                    return {};
                  });
}

ffi::Future CombineImpl(ffi::RunId run_id, ffi::AnyBuffer y, ffi::Buffer<ffi::S32> send_row,
                       ffi::Buffer<ffi::S32> rank_buf, ffi::Buffer<ffi::S32> group_buf,
                       ffi::RemainingArgs bias_args, ffi::Result<ffi::AnyBuffer> out,
                       ffi::Dictionary attrs) {
  // num_ranks and call_site, and optionally gpus_per_node: the node size of combine's
  // summation order (kernels/common/combine_order.h; absent: one node).
  const auto attr = [&](const char* name, int64_t* v) {
    auto got = attrs.get<int64_t>(name);
    if (got.has_error()) return false;
    *v = *got;
    return true;
  };
  int64_t num_ranks = 0, call_site = 0, gpus_per_node = 0;
  if (!attr("num_ranks", &num_ranks) || !attr("call_site", &call_site))
    return Failed(Invalid("combine needs the int64 attributes num_ranks and call_site"));
  if (!attrs.contains("gpus_per_node"))
    gpus_per_node = num_ranks;
  else if (!attr("gpus_per_node", &gpus_per_node))
    return Failed(Invalid("gpus_per_node must be an int64 attribute"));
  auto yd = y.dimensions();
  auto sd = send_row.dimensions();
  if (yd.size() != 2) return Failed(Invalid("y must be [C, H], got " + Dims(yd)));
  if (sd.size() != 2 || sd[1] != num_ranks)
    return Failed(Invalid("handle.send_row must be [T, R], got " + Dims(sd)));
  const int64_t C = yd[0], H = yd[1], T = sd[0];
  std::string err = ExpectShape("out", out->dimensions(), {T, H});
  if (!err.empty()) return Failed(Invalid(err));
  FloatKind kind;
  if (!FloatKindOf(y.element_type(), &kind))
    return Failed(Invalid("y must be float32, bfloat16 or float16"));
  if (gpus_per_node < 1 || num_ranks % gpus_per_node != 0)
    return Failed(Invalid("gpus_per_node (combine's node size) must be >= 1 and divide "
                          "num_ranks=" + std::to_string(num_ranks) + ", got " +
                          std::to_string(gpus_per_node)));
  // Optional trailing operands: up to two [T, H] bias arrays, added in float32.
  if (bias_args.size() > 2)
    return Failed(Invalid("combine takes at most two bias arrays, got " +
                          std::to_string(bias_args.size())));
  std::vector<CombineBias> bias;
  for (size_t i = 0; i < bias_args.size(); ++i) {
    auto b = bias_args.get<ffi::AnyBuffer>(i);
    const std::string name = "bias[" + std::to_string(i) + "]";
    if (!b.has_value()) return Failed(Invalid(name + " is not a buffer"));
    CombineBias term{};
    if (!FloatKindOf(b->element_type(), &term.kind))
      return Failed(Invalid(name + " must be float32, bfloat16 or float16"));
    err = ExpectShape(name.c_str(), b->dimensions(), {T, H});
    if (!err.empty()) return Failed(Invalid(err));
    term.data = b->untyped_data();
    bias.push_back(term);
  }
  const int rank = Scalar(rank_buf);
  PeerBuffers mine;
  mine.in[0] = y.untyped_data();
  mine.meta[0] = C;
  mine.meta[1] = H;
  mine.meta[2] = T;
  mine.meta[3] = static_cast<int64_t>(y.element_type());
  const int32_t* rows = send_row.typed_data();
  void* out_data = out->untyped_data();
  return Exchange(run_id, call_site, rank, Scalar(group_buf), static_cast<int>(num_ranks),
                  std::move(mine), [=](const std::vector<PeerBuffers>& peers) -> std::string {
                    std::vector<const void*> py(num_ranks);
                    for (int j = 0; j < num_ranks; ++j) py[j] = peers[j].in[0];
                    CombineCpu(kind, static_cast<int>(num_ranks), static_cast<int>(T),
                               static_cast<int>(H), rows, py.data(), out_data, bias.data(),
                               static_cast<int>(bias.size()), static_cast<int>(gpus_per_node));
                    return {};
                  });
}

ffi::Future GatherImpl(ffi::RunId run_id, ffi::AnyBuffer g, ffi::Buffer<ffi::S32> src_rank,
                      ffi::Buffer<ffi::S32> src_index, ffi::Buffer<ffi::S32> rank_buf,
                      ffi::Buffer<ffi::S32> group_buf, ffi::Result<ffi::AnyBuffer> out,
                      int64_t num_ranks, int64_t call_site) {
  auto gd = g.dimensions();
  if (gd.size() != 2) return Failed(Invalid("cotangent must be [T, H], got " + Dims(gd)));
  const int64_t T = gd[0], H = gd[1];
  const int64_t C = src_rank.element_count();
  std::string err = ExpectShape("handle.src_index", src_index.dimensions(), {C});
  if (err.empty()) err = ExpectShape("out", out->dimensions(), {C, H});
  if (!err.empty()) return Failed(Invalid(err));
  const size_t row_bytes = static_cast<size_t>(H) * ffi::ByteWidth(g.element_type());
  PeerBuffers mine;
  mine.in[0] = g.untyped_data();
  mine.meta[0] = T;
  mine.meta[1] = H;
  mine.meta[2] = C;
  mine.meta[3] = static_cast<int64_t>(g.element_type());
  const int32_t* sr = src_rank.typed_data();
  const int32_t* si = src_index.typed_data();
  void* out_data = out->untyped_data();
  return Exchange(run_id, call_site, Scalar(rank_buf), Scalar(group_buf),
                  static_cast<int>(num_ranks), std::move(mine),
                  [=](const std::vector<PeerBuffers>& peers) -> std::string {
                    std::vector<const void*> pg(num_ranks);
                    for (int j = 0; j < num_ranks; ++j) pg[j] = peers[j].in[0];
                    for (int64_t i = 0; i < C; ++i) {
                      if (sr[i] >= num_ranks || (sr[i] >= 0 && (si[i] < 0 || si[i] >= T)))
                        return "jax_ep: handle.src_rank/src_index out of range; the handle "
                               "does not belong to this call";
                    }
                    GatherByHandleCpu(static_cast<int>(C), row_bytes, sr, si, pg.data(),
                                      out_data);
                    return {};
                  });
}

}  // namespace

// The handlers of JEP_CPU_TARGETS (xla_ffi/common/op_tables.h).
JEP_CPU_TARGETS(JEP_FFI_DEFINE_TARGET)

}  // namespace jax_ep
