// Persistent worker threads for parallel_apply. No Python here: the Python
// binding (csrc/python/parallel_apply.cpp) wraps Python callables as tasks.
#pragma once

#include <c10/core/Device.h>

#include <chrono>
#include <cstddef>
#include <exception>
#include <functional>
#include <memory>
#include <stdexcept>
#include <vector>

namespace dpcore {

// One unit of a parallel run: `fn` runs on a worker thread under a device
// guard for `device`.
struct Task {
  c10::Device device;
  std::function<void()> fn;
};

// The error recorded for a task that never ran because its run was cancelled
// before the task started.
class TaskCancelled : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

namespace detail {
struct Run;
} // namespace detail

// A run of tasks started by submit_tasks. Copies of a handle share one run.
//
// The run owns its tasks (and so whatever they capture), its per-task errors
// and the pool it runs on; the workers share that ownership while they work.
// Dropping every handle before the run has finished abandons it safely: the
// tasks already running finish, the others still run unless the run was
// cancelled, and the pool goes back into service only once its last task has
// returned (a pool never runs two runs at once). The workers let go of a run
// before it counts as done, so what a run owns is freed by the thread that
// drops its last handle; only an abandoned run is freed by a worker.
class TaskRun {
 public:
  // Waits at most `timeout` for the run to finish (every task returned or
  // skipped); returns whether it has.
  bool wait_for(std::chrono::nanoseconds timeout) const;
  // Waits until the run has finished; returns errors().
  const std::vector<std::exception_ptr>& wait() const;
  // Whether every task has returned or been skipped (the run's pool is then
  // back in service).
  bool done() const;
  // Tasks that have not started yet are skipped (their error is
  // TaskCancelled); tasks already running finish. Idempotent; a no-op once
  // the run is done.
  void cancel() const;
  bool cancelled() const;
  // One std::exception_ptr per task, null where the task succeeded; only once
  // done() (an error otherwise).
  const std::vector<std::exception_ptr>& errors() const;

 private:
  explicit TaskRun(std::shared_ptr<detail::Run> run) : run_(std::move(run)) {}
  friend TaskRun submit_tasks(std::vector<Task> tasks, bool all_at_once);

  std::shared_ptr<detail::Run> run_;
};

// Starts every task on the worker threads of a pool whose threads are created
// once and reused by later runs, and returns at once: accelerator tasks each
// on a thread of its own, all at once; CPU tasks on at most
// at::get_num_threads() threads at once (the caller's intra-op budget, shared
// out among them), since more would only contend for the cores; the others
// start as those finish, in index order per thread. Each task runs with the
// caller's thread-local state at submission (grad mode, inference mode,
// autocast enabled/dtype/cache flag, saved tensor hooks, dispatch and
// function modes), under a device guard for its device and with the caller's
// current stream on that device as the current stream.
//
// A pool is leased by one run at a time, from submission until its last task
// has returned; a run submitted while every pool is leased (another thread,
// a task itself submitting, an abandoned run still going) takes a new pool,
// which is kept for later runs: no deadlock, and no thread is created once
// the process has seen its peak concurrency.
//
// `all_at_once`: every task gets a thread of its own and all run at once, on
// the CPU too (each with its share of the intra-op threads), for tasks that
// wait for each other (synchronized BatchNorm's rendezvous).
TaskRun submit_tasks(std::vector<Task> tasks, bool all_at_once = false);

// The blocking form: runs `tasks` as submit_tasks does and waits until every
// task has finished. Returns one std::exception_ptr per task (null where the
// task succeeded): nothing is rethrown here, so that the caller can choose
// (the Python layer raises the first by index).
std::vector<std::exception_ptr> run_tasks(const std::vector<Task>& tasks, bool all_at_once = false);

// Worker threads created so far, over all pools (for tests and diagnostics).
size_t worker_thread_count();

// Pools created so far; each one is leased by at most one run at a time (for
// tests and diagnostics).
size_t worker_pool_count();

} // namespace dpcore
