// parallel_apply over Python callables on dpcore's persistent worker pool.
// GIL handling lives here: the caller releases the GIL while it waits (taking
// it back every kSignalPoll so that Ctrl-C reaches it), and each worker takes
// it only to call into Python. Each call that shares a generator with
// another runs in a random stream of its own (dpcore/replica_rng.h), and
// while such calls run, torch's RNG-state names are bound to the functions
// dpcore/_rng.py hands over once (set_rng_state_functions).
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <chrono>
#include <iterator>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "dpcore/replica_rng.h"
#include "dpcore/worker_pool.h"
#include "python/bindings.h"

namespace py = pybind11;

namespace dpcore {
namespace python {
namespace {

std::string replica_note(size_t index, const c10::Device& device) {
  return "raised in replica " + std::to_string(index) + " on device " + device.str();
}

// Raises the error of task `index`: a Python exception as the same object
// (type, attributes and traceback intact), with a note naming the replica
// and device; a C++ exception as it is.
[[noreturn]] void raise_task_error(const std::exception_ptr& error, size_t index, const c10::Device& device) {
  try {
    std::rethrow_exception(error);
  } catch (py::error_already_set& e) {
    py::object value = e.value();
    if (value && py::hasattr(value, "add_note")) {
      value.attr("add_note")(replica_note(index, device));
    }
    throw;
  }
}

// How often a caller waiting for its replicas takes the GIL to let Python
// run signal handlers (which run only on the main thread, holding the GIL):
// a Ctrl-C reaches the caller within about this long.
constexpr std::chrono::milliseconds kSignalPoll{50};

bool interpreter_finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return !Py_IsInitialized() || Py_IsFinalizing();
#else
  return !Py_IsInitialized() || _Py_IsFinalizing();
#endif
}

// Drops an interrupt (ApplyCall::interrupt_running) that reached this worker
// after its call returned, so that it never reaches the thread's next task;
// GIL held. Only where one is pending: PyThreadState_SetAsyncExc(thread,
// nullptr) would signal the interpreter's eval breaker with nothing to
// deliver, and the signal would stay set for good (every Python instruction
// of every thread then takes the slow path; with a trace or profile function
// set, CPython 3.11's loop spins on it). The interrupt is delivered to a
// one-expression evaluation, which consumes the signal, and discarded.
void drop_late_interrupt() {
  if (PyThreadState_Get()->async_exc == nullptr) {
    return;
  }
  PyObject* globals = PyDict_New();
  if (globals != nullptr) {
    PyObject* result = PyRun_String("None", Py_eval_input, globals, globals);
    Py_XDECREF(result);
    Py_DECREF(globals);
  }
  PyErr_Clear();
}

// The Python objects of one call, shared by the caller and the tasks: a call
// abandoned by a signal outlives its caller's frame. The workers let go of a
// run before it counts as done, and an unfinished run whose handle is
// dropped is kept in AbandonedRuns, so these are freed by a Python thread;
// should a worker free them after all, it takes the GIL (and once the
// interpreter is shutting down, they are left to the process).
struct ApplyCall {
  std::vector<py::object> fns, positional, named, results;
  // running[i]: the Python thread id of the worker running call i while it
  // runs Python code, 0 otherwise. Read and written with the GIL held only.
  std::vector<unsigned long> running;

  // Raises KeyboardInterrupt asynchronously in every call still running
  // Python code (at its next bytecode); GIL held.
  void interrupt_running() const {
    for (const unsigned long thread : running) {
      if (thread != 0) {
        PyThreadState_SetAsyncExc(thread, PyExc_KeyboardInterrupt);
      }
    }
  }

  ApplyCall() = default;
  ApplyCall(const ApplyCall&) = delete;
  ApplyCall& operator=(const ApplyCall&) = delete;

  ~ApplyCall() {
    std::vector<py::object>* all[] = {&fns, &positional, &named, &results};
    if (interpreter_finalizing()) {
      for (auto* objects : all) {
        for (py::object& o : *objects) {
          o.release();
        }
      }
      return;
    }
    py::gil_scoped_acquire gil;
    for (auto* objects : all) {
      objects->clear();
    }
  }
};

// Runs left while still going (a signal interrupted the wait, or the handle
// was dropped): kept until they are done, so that a Python thread frees
// them, and waited for at interpreter exit, so that no worker is left
// running Python code while it shuts down.
class AbandonedRuns {
 public:
  // Keeps `run`, and lets go of those done since (freed after the lock is
  // released: freeing Python objects can run any Python code).
  void add(const TaskRun& run) {
    std::vector<TaskRun> finished;
    std::lock_guard<std::mutex> lock(mutex_);
    auto split =
        std::stable_partition(runs_.begin(), runs_.end(), [](const TaskRun& r) { return !r.done(); });
    finished.assign(std::make_move_iterator(split), std::make_move_iterator(runs_.end()));
    runs_.erase(split, runs_.end());
    runs_.push_back(run);
  }

  std::vector<TaskRun> take() {
    std::lock_guard<std::mutex> lock(mutex_);
    return std::exchange(runs_, {});
  }

 private:
  std::mutex mutex_;
  std::vector<TaskRun> runs_;
};

AbandonedRuns& abandoned_runs() {
  static AbandonedRuns instance;
  return instance;
}

// Waits for `run` with the GIL released, at most `timeout_s` seconds (None:
// until it is done), taking the GIL every kSignalPoll to run Python's signal
// handlers. When a handler raises (KeyboardInterrupt on Ctrl-C), the run is
// cancelled (its tasks not yet started are skipped) and, given `call`, the
// tasks still running are interrupted (KeyboardInterrupt raised in them at
// their next Python bytecode) and waited for, so that none of them still
// runs when the handler's exception reaches the caller; a second signal
// during that wait ends it, leaving them to finish in the background (see
// AbandonedRuns), as a run without `call` is at once. Returns whether the
// run is done.
bool wait_interruptibly(
    const TaskRun& run, std::optional<double> timeout_s, const ApplyCall* call = nullptr) {
  using Clock = std::chrono::steady_clock;
  const bool bounded = timeout_s.has_value();
  const Clock::time_point deadline =
      bounded ? Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                   std::chrono::duration<double>(std::max(0.0, *timeout_s)))
              : Clock::time_point::max();
  for (;;) {
    std::chrono::nanoseconds step = kSignalPoll;
    if (bounded) {
      step = std::clamp<std::chrono::nanoseconds>(deadline - Clock::now(), std::chrono::nanoseconds(0), step);
    }
    bool done = false;
    {
      py::gil_scoped_release no_gil;
      done = run.wait_for(step);
    }
    if (done) {
      return true;
    }
    if (PyErr_CheckSignals() != 0) {
      run.cancel();
      if (call == nullptr) {
        abandoned_runs().add(run);
        throw py::error_already_set();
      }
      py::error_already_set first; // the handler's exception, fetched
      call->interrupt_running();
      wait_interruptibly(run, std::nullopt); // a second signal abandons the run and raises its exception
      throw first;
    }
    if (bounded && Clock::now() >= deadline) {
      return false;
    }
  }
}

// At interpreter exit: cancels the abandoned runs and waits for their
// running tasks (a second signal stops the wait).
void join_abandoned_runs() {
  std::vector<TaskRun> runs = abandoned_runs().take();
  for (const TaskRun& run : runs) {
    run.cancel();
  }
  for (const TaskRun& run : runs) {
    wait_interruptibly(run, std::nullopt);
  }
}

// One parallel_apply call in flight (Python: dpcore._C.ParallelRun).
class ParallelRun {
 public:
  ParallelRun(std::shared_ptr<ApplyCall> call, TaskRun run, std::vector<c10::Device> devices)
      : call_(std::move(call)), run_(std::move(run)), devices_(std::move(devices)) {}
  ParallelRun(const ParallelRun&) = delete;
  ParallelRun& operator=(const ParallelRun&) = delete;

  // Freed by Python (GIL held): an unfinished run is kept until it is done.
  ~ParallelRun() {
    if (!run_.done()) {
      abandoned_runs().add(run_);
    }
  }

  // The results in order, once every call has returned; or the error of the
  // lowest failing index. Interruptible (see wait_interruptibly).
  py::list result() const {
    wait_interruptibly(run_, std::nullopt, call_.get());
    const std::vector<std::exception_ptr>& errors = run_.errors();
    for (size_t i = 0; i < errors.size(); ++i) {
      if (errors[i]) {
        raise_task_error(errors[i], i, devices_[i]);
      }
    }
    py::list out(call_->results.size());
    for (size_t i = 0; i < call_->results.size(); ++i) {
      out[i] = call_->results[i];
    }
    return out;
  }

  // Waits until every call has returned or been skipped, at most `timeout`
  // seconds (None: no limit); their errors are not raised. Interruptible.
  bool join(std::optional<double> timeout) const {
    return wait_interruptibly(run_, timeout, call_.get());
  }

  void cancel() const {
    run_.cancel();
  }
  bool done() const {
    return run_.done();
  }

 private:
  std::shared_ptr<ApplyCall> call_;
  TaskRun run_;
  std::vector<c10::Device> devices_;
};

// The RNG-state names to bind while replicas with streams run, given once
// by dpcore/_rng.py (the C++ imports no Python): a list of [owner, name,
// function, replaced], `replaced` holding the value that binding took
// while it holds. A strong reference, left to the process at exit (no
// decref once the interpreter is gone). GIL held.
py::handle state_functions;
// The calls with a stream running now, of every run; GIL held.
size_t calls_with_streams = 0;

void set_rng_state_functions(const py::list& functions) {
  TORCH_CHECK(
      calls_with_streams == 0,
      "set_rng_state_functions: expected no replica with a random stream running, but ", calls_with_streams,
      " are");
  py::list entries;
  for (const py::handle entry : functions) {
    TORCH_CHECK_VALUE(
        py::isinstance<py::tuple>(entry) && py::len(entry) == 3 &&
            py::isinstance<py::str>(entry[py::int_(1)]),
        "set_rng_state_functions: expected (owner, name, function) tuples, but got ",
        py::repr(entry).cast<std::string>());
    entries.append(
        py::list(py::make_tuple(entry[py::int_(0)], entry[py::int_(1)], entry[py::int_(2)], py::none())));
  }
  std::exchange(state_functions, entries.release()).dec_ref();
}

// While alive on a call with a stream (`bound`), torch's RNG-state names
// are bound to state_functions: from the first such call of any run to
// start until the last to end, so that outside them torch is as it is. A
// name that other code rebound meanwhile is left as that code set it. GIL
// held throughout.
class StateFunctionsBound {
 public:
  explicit StateFunctionsBound(bool bound) : bound_(bound && static_cast<bool>(state_functions)) {
    if (bound_ && calls_with_streams++ == 0) {
      swap(true);
    }
  }
  ~StateFunctionsBound() {
    if (bound_ && --calls_with_streams == 0) {
      swap(false);
    }
  }
  StateFunctionsBound(const StateFunctionsBound&) = delete;
  StateFunctionsBound& operator=(const StateFunctionsBound&) = delete;

 private:
  // Binds each name (on) or puts back what it replaced (off); a failure is
  // reported as unraisable, the Python error state kept as it was.
  static void swap(bool on) noexcept {
    PyObject *type = nullptr, *value = nullptr, *traceback = nullptr;
    PyErr_Fetch(&type, &value, &traceback);
    PyObject* entries = state_functions.ptr();
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(entries); ++i) {
      PyObject* entry = PyList_GET_ITEM(entries, i);
      PyObject* owner = PyList_GET_ITEM(entry, 0);
      PyObject* name = PyList_GET_ITEM(entry, 1);
      PyObject* function = PyList_GET_ITEM(entry, 2);
      PyObject* current = PyObject_GetAttr(owner, name);
      bool failed = current == nullptr;
      if (!failed && on) {
        failed = PyObject_SetAttr(owner, name, function) != 0;
        PyList_SetItem(entry, 3, current); // takes `current`: what the binding replaced
        current = nullptr;
      } else if (!failed) {
        PyObject* replaced = PyList_GET_ITEM(entry, 3);
        failed = current == function && PyObject_SetAttr(owner, name, replaced) != 0;
        Py_INCREF(Py_None);
        PyList_SetItem(entry, 3, Py_None);
      }
      Py_XDECREF(current);
      if (failed) {
        PyErr_WriteUnraisable(name);
      }
    }
    PyErr_Restore(type, value, traceback);
  }

  bool bound_;
};

// The calls' random streams (replica_rng.h); where they are unavailable,
// one RuntimeWarning says why. GIL held.
ReplicaStreams streams_for(const std::vector<c10::Device>& devices) {
  static bool warned = false;
  ReplicaStreams streams = replica_streams(devices);
  if (!streams.unavailable.empty() && !warned) {
    warned = true;
    const std::string message =
        "dpcore: replicas that share a generator draw from it in thread order, so random numbers (dropout) "
        "are not reproducible from run to run: " +
        streams.unavailable;
    if (PyErr_WarnEx(PyExc_RuntimeWarning, message.c_str(), 1) != 0) {
      throw py::error_already_set();
    }
  }
  return streams;
}

std::unique_ptr<ParallelRun> start_parallel_apply(
    const py::sequence& callables, const py::sequence& args, const py::sequence& kwargs,
    const std::vector<c10::Device>& devices, bool all_at_once) {
  const size_t n = py::len(callables);
  TORCH_CHECK_VALUE(
      py::len(args) == n, "parallel_apply: expected one args tuple per callable (", n, "), but got ",
      py::len(args));
  TORCH_CHECK_VALUE(
      py::len(kwargs) == n, "parallel_apply: expected one kwargs dict per callable (", n, "), but got ",
      py::len(kwargs));
  TORCH_CHECK_VALUE(
      devices.size() == n, "parallel_apply: expected one device per callable (", n, "), but got ",
      devices.size());
  auto call = std::make_shared<ApplyCall>();
  call->fns.resize(n);
  call->positional.resize(n);
  call->named.resize(n);
  call->results.resize(n);
  call->running.assign(n, 0);
  for (size_t i = 0; i < n; ++i) {
    call->fns[i] = callables[i];
    call->positional[i] = py::tuple(args[i]);
    call->named[i] = py::dict(kwargs[i]);
  }
  ReplicaStreams streams = streams_for(devices);
  std::vector<Task> tasks;
  tasks.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    std::shared_ptr<ReplicaStream> stream = streams.per_call.empty() ? nullptr : streams.per_call[i];
    tasks.push_back(Task{devices[i], [call, i, stream = std::move(stream)] {
                           ReplicaStreamScope random_stream(stream.get());
                           py::gil_scoped_acquire gil;
                           StateFunctionsBound state_names(stream != nullptr);
                           // While it runs Python code, the call can be interrupted
                           // (ApplyCall::interrupt_running); once it has returned, an
                           // interrupt sent too late is dropped, never left pending for
                           // the next task of this thread.
                           const unsigned long thread = PyThread_get_thread_ident();
                           call->running[i] = thread;
                           struct Finished {
                             ApplyCall& call;
                             size_t i;
                             ~Finished() {
                               call.running[i] = 0;
                               drop_late_interrupt();
                             }
                           } finished{*call, i};
                           call->results[i] = call->fns[i](*call->positional[i], **call->named[i]);
                         }});
  }
  TaskRun run = [&] {
    py::gil_scoped_release no_gil; // the tasks' state is captured here; they may start at once
    return submit_tasks(std::move(tasks), all_at_once);
  }();
  return std::make_unique<ParallelRun>(std::move(call), std::move(run), devices);
}

py::list parallel_apply(
    const py::sequence& callables, const py::sequence& args, const py::sequence& kwargs,
    const std::vector<c10::Device>& devices, bool all_at_once) {
  return start_parallel_apply(callables, args, kwargs, devices, all_at_once)->result();
}

} // namespace

void bind_parallel_apply(py::module_& m) {
  m.def(
      "parallel_apply", &parallel_apply, py::arg("callables"), py::arg("args"), py::arg("kwargs"),
      py::arg("devices"), py::kw_only(), py::arg("all_at_once") = false,
      "Calls callables[i](*args[i], **kwargs[i]) on persistent worker threads, "
      "one per call, under the caller's thread-local state and a device/stream guard for "
      "devices[i]; returns the results in order, or raises the first failure by index: "
      "start_parallel_apply(...).result(). all_at_once: every call on a thread of its own, all "
      "at once, on the CPU too.");
  py::class_<ParallelRun>(m, "ParallelRun")
      .def(
          "result", &ParallelRun::result,
          "Waits for every call (Python signal handlers keep running: an exception they raise, "
          "such as KeyboardInterrupt, cancels the calls not yet started, interrupts the running "
          "ones with KeyboardInterrupt and waits for them before it is raised; a second one ends "
          "that wait, leaving them to finish in the background); returns the results in order, or "
          "raises the error of the lowest failing index.")
      .def(
          "join", &ParallelRun::join, py::arg("timeout") = py::none(),
          "Waits until every call has returned or been skipped (at most `timeout` seconds), "
          "without raising their errors; returns whether they have. Interruptible as result().")
      .def("cancel", &ParallelRun::cancel, "Calls not yet started will be skipped.")
      .def_property_readonly("done", &ParallelRun::done);
  m.def(
      "start_parallel_apply", &start_parallel_apply, py::arg("callables"), py::arg("args"), py::arg("kwargs"),
      py::arg("devices"), py::kw_only(), py::arg("all_at_once") = false,
      "Starts parallel_apply's calls and returns a ParallelRun at once.");
  m.def(
      "replica_generator", [] { return current_replica_generator(); },
      "The generator of the random stream of the replica running on this thread (docs/design.md, "
      "\"Randomness\"), or None where the thread has none.");
  m.def(
      "replica_seeds", &replica_seeds, py::arg("devices"),
      "The seed of the random stream of each call of a parallel call on `devices`, derived as the "
      "replicas' streams are (docs/randomness.md), for every call: one number taken now per group "
      "of calls that share a default generator, then each call's position in its group.");
  m.def(
      "set_rng_state_functions", &set_rng_state_functions, py::arg("functions"),
      "(owner, name, function) triples: while a replica with a random stream runs, owner.name is "
      "function (torch's RNG-state names and dpcore/_rng.py's functions), and as before otherwise.");
  m.def("worker_thread_count", &worker_thread_count);
  m.def("worker_pool_count", &worker_pool_count);
  m.def(
      "join_abandoned_runs", &join_abandoned_runs,
      "Cancels the runs left unfinished and waits for their running calls: registered with atexit by "
      "dpcore/parallel_apply.py, so that no worker runs Python code while the interpreter shuts down.");
}

} // namespace python
} // namespace dpcore
