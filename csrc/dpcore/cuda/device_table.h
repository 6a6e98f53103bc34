// A table of 8-byte words (pointers, sizes, offsets) that a kernel reads from
// device memory, when it is too large for the kernel's arguments: the
// pack/unpack range table (pack.cu) and reduce_add_n's source pointers
// (reduce_add_n.cu). CUDA builds only.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <utility>

namespace dpcore {
namespace cuda {

// A table of `words` 8-byte entries on `device`: `fill(int64_t* entries)`
// writes them into pinned host memory, and one asynchronous copy on
// `device`'s current stream moves them over. A kernel queued afterwards on
// that stream reads the returned tensor's data; the caller may drop the
// tensor right after the launch: torch's caching host allocator keeps the
// pinned block until the copy has run, and the device block goes back to the
// caching allocator on that stream, so it is reused only after the kernel.
template <typename Fill>
at::Tensor device_table(int64_t words, c10::Device device, Fill&& fill) {
  at::Tensor host = at::empty({words}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  std::forward<Fill>(fill)(host.mutable_data_ptr<int64_t>());
  // non_blocking from pinned memory: an async copy on the current stream,
  // and the host block is recorded on it.
  return host.to(device, /*non_blocking=*/true);
}

} // namespace cuda
} // namespace dpcore
