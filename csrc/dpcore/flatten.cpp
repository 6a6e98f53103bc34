#define TORCH_ASSERT_ONLY_METHOD_OPERATORS

#include "dpcore/flatten.h"

#include <ATen/core/Tensor.h>
#include <c10/core/TensorImpl.h>
#include <c10/util/Exception.h>
#include <c10/util/strides.h>

#include <map>
#include <utility>

namespace dpcore {

FlatLayout FlatLayout::of(at::TensorList tensors) {
  FlatLayout layout;
  layout.offsets.reserve(tensors.size());
  layout.sizes.reserve(tensors.size());
  layout.strides.reserve(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    TORCH_CHECK(
        t.layout() == c10::kStrided, "flatten: expected dense tensors, but tensor ", i, " has layout ",
        t.layout());
    if (i == 0) {
      layout.dtype = t.scalar_type();
    }
    TORCH_CHECK(
        t.scalar_type() == layout.dtype, "flatten: expected all tensors to have dtype ", layout.dtype,
        " (the dtype of tensor 0), but tensor ", i, " has dtype ", t.scalar_type());
    layout.offsets.push_back(layout.numel);
    layout.sizes.emplace_back(t.sizes().begin(), t.sizes().end());
    if (t.is_non_overlapping_and_dense()) {
      layout.strides.emplace_back(t.strides().begin(), t.strides().end());
    } else {
      const auto contiguous = c10::contiguous_strides(t.sizes());
      layout.strides.emplace_back(contiguous.begin(), contiguous.end());
    }
    layout.numel += t.numel();
  }
  return layout;
}

bool FlatLayout::matches(size_t i, const at::Tensor& t) const {
  return t.sizes().equals(sizes[i]) && t.strides().equals(strides[i]) && is_plain_dense(t);
}

at::Tensor FlatLayout::view(const at::Tensor& flat, size_t i) const {
  return flat.as_strided(sizes[i], strides[i], flat.storage_offset() + offsets[i]);
}

std::vector<at::Tensor> FlatLayout::unflatten(const at::Tensor& flat) const {
  // Each entry is a fresh TensorImpl on flat's storage: no view metadata, no
  // autograd history, and a version counter of its own (see the
  // version-counter note in torch/csrc/cuda/comm.cpp for why). Built
  // directly rather than through as_strided: thousands of small parameters
  // per step make the dispatcher's per-call cost show.
  std::vector<at::Tensor> result;
  result.reserve(size());
  const c10::Storage& storage = flat.storage();
  for (size_t i = 0; i < size(); ++i) {
    auto impl = c10::make_intrusive<c10::TensorImpl>(c10::Storage(storage), flat.key_set(), flat.dtype());
    impl->set_sizes_and_strides(sizes[i], strides[i], flat.storage_offset() + offsets[i]);
    result.emplace_back(std::move(impl));
  }
  return result;
}

std::vector<Bucket> make_buckets(at::TensorList tensors, int64_t bucket_bytes) {
  TORCH_CHECK(bucket_bytes > 0, "expected bucket_bytes (buffer_size) to be positive, but got ", bucket_bytes);
  std::vector<Bucket> closed;
  // One open bucket per dtype; the position in `closed` it will take, so that
  // buckets come out in the order of their first tensor.
  std::map<c10::ScalarType, size_t> open;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    TORCH_CHECK(t.defined(), "expected a defined tensor at index ", i);
    const int64_t nbytes = static_cast<int64_t>(t.numel() * t.element_size());
    if (t.is_sparse()) {
      Bucket bucket;
      bucket.indices.push_back(i);
      bucket.nbytes = nbytes;
      bucket.sparse = true;
      closed.push_back(std::move(bucket));
      continue;
    }
    TORCH_CHECK(
        t.layout() == c10::kStrided, "expected dense or sparse COO tensors, but tensor ", i, " has layout ",
        t.layout());
    auto it = open.find(t.scalar_type());
    if (it == open.end()) {
      it = open.emplace(t.scalar_type(), closed.size()).first;
      closed.emplace_back();
    }
    Bucket& bucket = closed[it->second];
    bucket.indices.push_back(i);
    bucket.nbytes += nbytes;
    if (bucket.nbytes >= bucket_bytes) {
      open.erase(it);
    }
  }
  return closed;
}

std::vector<at::Tensor> Bucket::members(at::TensorList list) const {
  std::vector<at::Tensor> result;
  result.reserve(indices.size());
  for (size_t index : indices) {
    result.push_back(list[index]);
  }
  return result;
}

at::Tensor flat_alias(const at::Tensor& tensor, const FlatLayout& layout) {
  if (layout.size() != 1 || !layout.matches(0, tensor)) {
    return at::Tensor();
  }
  return tensor.as_strided({tensor.numel()}, {1}, tensor.storage_offset());
}

} // namespace dpcore
