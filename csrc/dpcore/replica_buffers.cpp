#define TORCH_ASSERT_ONLY_METHOD_OPERATORS

#include "dpcore/replica_buffers.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/ne.h>
#include <ATen/ops/scalar_tensor.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/GradMode.h>
#include <c10/core/InferenceMode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/Exception.h>
#include <c10/util/accumulate.h>

#include <algorithm>
#include <cstring>

#include "dpcore/comm.h"
#include "dpcore/device.h"
#include "dpcore/kernels.h"

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
  // Normal tensors (with version counters) even when built in inference mode, and plain ones (not
  // functorch's wrappers, whose storage cannot be read) when built under a torch.func transform.
  c10::InferenceMode normal_mode(false);
  c10::impl::ExcludeDispatchKeyGuard no_transforms(
      c10::DispatchKeySet(
          {c10::DispatchKey::FuncTorchDynamicLayerFrontMode,
           c10::DispatchKey::FuncTorchDynamicLayerBackMode}));
  flats_.reserve(targets_.size());
  anchors_.reserve(targets_.size());
  for (const c10::Device& device : targets_) {
    c10::DeviceGuard guard(device);
    flats_.push_back(at::empty({layout_.numel}, like[0].options().device(device)));
    anchors_.push_back(layout_.unflatten(flats_.back()));
    anchor_versions_.emplace_back(layout_.size(), -1);
    written_.emplace_back(layout_.size(), std::make_pair(nullptr, int64_t{-1}));
  }
  copied_bytes_.assign(targets_.size(), 0);
}

namespace {

// Whether the bytes of `a` and `b` (same dtype and numel, 1-D, contiguous,
// on one device) differ: a 0-dim bool tensor on their device. On the host a
// memcmp; on a device a comparison queued on its current stream (read with
// item() once every device's is queued), as the widest integers that the
// byte counts and offsets allow, so that NaN payloads and signed zeros
// count as bytes, not as values.
at::Tensor bytes_differ(const at::Tensor& a, const at::Tensor& b) {
  const int64_t size = a.element_size();
  const int64_t nbytes = a.numel() * size;
  if (a.device().is_cpu()) {
    const bool differ = nbytes > 0 && std::memcmp(a.const_data_ptr(), b.const_data_ptr(), nbytes) != 0;
    return at::scalar_tensor(differ, at::kBool);
  }
  int64_t word = 8;
  while (word > 1 && (nbytes % word != 0 || (a.storage_offset() * size) % word != 0 ||
                      (b.storage_offset() * size) % word != 0)) {
    word /= 2;
  }
  const c10::ScalarType type = word == 8   ? at::kLong
                               : word == 4 ? at::kInt
                               : word == 2 ? at::kShort
                                           : at::kByte;
  return at::ne(a.view(at::kByte).view(type), b.view(at::kByte).view(type)).any();
}

} // namespace

void ReplicaBuffers::check_tensors(at::TensorList tensors, const char* fn) const {
  TORCH_CHECK(
      tensors.size() == layout_.size(), fn, ": expected ", layout_.size(),
      " tensors (the bucket's), but got ", tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    TORCH_CHECK(
        tensors[i].sizes().equals(layout_.sizes[i]) && tensors[i].scalar_type() == layout_.dtype &&
            normalize_device(tensors[i].device()) == source_,
        fn, ": tensor ", i, " is ", tensors[i].scalar_type(), tensors[i].sizes(), " on ", tensors[i].device(),
        ", but the bucket was built for ", layout_.dtype, c10::IntArrayRef(layout_.sizes[i]), " on ",
        source_);
  }
}

bool ReplicaBuffers::changed(at::TensorList tensors, std::vector<char>& master_changed) const {
  // Entry i is stale on every device when its master changed, entry (d, i)
  // when a copy of it was changed in place.
  const size_t n = tensors.size();
  const bool first = master_ptrs_.size() != n;
  master_changed.assign(n, 0);
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
  return any;
}

TensorList2D ReplicaBuffers::refresh(at::TensorList tensors) {
  check_tensors(tensors, "ReplicaBuffers.refresh");
  std::lock_guard<std::mutex> lock(mutex_);
  c10::InferenceMode normal_mode(false);
  c10::NoGradGuard no_grad;
  const size_t n = tensors.size();
  std::vector<char> master_changed;
  const bool any = changed(tensors, master_changed);
  copied_.store(any);
  std::fill(copied_bytes_.begin(), copied_bytes_.end(), 0);
  if (any) {
    // kept[d][i]: write() left copy (d, i) equal to the master as it is now,
    // and nothing changed the copy since: it is not copied again.
    std::vector<std::vector<char>> kept(flats_.size(), std::vector<char>(n, 0));
    std::vector<at::Tensor> whole;
    std::vector<size_t> partial;
    const int64_t item = c10::elementSize(layout_.dtype);
    for (size_t d = 0; d < flats_.size(); ++d) {
      bool any_kept = false;
      for (size_t i = 0; i < n; ++i) {
        kept[d][i] = written_[d][i].first == tensors[i].data_ptr() &&
                     written_[d][i].second == tensors[i]._version() &&
                     anchors_[d][i]._version() == anchor_versions_[d][i];
        any_kept = any_kept || kept[d][i];
      }
      if (any_kept) {
        if (!std::all_of(kept[d].begin(), kept[d].end(), [](char k) { return k != 0; })) {
          partial.push_back(d); // else every entry is current there: nothing to copy
        }
      } else {
        whole.push_back(flats_[d]);
        copied_bytes_[d] = layout_.numel * item;
      }
    }
    if (!whole.empty()) {
      broadcast_flat_into(tensors, layout_, whole);
    }
    if (!partial.empty()) {
      copy_entries(tensors, kept, partial);
    }
    // Only entries whose bytes changed are marked: the copy rewrote the
    // others with the bytes they held (write() marked the kept ones).
    for (size_t d = 0; d < anchors_.size(); ++d) {
      for (size_t i = 0; i < n; ++i) {
        at::Tensor& anchor = anchors_[d][i];
        if (!kept[d][i] && (master_changed[i] || anchor._version() != anchor_versions_[d][i])) {
          anchor.unsafeGetTensorImpl()->bump_version();
        }
        anchor_versions_[d][i] = anchor._version();
        written_[d][i] = {nullptr, -1};
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

void ReplicaBuffers::copy_entries(
    at::TensorList tensors, const std::vector<std::vector<char>>& kept, const std::vector<size_t>& targets) {
  at::Tensor source = flat_alias(tensors[0], layout_);
  if (!source.defined()) {
    c10::DeviceGuard guard(source_);
    source = flatten(tensors, layout_);
  }
  const int64_t item = c10::elementSize(layout_.dtype);
  const size_t n = layout_.size();
  for (const size_t d : targets) {
    c10::DeviceGuard guard(flats_[d].device());
    int64_t bytes = 0;
    // Each run of entries not kept, as one block (the gaps of alignment between them included).
    for (size_t begin = 0; begin < n;) {
      if (kept[d][begin]) {
        ++begin;
        continue;
      }
      size_t end = begin;
      while (end < n && !kept[d][end]) {
        ++end;
      }
      const int64_t first = layout_.offsets[begin];
      const int64_t last = layout_.offsets[end - 1] + c10::multiply_integers(layout_.sizes[end - 1]);
      flats_[d]
          .narrow(0, first, last - first)
          .copy_(source.narrow(0, first, last - first), may_copy_async(flats_[d].device()));
      bytes += (last - first) * item;
      begin = end;
    }
    copied_bytes_[d] = bytes;
  }
}

std::vector<int64_t> ReplicaBuffers::last_copied_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return copied_bytes_;
}

void ReplicaBuffers::check_entry(
    int64_t target, int64_t entry, const at::Tensor& master, const char* fn) const {
  TORCH_CHECK(
      target >= 0 && target < static_cast<int64_t>(targets_.size()), fn, ": expected a target in [0, ",
      targets_.size(), "), but got ", target);
  TORCH_CHECK(
      entry >= 0 && entry < static_cast<int64_t>(layout_.size()), fn, ": expected an entry in [0, ",
      layout_.size(), "), but got ", entry);
  const c10::IntArrayRef shape(layout_.sizes[static_cast<size_t>(entry)]);
  TORCH_CHECK(
      master.sizes().equals(shape) && master.scalar_type() == layout_.dtype &&
          normalize_device(master.device()) == source_,
      fn, ": expected the master of entry ", entry, " (", layout_.dtype, shape, " on ", source_,
      "), but got ", master.scalar_type(), master.sizes(), " on ", master.device());
}

void ReplicaBuffers::write(int64_t target, int64_t entry, const at::Tensor& value, const at::Tensor& master) {
  const char* fn = "ReplicaBuffers.write";
  check_entry(target, entry, master, fn);
  const auto d = static_cast<size_t>(target);
  const auto i = static_cast<size_t>(entry);
  const c10::IntArrayRef shape(layout_.sizes[i]);
  TORCH_CHECK(
      value.sizes().equals(shape) && value.scalar_type() == layout_.dtype &&
          normalize_device(value.device()) == targets_[d],
      fn, ": expected a value of ", layout_.dtype, shape, " on ", targets_[d], ", but got ",
      value.scalar_type(), value.sizes(), " on ", value.device());
  std::lock_guard<std::mutex> lock(mutex_);
  c10::InferenceMode normal_mode(false);
  c10::NoGradGuard no_grad;
  c10::DeviceGuard guard(targets_[d]);
  at::Tensor& anchor = anchors_[d][i];
  anchor.copy_(value); // an in-place write: bumps the entry's version on this target
  anchor_versions_[d][i] = anchor._version();
  written_[d][i] = {master.data_ptr(), master._version()};
}

std::vector<at::Tensor> ReplicaBuffers::views(int64_t target) {
  TORCH_CHECK(
      target >= 0 && target < static_cast<int64_t>(targets_.size()),
      "ReplicaBuffers.views: expected a target in [0, ", targets_.size(), "), but got ", target);
  const auto d = static_cast<size_t>(target);
  std::lock_guard<std::mutex> lock(mutex_);
  c10::InferenceMode normal_mode(false);
  std::vector<at::Tensor> result = layout_.unflatten(flats_[d]);
  for (size_t i = 0; i < result.size(); ++i) {
    result[i].unsafeGetTensorImpl()->set_version_counter(
        anchors_[d][i].unsafeGetTensorImpl()->version_counter());
  }
  return result;
}

void ReplicaBuffers::mark_current(int64_t target, c10::ArrayRef<int64_t> entries, at::TensorList masters) {
  const char* fn = "ReplicaBuffers.mark_current";
  TORCH_CHECK(
      entries.size() == masters.size(), fn, ": expected one master per entry, but got ", entries.size(),
      " entries and ", masters.size(), " masters");
  for (size_t k = 0; k < entries.size(); ++k) {
    check_entry(target, entries[k], masters[k], fn);
  }
  std::lock_guard<std::mutex> lock(mutex_);
  const auto d = static_cast<size_t>(target);
  for (size_t k = 0; k < entries.size(); ++k) {
    const auto i = static_cast<size_t>(entries[k]);
    at::Tensor& anchor = anchors_[d][i];
    anchor.unsafeGetTensorImpl()->bump_version(); // a graph that saved the old copy is refused
    anchor_versions_[d][i] = anchor._version();
    written_[d][i] = {masters[k].data_ptr(), masters[k]._version()};
  }
}

void ReplicaBuffers::invalidate() {
  std::lock_guard<std::mutex> lock(mutex_);
  master_ptrs_.clear(); // the next refresh treats every entry as changed
  for (auto& row : written_) {
    std::fill(row.begin(), row.end(), std::make_pair(nullptr, int64_t{-1}));
  }
}

std::vector<int64_t> ReplicaBuffers::verify(at::TensorList tensors) {
  check_tensors(tensors, "ReplicaBuffers.verify");
  std::lock_guard<std::mutex> lock(mutex_);
  c10::InferenceMode normal_mode(false);
  c10::NoGradGuard no_grad;
  std::vector<char> master_changed;
  if (flats_.empty() || changed(tensors, master_changed)) {
    return {};
  }
  at::Tensor source = flat_alias(tensors[0], layout_);
  if (!source.defined()) {
    c10::DeviceGuard guard(source_);
    source = flatten(tensors, layout_);
  }
  // The master's bytes next to each target's buffer, on its device: every
  // copy and comparison is queued before the first result is read.
  std::vector<at::Tensor> masters;
  std::vector<at::Tensor> differs;
  masters.reserve(flats_.size());
  differs.reserve(flats_.size());
  for (const at::Tensor& flat : flats_) {
    c10::DeviceGuard guard(flat.device());
    if (normalize_device(flat.device()) == source_) {
      masters.push_back(source);
    } else {
      masters.push_back(at::empty_like(flat));
      masters.back().copy_(source, may_copy_async(flat.device()));
    }
    differs.push_back(bytes_differ(masters.back(), flat));
  }
  std::vector<char> target_differs(flats_.size(), 0);
  bool any = false;
  for (size_t d = 0; d < differs.size(); ++d) {
    target_differs[d] = differs[d].item<bool>() ? 1 : 0;
    any = any || target_differs[d];
  }
  std::vector<int64_t> stale;
  if (!any) {
    return stale;
  }
  // Which entries (only after a difference was found): one comparison each.
  for (size_t i = 0; i < layout_.size(); ++i) {
    const int64_t numel = c10::multiply_integers(layout_.sizes[i]);
    for (size_t d = 0; d < flats_.size(); ++d) {
      if (!target_differs[d]) {
        continue;
      }
      c10::DeviceGuard guard(flats_[d].device());
      const int64_t offset = layout_.offsets[i];
      if (bytes_differ(masters[d].narrow(0, offset, numel), flats_[d].narrow(0, offset, numel))
              .item<bool>()) {
        stale.push_back(static_cast<int64_t>(i));
        break;
      }
    }
  }
  for (int64_t i : stale) {
    master_ptrs_[i] = nullptr; // the next refresh copies them (entry i holds bytes: a storage)
  }
  return stale;
}

} // namespace dpcore
