#define TORCH_ASSERT_ONLY_METHOD_OPERATORS

#include "dpcore/rendezvous.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdio>
#include <utility>

#include "dpcore/env.h"

namespace dpcore {
namespace {

// "replica 1" or "replicas 0, 2".
std::string replicas_text(const std::vector<size_t>& ranks) {
  std::string text = ranks.size() == 1 ? "replica " : "replicas ";
  for (size_t i = 0; i < ranks.size(); ++i) {
    text += (i ? ", " : "") + std::to_string(ranks[i]);
  }
  return text;
}

// "300 s", "0.05 s".
std::string seconds_text(std::chrono::milliseconds ms) {
  char buffer[32];
  std::snprintf(buffer, sizeof(buffer), "%g s", static_cast<double>(ms.count()) / 1000.0);
  return buffer;
}

constexpr const char* kSameCalls = "every replica must make the same calls, in the same order";

} // namespace

std::chrono::milliseconds sync_timeout_from_env() {
  return std::chrono::seconds(env_int(kSyncTimeoutVariable, kDefaultSyncTimeoutSeconds, 1));
}

Rendezvous::Rendezvous(size_t participants, std::chrono::milliseconds timeout)
    : n_(participants),
      timeout_(timeout),
      present_(participants, 0),
      finished_(participants, 0),
      keys_(participants),
      pending_(participants) {
  TORCH_CHECK_VALUE(participants >= 1, "Rendezvous: expected at least 1 participant, but got ", participants);
  TORCH_CHECK_VALUE(
      timeout.count() > 0, "Rendezvous: expected a positive timeout, but got ", timeout.count(), " ms");
}

void Rendezvous::check_rank(size_t rank, const char* what) const {
  TORCH_CHECK_INDEX(rank < n_, "Rendezvous.", what, ": expected a rank in [0, ", n_, "), but got ", rank);
}

std::vector<size_t> Rendezvous::arrived_ranks_locked() const {
  std::vector<size_t> ranks;
  for (size_t i = 0; i < n_; ++i) {
    if (present_[i]) {
      ranks.push_back(i);
    }
  }
  return ranks;
}

std::string Rendezvous::waiting_key_locked() const {
  for (size_t i = 0; i < n_; ++i) {
    if (present_[i]) {
      return keys_[i];
    }
  }
  return {};
}

void Rendezvous::break_locked(std::string reason, int64_t culprit, std::vector<Contribution>& doomed) {
  if (broken_) {
    return;
  }
  broken_ = true;
  reason_ = std::move(reason);
  culprit_ = culprit;
  doomed.swap(pending_);
  cv_.notify_all();
}

std::vector<Contribution> Rendezvous::exchange(
    size_t rank, const std::string& key, Contribution contribution) {
  check_rank(rank, "exchange");
  // Declared before the lock: tensors dropped here are destroyed after it is released.
  std::vector<Contribution> doomed;
  std::shared_ptr<const std::vector<Contribution>> result;
  std::shared_ptr<const std::vector<Contribution>> previous;
  {
    std::unique_lock<std::mutex> lock(mutex_);
    if (broken_) {
      throw RendezvousBroken(reason_);
    }
    TORCH_CHECK(!finished_[rank], "Rendezvous.exchange: replica ", rank, " has already finished");
    TORCH_CHECK(!present_[rank], "Rendezvous.exchange: replica ", rank, " is already waiting at this round");
    std::vector<size_t> done;
    for (size_t i = 0; i < n_; ++i) {
      if (finished_[i]) {
        done.push_back(i);
      }
    }
    if (!done.empty()) {
      break_locked(
          "replica " + std::to_string(rank) + " reached " + key + " after " + replicas_text(done) +
              " had finished without it (an extra call on replica " + std::to_string(rank) +
              ", or one skipped on " + replicas_text(done) + "); " + kSameCalls,
          static_cast<int64_t>(rank), doomed);
      throw RendezvousBroken(reason_);
    }
    present_[rank] = 1;
    keys_[rank] = key;
    pending_[rank] = std::move(contribution);
    ++arrived_;
    if (arrived_ == n_) {
      // Group the ranks by key; the largest group (the lowest rank's on a tie) is the expected one.
      std::vector<std::pair<std::string, std::vector<size_t>>> groups;
      for (size_t i = 0; i < n_; ++i) {
        auto it =
            std::find_if(groups.begin(), groups.end(), [&](const auto& g) { return g.first == keys_[i]; });
        if (it == groups.end()) {
          groups.emplace_back(keys_[i], std::vector<size_t>{i});
        } else {
          it->second.push_back(i);
        }
      }
      if (groups.size() > 1) {
        size_t expected = 0;
        for (size_t g = 1; g < groups.size(); ++g) {
          if (groups[g].second.size() > groups[expected].second.size()) {
            expected = g;
          }
        }
        std::string reason;
        size_t culprit = n_;
        for (size_t g = 0; g < groups.size(); ++g) {
          if (g != expected) {
            reason += (reason.empty() ? "" : " and ") + replicas_text(groups[g].second) + " reached " +
                      groups[g].first;
            culprit = std::min(culprit, groups[g].second.front());
          }
        }
        reason += " where " + replicas_text(groups[expected].second) + " reached " + groups[expected].first +
                  "; " + kSameCalls;
        break_locked(std::move(reason), static_cast<int64_t>(culprit), doomed);
        throw RendezvousBroken(reason_);
      }
      previous = std::move(result_);
      result_ = std::make_shared<const std::vector<Contribution>>(std::move(pending_));
      pending_ = std::vector<Contribution>(n_);
      std::fill(present_.begin(), present_.end(), 0);
      arrived_ = 0;
      ++round_;
      result = result_;
      cv_.notify_all();
    } else {
      const uint64_t round = round_;
      const auto deadline = std::chrono::steady_clock::now() + timeout_;
      const bool woke = cv_.wait_until(lock, deadline, [&] { return round_ != round || broken_; });
      if (!woke) {
        std::vector<size_t> missing;
        for (size_t i = 0; i < n_; ++i) {
          if (!present_[i]) {
            missing.push_back(i);
          }
        }
        break_locked(
            replicas_text(missing) + " did not reach " + key + " within " + seconds_text(timeout_) +
                ", while " + replicas_text(arrived_ranks_locked()) + " waited there (raise the limit with " +
                kSyncTimeoutVariable + "=<seconds>)",
            missing.empty() ? -1 : static_cast<int64_t>(missing.front()), doomed);
      }
      // A completed round stands even if the rendezvous broke afterwards.
      if (round_ == round) {
        throw RendezvousBroken(reason_);
      }
      result = result_;
    }
  }
  return *result;
}

void Rendezvous::finish(size_t rank) {
  check_rank(rank, "finish");
  std::vector<Contribution> doomed;
  std::lock_guard<std::mutex> lock(mutex_);
  finished_[rank] = 1;
  if (!broken_ && arrived_ > 0 && !present_[rank]) {
    break_locked(
        "replica " + std::to_string(rank) + " finished without reaching " + waiting_key_locked() +
            ", which " + replicas_text(arrived_ranks_locked()) + " reached (a call skipped on replica " +
            std::to_string(rank) + ", or an extra one on the others); " + kSameCalls,
        static_cast<int64_t>(rank), doomed);
  }
}

void Rendezvous::fail(size_t rank, const std::string& reason) {
  check_rank(rank, "fail");
  std::vector<Contribution> doomed;
  std::lock_guard<std::mutex> lock(mutex_);
  finished_[rank] = 1;
  std::string text = "replica " + std::to_string(rank) + " raised " + reason;
  if (arrived_ > 0) {
    text += " (" + replicas_text(arrived_ranks_locked()) + " waited at " + waiting_key_locked() + ")";
  }
  break_locked(std::move(text), static_cast<int64_t>(rank), doomed);
}

void Rendezvous::abort(const std::string& reason) {
  std::vector<Contribution> doomed;
  std::lock_guard<std::mutex> lock(mutex_);
  break_locked(reason, -1, doomed);
}

bool Rendezvous::broken() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return broken_;
}

std::string Rendezvous::reason() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return reason_;
}

int64_t Rendezvous::culprit() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return culprit_;
}

size_t Rendezvous::waiting() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return arrived_;
}

uint64_t Rendezvous::rounds() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return round_;
}

} // namespace dpcore
