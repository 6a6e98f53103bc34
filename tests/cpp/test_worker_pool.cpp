// The persistent worker pool: tasks run, thread-local state reaches them,
// errors are captured per task, threads are reused, nesting does not deadlock.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/autocast_mode.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <atomic>
#include <stdexcept>
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
  auto errors = dpcore::run_tasks(tasks_of(2, [&](size_t) {
    dpcore::run_tasks(tasks_of(3, [&](size_t) { ++inner; }));
  }));
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
