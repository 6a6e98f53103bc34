// pack / pack_multi / unpack on CUDA: many tensors to and from flat buffers
// in one launch. The copy is cut into chunks of up to 64 KiB. A copy whose
// table of (source, destination, bytes) fits in the kernel arguments travels
// there (no host-to-device traffic); a larger one (a parameter bucket of
// thousands of tensors) puts its table in pinned host memory, moves it to the
// device with one asynchronous copy on the same stream, and a single
// grid-stride launch finds each chunk's range by binary search. 16-byte
// vector copies where every side is aligned.
// Every range has up to kMaxDests destinations at fixed byte distances from
// its first one (pack_multi: the same slot in K flat buffers): each chunk of
// the source is read once and written to all of them.
// Registers the CUDA implementations of torch.ops.dpcore.pack / .pack_multi /
// .unpack.
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS

#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/core/GradMode.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "dpcore/cuda/device_table.h"
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
// Destinations one launch writes: pack_multi into more flat buffers takes
// one launch (one read of the members) per kMaxDests of them.
constexpr int kMaxDests = 16;
static_assert(sizeof(uintptr_t) == sizeof(int64_t), "the table stores pointers in 8-byte words");

// The destinations of every range of a launch: destination k of a range
// starts `delta[k]` bytes after its `dst` (delta[0] = 0; pack and unpack
// have that one only).
struct Dests {
  int64_t delta[kMaxDests];
  int count;
  // The deltas OR-ed together: its low bits are zero where every destination
  // keeps the alignment of `dst`.
  uint64_t align_bits;
};

// Kept under the 4 KiB kernel-argument limit of older toolkits.
struct CopyArgs {
  const char* src[kMaxRanges];
  char* dst[kMaxRanges];
  int64_t nbytes[kMaxRanges];
  unsigned char block_range[kMaxBlocks];
  int block_chunk[kMaxBlocks];
};
static_assert(sizeof(CopyArgs) + sizeof(Dests) <= 4096, "kernel arguments must fit in 4 KiB");

__device__ __forceinline__ char* shifted(char* p, int64_t delta) {
  return reinterpret_cast<char*>(reinterpret_cast<uintptr_t>(p) + static_cast<uint64_t>(delta));
}

// Copies the whole `Word`s of `len` bytes from `src` to every destination
// with every thread of the block (each word read once); returns the bytes
// copied.
template <typename Word>
__device__ __forceinline__ int64_t copy_words(const char* src, char* dst, int64_t len, const Dests& dests) {
  const int64_t words = len / static_cast<int64_t>(sizeof(Word));
  const Word* s = reinterpret_cast<const Word*>(src);
  for (int64_t i = threadIdx.x; i < words; i += blockDim.x) {
    const Word w = s[i];
    for (int k = 0; k < dests.count; ++k) {
      reinterpret_cast<Word*>(shifted(dst, dests.delta[k]))[i] = w;
    }
  }
  return words * static_cast<int64_t>(sizeof(Word));
}

// Copies `len` bytes (at most one chunk) to every destination.
__device__ __forceinline__ void copy_chunk(const char* src, char* dst, int64_t len, const Dests& dests) {
  const uint64_t bits =
      reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst) | dests.align_bits;
  int64_t done = 0;
  if (bits % 16 == 0) {
    done = copy_words<uint4>(src, dst, len, dests);
  } else if (bits % 4 == 0) {
    done = copy_words<uint32_t>(src, dst, len, dests);
  }
  for (int64_t i = done + threadIdx.x; i < len; i += blockDim.x) {
    const char c = src[i];
    for (int k = 0; k < dests.count; ++k) {
      shifted(dst, dests.delta[k])[i] = c;
    }
  }
}

__global__ void copy_ranges_kernel(CopyArgs args, Dests dests) {
  const int range = args.block_range[blockIdx.x];
  const int64_t start = static_cast<int64_t>(args.block_chunk[blockIdx.x]) * kChunkBytes;
  const int64_t remaining = args.nbytes[range] - start;
  copy_chunk(
      args.src[range] + start, args.dst[range] + start, remaining < kChunkBytes ? remaining : kChunkBytes,
      dests);
}

// The device-side table of the one-launch path: for range r, its bytes, its
// pointers, and the index of its first chunk (first_chunk[count] is the total).
struct CopyTable {
  const int64_t* first_chunk; // count + 1 entries
  const int64_t* nbytes;
  const char* const* src;
  char* const* dst;
  int count;
};

__global__ void copy_table_kernel(CopyTable table, Dests dests) {
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
    copy_chunk(
        table.src[lo] + start, table.dst[lo] + start, remaining < kChunkBytes ? remaining : kChunkBytes,
        dests);
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

// The destinations of pack and unpack: each range's `dst` only.
Dests single_dest() {
  Dests dests{};
  dests.count = 1;
  return dests;
}

// Copies every range (each non-empty) in one launch through the kernel
// arguments; the caller checked that they fit.
void copy_ranges_in_args(const std::vector<Range>& ranges, const Dests& dests, cudaStream_t stream) {
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
  copy_ranges_kernel<<<block_count, kThreads, 0, stream>>>(args, dests);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Copies every range (each non-empty) in one launch whatever their number,
// its table moved to the device by device_table.
void copy_ranges_by_table(
    const std::vector<Range>& ranges, const Dests& dests, const at::Device& device, cudaStream_t stream) {
  const int64_t count = static_cast<int64_t>(ranges.size());
  TORCH_CHECK(
      count < std::numeric_limits<int>::max(), "pack/unpack: expected fewer than ",
      std::numeric_limits<int>::max(), " tensors in one call, but got ", count);
  // Four arrays of 8-byte entries: first_chunk (count + 1), nbytes, src, dst.
  int64_t chunks = 0;
  const at::Tensor table = device_table(4 * count + 1, device, [&](int64_t* first_chunk) {
    int64_t* nbytes = first_chunk + count + 1;
    uintptr_t* src = reinterpret_cast<uintptr_t*>(nbytes + count);
    uintptr_t* dst = src + count;
    for (int64_t r = 0; r < count; ++r) {
      first_chunk[r] = chunks;
      chunks += chunks_of(ranges[r]);
      nbytes[r] = ranges[r].nbytes;
      src[r] = reinterpret_cast<uintptr_t>(ranges[r].src);
      dst[r] = reinterpret_cast<uintptr_t>(ranges[r].dst);
    }
    first_chunk[count] = chunks;
  });
  const int64_t* base = table.const_data_ptr<int64_t>();
  CopyTable view{
      base, base + count + 1, reinterpret_cast<const char* const*>(base + 2 * count + 1),
      reinterpret_cast<char* const*>(base + 3 * count + 1), static_cast<int>(count)};
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t grid = std::min<int64_t>(chunks, static_cast<int64_t>(sms) * kTableBlocksPerSM);
  copy_table_kernel<<<static_cast<unsigned>(grid), kThreads, 0, stream>>>(view, dests);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Copies every range to every destination of `dests` in one launch (none
// when there is nothing to copy).
void copy_ranges(
    const std::vector<Range>& ranges, const Dests& dests, const at::Device& device, cudaStream_t stream) {
  if (ranges.empty())
    return;
  int64_t chunks = 0;
  for (const Range& r : ranges)
    chunks += chunks_of(r);
  if (static_cast<int64_t>(ranges.size()) <= kMaxRanges && chunks <= kMaxBlocks) {
    copy_ranges_in_args(ranges, dests, stream);
  } else {
    copy_ranges_by_table(ranges, dests, device, stream);
  }
}

template <bool kToFlat>
void copy_entries(at::TensorList tensors, const FlatLayout& layout, const at::Tensor& flat) {
  if (tensors.empty())
    return;
  c10::cuda::CUDAGuard guard(flat.device());
  c10::NoGradGuard no_grad;
  const int64_t itemsize = static_cast<int64_t>(flat.element_size());
  char* base = static_cast<char*>(flat.data_ptr());
  std::vector<Range> ranges;
  ranges.reserve(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    const int64_t nbytes = t.numel() * itemsize;
    if (nbytes == 0)
      continue;
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
  copy_ranges(ranges, single_dest(), flat.device(), at::cuda::getCurrentCUDAStream());
}

// Copies every block into every buffer of `bases` from index `first` on:
// one launch (one read of the blocks) per kMaxDests buffers.
void copy_blocks(
    const std::vector<detail::PackBlock>& blocks, const std::vector<char*>& bases, size_t first,
    const at::Device& device, cudaStream_t stream) {
  if (blocks.empty())
    return;
  std::vector<Range> ranges(blocks.size());
  for (size_t begin = first; begin < bases.size(); begin += kMaxDests) {
    const size_t end = std::min(bases.size(), begin + static_cast<size_t>(kMaxDests));
    Dests dests{};
    dests.count = static_cast<int>(end - begin);
    for (size_t k = begin; k < end; ++k) {
      const int64_t delta = static_cast<int64_t>(
          reinterpret_cast<uintptr_t>(bases[k]) - reinterpret_cast<uintptr_t>(bases[begin]));
      dests.delta[k - begin] = delta;
      dests.align_bits |= static_cast<uint64_t>(delta);
    }
    for (size_t j = 0; j < blocks.size(); ++j) {
      ranges[j] = Range{blocks[j].src, bases[begin] + blocks[j].offset, blocks[j].nbytes};
    }
    copy_ranges(ranges, dests, device, stream);
  }
}

} // namespace

void pack(at::TensorList tensors, const FlatLayout& layout, const at::Tensor& flat) {
  copy_entries<true>(tensors, layout, flat);
}

void pack_multi(at::TensorList tensors, const FlatLayout& layout, at::TensorList flats) {
  if (layout.numel == 0)
    return;
  const at::Device device = flats[0].device();
  c10::cuda::CUDAGuard guard(device);
  c10::NoGradGuard no_grad;
  std::vector<char*> bases;
  bases.reserve(flats.size());
  for (const at::Tensor& flat : flats) {
    bases.push_back(static_cast<char*>(flat.mutable_data_ptr()));
  }
  // The members not laid out as `layout` says go through ATen into flats[0]
  // first, on this stream, so before the kernels.
  const detail::PackMultiPlan plan = detail::plan_pack_multi(tensors, layout, flats[0]);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  copy_blocks(plan.direct, bases, 0, device, stream);
  copy_blocks(plan.staged, bases, 1, device, stream);
}

void unpack(const at::Tensor& flat, const FlatLayout& layout, at::TensorList tensors) {
  copy_entries<false>(tensors, layout, flat);
}

} // namespace cuda
} // namespace dpcore

TORCH_LIBRARY_IMPL(dpcore, CUDA, m) {
  m.impl("pack", &dpcore::detail::pack_op<&dpcore::cuda::pack>);
  m.impl("pack_multi", &dpcore::detail::pack_multi_op<&dpcore::cuda::pack_multi>);
  m.impl("unpack", &dpcore::detail::unpack_op<&dpcore::cuda::unpack>);
}
