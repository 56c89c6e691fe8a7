#include "kernels/cpu/cpu_rendezvous.h"

#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <sstream>
#include <thread>

namespace jax_ep {
namespace {

using Clock = std::chrono::steady_clock;

struct Participant {
  RendezvousWork work;
  RendezvousDone done;
  Clock::time_point deadline;
};

struct Round {
  explicit Round(int n) : num_ranks(n), peers(n), members(n), present(n, false) {}
  int num_ranks;
  std::vector<PeerBuffers> peers;
  std::vector<Participant> members;
  std::vector<bool> present;
  int arrived = 0;
};

// Shared by the threads of one completed round: counts finished works.
struct Latch {
  explicit Latch(int n) : remaining(n) {}
  std::mutex mu;
  std::condition_variable cv;
  int remaining;
  void ArriveAndWait() {
    std::unique_lock<std::mutex> lock(mu);
    if (--remaining == 0) {
      cv.notify_all();
      return;
    }
    cv.wait(lock, [&] { return remaining == 0; });
  }
};

std::string KeyText(const RendezvousKey& k) {
  std::ostringstream s;
  s << "run " << k.run_id << ", call site " << k.call_site << ", group " << k.group;
  return s.str();
}

// Runs `fn` on a new thread; if the system refuses one, runs it here.
template <typename Fn>
void Spawn(Fn fn) {
  try {
    std::thread(std::move(fn)).detach();
  } catch (const std::system_error&) {
    fn();
  }
}

// Global state, never destroyed: detached threads may still use it at process exit.
struct State {
  std::mutex mu;
  std::condition_variable cv;  // wakes the watchdog when a round appears
  std::map<RendezvousKey, std::unique_ptr<Round>> rounds;
  // Rounds that timed out, most recent last (bounded): a rank that reaches one late
  // fails at once instead of waiting a second timeout for peers that already gave up.
  std::set<RendezvousKey> expired;
  std::deque<RendezvousKey> expired_order;
  bool watchdog_started = false;
};

constexpr size_t kExpiredKept = 4096;

void RememberExpired(State& s, const RendezvousKey& key) {
  if (!s.expired.insert(key).second) return;
  s.expired_order.push_back(key);
  if (s.expired_order.size() > kExpiredKept) {
    s.expired.erase(s.expired_order.front());
    s.expired_order.pop_front();
  }
}

State& S() {
  static State* s = new State();
  return *s;
}

// Completes a round: one thread per participant runs its work, all wait for each other,
// then each reports. Completion runs on these threads, never on XLA's.
void Launch(std::unique_ptr<Round> round) {
  auto shared = std::shared_ptr<Round>(std::move(round));
  auto latch = std::make_shared<Latch>(shared->num_ranks);
  for (int r = 0; r < shared->num_ranks; ++r) {
    Spawn([shared, latch, r] {
      std::string err = shared->members[r].work(shared->peers);
      latch->ArriveAndWait();
      shared->members[r].done(err);
    });
  }
}

void Watchdog() {
  State& s = S();
  std::unique_lock<std::mutex> lock(s.mu);
  for (;;) {
    // Fail every participant of a round whose earliest deadline has passed.
    const auto now = Clock::now();
    Clock::time_point next = now + std::chrono::seconds(1);
    std::vector<std::pair<RendezvousDone, std::string>> expired;
    for (auto it = s.rounds.begin(); it != s.rounds.end();) {
      Round& round = *it->second;
      Clock::time_point earliest = Clock::time_point::max();
      for (int r = 0; r < round.num_ranks; ++r)
        if (round.present[r] && round.members[r].deadline < earliest)
          earliest = round.members[r].deadline;
      if (earliest <= now) {
        std::ostringstream m;
        m << "jax_ep: timed out at " << KeyText(it->first) << ": only " << round.arrived
          << " of " << round.num_ranks << " ranks arrived (missing:";
        for (int r = 0; r < round.num_ranks; ++r)
          if (!round.present[r]) m << " " << r;
        m << "). A peer never reached this call, or its execution is still queued: on CPU, "
             "XLA runs every device's program on one thread pool, and with many calls in "
             "flight a small pool can leave a peer no thread (see the README, 'Pipelined "
             "calls on CPU'). Raise JAX_EP_TIMEOUT_S if the peer is just slow.";
        for (int r = 0; r < round.num_ranks; ++r)
          if (round.present[r]) expired.emplace_back(round.members[r].done, m.str());
        RememberExpired(s, it->first);
        it = s.rounds.erase(it);
        continue;
      }
      if (earliest < next) next = earliest;
      ++it;
    }
    if (!expired.empty()) {
      lock.unlock();
      for (auto& e : expired) Spawn([e] { e.first(e.second); });
      lock.lock();
      continue;
    }
    s.cv.wait_until(lock, next);
  }
}

// Adds `rank` to the round of `key` (under s.mu). Returns "" or why it was refused; sets
// *complete when this arrival completes the round. Takes mine, work and done only if it
// admits the rank (the caller reports a refusal through done).
std::string Enter(State& s, const RendezvousKey& key, int rank, int num_ranks,
                  PeerBuffers& mine, double timeout_s, RendezvousWork& work,
                  RendezvousDone& done, std::unique_ptr<Round>* complete) {
  auto& slot = s.rounds[key];
  if (!slot) slot = std::make_unique<Round>(num_ranks);
  Round& round = *slot;
  if (round.num_ranks != num_ranks) {
    std::ostringstream m;
    m << "jax_ep: participants disagree on the number of ranks (" << round.num_ranks
      << " vs " << num_ranks << ") at " << KeyText(key);
    return m.str();
  }
  if (round.present[rank]) {
    // Two live participants claim one rank: they are not one EP group. Meeting would
    // exchange rows between unrelated groups, so refuse.
    std::ostringstream m;
    m << "jax_ep: two participants claim rank " << rank << " at " << KeyText(key)
      << "; EP groups are mislabelled (each group needs distinct ranks 0.."
      << num_ranks - 1 << ")";
    return m.str();
  }
  const auto wait = std::chrono::duration_cast<Clock::duration>(
      std::chrono::duration<double>(timeout_s));
  round.peers[rank] = std::move(mine);
  round.members[rank] = Participant{std::move(work), std::move(done), Clock::now() + wait};
  round.present[rank] = true;
  if (++round.arrived == num_ranks) {
    *complete = std::move(slot);
    s.rounds.erase(key);
  } else {
    s.cv.notify_all();
  }
  return {};
}

}  // namespace

Rendezvous& Rendezvous::Global() {
  static Rendezvous r;
  return r;
}

void Rendezvous::Join(const RendezvousKey& key, int rank, int num_ranks, PeerBuffers mine,
                      double timeout_s, RendezvousWork work, RendezvousDone done) {
  State& s = S();
  std::unique_ptr<Round> complete;
  std::string refused;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    if (!s.watchdog_started) {
      s.watchdog_started = true;
      Spawn([] { Watchdog(); });
    }
    if (s.expired.count(key)) {
      std::ostringstream m;
      m << "jax_ep: rank " << rank << " reached " << KeyText(key)
        << " after its peers timed out waiting for it (JAX_EP_TIMEOUT_S); the call failed "
           "on every rank";
      refused = m.str();
    } else {
      refused = Enter(s, key, rank, num_ranks, mine, timeout_s, work, done, &complete);
    }
  }
  if (!refused.empty()) {
    done(refused);
    return;
  }
  if (complete) Launch(std::move(complete));
}

}  // namespace jax_ep
