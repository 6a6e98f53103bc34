#define TORCH_ASSERT_ONLY_METHOD_OPERATORS

#include "dpcore/comm/checks.h"

#include <ATen/MemoryOverlap.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <utility>

namespace dpcore {
namespace {

// [first byte, one past the last byte] that a strided tensor with elements
// may touch (negative strides included).
std::pair<uintptr_t, uintptr_t> byte_range(const at::Tensor& t) {
  const auto base = reinterpret_cast<uintptr_t>(t.const_data_ptr());
  const auto itemsize = static_cast<int64_t>(t.element_size());
  int64_t low = 0;
  int64_t high = 0;
  for (int64_t d = 0; d < t.dim(); ++d) {
    const int64_t extent = (t.size(d) - 1) * t.stride(d) * itemsize;
    (extent < 0 ? low : high) += extent;
  }
  return {base + low, base + high + itemsize};
}

// Whether `a` and `b` may share elements though get_overlap_status could not
// tell: both have elements, live in one storage and their byte ranges meet.
bool ranges_intersect(const at::Tensor& a, const at::Tensor& b) {
  if (a.numel() == 0 || b.numel() == 0 || !a.storage().is_alias_of(b.storage())) {
    return false;
  }
  const auto [a_begin, a_end] = byte_range(a);
  const auto [b_begin, b_end] = byte_range(b);
  return a_begin < b_end && b_begin < a_end;
}

} // namespace

void check_dense(const at::Tensor& tensor, const char* op, const std::string& what) {
  TORCH_CHECK(
      tensor.layout() == c10::kStrided, op, ": expected dense (strided) tensors, but ", what, " has layout ",
      tensor.layout(), ": dpcore's scatter and gather take dense tensors only ",
      "(broadcast, broadcast_coalesced, reduce_add and reduce_add_coalesced take sparse COO ",
      "tensors too)");
}

void check_no_internal_overlap(const at::Tensor& out, const char* op, const std::string& what) {
  TORCH_CHECK(
      at::has_internal_overlap(out) != at::MemOverlap::Yes, op, ": ", what,
      " has internal overlap (more than one of its elements refer to one memory location, as in ",
      "an expanded tensor), so it cannot be written to; pass a tensor that owns its elements");
}

bool check_no_overlap(
    const at::Tensor& written, const std::string& written_name, const at::Tensor& read,
    const std::string& read_name, const char* op) {
  // Tensors without memory (meta) cannot overlap.
  if (!written.has_storage() || !read.has_storage() || written.is_meta() || read.is_meta()) {
    return false;
  }
  const at::MemOverlapStatus status = at::get_overlap_status(written, read);
  TORCH_CHECK(
      status != at::MemOverlapStatus::Full && status != at::MemOverlapStatus::Partial, op, ": ", written_name,
      " and ", read_name, " overlap in memory (", status == at::MemOverlapStatus::Full ? "fully" : "partly",
      "): an output must not share memory with the inputs or the other outputs, or writing it ",
      "would change values before they are read; write into a separate tensor");
  return status == at::MemOverlapStatus::TooHard && ranges_intersect(written, read);
}

} // namespace dpcore
