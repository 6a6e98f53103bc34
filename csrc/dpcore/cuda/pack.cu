// pack / unpack on CUDA: many tensors to and from one flat buffer in one
// launch. The copy is cut into chunks of up to 64 KiB. A copy whose table of
// (source, destination, bytes) fits in the kernel arguments travels there (no
// host-to-device traffic); a larger one (a parameter bucket of thousands of
// tensors) puts its table in pinned host memory, moves it to the device with
// one asynchronous copy on the same stream, and a single grid-stride launch
// finds each chunk's range by binary search. 16-byte vector copies where both
// sides are aligned.
// Registers the CUDA implementations of torch.ops.dpcore.pack / .unpack.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/core/GradMode.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAException.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "dpcore/kernels.h"

namespace dpcore {
namespace cuda {
namespace {

constexpr int kMaxRanges = 48;
constexpr int kMaxBlocks = 320;
constexpr int64_t kChunkBytes = 64 * 1024;
constexpr int kThreads = 256;
// Blocks per SM of the table kernel's grid (it strides over the chunks).
constexpr int kTableBlocksPerSM = 8;
static_assert(sizeof(uintptr_t) == sizeof(int64_t), "the table stores pointers in 8-byte words");

// Kept under the 4 KiB kernel-argument limit of older toolkits.
struct CopyArgs {
  const char* src[kMaxRanges];
  char* dst[kMaxRanges];
  int64_t nbytes[kMaxRanges];
  unsigned char block_range[kMaxBlocks];
  int block_chunk[kMaxBlocks];
};
static_assert(sizeof(CopyArgs) <= 4096, "kernel arguments must fit in 4 KiB");

// Copies `len` bytes (at most one chunk) with every thread of the block.
__device__ __forceinline__ void copy_chunk(const char* src, char* dst, int64_t len) {
  int64_t done = 0;
  if (reinterpret_cast<uintptr_t>(src) % 16 == 0 && reinterpret_cast<uintptr_t>(dst) % 16 == 0) {
    const int64_t vectors = len / 16;
    const uint4* s = reinterpret_cast<const uint4*>(src);
    uint4* d = reinterpret_cast<uint4*>(dst);
    for (int64_t i = threadIdx.x; i < vectors; i += blockDim.x) d[i] = s[i];
    done = vectors * 16;
  } else if (reinterpret_cast<uintptr_t>(src) % 4 == 0 && reinterpret_cast<uintptr_t>(dst) % 4 == 0) {
    const int64_t words = len / 4;
    const uint32_t* s = reinterpret_cast<const uint32_t*>(src);
    uint32_t* d = reinterpret_cast<uint32_t*>(dst);
    for (int64_t i = threadIdx.x; i < words; i += blockDim.x) d[i] = s[i];
    done = words * 4;
  }
  for (int64_t i = done + threadIdx.x; i < len; i += blockDim.x) dst[i] = src[i];
}

__global__ void copy_ranges_kernel(CopyArgs args) {
  const int range = args.block_range[blockIdx.x];
  const int64_t start = static_cast<int64_t>(args.block_chunk[blockIdx.x]) * kChunkBytes;
  const int64_t remaining = args.nbytes[range] - start;
  copy_chunk(args.src[range] + start, args.dst[range] + start, remaining < kChunkBytes ? remaining : kChunkBytes);
}

// The device-side table of the one-launch path: for range r, its bytes, its
// pointers, and the index of its first chunk (first_chunk[count] is the total).
struct CopyTable {
  const int64_t* first_chunk;  // count + 1 entries
  const int64_t* nbytes;
  const char* const* src;
  char* const* dst;
  int count;
};

__global__ void copy_table_kernel(CopyTable table) {
  const int64_t total = table.first_chunk[table.count];
  for (int64_t chunk = blockIdx.x; chunk < total; chunk += gridDim.x) {
    // The last range whose first chunk is <= chunk (empty ranges are never
    // in the table, so it is the one that holds it).
    int lo = 0;
    int hi = table.count - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (table.first_chunk[mid] <= chunk) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    const int64_t start = (chunk - table.first_chunk[lo]) * kChunkBytes;
    const int64_t remaining = table.nbytes[lo] - start;
    copy_chunk(table.src[lo] + start, table.dst[lo] + start, remaining < kChunkBytes ? remaining : kChunkBytes);
  }
}

struct Range {
  const char* src;
  char* dst;
  int64_t nbytes;
};

int64_t chunks_of(const Range& r) {
  return (r.nbytes + kChunkBytes - 1) / kChunkBytes;
}

// Copies every range (each non-empty) in one launch through the kernel
// arguments; the caller checked that they fit.
void copy_ranges_in_args(const std::vector<Range>& ranges, cudaStream_t stream) {
  CopyArgs args{};
  int block_count = 0;
  for (size_t slot = 0; slot < ranges.size(); ++slot) {
    const Range& r = ranges[slot];
    args.src[slot] = r.src;
    args.dst[slot] = r.dst;
    args.nbytes[slot] = r.nbytes;
    for (int64_t chunk = 0; chunk < chunks_of(r); ++chunk) {
      args.block_range[block_count] = static_cast<unsigned char>(slot);
      args.block_chunk[block_count] = static_cast<int>(chunk);
      ++block_count;
    }
  }
  copy_ranges_kernel<<<block_count, kThreads, 0, stream>>>(args);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Copies every range (each non-empty) in one launch whatever their number:
// the table goes to the device in one asynchronous copy from pinned memory
// on `stream` (torch's host allocator keeps the pinned block until that copy
// is done; the device block is freed to `stream`, after the kernel).
void copy_ranges_by_table(const std::vector<Range>& ranges, const at::Device& device, cudaStream_t stream) {
  const int64_t count = static_cast<int64_t>(ranges.size());
  TORCH_CHECK(
      count < std::numeric_limits<int>::max(), "pack/unpack: expected fewer than ",
      std::numeric_limits<int>::max(), " tensors in one call, but got ", count);
  // Four arrays of 8-byte entries: first_chunk (count + 1), nbytes, src, dst.
  const int64_t words = 4 * count + 1;
  at::Tensor host = at::empty({words}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  int64_t* first_chunk = host.data_ptr<int64_t>();
  int64_t* nbytes = first_chunk + count + 1;
  uintptr_t* src = reinterpret_cast<uintptr_t*>(nbytes + count);
  uintptr_t* dst = src + count;
  int64_t chunks = 0;
  for (int64_t r = 0; r < count; ++r) {
    first_chunk[r] = chunks;
    chunks += chunks_of(ranges[r]);
    nbytes[r] = ranges[r].nbytes;
    src[r] = reinterpret_cast<uintptr_t>(ranges[r].src);
    dst[r] = reinterpret_cast<uintptr_t>(ranges[r].dst);
  }
  first_chunk[count] = chunks;
  // non_blocking from pinned memory: an async copy on the current stream,
  // and the host block is recorded on it.
  const at::Tensor table = host.to(device, /*non_blocking=*/true);
  const int64_t* base = table.data_ptr<int64_t>();
  CopyTable view{
      base,
      base + count + 1,
      reinterpret_cast<const char* const*>(base + 2 * count + 1),
      reinterpret_cast<char* const*>(base + 3 * count + 1),
      static_cast<int>(count)};
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t grid = std::min<int64_t>(chunks, static_cast<int64_t>(sms) * kTableBlocksPerSM);
  copy_table_kernel<<<static_cast<unsigned>(grid), kThreads, 0, stream>>>(view);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Copies every range in one launch (none when there is nothing to copy).
void copy_ranges(const std::vector<Range>& ranges, const at::Device& device, cudaStream_t stream) {
  if (ranges.empty()) return;
  int64_t chunks = 0;
  for (const Range& r : ranges) chunks += chunks_of(r);
  if (static_cast<int64_t>(ranges.size()) <= kMaxRanges && chunks <= kMaxBlocks) {
    copy_ranges_in_args(ranges, stream);
  } else {
    copy_ranges_by_table(ranges, device, stream);
  }
}

template <bool kToFlat>
void copy_entries(at::TensorList tensors, const FlatLayout& layout, const at::Tensor& flat) {
  if (tensors.empty()) return;
  c10::cuda::CUDAGuard guard(flat.device());
  c10::NoGradGuard no_grad;
  const int64_t itemsize = static_cast<int64_t>(flat.element_size());
  char* base = static_cast<char*>(flat.data_ptr());
  std::vector<Range> ranges;
  ranges.reserve(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    const int64_t nbytes = t.numel() * itemsize;
    if (nbytes == 0) continue;
    if (layout.matches(i, t)) {
      char* slot = base + layout.offsets[i] * itemsize;
      char* data = static_cast<char*>(t.data_ptr());
      ranges.push_back(kToFlat ? Range{data, slot, nbytes} : Range{slot, data, nbytes});
    } else if (kToFlat) {
      layout.view(flat, i).copy_(t, /*non_blocking=*/true);
    } else {
      t.copy_(layout.view(flat, i), /*non_blocking=*/true);
    }
  }
  copy_ranges(ranges, flat.device(), at::cuda::getCurrentCUDAStream());
}

} // namespace

void pack(at::TensorList tensors, const FlatLayout& layout, const at::Tensor& flat) {
  copy_entries<true>(tensors, layout, flat);
}

void unpack(const at::Tensor& flat, const FlatLayout& layout, at::TensorList tensors) {
  copy_entries<false>(tensors, layout, flat);
}

} // namespace cuda
} // namespace dpcore

TORCH_LIBRARY_IMPL(dpcore, CUDA, m) {
  m.impl("pack", &dpcore::detail::pack_op<&dpcore::cuda::pack>);
  m.impl("unpack", &dpcore::detail::unpack_op<&dpcore::cuda::unpack>);
}
