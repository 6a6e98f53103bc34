#include "dpcore/replica_buffers.h"

#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>

#include "dpcore/comm.h"
#include "dpcore/device.h"

namespace dpcore {

ReplicaBuffers::ReplicaBuffers(at::TensorList like, std::vector<c10::Device> targets)
    : layout_(FlatLayout::of(like)),
      source_(like.empty() ? c10::Device(c10::kCPU) : normalize_device(like[0].device())),
      targets_(targets.empty() ? std::vector<c10::Device>{} : check_devices(targets, "ReplicaBuffers", "targets")) {
  TORCH_CHECK(!like.empty(), "ReplicaBuffers: expected at least one tensor in the bucket");
  for (size_t i = 0; i < like.size(); ++i) {
    TORCH_CHECK(
        normalize_device(like[i].device()) == source_, "ReplicaBuffers: expected all tensors on ",
        source_, " (the device of tensor 0), but tensor ", i, " is on ", like[i].device());
  }
  flats_.reserve(targets_.size());
  for (const c10::Device& device : targets_) {
    c10::DeviceGuard guard(device);
    flats_.push_back(at::empty({layout_.numel}, like[0].options().device(device)));
  }
}

bool ReplicaBuffers::up_to_date(at::TensorList tensors) const {
  if (master_ptrs_.size() != tensors.size()) {
    return false;
  }
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (tensors[i].data_ptr() != master_ptrs_[i] || tensors[i]._version() != master_versions_[i]) {
      return false;
    }
  }
  for (size_t d = 0; d < returned_.size(); ++d) {
    for (size_t i = 0; i < returned_[d].size(); ++i) {
      if (returned_[d][i]._version() != returned_versions_[d][i]) {
        return false;
      }
    }
  }
  return true;
}

TensorList2D ReplicaBuffers::refresh(at::TensorList tensors) {
  TORCH_CHECK(
      tensors.size() == layout_.size(), "ReplicaBuffers.refresh: expected ", layout_.size(),
      " tensors (the bucket's), but got ", tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    TORCH_CHECK(
        tensors[i].sizes().equals(layout_.sizes[i]) && tensors[i].scalar_type() == layout_.dtype &&
            normalize_device(tensors[i].device()) == source_,
        "ReplicaBuffers.refresh: tensor ", i, " is ", tensors[i].scalar_type(), tensors[i].sizes(),
        " on ", tensors[i].device(), ", but the bucket was built for ", layout_.dtype,
        c10::IntArrayRef(layout_.sizes[i]), " on ", source_);
  }
  c10::NoGradGuard no_grad;
  copied_ = !up_to_date(tensors);
  if (copied_) {
    broadcast_flat_into(tensors, layout_, flats_);
    for (auto& views : returned_) {
      for (auto& view : views) {
        view.unsafeGetTensorImpl()->bump_version();
      }
    }
    master_ptrs_.clear();
    master_versions_.clear();
    for (const at::Tensor& t : tensors) {
      master_ptrs_.push_back(t.data_ptr());
      master_versions_.push_back(t._version());
    }
  }
  returned_.clear();
  returned_versions_.clear();
  for (const at::Tensor& flat : flats_) {
    returned_.push_back(layout_.unflatten(flat));
    std::vector<int64_t> versions;
    versions.reserve(returned_.back().size());
    for (const at::Tensor& view : returned_.back()) {
      versions.push_back(view._version());
    }
    returned_versions_.push_back(std::move(versions));
  }
  return returned_;
}

} // namespace dpcore
