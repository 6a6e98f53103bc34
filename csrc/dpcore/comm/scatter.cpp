// scatter, scatter_out, balanced_chunk_sizes.
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS

#include <ATen/WrapDimUtils.h>
#include <ATen/core/Tensor.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/GradMode.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/TensorImpl.h>
#include <c10/util/Exception.h>

#include <numeric>
#include <string>

#include "dpcore/comm.h"
#include "dpcore/comm/checks.h"
#include "dpcore/device.h"
#include "dpcore/traffic.h"
#ifdef DPCORE_WITH_CUDA
#include "dpcore/cuda/host_staging.h"
#endif

namespace dpcore {
namespace {

int64_t check_scatter_dim(const at::Tensor& tensor, int64_t dim) {
  TORCH_CHECK(tensor.defined(), "scatter: expected a defined 'tensor'");
  check_dense(tensor, "scatter", "'tensor'");
  TORCH_CHECK(
      tensor.dim() > 0, "scatter: expected a tensor with at least one dimension, but got a ", "0-dim tensor");
  return at::maybe_wrap_dim(dim, tensor.dim());
}

void check_streams(const std::optional<StreamList>& streams, c10::ArrayRef<c10::Device> devices) {
  if (!streams) {
    return;
  }
  TORCH_CHECK(
      streams->size() == devices.size(), "scatter: expected one entry of 'streams' per device (",
      devices.size(), "), but got ", streams->size());
  for (size_t i = 0; i < streams->size(); ++i) {
    const auto& stream = (*streams)[i];
    TORCH_CHECK(
        !stream || normalize_device(stream->device()) == devices[i], "scatter: expected streams[", i, "] on ",
        devices[i], " (the device at that index), but ", "it is on ", stream ? stream->device() : devices[i]);
  }
}

// Copies chunk into `out` (or to `device`, when out is undefined) on the
// stream given for index i, under a guard for the target device.
at::Tensor move_chunk(
    const at::Tensor& chunk, c10::Device device, const at::Tensor& out,
    const std::optional<StreamList>& streams, size_t i) {
  c10::DeviceGuard device_guard(device);
  c10::OptionalStreamGuard stream_guard;
  if (streams && (*streams)[i]) {
    stream_guard.reset_stream(*(*streams)[i]);
  }
  if (out.defined()) {
    out.copy_(chunk, may_copy_async(device));
    return out;
  }
  return chunk.to(
      device, chunk.scalar_type(), may_copy_async(device), /*copy=*/false, c10::MemoryFormat::Preserve);
}

// Consecutive views of `tensor` along `dim` of the given sizes.
std::vector<at::Tensor> split(const at::Tensor& tensor, int64_t dim, c10::IntArrayRef sizes) {
  std::vector<at::Tensor> chunks;
  chunks.reserve(sizes.size());
  int64_t start = 0;
  for (const int64_t size : sizes) {
    chunks.push_back(tensor.narrow(dim, start, size));
    start += size;
  }
  return chunks;
}

// The chunks that share `tensor`'s storage (those on its own device) as
// tensors of their own: each keeps its storage, sizes and strides but is no
// view, the first keeps tensor's version counter and every other gets a new
// one, as a copy on another device would have. A write into one chunk then
// bumps neither the others' versions (what autograd checks of their saved
// tensors) nor, but through the first, tensor's. Tensors whose storage
// cannot be shared so (functorch wrappers, Python subclasses,
// functionalization, inference tensors, which have no version counter) keep
// their views.
void separate_chunks(const at::Tensor& tensor, std::vector<at::Tensor>& chunks) {
  constexpr auto kKeepViews = c10::DispatchKeySet(
      {c10::DispatchKey::Python, c10::DispatchKey::PythonTLSSnapshot, c10::DispatchKey::Functionalize});
  if (!tensor.has_storage() || tensor.is_inference() || tensor.key_set().has_any(kKeepViews)) {
    return;
  }
  bool first = true;
  for (at::Tensor& chunk : chunks) {
    if (!chunk.has_storage() || !chunk.is_alias_of(tensor)) {
      continue;
    }
    c10::VariableVersion version =
        first ? tensor.unsafeGetTensorImpl()->version_counter() : c10::VariableVersion(/*version=*/0);
    chunk = at::Tensor(chunk.unsafeGetTensorImpl()->shallow_copy_and_detach(
        std::move(version), /*allow_tensor_metadata_change=*/true));
    first = false;
  }
}

} // namespace

std::vector<int64_t> balanced_chunk_sizes(int64_t total, int64_t parts) {
  TORCH_CHECK(parts > 0, "balanced_chunk_sizes: expected parts > 0, but got ", parts);
  TORCH_CHECK(total >= 0, "balanced_chunk_sizes: expected total >= 0, but got ", total);
  std::vector<int64_t> sizes(parts, total / parts);
  for (int64_t i = 0; i < total % parts; ++i) {
    sizes[i] += 1;
  }
  return sizes;
}

std::vector<at::Tensor> scatter(
    const at::Tensor& tensor, c10::ArrayRef<c10::Device> devices_in,
    const std::optional<std::vector<int64_t>>& chunk_sizes, int64_t dim_in,
    const std::optional<StreamList>& streams, bool separate) {
  const int64_t dim = check_scatter_dim(tensor, dim_in);
  const auto devices = check_devices(devices_in, "scatter");
  const int64_t total = tensor.size(dim);
  std::vector<int64_t> sizes;
  if (chunk_sizes) {
    TORCH_CHECK(
        chunk_sizes->size() == devices.size(),
        "scatter: expected one chunk size per device: ", "len(devices) = ", devices.size(),
        ", but len(chunk_sizes) = ", chunk_sizes->size());
    for (size_t i = 0; i < chunk_sizes->size(); ++i) {
      TORCH_CHECK(
          (*chunk_sizes)[i] >= 0, "scatter: expected non-negative chunk sizes, but chunk_sizes[", i, "] is ",
          (*chunk_sizes)[i]);
    }
    const int64_t sum = std::accumulate(chunk_sizes->begin(), chunk_sizes->end(), int64_t{0});
    TORCH_CHECK(
        sum == total, "scatter: expected chunk_sizes to sum to ", total, " (the size of dim ", dim,
        " of the tensor), but they sum to ", sum);
    sizes = *chunk_sizes;
  } else {
    sizes = balanced_chunk_sizes(total, static_cast<int64_t>(devices.size()));
  }
  check_streams(streams, devices);
  c10::NoGradGuard no_grad;
  std::vector<at::Tensor> chunks = split(tensor, dim, sizes);
  {
    // Chunks bound for the tensor's own device are views: they move nothing.
    TrafficRecord traffic(TrafficKind::Scatter);
    const c10::Device source = normalize_device(tensor.device());
    const size_t source_slot = detail::slot_of(source, devices);
    for (size_t i = 0; i < devices.size(); ++i) {
      if (devices[i] != source) {
        traffic.copy(source_slot, i, detail::wire_bytes(chunks[i]));
      }
    }
  }
#ifdef DPCORE_WITH_CUDA
  if (tensor.is_cpu() && devices[0].is_cuda()) {
    return cuda::host_to_devices(chunks, devices, {}, streams); // copies only: nothing to separate
  }
#endif
  for (size_t i = 0; i < devices.size(); ++i) {
    chunks[i] = move_chunk(chunks[i], devices[i], at::Tensor(), streams, i);
  }
  if (separate) {
    separate_chunks(tensor, chunks);
  }
  return chunks;
}

void scatter_out(
    const at::Tensor& tensor, at::TensorList outs, int64_t dim_in, const std::optional<StreamList>& streams) {
  const int64_t dim = check_scatter_dim(tensor, dim_in);
  TORCH_CHECK(!outs.empty(), "scatter: expected at least one tensor in 'out', but it is empty");
  std::vector<c10::Device> devices;
  devices.reserve(outs.size());
  int64_t total = 0;
  for (size_t i = 0; i < outs.size(); ++i) {
    const at::Tensor& out = outs[i];
    TORCH_CHECK(out.defined(), "scatter: out[", i, "] is undefined");
    check_dense(out, "scatter", "out[" + std::to_string(i) + "]");
    TORCH_CHECK(
        out.dim() == tensor.dim(), "scatter: expected out[", i, "] to have ", tensor.dim(),
        " dimensions, as the tensor does, but it has ", out.dim());
    for (int64_t d = 0; d < tensor.dim(); ++d) {
      TORCH_CHECK(
          d == dim || out.size(d) == tensor.size(d), "scatter: output tensor at index ", i, " has shape ",
          out.sizes(), ", but expected the tensor's shape ", tensor.sizes(), " in every dimension but ", dim);
    }
    TORCH_CHECK(
        out.scalar_type() == tensor.scalar_type(), "scatter: expected out[", i, "] of dtype ",
        tensor.scalar_type(), ", but it is ", out.scalar_type());
    total += out.size(dim);
    devices.push_back(out.device());
  }
  TORCH_CHECK(
      total == tensor.size(dim), "scatter: total size of the output tensors along dim ", dim, " (", total,
      ") does not match the size of the source tensor (", tensor.size(dim), ")");
  const auto checked = check_devices(devices, "scatter", "the devices of out");
  check_streams(streams, checked);
  // A tensor that may share memory with an out (non-dense views interleaved
  // with it) is read from a copy made before anything is written.
  bool copy_source = false;
  for (size_t i = 0; i < outs.size(); ++i) {
    const std::string name = "out[" + std::to_string(i) + "]";
    check_no_internal_overlap(outs[i], "scatter", name);
    copy_source = check_no_overlap(outs[i], name, tensor, "'tensor'", "scatter") || copy_source;
    // Outs that may only interleave (column blocks of one buffer) are fine.
    for (size_t j = 0; j < i; ++j) {
      check_no_overlap(outs[i], name, outs[j], "out[" + std::to_string(j) + "]", "scatter");
    }
  }
  c10::NoGradGuard no_grad;
  const at::Tensor source = copy_source ? tensor.clone() : tensor;
  std::vector<int64_t> sizes;
  sizes.reserve(outs.size());
  for (const at::Tensor& out : outs) {
    sizes.push_back(out.size(dim));
  }
  const std::vector<at::Tensor> chunks = split(source, dim, sizes);
  {
    TrafficRecord traffic(TrafficKind::Scatter);
    const size_t source_slot = detail::slot_of(tensor.device(), checked);
    for (size_t i = 0; i < chunks.size(); ++i) {
      traffic.copy(source_slot, i, detail::wire_bytes(chunks[i]));
    }
  }
#ifdef DPCORE_WITH_CUDA
  if (tensor.is_cpu() && checked[0].is_cuda()) {
    cuda::host_to_devices(chunks, checked, outs, streams);
    return;
  }
#endif
  for (size_t i = 0; i < outs.size(); ++i) {
    move_chunk(chunks[i], checked[i], outs[i], streams, i);
  }
}

} // namespace dpcore
