#include "dpcore/worker_pool.h"

#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <ATen/autocast_mode.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <mutex>
#include <optional>
#include <thread>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace dpcore {
namespace {

std::atomic<size_t> g_threads{0};

// What every task of one run inherits from the caller.
struct CallerState {
  at::ThreadLocalState tls;
  bool autocast_cache_enabled = at::autocast::is_autocast_cache_enabled();
  std::vector<std::optional<c10::Stream>> streams;
  // Intra-op threads for each task (0: leave as is). When every task runs on
  // the CPU, the caller's threads are shared out among the tasks: K replicas
  // each opening a full OpenMP team would oversubscribe the cores, and the
  // idle teams' spin-waiting would slow whatever runs next.
  int intra_op_threads = 0;
};

class WorkerPool {
 public:
  WorkerPool() = default;
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  ~WorkerPool() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    work_ready_.notify_all();
    for (auto& thread : threads_) {
      thread.join();
    }
  }

  std::vector<std::exception_ptr> run(const std::vector<Task>& tasks, bool all_at_once) {
    std::vector<std::exception_ptr> errors(tasks.size());
    if (tasks.empty()) {
      return errors;
    }
    CallerState state;
    // On the CPU, replicas share the caller's intra-op thread budget: at most
    // that many run at once (more would only contend for cores and the GIL),
    // each with its share of intra-op threads. Accelerator tasks all run at
    // once, and so do CPU tasks with all_at_once (they wait for each other).
    const bool all_cpu = std::all_of(tasks.begin(), tasks.end(), [](const Task& t) { return t.device.is_cpu(); });
    size_t lanes = tasks.size();
    if (all_cpu) {
      const int budget = std::max(1, at::get_num_threads());
      lanes = all_at_once ? tasks.size() : std::min(tasks.size(), static_cast<size_t>(budget));
      state.intra_op_threads = std::max(1, budget / static_cast<int>(lanes));
    }
    state.streams.reserve(tasks.size());
    for (const Task& task : tasks) {
      if (task.device.is_cpu()) {
        state.streams.emplace_back(std::nullopt);
      } else {
        state.streams.emplace_back(c10::impl::getDeviceGuardImpl(task.device.type())->getStream(task.device));
      }
    }
    // Only run() changes generation_, and one call uses a pool at a time, so
    // reading it here is race-free; a new worker starts as having seen it.
    while (threads_.size() < lanes) {
      const size_t index = threads_.size();
      const uint64_t start = generation_;
      threads_.emplace_back([this, index, start] { loop(index, start); });
      g_threads.fetch_add(1);
    }
    std::unique_lock<std::mutex> lock(mutex_);
    tasks_ = &tasks;
    lanes_ = lanes;
    errors_ = &errors;
    state_ = &state;
    remaining_ = lanes;
    ++generation_;
    work_ready_.notify_all();
    all_done_.wait(lock, [this] { return remaining_ == 0; });
    tasks_ = nullptr;
    errors_ = nullptr;
    state_ = nullptr;
    return errors;
  }

 private:
  // Worker `index`: in every generation with more than `index` lanes, runs
  // tasks index, index + lanes, ... A worker without work in a generation
  // touches only lanes_, which stays valid after run() returns (tasks_ does
  // not).
  void loop(size_t index, uint64_t seen) {
    for (;;) {
      const std::vector<Task>* tasks = nullptr;
      const CallerState* state = nullptr;
      size_t lanes = 0;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        work_ready_.wait(lock, [&] { return stop_ || generation_ != seen; });
        if (stop_) {
          return;
        }
        seen = generation_;
        if (index >= lanes_) {
          continue;
        }
        tasks = tasks_;
        state = state_;
        lanes = lanes_;
      }
      std::vector<std::pair<size_t, std::exception_ptr>> failures;
      for (size_t i = index; i < tasks->size(); i += lanes) {
        if (auto error = run_one((*tasks)[i], *state, i)) {
          failures.emplace_back(i, std::move(error));
        }
      }
      std::lock_guard<std::mutex> lock(mutex_);
      for (auto& [i, error] : failures) {
        (*errors_)[i] = std::move(error);
      }
      if (--remaining_ == 0) {
        all_done_.notify_all();
      }
    }
  }

  // Runs one task under the caller's state; returns its exception, if any.
  static std::exception_ptr run_one(const Task& task, const CallerState& state, size_t i) {
    try {
      at::ThreadLocalStateGuard tls_guard(state.tls);
#ifdef _OPENMP
      if (state.intra_op_threads > 0) {
        omp_set_num_threads(state.intra_op_threads);  // this thread's teams only
      }
#endif
      const bool cache = at::autocast::is_autocast_cache_enabled();
      at::autocast::set_autocast_cache_enabled(state.autocast_cache_enabled);
      c10::DeviceGuard device_guard(task.device);
      c10::OptionalStreamGuard stream_guard;
      if (state.streams[i]) {
        stream_guard.reset_stream(*state.streams[i]);
      }
      try {
        task.fn();
      } catch (...) {
        at::autocast::set_autocast_cache_enabled(cache);
        throw;
      }
      at::autocast::set_autocast_cache_enabled(cache);
    } catch (...) {
      return std::current_exception();
    }
    return nullptr;
  }

  std::mutex mutex_;
  std::condition_variable work_ready_;
  std::condition_variable all_done_;
  std::vector<std::thread> threads_;
  const std::vector<Task>* tasks_ = nullptr;
  std::vector<std::exception_ptr>* errors_ = nullptr;
  const CallerState* state_ = nullptr;
  size_t lanes_ = 0;
  size_t remaining_ = 0;
  uint64_t generation_ = 0;
  bool stop_ = false;
};

// Every pool ever made, and those not in use by a call.
class PoolRegistry {
 public:
  WorkerPool* acquire() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (idle_.empty()) {
      pools_.push_back(std::make_unique<WorkerPool>());
      return pools_.back().get();
    }
    WorkerPool* pool = idle_.back();
    idle_.pop_back();
    return pool;
  }

  void release(WorkerPool* pool) {
    std::lock_guard<std::mutex> lock(mutex_);
    idle_.push_back(pool);
  }

 private:
  std::mutex mutex_;
  std::vector<std::unique_ptr<WorkerPool>> pools_;
  std::vector<WorkerPool*> idle_;
};

PoolRegistry& registry() {
  static PoolRegistry instance;
  return instance;
}

// Holds a pool for the duration of one call.
class PoolLease {
 public:
  PoolLease() : pool_(registry().acquire()) {}
  ~PoolLease() { registry().release(pool_); }
  PoolLease(const PoolLease&) = delete;
  PoolLease& operator=(const PoolLease&) = delete;
  WorkerPool& operator*() const { return *pool_; }

 private:
  WorkerPool* pool_;
};

} // namespace

std::vector<std::exception_ptr> run_tasks(const std::vector<Task>& tasks, bool all_at_once) {
  PoolLease pool;
  return (*pool).run(tasks, all_at_once);
}

size_t worker_thread_count() {
  return g_threads.load();
}

} // namespace dpcore
