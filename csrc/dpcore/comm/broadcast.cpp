// broadcast, broadcast_out, broadcast_coalesced.
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS

#include <ATen/core/Tensor.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>

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

at::Tensor copy_to(const at::Tensor& tensor, c10::Device device) {
  c10::DeviceGuard guard(device);
  if (tensor.layout() != c10::kStrided) {
    return tensor.to(device, tensor.scalar_type(), may_copy_async(device), /*copy=*/true);
  }
  at::Tensor copy = empty_preserving(tensor, device);
  copy.copy_(tensor, may_copy_async(device));
  return copy;
}

int64_t wire_bytes(const at::Tensor& tensor) {
  if (tensor.is_sparse()) {
    return wire_bytes(tensor._indices()) + wire_bytes(tensor._values());
  }
  return static_cast<int64_t>(tensor.numel()) * static_cast<int64_t>(tensor.element_size());
}

size_t slot_of(c10::Device device, c10::ArrayRef<c10::Device> devices) {
  const c10::Device normal = normalize_device(device);
  for (size_t i = 0; i < devices.size(); ++i) {
    if (normalize_device(devices[i]) == normal) {
      return i;
    }
  }
  return devices.size();
}

} // namespace detail

using detail::copy_to;

std::vector<at::Tensor> broadcast(const at::Tensor& tensor, c10::ArrayRef<c10::Device> devices_in) {
  TORCH_CHECK(tensor.defined(), "broadcast: expected a defined 'tensor'");
  const auto devices = check_devices(devices_in, "broadcast");
  c10::NoGradGuard no_grad;
  const c10::Device source = normalize_device(tensor.device());
  std::vector<at::Tensor> result(devices.size());
  TrafficRecord traffic(TrafficKind::Broadcast);
  const size_t source_slot = detail::slot_of(source, devices);
  const int64_t nbytes = detail::wire_bytes(tensor);
  // The copies on the source device (after the first entry there, which is
  // the tensor itself) are written by one pack_multi: the tensor is read once.
  const bool dense = tensor.layout() == c10::kStrided;
  std::optional<FlatLayout> layout;
  std::vector<at::Tensor> local_flats;
  bool aliased = false;
  for (size_t d = 0; d < devices.size(); ++d) {
    const c10::Device& device = devices[d];
    if (device != source) {
      result[d] = copy_to(tensor, device);
    } else if (!aliased) {
      result[d] = tensor;
      aliased = true;
    } else if (dense) {
      if (!layout) {
        layout = FlatLayout::of({tensor});
      }
      c10::DeviceGuard guard(device);
      result[d] = empty_preserving(tensor, device);
      // A fresh tensor with the layout's strides: always its own flat alias.
      local_flats.push_back(flat_alias(result[d], *layout));
      TORCH_INTERNAL_ASSERT(
          local_flats.back().defined(), "broadcast: a new tensor of sizes ", result[d].sizes(),
          " and strides ", result[d].strides(), " is not laid out as its source");
    } else {
      result[d] = copy_to(tensor, device);
    }
  }
  if (!local_flats.empty()) {
    c10::DeviceGuard guard(source);
    pack_multi({tensor}, *layout, local_flats);
  }
  for (size_t d = 0; d < devices.size(); ++d) {
    traffic.copy(source_slot, d, nbytes);
  }
  return result;
}

void broadcast_out(const at::Tensor& tensor, at::TensorList outs) {
  TORCH_CHECK(tensor.defined(), "broadcast: expected a defined 'tensor'");
  TORCH_CHECK(!outs.empty(), "broadcast: expected at least one tensor in 'out', but it is empty");
  for (size_t i = 0; i < outs.size(); ++i) {
    TORCH_CHECK(outs[i].defined(), "broadcast: expected out[", i, "] to be a defined tensor");
    TORCH_CHECK(
        outs[i].device().type() == outs[0].device().type(),
        "broadcast: expected all output tensors on devices of type ", outs[0].device().type(),
        " (the type of out[0]), but output tensor at index ", i, " is on ", outs[i].device());
    TORCH_CHECK(
        outs[i].sizes().equals(tensor.sizes()),
        "broadcast: expected all output tensors to have the shape of the source tensor ", tensor.sizes(),
        ", but output tensor at index ", i, " has shape ", outs[i].sizes());
    TORCH_CHECK(
        outs[i].scalar_type() == tensor.scalar_type(),
        "broadcast: expected all output tensors to have the dtype of the source tensor (",
        tensor.scalar_type(), "), but output tensor at index ", i, " has dtype ", outs[i].scalar_type());
  }
  c10::NoGradGuard no_grad;
  TrafficRecord traffic(TrafficKind::Broadcast);
  std::vector<c10::Device> devices;
  devices.reserve(outs.size());
  for (const at::Tensor& out : outs) {
    devices.push_back(out.device());
  }
  const size_t source_slot = detail::slot_of(tensor.device(), devices);
  const int64_t nbytes = detail::wire_bytes(tensor);
  for (size_t d = 0; d < outs.size(); ++d) {
    const at::Tensor& out = outs[d];
    if (out.is_same(tensor)) {
      continue;
    }
    c10::DeviceGuard guard(out.device());
    out.copy_(tensor, may_copy_async(out.device()));
    traffic.copy(source_slot, d, nbytes);
  }
}

void broadcast_flat_into(at::TensorList members, const FlatLayout& layout, at::TensorList flats) {
  TORCH_CHECK(!members.empty(), "broadcast_flat_into: expected at least one tensor");
  const c10::Device source = normalize_device(members[0].device());
  c10::NoGradGuard no_grad;
  // Every buffer on the source device is written by one pack_multi (the
  // members read once, no staging). For another device, the bucket is sent
  // from one flat buffer on the source: the member itself when it is the
  // whole bucket, else one of those just packed, else one flattened for it.
  std::vector<at::Tensor> local;
  std::vector<at::Tensor> remote;
  for (size_t d = 0; d < flats.size(); ++d) {
    detail::check_flat(flats[d], layout, members.size(), "broadcast_flat_into", static_cast<int64_t>(d));
    (normalize_device(flats[d].device()) == source ? local : remote).push_back(flats[d]);
  }
  {
    // The source is slot 0, flats[d] slot d + 1; a flat that is the members'
    // own memory moves nothing.
    TrafficRecord traffic(TrafficKind::Broadcast);
    const at::Tensor own = flat_alias(members[0], layout);
    const int64_t nbytes = layout.numel * static_cast<int64_t>(c10::elementSize(layout.dtype));
    for (size_t d = 0; d < flats.size(); ++d) {
      if (!(own.defined() && own.const_data_ptr() == flats[d].const_data_ptr())) {
        traffic.copy(0, d + 1, nbytes);
      }
    }
  }
  if (!local.empty()) {
    c10::DeviceGuard guard(source);
    pack_multi(members, layout, local);
  }
  if (remote.empty()) {
    return;
  }
  at::Tensor source_flat = flat_alias(members[0], layout);
  if (!source_flat.defined()) {
    if (!local.empty()) {
      source_flat = local[0];
    } else {
      c10::DeviceGuard guard(source);
      source_flat = flatten(members, layout);
    }
  }
  for (const at::Tensor& flat : remote) {
    c10::DeviceGuard guard(flat.device());
    flat.copy_(source_flat, may_copy_async(flat.device()));
  }
}

TensorList2D broadcast_coalesced(
    at::TensorList tensors, c10::ArrayRef<c10::Device> devices_in, int64_t bucket_bytes) {
  const auto devices = check_devices(devices_in, "broadcast_coalesced");
  for (size_t i = 0; i < tensors.size(); ++i) {
    TORCH_CHECK(tensors[i].defined(), "broadcast_coalesced: tensors[", i, "] is undefined");
    TORCH_CHECK(
        normalize_device(tensors[i].device()) == devices[0],
        "broadcast_coalesced: expected all tensors on devices[0] (", devices[0], "), but tensors[", i,
        "] is on ", tensors[i].device());
  }
  c10::NoGradGuard no_grad;
  TrafficRecord traffic(TrafficKind::Broadcast); // sparse tensors; broadcast_flat_into counts the rest
  TensorList2D outputs(devices.size());
  outputs[0] = tensors.vec();
  for (size_t d = 1; d < devices.size(); ++d) {
    outputs[d].resize(tensors.size());
  }
  for (const Bucket& bucket : make_buckets(tensors, bucket_bytes)) {
    if (bucket.sparse) {
      const at::Tensor& t = tensors[bucket.indices[0]];
      for (size_t d = 1; d < devices.size(); ++d) {
        outputs[d][bucket.indices[0]] = copy_to(t, devices[d]);
        traffic.copy(0, d, detail::wire_bytes(t));
      }
      continue;
    }
    const std::vector<at::Tensor> members = bucket.members(tensors);
    const FlatLayout layout = FlatLayout::of(members);
    std::vector<at::Tensor> flats;
    flats.reserve(devices.size() - 1);
    for (size_t d = 1; d < devices.size(); ++d) {
      flats.push_back(empty_flat(members[0], devices[d], layout.numel));
    }
    broadcast_flat_into(members, layout, flats);
    for (size_t d = 1; d < devices.size(); ++d) {
      std::vector<at::Tensor> views = layout.unflatten(flats[d - 1]);
      for (size_t j = 0; j < views.size(); ++j) {
        outputs[d][bucket.indices[j]] = std::move(views[j]);
      }
    }
  }
  return outputs;
}

} // namespace dpcore
