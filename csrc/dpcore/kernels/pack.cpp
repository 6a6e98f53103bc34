// pack / pack_multi / unpack: a list of tensors to and from flat buffers.
// CPU implementation (the reference), the ATen-generic one for other
// devices, the checked entry points, and the CPU registration of the
// operators torch.ops.dpcore.pack / .pack_multi / .unpack.
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

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
  at::parallel_for(0, static_cast<int64_t>(blocks.size()), kTensorsPerTask, [&](int64_t begin, int64_t end) {
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

// pack_multi's work is cut into pieces of at most this many bytes: a piece
// is read once and written to every destination while it is in cache.
constexpr int64_t kMultiPieceBytes = 64 * 1024;

// `nbytes` bytes from `src` to byte `offset` of destinations [first_dest, K).
struct Piece {
  const char* src;
  int64_t offset;
  int64_t nbytes;
  size_t first_dest;
};

void pack_multi_cpu(at::TensorList tensors, const FlatLayout& layout, at::TensorList flats) {
  c10::NoGradGuard no_grad;
  if (layout.numel == 0) {
    return;
  }
  const detail::PackMultiPlan plan = detail::plan_pack_multi(tensors, layout, flats[0]);
  std::vector<char*> bases;
  bases.reserve(flats.size());
  for (const at::Tensor& flat : flats) {
    bases.push_back(static_cast<char*>(flat.mutable_data_ptr()));
  }
  std::vector<Piece> pieces;
  pieces.reserve(plan.direct.size());
  const auto cut = [&](const std::vector<detail::PackBlock>& blocks, size_t first_dest) {
    if (first_dest == flats.size()) {
      return;
    }
    for (const detail::PackBlock& block : blocks) {
      for (int64_t start = 0; start < block.nbytes; start += kMultiPieceBytes) {
        pieces.push_back(
            Piece{
                block.src + start, block.offset + start, std::min(kMultiPieceBytes, block.nbytes - start),
                first_dest});
      }
    }
  };
  cut(plan.direct, 0);
  cut(plan.staged, 1);
  at::parallel_for(0, static_cast<int64_t>(pieces.size()), kTensorsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const Piece& piece = pieces[p];
      for (size_t k = piece.first_dest; k < bases.size(); ++k) {
        std::memcpy(bases[k] + piece.offset, piece.src, static_cast<size_t>(piece.nbytes));
      }
    }
  });
}

} // namespace

namespace detail {

void check_flat(
    const at::Tensor& flat, const FlatLayout& layout, size_t count, const char* op, int64_t index) {
  // Only evaluated for a message, when a check fails.
  const auto name = [&] { return index < 0 ? std::string("'flat'") : c10::str("flats[", index, "]"); };
  TORCH_CHECK(flat.defined(), op, ": expected ", name(), " to be a defined tensor");
  TORCH_CHECK(
      flat.dim() == 1 && flat.is_contiguous(), op, ": expected ", name(),
      " to be a contiguous 1-D tensor, but it has sizes ", flat.sizes(), " and strides ", flat.strides());
  TORCH_CHECK(
      flat.numel() == layout.numel, op, ": expected ", name(), " to have ", layout.numel,
      " elements, but it has ", flat.numel());
  TORCH_CHECK(
      count == 0 || flat.scalar_type() == layout.dtype, op, ": expected ", name(), " of dtype ", layout.dtype,
      ", but it is ", flat.scalar_type());
}

namespace {

// The checks of the tensors (as many as the layout's entries) against the
// layout and the device of `flat` (named by `flat_name`).
void check_members(
    at::TensorList tensors, const FlatLayout& layout, const at::Tensor& flat, const char* op,
    const char* flat_name) {
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    TORCH_CHECK(
        t.device() == flat.device(), op, ": expected tensor ", i, " on ", flat.device(), " (the device of ",
        flat_name, "), but it is on ", t.device());
    TORCH_CHECK(
        t.scalar_type() == layout.dtype, op, ": expected tensor ", i, " of dtype ", layout.dtype,
        ", but it is ", t.scalar_type());
    TORCH_CHECK(
        t.sizes().equals(layout.sizes[i]), op, ": expected tensor ", i, " of shape ",
        c10::IntArrayRef(layout.sizes[i]), ", but it has shape ", t.sizes());
  }
}

} // namespace

void check_pack_args(
    at::TensorList tensors, const FlatLayout& layout, const at::Tensor& flat, const char* op) {
  TORCH_CHECK(
      layout.size() == tensors.size(), op, ": expected ", layout.size(),
      " tensors (the layout's entries), but got ", tensors.size());
  check_flat(flat, layout, tensors.size(), op, -1);
  check_members(tensors, layout, flat, op, "'flat'");
}

PackMultiPlan plan_pack_multi(
    at::TensorList tensors, const FlatLayout& layout, const at::Tensor& first_flat) {
  const int64_t itemsize = static_cast<int64_t>(first_flat.element_size());
  const char* base = tensors.empty() ? nullptr : static_cast<const char*>(first_flat.const_data_ptr());
  PackMultiPlan plan;
  plan.direct.reserve(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    const int64_t nbytes = t.numel() * itemsize;
    if (nbytes == 0) {
      continue;
    }
    const int64_t offset = layout.offsets[i] * itemsize;
    if (layout.matches(i, t)) {
      plan.direct.push_back(PackBlock{static_cast<const char*>(t.const_data_ptr()), offset, nbytes});
    } else {
      // Not one block of bytes (strided, or a lazy conjugate/negative bit).
      layout.view(first_flat, i).copy_(t, /*non_blocking=*/true);
      plan.staged.push_back(PackBlock{base + offset, offset, nbytes});
    }
  }
  return plan;
}

void check_pack_multi_args(at::TensorList tensors, const FlatLayout& layout, at::TensorList flats) {
  TORCH_CHECK(!flats.empty(), "pack_multi: expected at least one tensor in 'flats', but it is empty");
  TORCH_CHECK(
      layout.size() == tensors.size(), "pack_multi: expected ", layout.size(),
      " tensors (the layout's entries), but got ", tensors.size());
  for (size_t k = 0; k < flats.size(); ++k) {
    check_flat(flats[k], layout, tensors.size(), "pack_multi", static_cast<int64_t>(k));
    TORCH_CHECK(
        flats[k].device() == flats[0].device(), "pack_multi: expected every flat buffer on ",
        flats[0].device(), " (the device of flats[0]), but flats[", k, "] is on ", flats[k].device());
  }
  check_members(tensors, layout, flats[0], "pack_multi", "flats[0]");
}

} // namespace detail

namespace cpu {
void pack(at::TensorList tensors, const FlatLayout& layout, const at::Tensor& flat) {
  copy_entries_cpu<true>(tensors, layout, flat);
}
void pack_multi(at::TensorList tensors, const FlatLayout& layout, at::TensorList flats) {
  pack_multi_cpu(tensors, layout, flats);
}
void unpack(const at::Tensor& flat, const FlatLayout& layout, at::TensorList tensors) {
  copy_entries_cpu<false>(tensors, layout, flat);
}
} // namespace cpu

namespace generic {
void pack(at::TensorList tensors, const FlatLayout& layout, const at::Tensor& flat) {
  copy_entries_generic<true>(tensors, layout, flat);
}
void pack_multi(at::TensorList tensors, const FlatLayout& layout, at::TensorList flats) {
  for (const at::Tensor& flat : flats) {
    copy_entries_generic<true>(tensors, layout, flat);
  }
}
void unpack(const at::Tensor& flat, const FlatLayout& layout, at::TensorList tensors) {
  copy_entries_generic<false>(tensors, layout, flat);
}
} // namespace generic

void pack(at::TensorList tensors, const FlatLayout& layout, const at::Tensor& flat) {
  detail::check_pack_args(tensors, layout, flat, "pack");
  detail::backend_for(flat.device()).pack(tensors, layout, flat);
}

void pack_multi(at::TensorList tensors, const FlatLayout& layout, at::TensorList flats) {
  detail::check_pack_multi_args(tensors, layout, flats);
  detail::backend_for(flats[0].device()).pack_multi(tensors, layout, flats);
}

void unpack(const at::Tensor& flat, const FlatLayout& layout, at::TensorList tensors) {
  detail::check_pack_args(tensors, layout, flat, "unpack");
  detail::backend_for(flat.device()).unpack(flat, layout, tensors);
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
  m.impl("pack_multi", &dpcore::detail::pack_multi_op<&dpcore::cpu::pack_multi>);
  m.impl("unpack", &dpcore::detail::unpack_op<&dpcore::cpu::unpack>);
}
