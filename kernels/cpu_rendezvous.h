// In-process rendezvous for the CPU transport: the virtual CPU devices of one process
// share memory, so the participants of one EP call publish pointers to their buffers,
// wait for each other, read their peers' buffers directly (the CPU analog of NVLink
// peer pointers), then wait again so no buffer is released while a peer still reads it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace jax_ep {

// What one participant publishes. Fields are op specific; unused ones stay null.
struct PeerBuffers {
  const void* in[4] = {nullptr, nullptr, nullptr, nullptr};
  void* out[4] = {nullptr, nullptr, nullptr, nullptr};
  int64_t meta[8] = {0, 0, 0, 0, 0, 0, 0, 0};  // shapes etc., checked for agreement
  std::vector<int32_t> counts;                  // per-destination token counts
  std::string error;                            // non-empty if this rank's input is bad
};

// Identifies one collective call: one execution (XLA run id), one call site in the
// program, one EP group. Two programs, two call sites or two groups never meet.
struct RendezvousKey {
  int64_t run_id;
  int64_t call_site;
  int64_t group;
  bool operator<(const RendezvousKey& o) const {
    if (run_id != o.run_id) return run_id < o.run_id;
    if (call_site != o.call_site) return call_site < o.call_site;
    return group < o.group;
  }
};

class Round;

// One participant's view of a completed arrival: every rank's buffers, by rank.
class RendezvousTicket {
 public:
  RendezvousTicket() = default;
  const std::vector<PeerBuffers>& peers() const;
  bool valid() const { return round_ != nullptr; }

 private:
  friend class Rendezvous;
  Round* round_ = nullptr;
  uint64_t generation_ = 0;
  RendezvousKey key_{};
};

class Rendezvous {
 public:
  static Rendezvous& Global();

  // Publishes `mine` as rank `rank` of `num_ranks` and waits for all of them. Returns
  // an empty string on success, else an error message (timeout or disagreement).
  std::string Arrive(const RendezvousKey& key, int rank, int num_ranks, PeerBuffers mine,
                     double timeout_s, RendezvousTicket* ticket);

  // Waits until every rank has finished reading peers' buffers. Must follow a
  // successful Arrive, whatever the outcome of the work in between.
  std::string Depart(RendezvousTicket* ticket, int rank, double timeout_s);
};

}  // namespace jax_ep
