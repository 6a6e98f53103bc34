#define TORCH_ASSERT_ONLY_METHOD_OPERATORS

#include "dpcore/common.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_strided.h>
#include <c10/core/DeviceGuard.h>
#include <c10/util/accumulate.h>
#include <c10/util/strides.h>

#include "dpcore/host_allocator.h"

namespace dpcore {

bool is_plain_dense(const at::Tensor& t) {
  return t.layout() == c10::kStrided && t.is_non_overlapping_and_dense() && !t.is_conj() && !t.is_neg();
}

at::Tensor empty_like_layout(
    const at::Tensor& like, c10::Device device, c10::IntArrayRef sizes, c10::IntArrayRef strides) {
  const int64_t nbytes = c10::multiply_integers(sizes) * static_cast<int64_t>(like.element_size());
  if (device.is_cpu() && nbytes >= kMinCachedBytes) {
    return host_cache_empty_strided(sizes, strides, like.scalar_type());
  }
  c10::DeviceGuard guard(device);
  return at::empty_strided(sizes, strides, like.options().device(device));
}

at::Tensor empty_preserving(const at::Tensor& like, c10::Device device) {
  if (like.is_non_overlapping_and_dense()) {
    return empty_like_layout(like, device, like.sizes(), like.strides());
  }
  const auto strides = c10::contiguous_strides(like.sizes());
  return empty_like_layout(like, device, like.sizes(), strides);
}

at::Tensor empty_flat(const at::Tensor& like, c10::Device device, int64_t numel) {
  return empty_like_layout(like, device, {numel}, {1});
}

} // namespace dpcore
