// Python lists of many new tensors, made at once (csrc/python only).
//
// A collective that makes thousands of tensors (broadcast_coalesced of 3000
// parameters to 4 devices: 9000) spends most of its host time wrapping them
// as Python objects. Each wrap allocates an object the cyclic garbage
// collector tracks, so the wraps trigger a young-generation collection every
// 700 objects, and every collection promotes the tensors wrapped so far
// (still referenced) towards the old generation, bringing the next
// collection of the whole heap closer. These helpers wrap with the collector
// paused: the new objects are examined once, by the first collection after
// the call, when the caller holds them, instead of a dozen times.
#pragma once

#include <Python.h>
#include <pybind11/pybind11.h>
#include <torch/csrc/autograd/python_variable.h>

#include <utility>
#include <vector>

#include "dpcore/common.h"

namespace dpcore {
namespace python {

// Pauses Python's cyclic garbage collector while it lives, and restores the
// state it found (a collector the caller had disabled stays disabled). Hold
// the GIL for its whole life and run no Python code under it: it is meant
// for loops that only allocate objects.
class GcPause {
 public:
  GcPause() : was_enabled_(PyGC_Disable() != 0) {}
  ~GcPause() {
    if (was_enabled_) {
      PyGC_Enable();
    }
  }
  GcPause(const GcPause&) = delete;
  GcPause& operator=(const GcPause&) = delete;

 private:
  bool was_enabled_;
};

// A Python list of `tensors` (the GIL held), wrapped with the collector
// paused. Tensors that already have a Python object return that object.
inline pybind11::list to_python_list(std::vector<at::Tensor>&& tensors) {
  pybind11::list result(tensors.size());
  GcPause pause;
  for (size_t i = 0; i < tensors.size(); ++i) {
    PyObject* object = THPVariable_Wrap(std::move(tensors[i]));
    if (object == nullptr) {
      throw pybind11::error_already_set();
    }
    PyList_SET_ITEM(result.ptr(), static_cast<Py_ssize_t>(i), object); // steals the reference
  }
  return result;
}

// A Python list of lists of `lists` (the GIL held), as to_python_list.
inline pybind11::list to_python_lists(TensorList2D&& lists) {
  pybind11::list result(lists.size());
  for (size_t k = 0; k < lists.size(); ++k) {
    PyList_SET_ITEM(
        result.ptr(), static_cast<Py_ssize_t>(k), to_python_list(std::move(lists[k])).release().ptr());
  }
  return result;
}

} // namespace python
} // namespace dpcore
