// The rendezvous of synchronized BatchNorm: rounds complete with every
// rank's tensors; a different key, a rank that finishes early or calls once
// more, a failure, or a timeout break it for everyone with a message naming
// the replica and the key; a broken rendezvous stays broken.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "dpcore/rendezvous.h"
#include "dpcore/worker_pool.h"

namespace {

using dpcore::Contribution;
using dpcore::Rendezvous;
using dpcore::RendezvousBroken;
using namespace std::chrono_literals;

// Runs body(rank) on one thread per rank; returns each rank's error message ("" if none).
std::vector<std::string> run_ranks(size_t n, const std::function<void(size_t)>& body) {
  std::vector<std::string> errors(n);
  std::vector<std::thread> threads;
  for (size_t rank = 0; rank < n; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        body(rank);
      } catch (const RendezvousBroken& e) {
        errors[rank] = e.what();
      }
    });
  }
  for (auto& t : threads) {
    t.join();
  }
  return errors;
}

Contribution of(double value, int64_t count) {
  return Contribution{{at::full({2}, value, at::kDouble)}, count};
}

bool contains(const std::string& text, const std::string& needle) {
  return text.find(needle) != std::string::npos;
}

TEST(Rendezvous, EveryRankGetsEveryContributionInRankOrder) {
  constexpr size_t n = 4;
  constexpr int rounds = 50;
  Rendezvous rv(n, 10s);
  std::atomic<int> checked{0};
  const auto errors = run_ranks(n, [&](size_t rank) {
    for (int r = 0; r < rounds; ++r) {
      const auto all = rv.exchange(rank, "layer " + std::to_string(r), of(100.0 * r + rank, rank + 1));
      ASSERT_EQ(all.size(), n);
      for (size_t i = 0; i < n; ++i) {
        EXPECT_EQ(all[i].count, static_cast<int64_t>(i + 1));
        ASSERT_EQ(all[i].tensors.size(), 1u);
        EXPECT_EQ(all[i].tensors[0][0].item<double>(), 100.0 * r + i);
      }
      ++checked;
    }
    rv.finish(rank);
  });
  for (const auto& e : errors) {
    EXPECT_EQ(e, "");
  }
  EXPECT_EQ(checked.load(), static_cast<int>(n) * rounds);
  EXPECT_EQ(rv.rounds(), static_cast<uint64_t>(rounds));
  EXPECT_FALSE(rv.broken());
  EXPECT_EQ(rv.culprit(), -1);
}

TEST(Rendezvous, HandsOverTheSameTensors) {
  Rendezvous rv(2, 10s);
  at::Tensor a = at::ones({3});
  at::Tensor b = at::zeros({3});
  std::vector<Contribution> got(2);
  run_ranks(
      2, [&](size_t rank) { got[rank] = rv.exchange(rank, "k", Contribution{{rank ? b : a}, 1})[1 - rank]; });
  EXPECT_TRUE(got[0].tensors[0].is_same(b));
  EXPECT_TRUE(got[1].tensors[0].is_same(a));
}

TEST(Rendezvous, OneParticipantNeverWaits) {
  Rendezvous rv(1, 10s);
  EXPECT_EQ(rv.exchange(0, "k", of(1, 5)).at(0).count, 5);
  rv.finish(0);
  EXPECT_FALSE(rv.broken());
}

TEST(Rendezvous, DifferentKeysBreakItForEveryone) {
  Rendezvous rv(3, 10s);
  const auto errors = run_ranks(3, [&](size_t rank) {
    rv.exchange(rank, "BatchNorm 'a' (call 1)", of(0, 1));
    rv.exchange(rank, rank == 1 ? "BatchNorm 'c' (call 1)" : "BatchNorm 'b' (call 1)", of(0, 1));
  });
  for (const auto& e : errors) {
    EXPECT_EQ(e, rv.reason());
  }
  EXPECT_TRUE(contains(
      rv.reason(),
      "replica 1 reached BatchNorm 'c' (call 1) where replicas 0, 2 reached BatchNorm 'b' (call 1)"))
      << rv.reason();
  EXPECT_EQ(rv.culprit(), 1);
  EXPECT_EQ(rv.rounds(), 1u);
}

TEST(Rendezvous, FinishingWithoutAReachedCallBreaksIt) {
  Rendezvous rv(3, 10s);
  const auto errors = run_ranks(3, [&](size_t rank) {
    rv.exchange(rank, "BatchNorm 'a' (call 1)", of(0, 1));
    if (rank != 2) {
      rv.exchange(rank, "BatchNorm 'b' (call 1)", of(0, 1));
    } else {
      while (rv.waiting() < 2) { // ranks 0 and 1 wait at 'b'
        std::this_thread::sleep_for(1ms);
      }
    }
    rv.finish(rank);
  });
  EXPECT_EQ(errors[2], "");
  EXPECT_EQ(errors[0], rv.reason());
  EXPECT_EQ(errors[1], rv.reason());
  EXPECT_EQ(rv.culprit(), 2) << rv.reason();
  EXPECT_TRUE(contains(rv.reason(), "BatchNorm 'b' (call 1)")) << rv.reason();
  EXPECT_TRUE(contains(rv.reason(), "replica 2")) << rv.reason();
}

TEST(Rendezvous, FinishWhileOthersWaitNamesTheWaiters) {
  Rendezvous rv(3, 10s);
  std::vector<std::string> errors(2);
  std::vector<std::thread> waiters;
  for (size_t rank = 0; rank < 2; ++rank) {
    waiters.emplace_back([&, rank] {
      try {
        rv.exchange(rank, "BatchNorm 'bn' (call 2)", of(0, 1));
      } catch (const RendezvousBroken& e) {
        errors[rank] = e.what();
      }
    });
  }
  while (rv.waiting() < 2) {
    std::this_thread::sleep_for(1ms);
  }
  rv.finish(2);
  for (auto& t : waiters) {
    t.join();
  }
  EXPECT_EQ(
      rv.reason(),
      "replica 2 finished without reaching BatchNorm 'bn' (call 2), which replicas 0, 1 reached (a call "
      "skipped on replica 2, or an extra one on the others); every replica must make the same calls, in "
      "the same order");
  EXPECT_EQ(errors[0], rv.reason());
  EXPECT_EQ(errors[1], rv.reason());
}

TEST(Rendezvous, AnExtraCallAfterOthersFinishedBreaksIt) {
  Rendezvous rv(2, 10s);
  rv.finish(1);
  EXPECT_FALSE(rv.broken());
  try {
    rv.exchange(0, "BatchNorm 'x' (call 3)", of(0, 1));
    FAIL() << "expected RendezvousBroken";
  } catch (const RendezvousBroken& e) {
    EXPECT_TRUE(contains(
        e.what(), "replica 0 reached BatchNorm 'x' (call 3) after replica 1 had finished without it"))
        << e.what();
  }
  EXPECT_EQ(rv.culprit(), 0);
}

TEST(Rendezvous, AFailureWakesTheWaitersWithItsReason) {
  Rendezvous rv(3, 10s);
  const auto errors = run_ranks(3, [&](size_t rank) {
    if (rank == 1) {
      std::this_thread::sleep_for(20ms);
      rv.fail(1, "ValueError: boom");
      return;
    }
    rv.exchange(rank, "BatchNorm 'bn' (call 1)", of(0, 1));
  });
  EXPECT_EQ(errors[1], "");
  EXPECT_TRUE(contains(rv.reason(), "replica 1 raised ValueError: boom")) << rv.reason();
  EXPECT_EQ(errors[0], rv.reason());
  EXPECT_EQ(errors[2], rv.reason());
  EXPECT_EQ(rv.culprit(), 1);
}

TEST(Rendezvous, TimeoutBreaksItNamingWhoWasWaitedFor) {
  Rendezvous rv(3, 300ms);
  const auto start = std::chrono::steady_clock::now();
  const auto errors = run_ranks(3, [&](size_t rank) {
    if (rank == 2) {
      return; // never arrives, never finishes
    }
    rv.exchange(rank, "BatchNorm 'bn' (call 1)", of(0, 1));
  });
  const auto elapsed = std::chrono::steady_clock::now() - start;
  EXPECT_GE(elapsed, 300ms);
  EXPECT_LT(elapsed, 5s);
  EXPECT_EQ(
      rv.reason(),
      "replica 2 did not reach BatchNorm 'bn' (call 1) within 0.3 s, while replicas 0, 1 waited there (raise "
      "the limit with DPCORE_SYNC_TIMEOUT_S=<seconds>)");
  EXPECT_EQ(errors[0], rv.reason());
  EXPECT_EQ(errors[1], rv.reason());
  EXPECT_EQ(rv.culprit(), 2);
}

TEST(Rendezvous, ABrokenRendezvousStaysBroken) {
  Rendezvous rv(2, 10s);
  rv.abort("cancelled by the caller");
  rv.fail(0, "later failure"); // the first cause stands
  EXPECT_EQ(rv.reason(), "cancelled by the caller");
  EXPECT_EQ(rv.culprit(), -1);
  for (size_t rank = 0; rank < 2; ++rank) {
    try {
      rv.exchange(rank, "k", of(0, 1));
      FAIL() << "expected RendezvousBroken";
    } catch (const RendezvousBroken& e) {
      EXPECT_EQ(std::string(e.what()), "cancelled by the caller");
    }
  }
}

TEST(Rendezvous, ACompletedRoundStandsWhenItBreaksLater) {
  // Rank 1 completes round 0 and immediately fails; rank 0 still gets round 0's result.
  for (int attempt = 0; attempt < 20; ++attempt) {
    Rendezvous rv(2, 10s);
    const auto errors = run_ranks(2, [&](size_t rank) {
      const auto all = rv.exchange(rank, "k", of(rank, 1));
      EXPECT_EQ(all.size(), 2u);
      if (rank == 1) {
        rv.fail(1, "RuntimeError: after the round");
      }
    });
    EXPECT_EQ(errors[0], "");
    EXPECT_EQ(errors[1], "");
    EXPECT_EQ(rv.rounds(), 1u);
  }
}

TEST(Rendezvous, AllAtOnceRunsMoreCpuReplicasThanIntraOpThreadsTogether) {
  // Without all_at_once, CPU tasks beyond at::get_num_threads() would queue
  // behind ones that wait for them; here every task must be running at once.
  const size_t n = 2 * static_cast<size_t>(at::get_num_threads()) + 1;
  Rendezvous rv(n, 20s);
  std::vector<dpcore::Task> tasks;
  for (size_t rank = 0; rank < n; ++rank) {
    tasks.push_back(dpcore::Task{c10::Device(c10::kCPU), [&rv, rank] {
                                   for (int round = 0; round < 3; ++round) {
                                     rv.exchange(rank, "k" + std::to_string(round), of(rank, 1));
                                   }
                                   rv.finish(rank);
                                 }});
  }
  const auto errors = dpcore::run_tasks(tasks, /*all_at_once=*/true);
  for (const auto& e : errors) {
    EXPECT_FALSE(e);
  }
  EXPECT_FALSE(rv.broken()) << rv.reason();
  EXPECT_EQ(rv.rounds(), 3u);
}

TEST(Rendezvous, ChecksItsArguments) {
  EXPECT_THROW(Rendezvous(0, 1s), c10::ValueError);
  EXPECT_THROW(Rendezvous(2, 0ms), c10::ValueError);
  Rendezvous rv(2, 1s);
  try {
    rv.exchange(2, "k", of(0, 1));
    FAIL() << "expected c10::IndexError";
  } catch (const c10::IndexError& e) {
    EXPECT_TRUE(contains(e.what_without_backtrace(), "expected a rank in [0, 2), but got 2"));
  }
  EXPECT_THROW(rv.finish(5), c10::IndexError);
  EXPECT_FALSE(rv.broken());
}

TEST(Rendezvous, TimeoutComesFromTheEnvironment) {
  unsetenv("DPCORE_SYNC_TIMEOUT_S");
  EXPECT_EQ(dpcore::sync_timeout_from_env(), std::chrono::seconds(dpcore::kDefaultSyncTimeoutSeconds));
  setenv("DPCORE_SYNC_TIMEOUT_S", "7", 1);
  EXPECT_EQ(dpcore::sync_timeout_from_env(), 7s);
  setenv("DPCORE_SYNC_TIMEOUT_S", "0", 1);
  try {
    dpcore::sync_timeout_from_env();
    FAIL() << "expected c10::Error";
  } catch (const c10::Error& e) {
    EXPECT_TRUE(contains(e.what_without_backtrace(), "DPCORE_SYNC_TIMEOUT_S to be an integer of at least 1"));
  }
  unsetenv("DPCORE_SYNC_TIMEOUT_S");
}

} // namespace
