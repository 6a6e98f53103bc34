// reduce_add, reduce_add_coalesced.
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS

#include <ATen/core/Tensor.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <optional>
#include <vector>

#include "dpcore/comm.h"
#include "dpcore/common.h"
#include "dpcore/device.h"
#include "dpcore/flatten.h"
#include "dpcore/kernels.h"
#include "dpcore/traffic.h"

namespace dpcore {
namespace detail {

at::Tensor readable_on(const at::Tensor& tensor, c10::Device device) {
  if (can_access_directly(device, tensor.device())) {
    return tensor;
  }
  return tensor.to(device, may_copy_async(device));
}

} // namespace detail

namespace {

using detail::readable_on;

// Checks that `tensors` can be summed elementwise; returns their device type.
// The messages name tensors[k] what[k], or what[k][column] when the tensors
// are one column of a list of lists (reduce_add_coalesced's inputs[k][i]).
c10::DeviceType check_summable(
    at::TensorList tensors, const char* op, const char* what, std::optional<size_t> column = std::nullopt) {
  TORCH_CHECK(!tensors.empty(), op, ": expected at least one tensor to reduce, but got none");
  // Only evaluated for a message, when a check fails.
  const auto name = [&](size_t k) {
    return column ? c10::str(what, "[", k, "][", *column, "]") : c10::str(what, "[", k, "]");
  };
  const at::Tensor& first = tensors[0];
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    TORCH_CHECK(t.defined(), op, ": ", name(i), " is undefined");
    TORCH_CHECK(
        t.layout() == c10::kStrided || t.is_sparse(), op, ": expected dense or sparse COO tensors, but ",
        name(i), " has layout ", t.layout());
    TORCH_CHECK(
        t.sizes().equals(first.sizes()), op, ": expected all tensors to have the shape ", first.sizes(),
        " of ", name(0), ", but ", name(i), " has shape ", t.sizes());
    TORCH_CHECK(
        t.scalar_type() == first.scalar_type(), op, ": expected all tensors to have the dtype ",
        first.scalar_type(), " of ", name(0), ", but ", name(i), " has dtype ", t.scalar_type());
    TORCH_CHECK(
        t.layout() == first.layout(), op, ": expected all tensors to have the layout ", first.layout(),
        " of ", name(0), ", but ", name(i), " has layout ", t.layout());
    TORCH_CHECK(
        t.device().type() == first.device().type(), op, ": expected all tensors on devices of one type, but ",
        name(0), " is on ", first.device(), " and ", name(i), " is on ", t.device());
  }
  return first.device().type();
}

c10::Device resolve_destination(std::optional<c10::Device> destination, c10::DeviceType type) {
  return destination ? normalize_device(*destination) : current_device(type);
}

// `tensor` on `device`: itself when already there, else a copy.
at::Tensor on_device(const at::Tensor& tensor, c10::Device device) {
  if (normalize_device(tensor.device()) == device) {
    return tensor;
  }
  return tensor.to(device, may_copy_async(device));
}

// Bucket `members` (all on `device`) as one flat buffer laid out as `layout`
// that reduce_add_n on `dest` can read: the member's own memory when it is
// the whole bucket, else packed on `device`; copied to `dest` when `dest`
// cannot read `device`'s memory.
at::Tensor flat_source(
    const std::vector<at::Tensor>& members, const FlatLayout& layout, c10::Device device, c10::Device dest) {
  c10::DeviceGuard guard(device);
  at::Tensor flat = flat_alias(members[0], layout);
  if (!flat.defined()) {
    flat = flatten(members, layout);
  }
  return readable_on(flat, dest);
}

at::Tensor sum_sparse(at::TensorList tensors, c10::Device destination) {
  at::Tensor result = tensors[0].to(destination, may_copy_async(destination), /*copy=*/true);
  for (size_t i = 1; i < tensors.size(); ++i) {
    result.add_(on_device(tensors[i], destination));
  }
  return result;
}

// Checks reduce_add_coalesced's `inputs` (one list per device, each list on
// one device, all of one length, every column summable) and `bucket_bytes`;
// returns the device of each list, or nothing when the lists are empty.
std::vector<c10::Device> check_coalesced_inputs(const TensorList2D& inputs, int64_t bucket_bytes) {
  TORCH_CHECK(!inputs.empty(), "reduce_add_coalesced: expected at least one list of tensors in 'inputs'");
  TORCH_CHECK(
      bucket_bytes > 0, "reduce_add_coalesced: expected bucket_bytes (buffer_size) to be positive, but got ",
      bucket_bytes);
  const size_t count = inputs[0].size();
  std::vector<c10::Device> list_devices;
  list_devices.reserve(inputs.size());
  for (size_t k = 0; k < inputs.size(); ++k) {
    TORCH_CHECK(
        inputs[k].size() == count, "reduce_add_coalesced: expected inputs[", k, "] to hold ", count,
        " tensors, as inputs[0] does, but it holds ", inputs[k].size());
    for (size_t i = 0; i < count; ++i) {
      TORCH_CHECK(inputs[k][i].defined(), "reduce_add_coalesced: inputs[", k, "][", i, "] is undefined");
      TORCH_CHECK(
          inputs[k][i].device() == inputs[k][0].device(), "reduce_add_coalesced: expected all of inputs[", k,
          "] on one device, but inputs[", k, "][0] is on ", inputs[k][0].device(), " and inputs[", k, "][", i,
          "] is on ", inputs[k][i].device());
    }
    if (count > 0) {
      list_devices.push_back(normalize_device(inputs[k][0].device()));
    }
  }
  if (count == 0) {
    return {};
  }
  std::vector<at::Tensor> column;
  for (size_t i = 0; i < count; ++i) {
    take_column(inputs, i, column);
    check_summable(column, "reduce_add_coalesced", "inputs", i);
  }
  return check_devices(list_devices, "reduce_add_coalesced", "the devices of inputs");
}

// The CUDA path of one dense bucket: flat = the sum over k of inputs[k]'s
// members laid out as `layout`. One pack launch per device and one
// reduce_add_n launch reading every device's flat buffer in place (peer
// access) beat a launch per tensor.
void reduce_bucket_cuda(
    const TensorList2D& inputs, const Bucket& bucket, const FlatLayout& layout,
    c10::ArrayRef<c10::Device> list_devices, c10::Device dest, const at::Tensor& flat) {
  std::vector<at::Tensor> flats;
  flats.reserve(inputs.size());
  for (size_t k = 0; k < inputs.size(); ++k) {
    flats.push_back(flat_source(bucket.members(inputs[k]), layout, list_devices[k], dest));
  }
  reduce_add_n(flats, flat, /*accumulate=*/false);
}

// The CPU path of one dense bucket (any destination but CUDA): results[j] =
// the sum over k of inputs[k]'s j-th member, by reduce_add_lists. Lists on
// the destination are read in place; the others are flattened on their
// device and the flat buffer copied over.
void reduce_bucket_cpu(
    const TensorList2D& inputs, const Bucket& bucket, const FlatLayout& layout,
    c10::ArrayRef<c10::Device> list_devices, c10::Device dest, at::TensorList results) {
  TensorList2D sources;
  sources.reserve(inputs.size());
  for (size_t k = 0; k < inputs.size(); ++k) {
    std::vector<at::Tensor> members = bucket.members(inputs[k]);
    if (list_devices[k] == dest) {
      sources.push_back(std::move(members));
      continue;
    }
    c10::DeviceGuard source_guard(list_devices[k]);
    at::Tensor staged = flatten(members, layout).to(dest, may_copy_async(dest));
    // Read only: views built in bulk (no dispatcher call each) serve.
    sources.push_back(layout.unflatten(staged));
  }
  reduce_add_lists(sources, results, /*accumulate=*/false);
}

} // namespace

at::Tensor reduce_add(at::TensorList tensors, std::optional<c10::Device> destination) {
  const c10::DeviceType type = check_summable(tensors, "reduce_add", "inputs");
  const c10::Device dest = resolve_destination(destination, type);
  check_devices({dest}, "reduce_add", "destination");
  c10::NoGradGuard no_grad;
  c10::DeviceGuard guard(dest);
  {
    // Input k is slot k; the destination is the slot of the first input on
    // its device, else slot N.
    TrafficRecord traffic(TrafficKind::ReduceAdd);
    std::vector<c10::Device> devices;
    devices.reserve(tensors.size());
    for (const at::Tensor& t : tensors) {
      devices.push_back(t.device());
    }
    const size_t dest_slot = detail::slot_of(dest, devices);
    for (size_t k = 0; k < tensors.size(); ++k) {
      traffic.copy(k, dest_slot, detail::wire_bytes(tensors[k]));
    }
  }
  if (tensors[0].is_sparse()) {
    return sum_sparse(tensors, dest);
  }
  std::vector<at::Tensor> sources;
  sources.reserve(tensors.size());
  for (const at::Tensor& t : tensors) {
    sources.push_back(readable_on(t, dest));
  }
  at::Tensor out = empty_preserving(sources[0], dest);
  reduce_add_n(sources, out, /*accumulate=*/false);
  return out;
}

std::vector<at::Tensor> reduce_add_coalesced(
    const TensorList2D& inputs, std::optional<c10::Device> destination, int64_t bucket_bytes,
    const std::optional<std::vector<int64_t>>& slots) {
  const std::vector<c10::Device> list_devices = check_coalesced_inputs(inputs, bucket_bytes);
  if (slots) {
    TORCH_CHECK(
        slots->size() == inputs.size(), "reduce_add_coalesced: slots: expected one slot per list (",
        inputs.size(), "), but got ", slots->size());
    for (size_t k = 0; k < slots->size(); ++k) {
      TORCH_CHECK(
          (*slots)[k] >= 0, "reduce_add_coalesced: slots[", k, "]: expected a position >= 0, but got ",
          (*slots)[k]);
    }
  }
  if (list_devices.empty()) {
    return {};
  }
  const c10::Device dest = resolve_destination(destination, list_devices[0].type());
  check_devices({dest}, "reduce_add_coalesced", "destination");

  c10::NoGradGuard no_grad;
  c10::DeviceGuard guard(dest);
  {
    // List k is slot k (or slots[k], the destination then slot 0); else the
    // destination is the slot of the first list on its device (slot 0 on a
    // CPU list), else slot N.
    TrafficRecord traffic(TrafficKind::ReduceAdd);
    const size_t dest_slot = slots ? 0 : detail::slot_of(dest, list_devices);
    for (size_t k = 0; k < inputs.size(); ++k) {
      int64_t nbytes = 0;
      for (const at::Tensor& t : inputs[k]) {
        nbytes += detail::wire_bytes(t);
      }
      traffic.copy(slots ? static_cast<size_t>((*slots)[k]) : k, dest_slot, nbytes);
    }
  }
  std::vector<at::Tensor> outputs(inputs[0].size());
  std::vector<at::Tensor> column;
  for (const Bucket& bucket : make_buckets(inputs[0], bucket_bytes)) {
    if (bucket.sparse) {
      take_column(inputs, bucket.indices[0], column);
      outputs[bucket.indices[0]] = sum_sparse(column, dest);
      continue;
    }
    const FlatLayout layout = FlatLayout::of(bucket.members(inputs[0]));
    at::Tensor flat = empty_flat(inputs[0][bucket.indices[0]], dest, layout.numel);
    std::vector<at::Tensor> results = layout.unflatten(flat);
    if (dest.is_cuda()) {
      reduce_bucket_cuda(inputs, bucket, layout, list_devices, dest, flat);
    } else {
      reduce_bucket_cpu(inputs, bucket, layout, list_devices, dest, results);
    }
    for (size_t j = 0; j < results.size(); ++j) {
      outputs[bucket.indices[j]] = std::move(results[j]);
    }
  }
  return outputs;
}

} // namespace dpcore
