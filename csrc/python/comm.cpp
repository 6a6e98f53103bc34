// Bindings of the collectives (csrc/dpcore/comm.h), of the bucketing and
// unflattening they build on (csrc/dpcore/flatten.h) and of their traffic
// counters (csrc/dpcore/traffic.h): dpcore._C.broadcast, broadcast_out,
// broadcast_coalesced, reduce_add, reduce_add_coalesced, scatter,
// scatter_out, gather, gather_out, reduce_scatter, all_gather,
// all_gather_out, all_reduce, reduce_scatter_coalesced, all_gather_coalesced,
// balanced_chunk_sizes, make_buckets, unflatten, traffic, reset_traffic.
// Every collective releases the GIL while it runs.
#include <torch/csrc/utils/pybind.h>

#include <optional>
#include <vector>

#include "dpcore/comm.h"
#include "dpcore/flatten.h"
#include "dpcore/traffic.h"
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
      [](const dpcore::TensorList2D& inputs, std::optional<c10::Device> destination, int64_t bucket_bytes,
         const std::optional<std::vector<int64_t>>& slots) {
        Tensors result;
        {
          py::gil_scoped_release no_gil;
          result = dpcore::reduce_add_coalesced(inputs, destination, bucket_bytes, slots);
        }
        return to_python_list(std::move(result));
      },
      py::arg("inputs"), py::arg("destination"), py::arg("bucket_bytes"), py::arg("slots") = py::none());
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
      "reduce_scatter",
      [](const Tensors& inputs, const Devices& devices, const std::optional<std::vector<int64_t>>& sizes) {
        return dpcore::reduce_scatter(inputs, devices, sizes);
      },
      py::arg("inputs"), py::arg("devices"), py::arg("sizes"), NoGil());
  m.def(
      "all_gather",
      [](const Tensors& shards, const Devices& devices) { return dpcore::all_gather(shards, devices); },
      py::arg("shards"), py::arg("devices"), NoGil());
  m.def(
      "all_gather_out",
      [](const Tensors& shards, const Tensors& outs) { dpcore::all_gather_out(shards, outs); },
      py::arg("shards"), py::arg("out"), NoGil());
  m.def(
      "all_reduce",
      [](const Tensors& inputs, const Devices& devices) { dpcore::all_reduce(inputs, devices); },
      py::arg("inputs"), py::arg("devices"), NoGil());
  m.def(
      "reduce_scatter_coalesced",
      [](const dpcore::TensorList2D& tensors, const Devices& devices, const std::vector<int64_t>& owners,
         int64_t bucket_bytes) {
        Tensors result;
        {
          py::gil_scoped_release no_gil;
          result = dpcore::reduce_scatter_coalesced(tensors, devices, owners, bucket_bytes);
        }
        return to_python_list(std::move(result));
      },
      py::arg("tensors"), py::arg("devices"), py::arg("owners"), py::arg("bucket_bytes"));
  m.def(
      "all_gather_coalesced",
      [](const Tensors& tensors, const std::vector<int64_t>& owners, const Devices& devices,
         const std::optional<dpcore::TensorList2D>& outs, int64_t bucket_bytes) {
        dpcore::TensorList2D result;
        {
          py::gil_scoped_release no_gil;
          result = dpcore::all_gather_coalesced(tensors, owners, devices, outs, bucket_bytes);
        }
        return to_python_lists(std::move(result));
      },
      py::arg("tensors"), py::arg("owners"), py::arg("devices"), py::arg("outs"), py::arg("bucket_bytes"));
  m.def(
      "traffic",
      [] {
        const auto table = dpcore::traffic_table();
        py::dict result;
        for (size_t kind = 0; kind < dpcore::kTrafficKinds; ++kind) {
          py::list slots;
          for (const dpcore::SlotTraffic& slot : table[kind]) {
            slots.append(py::make_tuple(slot.sent, slot.received));
          }
          result[dpcore::traffic_kind_name(static_cast<dpcore::TrafficKind>(kind))] = slots;
        }
        return result;
      },
      "{kind: [(bytes sent, bytes received) per slot]} of every collective since the last reset.");
  m.def("reset_traffic", &dpcore::reset_traffic, "Sets every traffic count to zero.");
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
