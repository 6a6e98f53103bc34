#define TORCH_ASSERT_ONLY_METHOD_OPERATORS

#include "dpcore/replica_buffers.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/GradMode.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/Exception.h>

#include "dpcore/comm.h"
#include "dpcore/device.h"

namespace dpcore {

ReplicaBuffers::ReplicaBuffers(at::TensorList like, std::vector<c10::Device> targets)
    : layout_(FlatLayout::of(like)),
      source_(like.empty() ? c10::Device(c10::kCPU) : normalize_device(like[0].device())),
      targets_(
          targets.empty() ? std::vector<c10::Device>{}
                          : check_devices(targets, "ReplicaBuffers", "targets")) {
  TORCH_CHECK(!like.empty(), "ReplicaBuffers: expected at least one tensor in the bucket");
  for (size_t i = 0; i < like.size(); ++i) {
    TORCH_CHECK(
        normalize_device(like[i].device()) == source_, "ReplicaBuffers: expected all tensors on ", source_,
        " (the device of tensor 0), but tensor ", i, " is on ", like[i].device());
  }
  // Normal tensors (with version counters) even when built in inference mode.
  c10::InferenceMode normal_mode(false);
  flats_.reserve(targets_.size());
  anchors_.reserve(targets_.size());
  for (const c10::Device& device : targets_) {
    c10::DeviceGuard guard(device);
    flats_.push_back(at::empty({layout_.numel}, like[0].options().device(device)));
    anchors_.push_back(layout_.unflatten(flats_.back()));
    anchor_versions_.emplace_back(layout_.size(), -1);
  }
}

TensorList2D ReplicaBuffers::refresh(at::TensorList tensors) {
  TORCH_CHECK(
      tensors.size() == layout_.size(), "ReplicaBuffers.refresh: expected ", layout_.size(),
      " tensors (the bucket's), but got ", tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    TORCH_CHECK(
        tensors[i].sizes().equals(layout_.sizes[i]) && tensors[i].scalar_type() == layout_.dtype &&
            normalize_device(tensors[i].device()) == source_,
        "ReplicaBuffers.refresh: tensor ", i, " is ", tensors[i].scalar_type(), tensors[i].sizes(), " on ",
        tensors[i].device(), ", but the bucket was built for ", layout_.dtype,
        c10::IntArrayRef(layout_.sizes[i]), " on ", source_);
  }
  std::lock_guard<std::mutex> lock(mutex_);
  c10::InferenceMode normal_mode(false);
  c10::NoGradGuard no_grad;
  // Entry i is stale on every device when its master changed, entry (d, i)
  // when a copy of it was changed in place.
  const size_t n = tensors.size();
  const bool first = master_ptrs_.size() != n;
  std::vector<char> master_changed(n, 0);
  bool any = first;
  for (size_t i = 0; i < n; ++i) {
    master_changed[i] =
        first || tensors[i].data_ptr() != master_ptrs_[i] || tensors[i]._version() != master_versions_[i];
    any = any || master_changed[i];
  }
  for (size_t d = 0; d < anchors_.size() && !any; ++d) {
    for (size_t i = 0; i < n && !any; ++i) {
      any = anchors_[d][i]._version() != anchor_versions_[d][i];
    }
  }
  copied_.store(any);
  if (any) {
    broadcast_flat_into(tensors, layout_, flats_);
    // Only entries whose bytes changed are marked: the copy rewrote the
    // others with the bytes they held.
    for (size_t d = 0; d < anchors_.size(); ++d) {
      for (size_t i = 0; i < n; ++i) {
        at::Tensor& anchor = anchors_[d][i];
        if (master_changed[i] || anchor._version() != anchor_versions_[d][i]) {
          anchor.unsafeGetTensorImpl()->bump_version();
        }
        anchor_versions_[d][i] = anchor._version();
      }
    }
    master_ptrs_.resize(n);
    master_versions_.resize(n);
    for (size_t i = 0; i < n; ++i) {
      master_ptrs_[i] = tensors[i].data_ptr();
      master_versions_[i] = tensors[i]._version();
    }
  }
  TensorList2D result;
  result.reserve(flats_.size());
  for (size_t d = 0; d < flats_.size(); ++d) {
    result.push_back(layout_.unflatten(flats_[d]));
    for (size_t i = 0; i < n; ++i) {
      result.back()[i].unsafeGetTensorImpl()->set_version_counter(
          anchors_[d][i].unsafeGetTensorImpl()->version_counter());
    }
  }
  return result;
}

void ReplicaBuffers::invalidate() {
  std::lock_guard<std::mutex> lock(mutex_);
  master_ptrs_.clear(); // the next refresh treats every entry as changed
}

} // namespace dpcore
