// In-process rendezvous for the CPU transport. The virtual CPU devices of one process
// share memory, so the participants of one EP call publish pointers to their buffers and,
// once all have arrived, each one's work reads its peers' buffers directly (the CPU analog
// of NVLink peer pointers).
//
// Joining never blocks the caller: XLA runs every virtual device's program on one shared
// thread pool, and a thread parked waiting for peers could starve a peer (or one of XLA's
// own collectives) of the thread it needs. The last participant to arrive starts one
// thread per participant; each runs its work, waits until all works are done (no buffer
// may be released while a peer still reads it), then reports completion. A participant
// whose peers do not arrive within the timeout is completed with an error, and so is, at
// once, one that arrives at a round its peers already abandoned.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace jax_ep {

// What one participant publishes. Fields are op specific; unused ones stay null.
struct PeerBuffers {
  const void* in[4] = {nullptr, nullptr, nullptr, nullptr};
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

// Runs once all participants are present; returns "" or an error message.
using RendezvousWork = std::function<std::string(const std::vector<PeerBuffers>& peers)>;
// Called exactly once per participant, with "" on success or an error message.
using RendezvousDone = std::function<void(const std::string& error)>;

class Rendezvous {
 public:
  static Rendezvous& Global();

  // Publishes `mine` as rank `rank` of `num_ranks` and returns at once. `work` runs
  // after all ranks arrive; `done` runs after every rank's work has finished, or with a
  // timeout error if they do not all arrive within `timeout_s`.
  void Join(const RendezvousKey& key, int rank, int num_ranks, PeerBuffers mine,
            double timeout_s, RendezvousWork work, RendezvousDone done);
};

}  // namespace jax_ep
