// pack / unpack: a list of tensors to and from one flat buffer.
// CPU implementation (the reference), the device dispatch, and the CPU
// registration of the operators torch.ops.dpcore.pack / .unpack.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <cstring>

#include "dpcore/kernels.h"

namespace dpcore {
namespace {

using detail::kLargeTensorBytes;
using detail::kTensorsPerTask;

// Copies between each tensor and its entry in `flat`: kToFlat packs, else unpacks.
template <bool kToFlat>
void copy_entries_cpu(at::TensorList tensors, const FlatLayout& layout, const at::Tensor& flat) {
  c10::NoGradGuard no_grad;
  const int64_t itemsize = static_cast<int64_t>(flat.element_size());
  char* base = tensors.empty() ? nullptr : static_cast<char*>(flat.data_ptr());
  // Entries that are one block of bytes on both sides and small enough to be
  // grouped; the rest go through copy_ here, one at a time.
  std::vector<size_t> blocks;
  blocks.reserve(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    const int64_t nbytes = t.numel() * itemsize;
    if (nbytes == 0) {
      continue;
    }
    if (nbytes < kLargeTensorBytes && layout.matches(i, t)) {
      blocks.push_back(i);
    } else if (kToFlat) {
      layout.view(flat, i).copy_(t);
    } else {
      t.copy_(layout.view(flat, i));
    }
  }
  at::parallel_for(
      0, static_cast<int64_t>(blocks.size()), kTensorsPerTask, [&](int64_t begin, int64_t end) {
        for (int64_t b = begin; b < end; ++b) {
          const size_t i = blocks[b];
          char* slot = base + layout.offsets[i] * itemsize;
          char* data = static_cast<char*>(tensors[i].data_ptr());
          const size_t nbytes = static_cast<size_t>(tensors[i].numel() * itemsize);
          if (kToFlat) {
            std::memcpy(slot, data, nbytes);
          } else {
            std::memcpy(data, slot, nbytes);
          }
        }
      });
}

// Any device: one ATen copy per tensor.
template <bool kToFlat>
void copy_entries_generic(at::TensorList tensors, const FlatLayout& layout, const at::Tensor& flat) {
  c10::NoGradGuard no_grad;
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (kToFlat) {
      layout.view(flat, i).copy_(tensors[i], /*non_blocking=*/true);
    } else {
      tensors[i].copy_(layout.view(flat, i), /*non_blocking=*/true);
    }
  }
}

} // namespace

namespace detail {

void check_pack_args(at::TensorList tensors, const FlatLayout& layout, const at::Tensor& flat, const char* op) {
  const size_t count = tensors.size();
  TORCH_CHECK(
      layout.size() == count, op, ": expected ", layout.size(),
      " tensors (the layout's entries), but got ", count);
  TORCH_CHECK(
      flat.dim() == 1 && flat.is_contiguous(), op,
      ": expected 'flat' to be a contiguous 1-D tensor, but it has sizes ",
      flat.sizes(), " and strides ", flat.strides());
  TORCH_CHECK(
      flat.numel() == layout.numel, op, ": expected 'flat' to have ", layout.numel,
      " elements, but it has ", flat.numel());
  TORCH_CHECK(
      count == 0 || flat.scalar_type() == layout.dtype, op, ": expected 'flat' of dtype ",
      layout.dtype, ", but it is ", flat.scalar_type());
  for (size_t i = 0; i < count; ++i) {
    const at::Tensor& t = tensors[i];
    TORCH_CHECK(
        t.device() == flat.device(), op, ": expected tensor ", i, " on ", flat.device(),
        " (the device of 'flat'), but it is on ", t.device());
    TORCH_CHECK(
        t.scalar_type() == layout.dtype, op, ": expected tensor ", i, " of dtype ",
        layout.dtype, ", but it is ", t.scalar_type());
    TORCH_CHECK(
        t.sizes().equals(layout.sizes[i]), op, ": expected tensor ", i, " of shape ",
        c10::IntArrayRef(layout.sizes[i]), ", but it has shape ", t.sizes());
  }
}

} // namespace detail

namespace cpu {
void pack(at::TensorList tensors, const FlatLayout& layout, const at::Tensor& flat) {
  copy_entries_cpu<true>(tensors, layout, flat);
}
void unpack(const at::Tensor& flat, const FlatLayout& layout, at::TensorList tensors) {
  copy_entries_cpu<false>(tensors, layout, flat);
}
} // namespace cpu

void pack(at::TensorList tensors, const FlatLayout& layout, const at::Tensor& flat) {
  detail::check_pack_args(tensors, layout, flat, "pack");
  if (flat.is_cpu()) {
    cpu::pack(tensors, layout, flat);
#ifdef DPCORE_WITH_CUDA
  } else if (flat.is_cuda()) {
    cuda::pack(tensors, layout, flat);
#endif
  } else {
    copy_entries_generic<true>(tensors, layout, flat);
  }
}

void unpack(const at::Tensor& flat, const FlatLayout& layout, at::TensorList tensors) {
  detail::check_pack_args(tensors, layout, flat, "unpack");
  if (flat.is_cpu()) {
    cpu::unpack(flat, layout, tensors);
#ifdef DPCORE_WITH_CUDA
  } else if (flat.is_cuda()) {
    cuda::unpack(flat, layout, tensors);
#endif
  } else {
    copy_entries_generic<false>(tensors, layout, flat);
  }
}

at::Tensor flatten(at::TensorList tensors, const FlatLayout& layout) {
  TORCH_CHECK(!tensors.empty(), "flatten: expected at least one tensor");
  at::Tensor flat = empty_flat(tensors[0], tensors[0].device(), layout.numel);
  pack(tensors, layout, flat);
  return flat;
}

} // namespace dpcore

TORCH_LIBRARY_IMPL(dpcore, CPU, m) {
  m.impl("pack", &dpcore::detail::pack_op<&dpcore::cpu::pack>);
  m.impl("unpack", &dpcore::detail::unpack_op<&dpcore::cpu::unpack>);
}
