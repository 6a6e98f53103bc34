// Registration functions of the binding translation units (csrc/python/).
#pragma once

#include <pybind11/pybind11.h>

namespace dpcore {
namespace python {

void bind_comm(pybind11::module_& m);           // comm.cpp
void bind_grad_ready(pybind11::module_& m);     // grad_ready.cpp
void bind_packed(pybind11::module_& m);         // packed.cpp
void bind_parallel_apply(pybind11::module_& m); // parallel_apply.cpp
void bind_replica_sync(pybind11::module_& m);   // replica_sync.cpp
void bind_split(pybind11::module_& m);          // split.cpp
void bind_sync_batchnorm(pybind11::module_& m); // sync_batchnorm.cpp

} // namespace python
} // namespace dpcore
