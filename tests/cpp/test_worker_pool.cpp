// The persistent worker pool: tasks run, thread-local state reaches them,
// errors are captured per task, threads are reused, nesting does not deadlock;
// submitted runs can be waited for with a timeout, cancelled and abandoned.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/autocast_mode.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "dpcore/worker_pool.h"

namespace {

std::vector<dpcore::Task> tasks_of(size_t n, const std::function<void(size_t)>& body) {
  std::vector<dpcore::Task> tasks;
  for (size_t i = 0; i < n; ++i) {
    tasks.push_back(dpcore::Task{c10::Device(c10::kCPU), [&body, i] { body(i); }});
  }
  return tasks;
}

TEST(WorkerPool, CpuTasksShareTheIntraOpBudget) {
  // CPU tasks run on pool threads (never the caller's), at most
  // at::get_num_threads() of them at once.
  std::vector<std::thread::id> ids(6);
  auto errors = dpcore::run_tasks(tasks_of(6, [&](size_t i) { ids[i] = std::this_thread::get_id(); }));
  ASSERT_EQ(errors.size(), 6u);
  std::vector<std::thread::id> distinct;
  for (size_t i = 0; i < 6; ++i) {
    EXPECT_FALSE(errors[i]);
    EXPECT_NE(ids[i], std::this_thread::get_id());
    if (std::find(distinct.begin(), distinct.end(), ids[i]) == distinct.end()) {
      distinct.push_back(ids[i]);
    }
  }
  EXPECT_EQ(distinct.size(), std::min<size_t>(6, static_cast<size_t>(at::get_num_threads())));
}

TEST(WorkerPool, ReusesThreadsAcrossCalls) {
  dpcore::run_tasks(tasks_of(4, [](size_t) {}));
  const size_t before = dpcore::worker_thread_count();
  for (int step = 0; step < 100; ++step) {
    dpcore::run_tasks(tasks_of(4, [](size_t) {}));
  }
  EXPECT_EQ(dpcore::worker_thread_count(), before);
}

TEST(WorkerPool, PropagatesGradModeAndAutocastCacheFlag) {
  std::vector<int> grad(3, -1), cache(3, -1);
  {
    c10::NoGradGuard no_grad;
    const bool previous = at::autocast::is_autocast_cache_enabled();
    at::autocast::set_autocast_cache_enabled(false);
    dpcore::run_tasks(tasks_of(3, [&](size_t i) {
      grad[i] = c10::GradMode::is_enabled();
      cache[i] = at::autocast::is_autocast_cache_enabled();
    }));
    at::autocast::set_autocast_cache_enabled(previous);
  }
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(grad[i], 0) << "task " << i;
    EXPECT_EQ(cache[i], 0) << "task " << i;
  }
  dpcore::run_tasks(tasks_of(3, [&](size_t i) { grad[i] = c10::GradMode::is_enabled(); }));
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(grad[i], 1) << "task " << i;
  }
}

TEST(WorkerPool, CapturesEachTaskError) {
  auto errors = dpcore::run_tasks(tasks_of(4, [](size_t i) {
    if (i % 2 == 1) {
      throw std::runtime_error("task " + std::to_string(i));
    }
  }));
  EXPECT_FALSE(errors[0]);
  EXPECT_FALSE(errors[2]);
  for (size_t i : {1u, 3u}) {
    ASSERT_TRUE(errors[i]);
    try {
      std::rethrow_exception(errors[i]);
    } catch (const std::runtime_error& e) {
      EXPECT_EQ(std::string(e.what()), "task " + std::to_string(i));
    }
  }
  // Still usable afterwards.
  std::atomic<int> count{0};
  auto again = dpcore::run_tasks(tasks_of(4, [&](size_t) { ++count; }));
  EXPECT_EQ(count.load(), 4);
}

TEST(WorkerPool, NestedAndConcurrentCallsComplete) {
  std::atomic<int> inner{0};
  auto errors = dpcore::run_tasks(
      tasks_of(2, [&](size_t) { dpcore::run_tasks(tasks_of(3, [&](size_t) { ++inner; })); }));
  EXPECT_EQ(inner.load(), 6);
  std::atomic<int> total{0};
  std::thread other([&] { dpcore::run_tasks(tasks_of(4, [&](size_t) { ++total; })); });
  dpcore::run_tasks(tasks_of(4, [&](size_t) { ++total; }));
  other.join();
  EXPECT_EQ(total.load(), 8);
}

TEST(WorkerPool, EmptyTaskListIsANoOp) {
  EXPECT_TRUE(dpcore::run_tasks({}).empty());
}

} // namespace

namespace {

// A call narrower than the pool leaves idle workers that wake after the call
// returned: they must not touch that call's (gone) task list.
TEST(WorkerPool, NarrowCallsAfterAWideOneAreSafe) {
  std::atomic<int> count{0};
  dpcore::run_tasks(tasks_of(6, [&](size_t) { ++count; }));
  for (int step = 0; step < 500; ++step) {
    dpcore::run_tasks(tasks_of(1 + step % 2, [&](size_t) { ++count; }));
  }
  EXPECT_EQ(count.load(), 6 + 250 * 1 + 250 * 2);
}

} // namespace

namespace {

// A gate that tasks wait at until the test opens it.
class Gate {
 public:
  void open() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      open_ = true;
    }
    cv_.notify_all();
  }
  void wait() {
    std::unique_lock<std::mutex> lock(mutex_);
    cv_.wait(lock, [this] { return open_; });
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  bool open_ = false;
};

// Spins (with short sleeps) until `done()` or `seconds` have passed.
bool eventually(const std::function<bool()>& done, double seconds = 10.0) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (!done()) {
    if (std::chrono::steady_clock::now() > deadline) {
      return false;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

std::vector<dpcore::Task> owning_tasks(size_t n, const std::function<void(size_t)>& body) {
  std::vector<dpcore::Task> tasks;
  for (size_t i = 0; i < n; ++i) {
    tasks.push_back(dpcore::Task{c10::Device(c10::kCPU), [body, i] { body(i); }});
  }
  return tasks;
}

TEST(WorkerPoolAsync, SubmitReturnsAtOnceAndWaitForTimesOut) {
  auto gate = std::make_shared<Gate>();
  auto ran = std::make_shared<std::atomic<int>>(0);
  dpcore::TaskRun run = dpcore::submit_tasks(owning_tasks(2, [gate, ran](size_t) {
    gate->wait();
    ++*ran;
  }));
  EXPECT_FALSE(run.wait_for(std::chrono::milliseconds(20)));
  EXPECT_FALSE(run.done());
  EXPECT_THROW(run.errors(), c10::Error); // not finished yet
  gate->open();
  EXPECT_TRUE(run.wait_for(std::chrono::seconds(30)));
  EXPECT_TRUE(run.done());
  EXPECT_EQ(ran->load(), 2);
  ASSERT_EQ(run.errors().size(), 2u);
  EXPECT_FALSE(run.errors()[0]);
  EXPECT_FALSE(run.errors()[1]);
  run.cancel(); // a no-op once done
  EXPECT_EQ(run.wait().size(), 2u);
}

TEST(WorkerPoolAsync, CancelSkipsTasksNotYetStarted) {
  // CPU tasks run on at most get_num_threads() lanes: with twice as many
  // tasks plus two, every lane's first task blocks at the gate and the rest
  // wait their turn, so that cancel() finds them unstarted.
  const size_t lanes = static_cast<size_t>(std::max(1, at::get_num_threads()));
  const size_t n = 2 * lanes + 2;
  auto gate = std::make_shared<Gate>();
  auto started = std::make_shared<std::atomic<size_t>>(0);
  auto ran = std::make_shared<std::vector<std::atomic<int>>>(n);
  dpcore::TaskRun run = dpcore::submit_tasks(owning_tasks(n, [gate, started, ran](size_t i) {
    ++*started;
    gate->wait();
    ++(*ran)[i];
  }));
  ASSERT_TRUE(eventually([&] { return started->load() == lanes; }));
  run.cancel();
  EXPECT_TRUE(run.cancelled());
  gate->open();
  const auto& errors = run.wait();
  ASSERT_EQ(errors.size(), n);
  for (size_t i = 0; i < n; ++i) {
    if (i < lanes) {
      EXPECT_EQ((*ran)[i].load(), 1) << "task " << i << " had started: it finishes";
      EXPECT_FALSE(errors[i]) << "task " << i;
      continue;
    }
    EXPECT_EQ((*ran)[i].load(), 0) << "task " << i << " ran after cancel()";
    ASSERT_TRUE(errors[i]) << "task " << i;
    try {
      std::rethrow_exception(errors[i]);
    } catch (const dpcore::TaskCancelled& e) {
      EXPECT_NE(std::string(e.what()).find("task " + std::to_string(i) + " was skipped"), std::string::npos)
          << e.what();
    }
  }
  EXPECT_EQ(started->load(), lanes);
}

TEST(WorkerPoolAsync, PoolIsNotReusedWhileAnAbandonedRunIsGoing) {
  dpcore::run_tasks(tasks_of(1, [](size_t) {})); // at least one pool exists
  auto gate = std::make_shared<Gate>();
  auto first_thread = std::make_shared<std::thread::id>();
  auto first_finished = std::make_shared<std::atomic<bool>>(false);
  std::weak_ptr<Gate> watch = gate;
  {
    dpcore::TaskRun abandoned =
        dpcore::submit_tasks(owning_tasks(1, [gate, first_thread, first_finished](size_t) {
          *first_thread = std::this_thread::get_id();
          gate->wait();
          first_finished->store(true);
        }));
    ASSERT_TRUE(eventually([&] { return *first_thread != std::thread::id(); }));
  } // every handle dropped: the run goes on, owning its task and gate
  const size_t pools_before = dpcore::worker_pool_count();
  // Calls made meanwhile get another pool (other threads) and complete.
  for (int step = 0; step < 20; ++step) {
    std::thread::id id;
    auto errors = dpcore::run_tasks(tasks_of(1, [&](size_t) { id = std::this_thread::get_id(); }));
    ASSERT_FALSE(errors[0]);
    EXPECT_NE(id, *first_thread) << "a pool was handed out while its task still ran";
  }
  EXPECT_FALSE(first_finished->load());
  EXPECT_LE(dpcore::worker_pool_count(), pools_before + 1); // one more pool at most, reused
  gate->open();
  gate.reset();
  // The abandoned run finishes; what it owned is freed (by the worker).
  ASSERT_TRUE(eventually([&] { return watch.expired(); }));
  EXPECT_TRUE(first_finished->load());
  // Its pool is back in service: no pool or thread is created from now on.
  const size_t pools = dpcore::worker_pool_count();
  const size_t threads = dpcore::worker_thread_count();
  for (int step = 0; step < 20; ++step) {
    dpcore::run_tasks(tasks_of(1, [](size_t) {}));
  }
  EXPECT_EQ(dpcore::worker_pool_count(), pools);
  EXPECT_EQ(dpcore::worker_thread_count(), threads);
}

TEST(WorkerPoolAsync, FinishedRunsFreeTheirTasks) {
  // Whether the caller or a worker lets go last, a run's tasks (and what they
  // capture) are freed once it has finished and its handles are gone.
  for (int step = 0; step < 50; ++step) {
    auto token = std::make_shared<int>(step);
    std::weak_ptr<int> watch = token;
    {
      dpcore::TaskRun run = dpcore::submit_tasks(owning_tasks(3, [token](size_t) {}));
      token.reset();
      if (step % 2 == 0) {
        run.wait();
      }
    }
    ASSERT_TRUE(eventually([&] { return watch.expired(); })) << "step " << step;
  }
}

TEST(WorkerPoolAsync, RunTasksIsSubmitAndWait) {
  std::atomic<int> count{0};
  auto errors = dpcore::run_tasks(tasks_of(5, [&](size_t i) {
    ++count;
    if (i == 3) {
      throw std::runtime_error("three");
    }
  }));
  EXPECT_EQ(count.load(), 5);
  ASSERT_EQ(errors.size(), 5u);
  for (size_t i = 0; i < 5; ++i) {
    EXPECT_EQ(static_cast<bool>(errors[i]), i == 3) << "task " << i;
  }
  dpcore::TaskRun empty = dpcore::submit_tasks({});
  EXPECT_TRUE(empty.done());
  EXPECT_TRUE(empty.errors().empty());
}

} // namespace
