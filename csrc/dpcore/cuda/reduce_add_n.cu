// reduce_add_n on CUDA: out (+)= the sum of K same-device buffers in one
// kernel (K reads, one write), 16-byte vector loads where every pointer is
// aligned. All K sources are summed in one pass, so half types accumulate in
// float across all of them and are rounded once, as the CPU kernel does (the
// same float additions in the same order).
// Registers the CUDA implementation of torch.ops.dpcore.reduce_add_n.
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "dpcore/cuda/device_table.h"
#include "dpcore/device.h"
#include "dpcore/kernels.h"

namespace dpcore {
namespace cuda {
namespace {

// Up to kInlineSources pointers travel in the kernel's parameters; with more,
// all of them are read from a pointer table in device memory.
constexpr int kInlineSources = 8;
constexpr int kThreads = 256;

template <typename scalar_t>
struct Sources {
  const scalar_t* ptr[kInlineSources];
  const scalar_t* const* table; // device memory with `count` pointers, or null
  int count;

  __device__ const scalar_t* operator[](int k) const {
    return table != nullptr ? table[k] : ptr[k];
  }
};

template <typename scalar_t>
struct alignas(16) Vec {
  static constexpr int kSize = 16 / sizeof(scalar_t);
  scalar_t v[kSize];
};

template <typename scalar_t, bool kVectorized>
__global__ void reduce_add_n_kernel(Sources<scalar_t> src, scalar_t* out, int64_t n, bool accumulate) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if constexpr (kVectorized) {
    using V = Vec<scalar_t>;
    constexpr int kSize = V::kSize;
    const int64_t vectors = n / kSize;
    for (int64_t i = first; i < vectors; i += stride) {
      acc_t acc[kSize];
      if (accumulate) {
        const V current = reinterpret_cast<const V*>(out)[i];
#pragma unroll
        for (int j = 0; j < kSize; ++j)
          acc[j] = static_cast<acc_t>(current.v[j]);
      } else {
#pragma unroll
        for (int j = 0; j < kSize; ++j)
          acc[j] = acc_t(0);
      }
      for (int k = 0; k < src.count; ++k) {
        const V value = reinterpret_cast<const V*>(src[k])[i];
#pragma unroll
        for (int j = 0; j < kSize; ++j)
          acc[j] += static_cast<acc_t>(value.v[j]);
      }
      V result;
#pragma unroll
      for (int j = 0; j < kSize; ++j)
        result.v[j] = static_cast<scalar_t>(acc[j]);
      reinterpret_cast<V*>(out)[i] = result;
    }
    // The tail that does not fill a vector.
    for (int64_t i = vectors * kSize + first; i < n; i += stride) {
      acc_t acc = accumulate ? static_cast<acc_t>(out[i]) : acc_t(0);
      for (int k = 0; k < src.count; ++k)
        acc += static_cast<acc_t>(src[k][i]);
      out[i] = static_cast<scalar_t>(acc);
    }
  } else {
    for (int64_t i = first; i < n; i += stride) {
      acc_t acc = accumulate ? static_cast<acc_t>(out[i]) : acc_t(0);
      for (int k = 0; k < src.count; ++k)
        acc += static_cast<acc_t>(src[k][i]);
      out[i] = static_cast<scalar_t>(acc);
    }
  }
}

bool aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

} // namespace

void reduce_add_n(at::TensorList sources_in, const at::Tensor& out, bool accumulate) {
  if (out.numel() == 0)
    return;
  c10::cuda::CUDAGuard guard(out.device());
  std::vector<at::Tensor> sources = sources_in.vec();
  const bool dense = detail::same_dense_layout(sources, out);
  std::vector<c10::Device> ordered;
  for (at::Tensor& source : sources) {
    if (source.device() == out.device())
      continue;
    if (!dense) {
      // ATen's fallback needs every operand on out's device.
      source = source.to(out.device(), /*non_blocking=*/true);
      continue;
    }
    // Read in place through peer access: after its producer, and its memory
    // not reused before out's stream has read it.
    if (std::find(ordered.begin(), ordered.end(), source.device()) == ordered.end()) {
      order_after(out.device(), source.device());
      ordered.push_back(source.device());
    }
    source.record_stream(at::cuda::getCurrentCUDAStream());
  }
  if (!dense) {
    detail::reduce_add_n_aten(sources, out, accumulate);
    return;
  }
  const auto stream = at::cuda::getCurrentCUDAStream();
  const int64_t n = out.numel();
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  // More sources than fit in the parameters: their pointers go to the device
  // in stream order (device_table).
  at::Tensor table;
  if (sources.size() > static_cast<size_t>(kInlineSources)) {
    table = device_table(static_cast<int64_t>(sources.size()), out.device(), [&](int64_t* entries) {
      for (size_t k = 0; k < sources.size(); ++k) {
        entries[k] = reinterpret_cast<int64_t>(sources[k].const_data_ptr());
      }
    });
  }
  AT_DISPATCH_ALL_TYPES_AND3(
      at::kHalf, at::kBFloat16, at::kBool, out.scalar_type(), "dpcore::reduce_add_n_cuda", [&] {
        scalar_t* dst = out.mutable_data_ptr<scalar_t>();
        Sources<scalar_t> src{};
        src.count = static_cast<int>(sources.size());
        src.table = table.defined()
                        ? reinterpret_cast<const scalar_t* const*>(table.const_data_ptr<int64_t>())
                        : nullptr;
        bool vectorized = aligned16(dst);
        for (size_t k = 0; k < sources.size(); ++k) {
          const scalar_t* pointer = sources[k].const_data_ptr<scalar_t>();
          if (k < static_cast<size_t>(kInlineSources)) {
            src.ptr[k] = pointer;
          }
          vectorized = vectorized && aligned16(pointer);
        }
        const int64_t work = vectorized ? std::max<int64_t>(1, n / Vec<scalar_t>::kSize) : n;
        const int blocks = static_cast<int>(std::min<int64_t>((work + kThreads - 1) / kThreads, sms * 8));
        if (vectorized) {
          reduce_add_n_kernel<scalar_t, true><<<blocks, kThreads, 0, stream>>>(src, dst, n, accumulate);
        } else {
          reduce_add_n_kernel<scalar_t, false><<<blocks, kThreads, 0, stream>>>(src, dst, n, accumulate);
        }
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
  // The peers' streams wait for the reads, so that work queued there next
  // (zeroing a gradient, say) cannot overwrite a source still being read.
  for (const c10::Device& device : ordered) {
    order_after(device, out.device());
  }
}

} // namespace cuda
} // namespace dpcore

TORCH_LIBRARY_IMPL(dpcore, CUDA, m) {
  m.impl("reduce_add_n", &dpcore::detail::reduce_add_n_op<&dpcore::cuda::reduce_add_n>);
}
