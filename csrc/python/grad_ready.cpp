// Binding of dpcore::GradReadiness (csrc/dpcore/grad_ready.h): its callbacks
// call the front end's Python callables with the GIL (the autograd engine
// runs hooks without it); a Python exception they raise reaches the caller
// of backward() as itself.
#include <torch/csrc/utils/pybind.h>

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "dpcore/grad_ready.h"
#include "python/bindings.h"

namespace py = pybind11;

namespace dpcore {
namespace python {
namespace {

// A Python callable held from C++, released with the GIL wherever the last
// reference goes.
struct HeldCallable {
  py::function fn;
  explicit HeldCallable(py::function f) : fn(std::move(f)) {}
  HeldCallable(const HeldCallable&) = delete;
  HeldCallable& operator=(const HeldCallable&) = delete;
  ~HeldCallable() {
    py::gil_scoped_acquire gil;
    fn = py::function();
  }
};

} // namespace

void bind_grad_ready(py::module_& m) {
  py::class_<GradReadiness>(m, "GradReadiness")
      .def(
          py::init([](const std::vector<at::Tensor>& params, std::vector<int64_t> bucket_of,
                      std::vector<int64_t> order, py::function on_begin, py::function on_ready) {
            auto begin = std::make_shared<HeldCallable>(std::move(on_begin));
            auto ready = std::make_shared<HeldCallable>(std::move(on_ready));
            return std::make_unique<GradReadiness>(
                params, std::move(bucket_of), std::move(order),
                [begin]() {
                  py::gil_scoped_acquire gil;
                  begin->fn();
                },
                [ready](int64_t prefix) {
                  py::gil_scoped_acquire gil;
                  ready->fn(prefix);
                });
          }),
          py::arg("params"), py::arg("bucket_of"), py::arg("order"), py::arg("on_begin"), py::arg("on_ready"))
      .def("arm", &GradReadiness::arm, py::arg("armed"), py::arg("deferred"))
      .def("reset", &GradReadiness::reset)
      .def_property_readonly("task", &GradReadiness::task)
      .def("remove", &GradReadiness::remove);
}

} // namespace python
} // namespace dpcore
