// dpcore._C.Rendezvous (csrc/dpcore/rendezvous.h), dpcore._C.SyncBatchNormError
// and dpcore._C.sync_batch_norm (csrc/dpcore/sync_batchnorm.h).
// The methods that can block release the GIL. The rendezvous never destroys
// a tensor (which may take the GIL) under its lock, so the properties, which
// keep the GIL, only ever wait for short critical sections.
#include <torch/csrc/utils/pybind.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "dpcore/rendezvous.h"
#include "dpcore/sync_batchnorm.h"
#include "python/bindings.h"

namespace py = pybind11;

namespace dpcore {
namespace python {

void bind_sync_batchnorm(py::module_& m) {
  py::register_exception<RendezvousBroken>(m, "SyncBatchNormError", PyExc_RuntimeError);
  using NoGil = py::call_guard<py::gil_scoped_release>;
  using Exchanged = std::pair<std::vector<std::vector<at::Tensor>>, std::vector<int64_t>>;
  py::class_<Rendezvous>(m, "Rendezvous")
      .def(
          py::init([](size_t participants, std::optional<double> timeout_s) {
            std::chrono::milliseconds timeout = sync_timeout_from_env();
            if (timeout_s) {
              TORCH_CHECK_VALUE(
                  std::isfinite(*timeout_s) && *timeout_s >= 0.001,
                  "Rendezvous: expected timeout_s to be at least 0.001 seconds, but got ", *timeout_s);
              timeout = std::chrono::milliseconds(static_cast<int64_t>(std::llround(*timeout_s * 1000.0)));
            }
            return std::make_unique<Rendezvous>(participants, timeout);
          }),
          py::arg("participants"), py::arg("timeout_s") = py::none(),
          "A rendezvous of `participants` ranks; timeout_s defaults to DPCORE_SYNC_TIMEOUT_S (read now), "
          "else 300 s.")
      .def(
          "exchange",
          [](Rendezvous& self, size_t rank, const std::string& key, std::vector<at::Tensor> tensors,
             int64_t count) {
            std::vector<Contribution> all = self.exchange(rank, key, Contribution{std::move(tensors), count});
            Exchanged out;
            out.first.reserve(all.size());
            out.second.reserve(all.size());
            for (Contribution& c : all) {
              out.first.push_back(std::move(c.tensors));
              out.second.push_back(c.count);
            }
            return out;
          },
          py::arg("rank"), py::arg("key"), py::arg("tensors"), py::arg("count"), NoGil(),
          "Blocks (without the GIL) until every rank reached this round with the same key; returns "
          "([tensors of rank 0, ...], [count of rank 0, ...]). Raises SyncBatchNormError once broken.")
      .def("finish", &Rendezvous::finish, py::arg("rank"), NoGil())
      .def("fail", &Rendezvous::fail, py::arg("rank"), py::arg("reason"), NoGil())
      .def("abort", &Rendezvous::abort, py::arg("reason"), NoGil())
      .def_property_readonly("broken", &Rendezvous::broken)
      .def_property_readonly("reason", &Rendezvous::reason)
      .def_property_readonly("culprit", &Rendezvous::culprit)
      .def_property_readonly("rounds", &Rendezvous::rounds)
      .def_property_readonly("participants", &Rendezvous::participants)
      .def_property_readonly("timeout_s", [](const Rendezvous& self) {
        return static_cast<double>(self.timeout().count()) / 1000.0;
      });
  m.def(
      "sync_batch_norm",
      [](Rendezvous& rendezvous, size_t rank, const std::string& key, const at::Tensor& input,
         const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
         const std::optional<at::Tensor>& running_mean, const std::optional<at::Tensor>& running_var,
         bool update_running_stats, double momentum, double eps, std::optional<py::function> across) {
        // Declared before the release: destroyed (with the Python callable) once the GIL is held again.
        CombineAcross combine;
        if (across) {
          auto fn = std::make_shared<py::function>(std::move(*across));
          combine = [fn](const std::string& k, const at::Tensor& mean, const at::Tensor& var, int64_t count) {
            py::gil_scoped_acquire gil;
            py::tuple result = (*fn)(k, mean, var, count);
            TORCH_CHECK(
                result.size() == 3,
                "sync_batch_norm: expected `across` to return (mean, var, count), but got ", result.size(),
                " values");
            return std::make_tuple(
                result[0].cast<at::Tensor>(), result[1].cast<at::Tensor>(), result[2].cast<int64_t>());
          };
        }
        py::gil_scoped_release no_gil;
        return sync_batch_norm(
            rendezvous, rank, key, input, weight, bias, running_mean, running_var, update_running_stats,
            momentum, eps, combine);
      },
      py::arg("rendezvous"), py::arg("rank"), py::arg("key"), py::arg("input"), py::arg("weight"),
      py::arg("bias"), py::arg("running_mean"), py::arg("running_var"), py::arg("update_running_stats"),
      py::arg("momentum"), py::arg("eps"), py::arg("across") = py::none(),
      "One replica's BatchNorm in training mode with the statistics of every replica's input "
      "(exchanged once through `rendezvous` under `key`, without the GIL); differentiable. With `across`, "
      "a callable (key, mean, var, count) -> (mean, var, count) that rank 0 calls (with the GIL) to turn "
      "this process's statistics into those of every process. See csrc/dpcore/sync_batchnorm.h.");
}

} // namespace python
} // namespace dpcore
