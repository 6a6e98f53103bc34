// pack / unpack on CUDA: many tensors to and from one flat buffer in few
// launches. Every block copies one chunk of one tensor; the (tensor, chunk)
// of each block travels in the kernel arguments, as in PyTorch's
// multi_tensor_apply. 16-byte vector copies where both sides are aligned.
// Registers the CUDA implementations of torch.ops.dpcore.pack / .unpack.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/core/GradMode.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAException.h>
#include <torch/library.h>

#include <cstdint>
#include <vector>

#include "dpcore/kernels.h"

namespace dpcore {
namespace cuda {
namespace {

constexpr int kMaxRanges = 48;
constexpr int kMaxBlocks = 320;
constexpr int64_t kChunkBytes = 64 * 1024;
constexpr int kThreads = 256;

// Kept under the 4 KiB kernel-argument limit of older toolkits.
struct CopyArgs {
  const char* src[kMaxRanges];
  char* dst[kMaxRanges];
  int64_t nbytes[kMaxRanges];
  unsigned char block_range[kMaxBlocks];
  int block_chunk[kMaxBlocks];
};
static_assert(sizeof(CopyArgs) <= 4096, "kernel arguments must fit in 4 KiB");

__global__ void copy_ranges_kernel(CopyArgs args) {
  const int range = args.block_range[blockIdx.x];
  const int64_t start = static_cast<int64_t>(args.block_chunk[blockIdx.x]) * kChunkBytes;
  const int64_t remaining = args.nbytes[range] - start;
  const int64_t len = remaining < kChunkBytes ? remaining : kChunkBytes;
  const char* src = args.src[range] + start;
  char* dst = args.dst[range] + start;
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

struct Range {
  const char* src;
  char* dst;
  int64_t nbytes;
};

// Copies every range, batching them into launches of at most kMaxRanges
// ranges and kMaxBlocks blocks.
void copy_ranges(const std::vector<Range>& ranges, cudaStream_t stream) {
  CopyArgs args{};
  int range_count = 0;
  int block_count = 0;
  auto launch = [&]() {
    if (block_count > 0) {
      copy_ranges_kernel<<<block_count, kThreads, 0, stream>>>(args);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    range_count = 0;
    block_count = 0;
  };
  for (const Range& r : ranges) {
    const int64_t chunks = (r.nbytes + kChunkBytes - 1) / kChunkBytes;
    int64_t chunk = 0;
    while (chunk < chunks) {
      if (range_count == kMaxRanges) launch();
      const int slot = range_count++;
      args.src[slot] = r.src;
      args.dst[slot] = r.dst;
      args.nbytes[slot] = r.nbytes;
      for (; chunk < chunks; ++chunk) {
        if (block_count == kMaxBlocks) break;
        args.block_range[block_count] = static_cast<unsigned char>(slot);
        args.block_chunk[block_count] = static_cast<int>(chunk);
        ++block_count;
      }
      if (block_count == kMaxBlocks) launch();
    }
  }
  launch();
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
  copy_ranges(ranges, at::cuda::getCurrentCUDAStream());
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
