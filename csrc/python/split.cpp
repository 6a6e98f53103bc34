// Bindings of the split arithmetic (csrc/dpcore/split.h): dpcore._C.split_sizes
// and plan_split, whose faults become the ValueErrors that name the inputs'
// paths (str() of each path object, made only for the message).
#include <torch/csrc/utils/pybind.h>

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "dpcore/split.h"
#include "python/bindings.h"

namespace py = pybind11;

namespace dpcore {
namespace python {
namespace {

using Entry = std::pair<py::object, std::optional<int64_t>>; // (path, size along dim or none)
using Unit = std::tuple<py::object, int64_t, py::object>;    // (path, count, noun)

std::string text(const py::handle& obj) {
  return py::str(obj).cast<std::string>();
}

const char kBroadcast[] = " (wrap a tensor in dpcore.Broadcast to pass it whole to every replica)";

// The ValueError of a plan's fault (split.h), in the words of dpcore/_split.py's plan_split.
[[noreturn]] void raise_fault(
    const SplitPlan& plan, const std::vector<Entry>& entries, const std::vector<Unit>& units, int64_t dim,
    const py::object& hint) {
  const std::string along = " along dim " + std::to_string(dim);
  std::string message;
  if (plan.fault == SplitFault::kUnitCount || plan.fault == SplitFault::kUnitSize) {
    const auto& [first_path, batch, noun] = units[0];
    const std::string theirs =
        " but " + text(first_path) + " has " + std::to_string(batch) + " " + text(noun);
    if (plan.fault == SplitFault::kUnitCount) {
      const auto& [path, count, what] = units[plan.at];
      message =
          text(path) + " has " + std::to_string(count) + " " + text(what) + theirs +
          ": every input that is split between samples (dpcore.Samples lists, PackedSequences) in one call "
          "must hold the batch's number of them";
    } else {
      const auto& [path, size] = entries[plan.at];
      message = text(path) + " has size " + std::to_string(*size) + along + theirs +
                ": every tensor scattered in one call must have the batch's size (" + std::to_string(batch) +
                ")" + along + " or, to be split one row per replica, the number of replicas used (" +
                std::to_string(plan.replicas) + ")" + kBroadcast + text(hint);
    }
  } else {
    const auto& [path, size] = entries[plan.at];
    const auto& [first_path, first] = entries[plan.first];
    const std::string per =
        !plan.per ? ""
                  : " or, to be split one row per replica, the number of replicas used (" +
                        std::to_string(*plan.per) + " for a batch of " + std::to_string(*first) + ")";
    message = text(path) + " has size " + std::to_string(*size) + along + " but " + text(first_path) +
              " has size " + std::to_string(*first) +
              ": every tensor scattered in one call must have the batch's size" + along + per + kBroadcast +
              text(hint);
  }
  throw py::value_error(message);
}

} // namespace

void bind_split(py::module_& m) {
  m.def(
      "split_sizes", &split_sizes, py::arg("batch"), py::arg("n_devices"), py::arg("chunk_sizes"),
      py::arg("weights"),
      "Each device's rows of `batch`: chunk_sizes as given, in proportion to weights (exact largest "
      "remainder), else balanced (csrc/dpcore/split.h).");
  m.def(
      "plan_split",
      [](const std::vector<Entry>& entries, int64_t n_devices,
         const std::optional<std::vector<int64_t>>& chunk_sizes,
         const std::optional<std::vector<double>>& weights, int64_t dim, const std::vector<Unit>& units,
         const py::object& hint) {
        std::vector<std::optional<int64_t>> sizes;
        sizes.reserve(entries.size());
        for (const Entry& e : entries) {
          sizes.push_back(e.second);
        }
        std::vector<int64_t> counts;
        for (const Unit& u : units) {
          counts.push_back(std::get<1>(u));
        }
        const SplitPlan plan = plan_split(sizes, n_devices, chunk_sizes, weights, counts);
        if (plan.fault != SplitFault::kNone) {
          raise_fault(plan, entries, units, dim, hint);
        }
        return std::make_tuple(plan.batch, plan.sizes, plan.replicas);
      },
      py::arg("entries"), py::arg("n_devices"), py::arg("chunk_sizes"), py::arg("weights"), py::arg("dim"),
      py::arg("units"), py::arg("hint"),
      "(batch, sizes, replicas) of one call's scatter (dpcore._split.plan_split's rules); a ValueError "
      "naming two paths where no size is the batch.");
}

} // namespace python
} // namespace dpcore
