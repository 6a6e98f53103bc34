// Python bindings of the C++ core. The only place (with the rest of
// csrc/python/) that includes pybind11 and the Python headers. Every
// collective releases the GIL while it runs.
#include <torch/extension.h>

#include <optional>
#include <string>
#include <vector>

#include "dpcore/comm.h"
#include "dpcore/device.h"
#include "dpcore/flatten.h"
#include "dpcore/host_allocator.h"
#include "dpcore/kernels.h"
#include "python/bindings.h"
#include "python/tensor_lists.h"

namespace py = pybind11;

namespace {

using Devices = std::vector<c10::Device>;
using Tensors = std::vector<at::Tensor>;
using NoGil = py::call_guard<py::gil_scoped_release>;

std::vector<std::string> cuda_arch_list() {
  std::vector<std::string> arches;
#ifdef DPCORE_CUDA_ARCH_LIST
  std::string list = DPCORE_CUDA_ARCH_LIST;
  size_t start = 0;
  while (start < list.size()) {
    size_t end = list.find(';', start);
    if (end == std::string::npos) {
      end = list.size();
    }
    if (end > start) {
      arches.push_back(list.substr(start, end - start));
    }
    start = end + 1;
  }
#endif
  return arches;
}

// A c10::Error whose message formats numbers, raised and caught here: its
// message, which dpcore.info() compares with the expected text. A second,
// static libstdc++ in this library next to torch's shared one drops the
// numbers (GCC 12) or crashes (GCC 13) right here.
std::string self_check() {
  try {
    TORCH_CHECK(
        false, "self-check: size_t ", size_t{42}, ", int64_t ", int64_t{-7}, ", double ", 0.5);
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "self-check: TORCH_CHECK(false) did not throw";
}

} // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "dpcore's C++ core: collectives, flattening and kernels";

  // c10::Error carries a C++ backtrace in what(); Python users get the
  // message alone, as the type torch would raise.
  py::register_exception_translator([](std::exception_ptr error) {
    try {
      if (error) {
        std::rethrow_exception(error);
      }
    } catch (const c10::IndexError& e) {
      PyErr_SetString(PyExc_IndexError, e.what_without_backtrace());
    } catch (const c10::ValueError& e) {
      PyErr_SetString(PyExc_ValueError, e.what_without_backtrace());
    } catch (const c10::TypeError& e) {
      PyErr_SetString(PyExc_TypeError, e.what_without_backtrace());
    } catch (const c10::Error& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what_without_backtrace());
    }
  });

#ifdef DPCORE_WITH_CUDA
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif
  m.attr("torch_version") = TORCH_VERSION;
  m.attr("cuda_arch_list") = cuda_arch_list();
  m.attr("default_bucket_bytes") = dpcore::kDefaultBucketBytes;
  m.def(
      "_self_check", &self_check,
      "The message of a C++ error raised and caught inside _C, with numbers formatted "
      "into it (dpcore.info() checks them).");

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
        return dpcore::python::to_python_lists(std::move(result));
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
        return dpcore::python::to_python_list(std::move(result));
      },
      py::arg("inputs"), py::arg("destination"), py::arg("bucket_bytes"));
  m.def(
      "scatter",
      [](const at::Tensor& tensor, const Devices& devices,
         const std::optional<std::vector<int64_t>>& chunk_sizes, int64_t dim,
         const std::optional<dpcore::StreamList>& streams) {
        return dpcore::scatter(tensor, devices, chunk_sizes, dim, streams);
      },
      py::arg("tensor"), py::arg("devices"), py::arg("chunk_sizes"), py::arg("dim"),
      py::arg("streams"), NoGil());
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
  m.def(
      "host_cache_stats",
      [] {
        const auto stats = dpcore::host_cache_stats();
        py::dict d;
        d["cached_bytes"] = stats.cached_bytes;
        d["hits"] = stats.hits;
        d["misses"] = stats.misses;
        return d;
      },
      "Counters of the caching allocator for large CPU buffers of the collectives.");
  m.def("host_cache_clear", &dpcore::host_cache_clear, "Frees every cached CPU buffer.");
  m.def(
      "peer_access",
      [](const Devices& devices_in) {
        const auto devices = dpcore::check_devices(devices_in, "peer_access");
        TORCH_CHECK(
            devices[0].is_cuda(), "peer_access: expected CUDA devices, but devices[0] is ",
            devices[0]);
        py::dict result;
        for (const c10::Device& reader : devices) {
          for (const c10::Device& owner : devices) {
            if (reader != owner) {
              result[py::make_tuple(reader.index(), owner.index())] =
                  dpcore::can_access_directly(reader, owner);
            }
          }
        }
        return result;
      },
      py::arg("devices"),
      "{(reader, owner): whether kernels on CUDA device `reader` read memory of `owner` "
      "directly}, for every ordered pair of distinct `devices`; asking enables access "
      "where the hardware allows it.");

  // pack, unpack and reduce_add_n are operators: torch.ops.dpcore.* (schema in
  // csrc/dpcore/ops.cpp, implementations registered by kernels/ and cuda/).

  dpcore::python::bind_parallel_apply(m);
  dpcore::python::bind_replica_sync(m);
  dpcore::python::bind_rendezvous(m);
}
