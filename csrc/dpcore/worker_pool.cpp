#include "dpcore/worker_pool.h"

#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <ATen/autocast_mode.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#if defined(__GLIBCXX__)
#include <cxxabi.h>
#endif

#ifdef _OPENMP
#include <omp.h>
#endif

namespace dpcore {
namespace detail {

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

// How far a run has got. Separate from the run so that the workers can let
// go of the run (and of what its tasks own) before it counts as done: then
// the handles' owner, not a worker thread, frees it (unless it was abandoned).
struct Completion {
  std::mutex mutex;
  std::condition_variable finished;
  size_t remaining = 0; // lanes still holding the run
  bool done = false;    // every lane let go and the pool is back in service
};

// One submitted run, shared by its TaskRun handles and the workers running
// it. Worker `lane` runs tasks lane, lane + lanes, ...
struct Run {
  std::vector<Task> tasks;
  CallerState state;
  size_t lanes = 0;
  std::atomic<bool> cancelled{false};
  std::mutex mutex;
  std::vector<std::exception_ptr> errors; // under `mutex`
  std::shared_ptr<Completion> completion = std::make_shared<Completion>();
};

} // namespace detail

namespace {

using detail::CallerState;
using detail::Completion;
using detail::Run;

std::atomic<size_t> g_threads{0};
std::atomic<size_t> g_pools{0};

class WorkerPool;
void release_pool(WorkerPool* pool);

class WorkerPool {
 public:
  WorkerPool() {
    g_pools.fetch_add(1);
  }
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

  // Hands `run` to this pool's workers (the caller holds the pool's lease,
  // which the run's last lane gives back).
  void start(std::shared_ptr<Run> run) {
    // Only start() changes generation_, and one run leases a pool at a time,
    // so reading it here is race-free; a new worker starts as having seen it.
    while (threads_.size() < run->lanes) {
      const size_t index = threads_.size();
      const uint64_t start = generation_;
      threads_.emplace_back([this, index, start] { loop(index, start); });
      g_threads.fetch_add(1);
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      run_ = std::move(run);
      ++generation_;
    }
    work_ready_.notify_all();
  }

 private:
  // Worker `index`: in every generation whose run has more than `index`
  // lanes, works its lane of that run. A worker without work in a generation
  // (or waking after the run finished) touches only run_, under the mutex.
  void loop(size_t index, uint64_t seen) {
    for (;;) {
      std::shared_ptr<Run> run;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        work_ready_.wait(lock, [&] { return stop_ || generation_ != seen; });
        if (stop_) {
          return;
        }
        seen = generation_;
        // A lane of a run always sees its run here: the next generation
        // cannot start before every lane of this one has finished.
        if (!run_ || index >= run_->lanes) {
          continue;
        }
        run = run_;
      }
      work_lane(std::move(run), index);
    }
  }

  // Runs lane `lane` of `run`, lets go of the run, and, as its last lane,
  // puts this pool back into service and marks the run done.
  void work_lane(std::shared_ptr<Run> run, size_t lane) {
    std::vector<std::pair<size_t, std::exception_ptr>> failures;
    for (size_t i = lane; i < run->tasks.size(); i += run->lanes) {
      if (run->cancelled.load()) {
        failures.emplace_back(
            i, std::make_exception_ptr(TaskCancelled(
                   "task " + std::to_string(i) + " was skipped: its run was cancelled before it started")));
        continue;
      }
      if (auto error = run_one(run->tasks[i], run->state, i)) {
        failures.emplace_back(i, std::move(error));
      }
    }
    {
      std::lock_guard<std::mutex> lock(run->mutex);
      for (auto& [i, error] : failures) {
        run->errors[i] = std::move(error);
      }
    }
    const std::shared_ptr<Completion> completion = run->completion;
    run.reset(); // freed here only if every handle is gone (abandoned)
    {
      std::lock_guard<std::mutex> lock(completion->mutex);
      if (--completion->remaining != 0) {
        return;
      }
    }
    // The last lane: the pool lets go of the run, and goes back into service
    // before the run counts as done, so that a caller woken by it finds this
    // pool idle (no new pool, no new threads).
    std::shared_ptr<Run> last;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      last = std::move(run_);
    }
    last.reset();
    release_pool(this);
    {
      std::lock_guard<std::mutex> lock(completion->mutex);
      completion->done = true;
    }
    completion->finished.notify_all();
  }

  // Runs one task under the caller's state; returns its exception, if any.
  static std::exception_ptr run_one(const Task& task, const CallerState& state, size_t i) {
    try {
      at::ThreadLocalStateGuard tls_guard(state.tls);
#ifdef _OPENMP
      if (state.intra_op_threads > 0) {
        omp_set_num_threads(state.intra_op_threads); // this thread's teams only
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
#if defined(__GLIBCXX__)
    } catch (const abi::__forced_unwind&) {
      throw; // the thread is being ended (pthread_exit): never swallow that
#endif
    } catch (...) {
      return std::current_exception();
    }
    return nullptr;
  }

  std::mutex mutex_;
  std::condition_variable work_ready_;
  std::vector<std::thread> threads_;
  std::shared_ptr<Run> run_; // the run of the current generation, until it finishes
  uint64_t generation_ = 0;
  bool stop_ = false;
};

// Every pool ever made, and those not leased by a run.
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
  // Destroyed in reverse order: pools_ first (joining their threads, whose
  // last run may still hand its pool back), then idle_ and the mutex.
  std::mutex mutex_;
  std::vector<WorkerPool*> idle_;
  std::vector<std::unique_ptr<WorkerPool>> pools_;
};

PoolRegistry& registry() {
  static PoolRegistry instance;
  return instance;
}

void release_pool(WorkerPool* pool) {
  registry().release(pool);
}

// The caller's state for `run`, and how many lanes it gets.
void prepare(Run& run, bool all_at_once) {
  const std::vector<Task>& tasks = run.tasks;
  CallerState& state = run.state;
  // On the CPU, replicas share the caller's intra-op thread budget: at most
  // that many run at once (more would only contend for cores and the GIL),
  // each with its share of intra-op threads. Accelerator tasks all run at
  // once, and so do CPU tasks with all_at_once (they wait for each other).
  const bool all_cpu =
      std::all_of(tasks.begin(), tasks.end(), [](const Task& t) { return t.device.is_cpu(); });
  run.lanes = tasks.size();
  if (all_cpu) {
    const int budget = std::max(1, at::get_num_threads());
    run.lanes = all_at_once ? tasks.size() : std::min(tasks.size(), static_cast<size_t>(budget));
    state.intra_op_threads = std::max(1, budget / static_cast<int>(run.lanes));
  }
  state.streams.reserve(tasks.size());
  for (const Task& task : tasks) {
    if (task.device.is_cpu()) {
      state.streams.emplace_back(std::nullopt);
    } else {
      state.streams.emplace_back(c10::impl::getDeviceGuardImpl(task.device.type())->getStream(task.device));
    }
  }
  run.errors.resize(tasks.size());
  run.completion->remaining = run.lanes;
}

} // namespace

TaskRun submit_tasks(std::vector<Task> tasks, bool all_at_once) {
  auto run = std::make_shared<Run>(); // captures the caller's thread-local state
  run->tasks = std::move(tasks);
  if (run->tasks.empty()) {
    run->completion->done = true;
    return TaskRun(std::move(run));
  }
  prepare(*run, all_at_once);
  WorkerPool* pool = registry().acquire();
  try {
    pool->start(run);
  } catch (...) {
    // No worker got the run (a thread could not be created): the pool is
    // still idle.
    release_pool(pool);
    throw;
  }
  return TaskRun(std::move(run));
}

bool TaskRun::wait_for(std::chrono::nanoseconds timeout) const {
  detail::Completion& c = *run_->completion;
  std::unique_lock<std::mutex> lock(c.mutex);
  return c.finished.wait_for(lock, timeout, [&c] { return c.done; });
}

const std::vector<std::exception_ptr>& TaskRun::wait() const {
  {
    detail::Completion& c = *run_->completion;
    std::unique_lock<std::mutex> lock(c.mutex);
    c.finished.wait(lock, [&c] { return c.done; });
  }
  return errors();
}

bool TaskRun::done() const {
  detail::Completion& c = *run_->completion;
  std::lock_guard<std::mutex> lock(c.mutex);
  return c.done;
}

void TaskRun::cancel() const {
  run_->cancelled.store(true);
}

bool TaskRun::cancelled() const {
  return run_->cancelled.load();
}

const std::vector<std::exception_ptr>& TaskRun::errors() const {
  size_t remaining = 0;
  {
    detail::Completion& c = *run_->completion;
    std::lock_guard<std::mutex> lock(c.mutex);
    remaining = c.done ? 0 : std::max<size_t>(c.remaining, 1);
  }
  TORCH_CHECK(
      remaining == 0, "TaskRun::errors: expected a finished run, but ", remaining, " of its ", run_->lanes,
      " lanes are still working (wait first)");
  // No worker writes the errors any more.
  return run_->errors;
}

std::vector<std::exception_ptr> run_tasks(const std::vector<Task>& tasks, bool all_at_once) {
  // The caller's tasks outlive the run (this call blocks until it is done),
  // so the run holds references to them rather than copies of what they
  // capture.
  std::vector<Task> refs;
  refs.reserve(tasks.size());
  for (const Task& task : tasks) {
    refs.push_back(Task{task.device, [&fn = task.fn] { fn(); }});
  }
  return submit_tasks(std::move(refs), all_at_once).wait();
}

size_t worker_thread_count() {
  return g_threads.load();
}

size_t worker_pool_count() {
  return g_pools.load();
}

} // namespace dpcore
