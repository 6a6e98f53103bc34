// Bindings of the collectives (csrc/dpcore/comm.h) and of the bucketing and
// unflattening they build on (csrc/dpcore/flatten.h): dpcore._C.broadcast,
// broadcast_out, broadcast_coalesced, reduce_add, reduce_add_coalesced,
// scatter, scatter_out, gather, gather_out, balanced_chunk_sizes, make_buckets,
// unflatten. Every
// collective releases the GIL while it runs.
#include <torch/csrc/utils/pybind.h>

#include <optional>
#include <vector>

#include "dpcore/comm.h"
#include "dpcore/flatten.h"
#include "python/bindings.h"
#include "python/tensor_lists.h"

namespace py = pybind11;

namespace dpcore {
namespace python {
namespace {

using Devices = std::vector<c10::Device>;
using Tensors = std::vector<at::Tensor>;
using NoGil = py::call_guard<py::gil_scoped_release>;

} // namespace

void bind_comm(py::module_& m) {
  m.def(
      "broadcast",
      [](const at::Tensor& tensor, const Devices& devices) { return dpcore::broadcast(tensor, devices); },
      py::arg("tensor"), py::arg("devices"), NoGil());
  m.def(
      "broadcast_out",
      [](const at::Tensor& tensor, const Tensors& outs) { dpcore::broadcast_out(tensor, outs); },
      py::arg("tensor"), py::arg("out"), NoGil());
  // The coalesced collectives return thousands of new tensors: the work runs
  // without the GIL, the wrapping with it, in bulk (tensor_lists.h).
  m.def(
      "broadcast_coalesced",
      [](const Tensors& tensors, const Devices& devices, int64_t bucket_bytes) {
        dpcore::TensorList2D result;
        {
          py::gil_scoped_release no_gil;
          result = dpcore::broadcast_coalesced(tensors, devices, bucket_bytes);
        }
        return to_python_lists(std::move(result));
      },
      py::arg("tensors"), py::arg("devices"), py::arg("bucket_bytes"));
  m.def(
      "reduce_add",
      [](const Tensors& inputs, std::optional<c10::Device> destination) {
        return dpcore::reduce_add(inputs, destination);
      },
      py::arg("inputs"), py::arg("destination"), NoGil());
  m.def(
      "reduce_add_coalesced",
      [](const dpcore::TensorList2D& inputs, std::optional<c10::Device> destination, int64_t bucket_bytes) {
        Tensors result;
        {
          py::gil_scoped_release no_gil;
          result = dpcore::reduce_add_coalesced(inputs, destination, bucket_bytes);
        }
        return to_python_list(std::move(result));
      },
      py::arg("inputs"), py::arg("destination"), py::arg("bucket_bytes"));
  m.def(
      "scatter",
      [](const at::Tensor& tensor, const Devices& devices,
         const std::optional<std::vector<int64_t>>& chunk_sizes, int64_t dim,
         const std::optional<dpcore::StreamList>& streams,
         bool separate) { return dpcore::scatter(tensor, devices, chunk_sizes, dim, streams, separate); },
      py::arg("tensor"), py::arg("devices"), py::arg("chunk_sizes"), py::arg("dim"), py::arg("streams"),
      py::arg("separate") = false, NoGil());
  m.def(
      "scatter_out",
      [](const at::Tensor& tensor, const Tensors& outs, int64_t dim,
         const std::optional<dpcore::StreamList>& streams) {
        dpcore::scatter_out(tensor, outs, dim, streams);
      },
      py::arg("tensor"), py::arg("out"), py::arg("dim"), py::arg("streams"), NoGil());
  m.def(
      "gather",
      [](const Tensors& tensors, int64_t dim, std::optional<c10::Device> destination) {
        return dpcore::gather(tensors, dim, destination);
      },
      py::arg("tensors"), py::arg("dim"), py::arg("destination"), NoGil());
  m.def(
      "gather_out",
      [](const Tensors& tensors, const at::Tensor& out, int64_t dim) {
        dpcore::gather_out(tensors, out, dim);
      },
      py::arg("tensors"), py::arg("out"), py::arg("dim"), NoGil());
  m.def(
      "balanced_chunk_sizes", &balanced_chunk_sizes, py::arg("total"), py::arg("parts"),
      "`total` split into `parts` sizes differing by at most one, the larger first: what scatter "
      "uses without chunk sizes, and DataParallel's balanced split (dpcore._split.balanced).");

  m.def(
      "make_buckets",
      [](const Tensors& tensors, int64_t bucket_bytes) {
        std::vector<std::vector<size_t>> groups;
        for (const dpcore::Bucket& bucket : dpcore::make_buckets(tensors, bucket_bytes)) {
          groups.push_back(bucket.indices);
        }
        return groups;
      },
      py::arg("tensors"), py::arg("bucket_bytes"),
      "Indices of `tensors` grouped as the C++ core buckets them: dense tensors by dtype in "
      "order, a bucket closed once it holds at least `bucket_bytes`; each sparse tensor alone.");
  m.def(
      "unflatten",
      [](const at::Tensor& flat, const Tensors& like) {
        return dpcore::FlatLayout::of(like).unflatten(flat);
      },
      py::arg("flat"), py::arg("like"), NoGil());
}

} // namespace python
} // namespace dpcore
