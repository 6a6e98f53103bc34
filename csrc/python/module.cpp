// The extension module dpcore._C: its error translation, the build facts
// (CUDA or not, torch version, CUDA architectures, self-check), the CPU
// host cache and peer access; then every binding translation unit of
// csrc/python/ (bindings.h). csrc/python/ is the only folder that includes
// pybind11 and the Python headers.
#include <torch/csrc/utils/pybind.h>
#include <torch/version.h>

#include <optional>
#include <string>
#include <vector>

#include "dpcore/comm.h"
#include "dpcore/device.h"
#include "dpcore/host_allocator.h"
#include "python/bindings.h"

namespace py = pybind11;

namespace {

using Devices = std::vector<c10::Device>;

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
    TORCH_CHECK(false, "self-check: size_t ", size_t{42}, ", int64_t ", int64_t{-7}, ", double ", 0.5);
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
            devices[0].is_cuda(), "peer_access: expected CUDA devices, but devices[0] is ", devices[0]);
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

  dpcore::python::bind_comm(m);
  dpcore::python::bind_grad_ready(m);
  dpcore::python::bind_packed(m);
  dpcore::python::bind_parallel_apply(m);
  dpcore::python::bind_replica_sync(m);
  dpcore::python::bind_split(m);
  dpcore::python::bind_sync_batchnorm(m);
}
