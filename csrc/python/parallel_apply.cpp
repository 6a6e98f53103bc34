// parallel_apply over Python callables on dpcore's persistent worker pool.
// GIL handling lives here: the caller releases the GIL while it waits, and
// each worker takes it only to call into Python.
#include <torch/extension.h>

#include <string>
#include <vector>

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

py::list parallel_apply(
    const py::sequence& callables,
    const py::sequence& args,
    const py::sequence& kwargs,
    const std::vector<c10::Device>& devices,
    bool all_at_once) {
  const size_t n = py::len(callables);
  TORCH_CHECK_VALUE(
      py::len(args) == n, "parallel_apply: expected one args tuple per callable (", n, "), but got ",
      py::len(args));
  TORCH_CHECK_VALUE(
      py::len(kwargs) == n, "parallel_apply: expected one kwargs dict per callable (", n,
      "), but got ", py::len(kwargs));
  TORCH_CHECK_VALUE(
      devices.size() == n, "parallel_apply: expected one device per callable (", n, "), but got ",
      devices.size());
  std::vector<py::object> fns(n), positional(n), named(n), results(n);
  for (size_t i = 0; i < n; ++i) {
    fns[i] = callables[i];
    positional[i] = py::tuple(args[i]);
    named[i] = py::dict(kwargs[i]);
  }
  std::vector<Task> tasks;
  tasks.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    tasks.push_back(Task{devices[i], [&, i] {
                           py::gil_scoped_acquire gil;
                           results[i] = fns[i](*positional[i], **named[i]);
                         }});
  }
  std::vector<std::exception_ptr> errors;
  {
    py::gil_scoped_release no_gil;
    errors = run_tasks(tasks, all_at_once);
  }
  for (size_t i = 0; i < n; ++i) {
    if (errors[i]) {
      raise_task_error(errors[i], i, devices[i]);
    }
  }
  py::list out(n);
  for (size_t i = 0; i < n; ++i) {
    out[i] = std::move(results[i]);
  }
  return out;
}

} // namespace

void bind_parallel_apply(py::module_& m) {
  m.def(
      "parallel_apply", &parallel_apply, py::arg("callables"), py::arg("args"), py::arg("kwargs"),
      py::arg("devices"), py::kw_only(), py::arg("all_at_once") = false,
      "Calls callables[i](*args[i], **kwargs[i]) on persistent worker threads, "
      "one per call, under the caller's thread-local state and a device/stream guard for "
      "devices[i]; returns the results in order, or raises the first failure by index. "
      "all_at_once: every call on a thread of its own, all at once, on the CPU too.");
  m.def("worker_thread_count", &worker_thread_count);
}

} // namespace python
} // namespace dpcore
