// gather, gather_out.
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS

#include <ATen/WrapDimUtils.h>
#include <ATen/core/Tensor.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <c10/util/strides.h>

#include <string>

#include "dpcore/comm.h"
#include "dpcore/comm/checks.h"
#include "dpcore/common.h"
#include "dpcore/device.h"
#include "dpcore/traffic.h"
#ifdef DPCORE_WITH_CUDA
#include "dpcore/cuda/host_staging.h"
#endif

namespace dpcore {
namespace {

// Checks the inputs of a gather along `dim`; returns the wrapped dim and
// fills `shape` with the shape of the result.
int64_t check_gather(at::TensorList tensors, int64_t dim, std::vector<int64_t>& shape) {
  TORCH_CHECK(!tensors.empty(), "gather: expected at least one tensor to gather from");
  const at::Tensor& first = tensors[0];
  TORCH_CHECK(first.defined(), "gather: tensors[0] is undefined");
  check_dense(first, "gather", "tensors[0]");
  TORCH_CHECK(
      first.dim() > 0, "gather: expected tensors with at least one dimension, but tensors[0] ", "is 0-dim");
  const int64_t wrapped = at::maybe_wrap_dim(dim, first.dim());
  shape.assign(first.sizes().begin(), first.sizes().end());
  shape[wrapped] = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    TORCH_CHECK(t.defined(), "gather: tensors[", i, "] is undefined");
    check_dense(t, "gather", "tensors[" + std::to_string(i) + "]");
    TORCH_CHECK(
        t.dim() == first.dim(), "gather: expected all tensors to have ", first.dim(),
        " dimensions, as tensors[0] does, but tensors[", i, "] has ", t.dim());
    TORCH_CHECK(
        t.scalar_type() == first.scalar_type(), "gather: expected all tensors of dtype ", first.scalar_type(),
        ", as tensors[0] is, but tensors[", i, "] is ", t.scalar_type());
    TORCH_CHECK(
        t.device().type() == first.device().type(),
        "gather: expected all tensors on devices of one type, but tensors[0] is on ", first.device(),
        " and tensors[", i, "] is on ", t.device());
    for (int64_t d = 0; d < first.dim(); ++d) {
      TORCH_CHECK(
          d == wrapped || t.size(d) == first.size(d), "gather: input tensor at index ", i,
          " has invalid shape ", t.sizes(), ": expected ", first.sizes(), " in every dimension but ",
          wrapped);
    }
    shape[wrapped] += t.size(wrapped);
  }
  return wrapped;
}

// Copies tensors[i] into its slice of `out` along `dim`. Into a CPU `out`,
// the data has landed when this returns.
void copy_slices(at::TensorList tensors, const at::Tensor& out, int64_t dim) {
  c10::NoGradGuard no_grad;
  {
    // Input i is slot i; `out` takes the slot of the first input on its
    // device, else slot N.
    TrafficRecord traffic(TrafficKind::Gather);
    std::vector<c10::Device> devices;
    devices.reserve(tensors.size());
    for (const at::Tensor& t : tensors) {
      devices.push_back(t.device());
    }
    const size_t dest_slot = detail::slot_of(out.device(), devices);
    for (size_t i = 0; i < tensors.size(); ++i) {
      traffic.copy(i, dest_slot, detail::wire_bytes(tensors[i]));
    }
  }
  std::vector<at::Tensor> slices;
  slices.reserve(tensors.size());
  int64_t start = 0;
  for (const at::Tensor& t : tensors) {
    slices.push_back(out.narrow(dim, start, t.size(dim)));
    start += t.size(dim);
  }
#ifdef DPCORE_WITH_CUDA
  if (out.is_cpu() && tensors[0].is_cuda()) {
    cuda::devices_to_host(tensors, slices);
    return;
  }
#endif
  c10::DeviceGuard guard(out.device());
  for (size_t i = 0; i < tensors.size(); ++i) {
    slices[i].copy_(tensors[i], may_copy_async(out.device()));
  }
}

} // namespace

at::Tensor gather(at::TensorList tensors, int64_t dim, std::optional<c10::Device> destination) {
  std::vector<int64_t> shape;
  const int64_t wrapped = check_gather(tensors, dim, shape);
  const c10::Device dest =
      destination ? normalize_device(*destination) : current_device(tensors[0].device().type());
  check_devices({dest}, "gather", "destination");
  c10::MemoryFormat format = tensors[0].suggest_memory_format();
  for (const at::Tensor& t : tensors) {
    if (t.suggest_memory_format() != format) {
      format = c10::MemoryFormat::Contiguous;
    }
  }
  std::vector<int64_t> strides;
  if (format == c10::MemoryFormat::ChannelsLast && shape.size() == 4) {
    strides = c10::get_channels_last_strides_2d(shape);
  } else if (format == c10::MemoryFormat::ChannelsLast3d && shape.size() == 5) {
    strides = c10::get_channels_last_strides_3d(shape);
  } else {
    const auto contiguous = c10::contiguous_strides(shape);
    strides.assign(contiguous.begin(), contiguous.end());
  }
  at::Tensor out = empty_like_layout(tensors[0], dest, shape, strides);
  copy_slices(tensors, out, wrapped);
  return out;
}

void gather_out(at::TensorList tensors, const at::Tensor& out, int64_t dim) {
  std::vector<int64_t> shape;
  const int64_t wrapped = check_gather(tensors, dim, shape);
  TORCH_CHECK(out.defined(), "gather: expected a defined 'out' tensor");
  TORCH_CHECK(
      out.sizes().equals(shape), "gather: expected 'out' of shape ", c10::IntArrayRef(shape),
      " (the inputs joined along dim ", wrapped, "), but it has shape ", out.sizes());
  TORCH_CHECK(
      out.scalar_type() == tensors[0].scalar_type(), "gather: expected 'out' of dtype ",
      tensors[0].scalar_type(), ", but it is ", out.scalar_type());
  check_dense(out, "gather", "'out'");
  check_no_internal_overlap(out, "gather", "'out'");
  // Inputs that may share memory with `out` (non-dense views interleaved
  // with it) are read from copies made before anything is written.
  std::vector<at::Tensor> sources(tensors.begin(), tensors.end());
  for (size_t i = 0; i < sources.size(); ++i) {
    if (check_no_overlap(out, "'out'", sources[i], "tensors[" + std::to_string(i) + "]", "gather")) {
      c10::NoGradGuard no_grad;
      sources[i] = sources[i].clone();
    }
  }
  copy_slices(sources, out, wrapped);
}

} // namespace dpcore
