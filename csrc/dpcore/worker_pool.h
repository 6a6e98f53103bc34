// Persistent worker threads for parallel_apply. No Python here: the Python
// binding (csrc/python/parallel_apply.cpp) wraps Python callables as tasks.
#pragma once

#include <c10/core/Device.h>

#include <cstddef>
#include <exception>
#include <functional>
#include <memory>
#include <vector>

namespace dpcore {

// One unit of a parallel run: `fn` runs on a worker thread under a device
// guard for `device`.
struct Task {
  c10::Device device;
  std::function<void()> fn;
};

// Runs every task on the worker threads of a pool whose threads are created
// once and reused by later calls: accelerator tasks each on a thread of its
// own, all at once; CPU tasks on at most at::get_num_threads() threads at
// once (the caller's intra-op budget, shared out among them), since more
// would only contend for the cores. Each task runs with the caller's thread-local
// state (grad mode, inference mode, autocast enabled/dtype/cache flag, saved
// tensor hooks, dispatch and function modes), under a device guard for its
// device and with the caller's current stream on that device as the
// current stream. Blocks until every task has finished.
//
// Returns one std::exception_ptr per task (null where the task succeeded):
// nothing is rethrown here, so that the caller can choose (the Python layer
// raises the first by index). A pool is used by one call at a time; a call
// made while every pool is busy (another thread, or a task itself calling
// run_tasks) takes a new pool, which is kept for later calls: no deadlock,
// and no thread is created once the process has seen its peak concurrency.
//
// `all_at_once`: every task gets a thread of its own and all run at once, on
// the CPU too (each with its share of the intra-op threads), for tasks that
// wait for each other (synchronized BatchNorm's rendezvous).
std::vector<std::exception_ptr> run_tasks(const std::vector<Task>& tasks, bool all_at_once = false);

// Worker threads created so far, over all pools (for tests and diagnostics).
size_t worker_thread_count();

} // namespace dpcore
