// A rendezvous among the replicas of one parallel call (synchronized
// BatchNorm exchanges its statistics through it). No Python here: the binding
// is csrc/python/sync_batchnorm.cpp.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Stream.h>

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace dpcore {

// What every waiter of a broken rendezvous, and every later call on it,
// raises (Python: dpcore.SyncBatchNormError, a RuntimeError). what() says
// why it broke, naming the replica(s) and the key.
class RendezvousBroken : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// One participant's share of a round: its tensors, a count, and the stream
// its tensors were produced on (for readers on other devices to wait for).
struct Contribution {
  std::vector<at::Tensor> tensors;
  int64_t count = 0;
  std::optional<c10::Stream> stream;
};

// Seconds a participant waits for the others at one round, unless the
// environment variable DPCORE_SYNC_TIMEOUT_S (an integer >= 1) says otherwise.
constexpr int64_t kDefaultSyncTimeoutSeconds = 300;
constexpr const char* kSyncTimeoutVariable = "DPCORE_SYNC_TIMEOUT_S";

// DPCORE_SYNC_TIMEOUT_S, read now (error naming it when malformed), or the default.
std::chrono::milliseconds sync_timeout_from_env();

// `participants` ranks meet in rounds. Round r completes when every rank
// has called exchange() for the r-th time with the same key; each then gets
// every rank's contribution, in rank order. The tensors are handed over as
// they are (the same tensors, autograd history included); nothing is copied.
//
// Never hangs; instead the rendezvous breaks, for good, and every waiter and
// every later exchange() raises RendezvousBroken with the first cause:
//   * keys differ at a round (replicas reached different calls);
//   * a rank finish()es while others wait at a round it never reached, or a
//     rank reaches a round after another rank finished (a skipped or an extra call);
//   * fail(rank, reason): a rank raised;
//   * a waiter waited `timeout` for the others (it names the missing ranks);
//   * abort(reason), from outside.
// Thread-safe; one thread per rank. Tensors are never destroyed under the
// internal lock.
class Rendezvous {
 public:
  Rendezvous(size_t participants, std::chrono::milliseconds timeout);
  Rendezvous(const Rendezvous&) = delete;
  Rendezvous& operator=(const Rendezvous&) = delete;

  // Blocks until every rank reached this round (or the rendezvous broke);
  // returns the contributions of ranks 0..participants-1.
  std::vector<Contribution> exchange(size_t rank, const std::string& key, Contribution contribution);

  // `rank` makes no further exchange (its task ended, normally or not).
  void finish(size_t rank);
  // `rank` raised `reason`: breaks the rendezvous (unless broken already) and finishes it.
  void fail(size_t rank, const std::string& reason);
  // Breaks the rendezvous with `reason` (unless broken already), e.g. on cancellation.
  void abort(const std::string& reason);

  bool broken() const;
  // Why it broke ("" while not broken).
  std::string reason() const;
  // The rank whose action broke it (raised, skipped or added a call, arrived
  // with another key, or did not arrive in time); -1 while not broken or after abort().
  int64_t culprit() const;
  size_t participants() const {
    return n_;
  }
  std::chrono::milliseconds timeout() const {
    return timeout_;
  }
  // Rounds completed so far.
  uint64_t rounds() const;
  // Ranks waiting at the current round.
  size_t waiting() const;

 private:
  // Marks the rendezvous broken (first cause wins) and wakes every waiter.
  // Moves the pending contributions into `doomed` so that the caller
  // destroys them after releasing the lock.
  void break_locked(std::string reason, int64_t culprit, std::vector<Contribution>& doomed);
  std::string waiting_key_locked() const;
  std::vector<size_t> arrived_ranks_locked() const;
  void check_rank(size_t rank, const char* what) const;

  const size_t n_;
  const std::chrono::milliseconds timeout_;
  mutable std::mutex mutex_;
  std::condition_variable cv_;
  uint64_t round_ = 0;
  size_t arrived_ = 0;
  std::vector<char> present_; // per rank: arrived at the current round
  std::vector<char> finished_;
  std::vector<std::string> keys_;
  std::vector<Contribution> pending_;
  // The contributions of the last completed round: its waiters read them
  // after waking, and no later round can complete before they have left.
  std::shared_ptr<const std::vector<Contribution>> result_;
  bool broken_ = false;
  std::string reason_;
  int64_t culprit_ = -1;
};

} // namespace dpcore
