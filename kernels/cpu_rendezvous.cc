#include "kernels/cpu_rendezvous.h"

#include <chrono>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>

namespace jax_ep {

// A reusable barrier for one key: ranks arrive, the round closes when all have,
// then ranks depart; the last to depart reopens it for the next call (a loop body
// runs the same call site many times in one execution).
class Round {
 public:
  explicit Round(int n) : num_ranks(n), peers(n), present(n, false) {}
  int num_ranks;
  std::vector<PeerBuffers> peers;
  std::vector<bool> present;
  int arrived = 0;
  int departed = 0;
  bool closed = false;       // all arrived; exchanging
  uint64_t generation = 0;   // bumped when a round completes
  int users = 0;             // threads holding a pointer to this round
};

const std::vector<PeerBuffers>& RendezvousTicket::peers() const { return round_->peers; }

namespace {
std::mutex g_mu;
std::condition_variable g_cv;
std::map<RendezvousKey, std::unique_ptr<Round>> g_rounds;

std::string KeyText(const RendezvousKey& k) {
  std::ostringstream s;
  s << "run " << k.run_id << ", call site " << k.call_site << ", group " << k.group;
  return s.str();
}

void Release(const RendezvousKey& key, Round* round) {
  if (--round->users == 0 && round->arrived == 0) g_rounds.erase(key);
}
}  // namespace

Rendezvous& Rendezvous::Global() {
  static Rendezvous r;
  return r;
}

std::string Rendezvous::Arrive(const RendezvousKey& key, int rank, int num_ranks,
                               PeerBuffers mine, double timeout_s,
                               RendezvousTicket* ticket) {
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                            std::chrono::duration<double>(timeout_s));
  std::unique_lock<std::mutex> lock(g_mu);
  auto& slot = g_rounds[key];
  if (!slot) slot = std::make_unique<Round>(num_ranks);
  Round* round = slot.get();
  round->users++;
  if (round->num_ranks != num_ranks) {
    std::ostringstream s;
    s << "jax_ep: participants disagree on the number of ranks (" << round->num_ranks
      << " vs " << num_ranks << ") at " << KeyText(key);
    Release(key, round);
    return s.str();
  }
  if (!round->closed && round->present[rank]) {
    // Two live participants claim one rank: they are not one EP group. Meeting would
    // exchange rows between unrelated groups, so refuse.
    std::ostringstream s;
    s << "jax_ep: two participants claim rank " << rank << " at " << KeyText(key)
      << "; EP groups are mislabelled (each group must have distinct ranks 0.." << num_ranks - 1
      << ")";
    Release(key, round);
    return s.str();
  }
  // A previous call of this site may still be exchanging: wait for it to finish.
  while (round->closed || round->present[rank]) {
    if (g_cv.wait_until(lock, deadline) == std::cv_status::timeout &&
        (round->closed || round->present[rank])) {
      Release(key, round);
      return "jax_ep: timed out waiting for the previous exchange at " + KeyText(key) +
             " to finish (JAX_EP_TIMEOUT_S)";
    }
  }
  round->peers[rank] = std::move(mine);
  round->present[rank] = true;
  round->arrived++;
  const uint64_t gen = round->generation;
  if (round->arrived == num_ranks) {
    round->closed = true;
    g_cv.notify_all();
  }
  while (!(round->closed && round->generation == gen)) {
    if (g_cv.wait_until(lock, deadline) == std::cv_status::timeout &&
        !(round->closed && round->generation == gen)) {
      std::ostringstream s;
      s << "jax_ep: rank " << rank << " waited " << timeout_s << " s at " << KeyText(key)
        << " but only " << round->arrived << " of " << num_ranks
        << " ranks arrived (missing:";
      for (int i = 0; i < num_ranks; ++i)
        if (!round->present[i]) s << " " << i;
      s << "). A peer never reached this call; raise JAX_EP_TIMEOUT_S if it is just slow.";
      // Withdraw so a late peer cannot read this rank's (soon released) buffers.
      round->present[rank] = false;
      round->peers[rank] = PeerBuffers();
      round->arrived--;
      Release(key, round);
      return s.str();
    }
  }
  ticket->round_ = round;
  ticket->generation_ = gen;
  ticket->key_ = key;
  return {};
}

std::string Rendezvous::Depart(RendezvousTicket* ticket, int rank, double timeout_s) {
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                            std::chrono::duration<double>(timeout_s));
  std::unique_lock<std::mutex> lock(g_mu);
  Round* round = ticket->round_;
  const uint64_t gen = ticket->generation_;
  const RendezvousKey key = ticket->key_;
  ticket->round_ = nullptr;
  round->departed++;
  if (round->departed == round->num_ranks) {
    // Everyone has finished reading: reopen for the next call of this site.
    round->arrived = 0;
    round->departed = 0;
    round->closed = false;
    for (int i = 0; i < round->num_ranks; ++i) {
      round->present[i] = false;
      round->peers[i] = PeerBuffers();
    }
    round->generation++;
    g_cv.notify_all();
  }
  std::string err;
  while (round->generation == gen) {
    if (g_cv.wait_until(lock, deadline) == std::cv_status::timeout &&
        round->generation == gen) {
      std::ostringstream s;
      s << "jax_ep: rank " << rank << " timed out after " << timeout_s
        << " s waiting for peers to finish reading at " << KeyText(key);
      err = s.str();
      break;
    }
  }
  Release(key, round);
  return err;
}

}  // namespace jax_ep
