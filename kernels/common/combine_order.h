// The one summation order of combine, shared by every backend (reference, CPU, intranode
// CUDA, internode direct and hierarchical), so that all of them are bit-exact with each
// other whatever the node size.
//
// For each token:
//   1. within each node n (ranks [n*G, (n+1)*G), G = ranks per node), sum the rows that
//      come back from the node's ranks in ascending rank order, in float32: the partial p_n;
//   2. with more than one node, p_n is rounded to the combine's row dtype, the dtype it
//      crosses the network in (the forwarding GPU sends one partial per token per node);
//      with one node nothing is rounded, which is the single-node order of before;
//   3. sum the partials over nodes in ascending order, in float32;
//   4. bias terms are added after, then the result is cast to the output dtype.
// G comes from the topology (JAX_EP_GPUS_PER_NODE); G >= R, or G <= 0, means one node.
#pragma once

#if defined(__CUDACC__)
#define JEP_ORDER_HD __host__ __device__ __forceinline__
#else
#define JEP_ORDER_HD inline
#endif

namespace jax_ep {

// Ranks per node as the order sees it: G clamped to [1, R]; G <= 0 means one node.
JEP_ORDER_HD int combine_node_size(int num_ranks, int gpus_per_node) {
  if (gpus_per_node <= 0 || gpus_per_node >= num_ranks) return num_ranks < 1 ? 1 : num_ranks;
  return gpus_per_node;
}

// Node of `rank` under node size `node_size` (from combine_node_size).
JEP_ORDER_HD int combine_node_of(int rank, int node_size) { return rank / node_size; }

// Number of nodes (ceil: a last partial node still counts as one).
JEP_ORDER_HD int combine_num_nodes(int num_ranks, int node_size) {
  return (num_ranks + node_size - 1) / node_size;
}

// Whether step 2 rounds the node partials to the row dtype.
JEP_ORDER_HD bool combine_rounds_partials(int num_nodes) { return num_nodes > 1; }

}  // namespace jax_ep
