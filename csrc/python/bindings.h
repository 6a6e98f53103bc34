// Registration functions of the binding translation units (csrc/python/).
#pragma once

#include <pybind11/pybind11.h>

namespace dpcore {
namespace python {

void bind_parallel_apply(pybind11::module_& m);
void bind_replica_sync(pybind11::module_& m);
void bind_rendezvous(pybind11::module_& m);

} // namespace python
} // namespace dpcore
