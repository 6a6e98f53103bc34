// Coalescing: how a list of tensors is laid out in one flat buffer, and how a
// list is cut into buckets of one dtype each. Used by broadcast_coalesced,
// reduce_add_coalesced and the replica parameter buffers. Layouts only: the
// kernels that copy into and out of flat buffers (pack, unpack, flatten) are
// in kernels.h, which builds on this header.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/SmallVector.h>

#include <cstdint>
#include <vector>

#include "dpcore/common.h"

namespace dpcore {

// Where each tensor of a list lives inside one flat, contiguous 1-D buffer.
// A tensor whose elements are dense in memory (contiguous, channels_last, any
// permutation) keeps its strides, so its view in the buffer has the same
// memory format; any other tensor is laid out contiguously.
struct FlatLayout {
  c10::ScalarType dtype = c10::ScalarType::Undefined;
  int64_t numel = 0;
  std::vector<int64_t> offsets;
  std::vector<c10::SmallVector<int64_t, 5>> sizes;
  std::vector<c10::SmallVector<int64_t, 5>> strides;

  // Layout of `tensors`, which must all be dense (strided) and of one dtype.
  static FlatLayout of(at::TensorList tensors);

  size_t size() const {
    return offsets.size();
  }
  // Whether tensor `t` is already laid out as entry i (same strides, dense):
  // then its bytes can be copied as one block.
  bool matches(size_t i, const at::Tensor& t) const;
  // Entry i as a view of `flat` (shares flat's storage and version counter).
  at::Tensor view(const at::Tensor& flat, size_t i) const;
  // Every entry as a view of `flat`, each with its own version counter and no
  // autograd history, so that an in-place change of one does not bump another.
  std::vector<at::Tensor> unflatten(const at::Tensor& flat) const;
};

// A group of tensors, by index into the list it was cut from, all of one
// dtype and all dense, or a single sparse tensor.
struct Bucket {
  std::vector<size_t> indices;
  int64_t nbytes = 0;
  bool sparse = false;

  // The bucket's tensors: those of `list` (the list it was cut from, or one
  // of the same length) at `indices`.
  std::vector<at::Tensor> members(at::TensorList list) const;
};

// Cuts `tensors` into buckets: dense tensors are grouped by dtype in input
// order, a bucket being closed as soon as it holds at least `bucket_bytes`
// (so a tensor larger than that has a bucket of its own); each sparse tensor
// is a bucket of its own. Every index appears in exactly one bucket.
std::vector<Bucket> make_buckets(at::TensorList tensors, int64_t bucket_bytes);

// `tensor`'s elements as a 1-D view of its own memory when `layout` is its
// layout alone and it is dense (a copy would only reproduce its bytes);
// undefined otherwise.
at::Tensor flat_alias(const at::Tensor& tensor, const FlatLayout& layout);

} // namespace dpcore
