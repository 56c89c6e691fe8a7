// The striping plan of kernels/striping_plan.h for jax_ep.transport, so Python and the
// kernels use one function; and the heap layout of kernels/internode_layout.h.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/pair.h>

#include <stdexcept>

#include "kernels/internode/internode_layout.h"
#include "kernels/common/striping_plan.h"
#include "xla_ffi/common/transport_bindings.h"

namespace nb = nanobind;

namespace jax_ep {
namespace {
using In = nb::ndarray<const int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using Out = nb::ndarray<int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

void QpForArray(In peer, In channel, In chunk, int num_ports, int qps_per_port, Out qp,
                Out port) {
  const size_t n = peer.shape(0);
  if (channel.shape(0) != n || chunk.shape(0) != n || qp.shape(0) != n || port.shape(0) != n)
    throw std::invalid_argument("striping_qp_for_array: arrays differ in length");
  for (size_t i = 0; i < n; ++i) {
    const QpPort r = qp_for(static_cast<int32_t>(peer(i)), static_cast<int32_t>(channel(i)),
                            chunk(i), num_ports, qps_per_port);
    qp(i) = r.qp;
    port(i) = r.port;
  }
}
}  // namespace

void AddTransportBindings(nb::module_& m) {
  m.def("striping_qp_for",
        [](int peer, int channel, int64_t chunk, int num_ports, int qps_per_port) {
          const QpPort r = qp_for(peer, channel, chunk, num_ports, qps_per_port);
          return std::make_pair(r.qp, r.port);
        });
  m.def("striping_qp_for_array", &QpForArray);
  m.def("internode_heap_bytes",
        [](int64_t num_ranks, int64_t max_tokens, int64_t capacity, int64_t hidden,
           int64_t topk, int64_t x_bytes, int64_t y_bytes) {
          return heap_bytes(num_ranks, max_tokens, capacity, hidden, topk, x_bytes, y_bytes);
        });
#ifdef JAX_EP_WITH_NVSHMEM
  AddNvshmemBindings(m);
#endif
}

}  // namespace jax_ep
