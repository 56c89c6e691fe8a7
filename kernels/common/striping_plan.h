// Striping of inter-node traffic over the ports of a NIC: which queue pair (QP) and
// which port carry each chunk of the bytes a rank sends to one peer.
//
// One definition, used by the CUDA kernels (device), by the FFI handlers (host) and,
// through a nanobind binding, by `jax_ep.TransportConfig` (Python). Everything here is
// a pure function of its arguments.
//
// Model of the wire (see docs/internode.md):
//   * A NIC has `num_ports` ports (2 for a dual-port or bonded NIC). Every peer is
//     reached through `num_ports * qps_per_port` RC QPs; QP q is bound to port
//     q % num_ports (NVSHMEM multi-port spreads its QPs round-robin over the ports;
//     under a hashing bond the binding is whatever the hash picks).
//   * The bytes bound for one peer form one contiguous stream, cut into chunks of
//     `chunk_bytes` (the last one may be shorter). Chunk j goes out on port
//     (start_port(peer) + j) % num_ports, so for every peer the ports carry the same
//     number of chunks, give or take one, and their bytes differ by at most one chunk.
//   * The starting port rotates across peers, so that all peers do not begin on port 0.
//   * Chunk j is sent by channel j % num_channels (one CUDA block per channel). With
//     num_channels = num_ports * qps_per_port, every channel uses exactly one QP per
//     peer and the channels of one peer use every QP once: one QP per channel.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define JEP_STRIPE_HD __host__ __device__ __forceinline__
#else
#define JEP_STRIPE_HD inline
#endif

namespace jax_ep {

// Most logical QPs per peer (num_ports * qps_per_port). Defined here only: the direct
// mode reserves one signal word per (source, QP) for each (wire::sig_word) and the
// NVSHMEM transport keeps a handle table of this size; wire::, transport::, hier:: and
// llwire:: alias it, and Python reads it from internode_protocol()["max_qps"].
constexpr int kMaxQps = 64;

struct QpPort {
  int32_t qp;    // index in [0, num_ports * qps_per_port)
  int32_t port;  // index in [0, num_ports); equals qp % num_ports
};

// Starting port of a peer: the sum of the base-`num_ports` digits of `peer`, modulo
// `num_ports`. Any P consecutive peers starting at a multiple of P start on P distinct
// ports, and so do peers spaced by a power of P (e.g. the same GPU index on every
// node), which a plain `peer % num_ports` would put all on one port.
JEP_STRIPE_HD int32_t start_port(int32_t peer, int32_t num_ports) {
  if (num_ports <= 1 || peer < 0) return 0;
  int32_t sum = 0;
  for (int32_t v = peer; v > 0; v /= num_ports) sum += v % num_ports;
  return sum % num_ports;
}

// Port that carries chunk `chunk` of the stream to `peer`.
JEP_STRIPE_HD int32_t port_for_chunk(int32_t peer, int64_t chunk, int32_t num_ports) {
  if (num_ports <= 1) return 0;
  return static_cast<int32_t>((start_port(peer, num_ports) + chunk % num_ports) % num_ports);
}

// Channel (CUDA block) that sends chunk `chunk` of a stream.
JEP_STRIPE_HD int32_t channel_for_chunk(int64_t chunk, int32_t num_channels) {
  return num_channels <= 1 ? 0 : static_cast<int32_t>(chunk % num_channels);
}

// The QP and port of chunk `chunk` to `peer`, sent by channel `channel`. The port is
// fixed by (peer, chunk); the channel picks which of that port's `qps_per_port` QPs.
JEP_STRIPE_HD QpPort qp_for(int32_t peer, int32_t channel, int64_t chunk, int32_t num_ports,
                            int32_t qps_per_port) {
  const int32_t p = num_ports < 1 ? 1 : num_ports;
  const int32_t q = qps_per_port < 1 ? 1 : qps_per_port;
  const int32_t port = port_for_chunk(peer, chunk, p);
  const int32_t c = channel < 0 ? 0 : channel;
  const int32_t slot = (c / p) % q;
  return QpPort{slot * p + port, port};
}

// Number of chunks in a stream of `bytes`.
JEP_STRIPE_HD int64_t num_chunks(int64_t bytes, int64_t chunk_bytes) {
  if (bytes <= 0) return 0;
  if (chunk_bytes <= 0) return 1;
  return (bytes + chunk_bytes - 1) / chunk_bytes;
}

// Byte offset and size of chunk `chunk` of a stream of `bytes`.
JEP_STRIPE_HD int64_t chunk_offset(int64_t chunk, int64_t chunk_bytes) {
  return chunk * chunk_bytes;
}
JEP_STRIPE_HD int64_t chunk_size(int64_t bytes, int64_t chunk, int64_t chunk_bytes) {
  if (chunk_bytes <= 0) return chunk == 0 ? bytes : 0;
  const int64_t left = bytes - chunk * chunk_bytes;
  if (left <= 0) return 0;
  return left < chunk_bytes ? left : chunk_bytes;
}

}  // namespace jax_ep
