// reduce_add_n: out (+)= the sum of K equally shaped tensors, in one pass.
// CPU implementation (the reference) and the device dispatch.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <vector>

#include "dpcore/kernels.h"

namespace dpcore {
namespace {

// Elements summed per block: the block's accumulators stay in L1 while the
// K sources stream through, so memory sees K reads and one write.
constexpr int64_t kBlock = 1024;
constexpr int64_t kGrain = 32 * 1024;

template <typename scalar_t>
void reduce_dense(
    const std::vector<const scalar_t*>& sources, scalar_t* out, int64_t n, bool accumulate) {
  using acc_t = at::opmath_type<scalar_t>;
  at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
    acc_t acc[kBlock];
    for (int64_t start = begin; start < end; start += kBlock) {
      const int64_t len = std::min(kBlock, end - start);
      const scalar_t* first = sources[0] + start;
      if (accumulate) {
        const scalar_t* current = out + start;
        for (int64_t j = 0; j < len; ++j) {
          acc[j] = static_cast<acc_t>(current[j]) + static_cast<acc_t>(first[j]);
        }
      } else {
        for (int64_t j = 0; j < len; ++j) {
          acc[j] = static_cast<acc_t>(first[j]);
        }
      }
      for (size_t k = 1; k < sources.size(); ++k) {
        const scalar_t* src = sources[k] + start;
        for (int64_t j = 0; j < len; ++j) {
          acc[j] += static_cast<acc_t>(src[j]);
        }
      }
      scalar_t* dst = out + start;
      for (int64_t j = 0; j < len; ++j) {
        dst[j] = static_cast<scalar_t>(acc[j]);
      }
    }
  });
}

void check_reduce_args(at::TensorList sources, const at::Tensor& out) {
  TORCH_CHECK(
      !sources.empty(), "reduce_add_n: expected at least one source tensor, but got none");
  TORCH_CHECK(out.defined(), "reduce_add_n: expected a defined 'out' tensor");
  TORCH_CHECK(
      out.layout() == c10::kStrided, "reduce_add_n: expected a dense 'out', but it has layout ",
      out.layout());
  for (size_t i = 0; i < sources.size(); ++i) {
    const at::Tensor& s = sources[i];
    TORCH_CHECK(
        s.device() == out.device(), "reduce_add_n: expected sources[", i, "] on ",
        out.device(), " (the device of 'out'), but it is on ", s.device());
    TORCH_CHECK(
        s.scalar_type() == out.scalar_type(), "reduce_add_n: expected sources[", i,
        "] of dtype ", out.scalar_type(), " (the dtype of 'out'), but it is ", s.scalar_type());
    TORCH_CHECK(
        s.sizes().equals(out.sizes()), "reduce_add_n: expected sources[", i, "] of shape ",
        out.sizes(), " (the shape of 'out'), but it has shape ", s.sizes());
    TORCH_CHECK(
        s.layout() == c10::kStrided, "reduce_add_n: expected dense sources, but sources[", i,
        "] has layout ", s.layout());
  }
}

} // namespace

namespace detail {

bool same_dense_layout(at::TensorList sources, const at::Tensor& out) {
  if (!out.is_non_overlapping_and_dense()) {
    return false;
  }
  return std::all_of(sources.begin(), sources.end(), [&](const at::Tensor& s) {
    return s.strides().equals(out.strides()) && s.is_non_overlapping_and_dense();
  });
}

void reduce_add_n_aten(at::TensorList sources, const at::Tensor& out, bool accumulate) {
  c10::NoGradGuard no_grad;
  const bool low_precision =
      out.scalar_type() == at::kHalf || out.scalar_type() == at::kBFloat16;
  if (!low_precision) {
    size_t k = 0;
    if (!accumulate) {
      out.copy_(sources[0]);
      k = 1;
    }
    for (; k < sources.size(); ++k) {
      out.add_(sources[k]);
    }
    return;
  }
  at::Tensor sum = (accumulate ? out : sources[0]).to(at::kFloat);
  for (size_t k = accumulate ? 0 : 1; k < sources.size(); ++k) {
    sum.add_(sources[k]);
  }
  out.copy_(sum);
}

} // namespace detail

namespace cpu {
void reduce_add_n(at::TensorList sources, const at::Tensor& out, bool accumulate) {
  if (out.numel() == 0) {
    return;
  }
  if (!detail::same_dense_layout(sources, out)) {
    detail::reduce_add_n_aten(sources, out, accumulate);
    return;
  }
  AT_DISPATCH_ALL_TYPES_AND_COMPLEX_AND3(
      at::kHalf, at::kBFloat16, at::kBool, out.scalar_type(), "dpcore::reduce_add_n", [&] {
        std::vector<const scalar_t*> pointers;
        pointers.reserve(sources.size());
        for (const auto& s : sources) {
          pointers.push_back(s.const_data_ptr<scalar_t>());
        }
        reduce_dense<scalar_t>(pointers, out.mutable_data_ptr<scalar_t>(), out.numel(), accumulate);
      });
}

void reduce_add_lists(const TensorList2D& sources, at::TensorList outs, bool accumulate) {
  // Large or irregular entries one by one (each spread over the threads),
  // the small dense ones as one parallel loop over entries.
  std::vector<size_t> small;
  small.reserve(outs.size());
  std::vector<at::Tensor> column(sources.size());
  for (size_t i = 0; i < outs.size(); ++i) {
    for (size_t k = 0; k < sources.size(); ++k) {
      column[k] = sources[k][i];
    }
    const int64_t nbytes = static_cast<int64_t>(outs[i].numel() * outs[i].element_size());
    if (nbytes < detail::kLargeTensorBytes && detail::same_dense_layout(column, outs[i])) {
      small.push_back(i);
    } else {
      reduce_add_n(column, outs[i], accumulate);
    }
  }
  at::parallel_for(
      0, static_cast<int64_t>(small.size()), detail::kTensorsPerTask,
      [&](int64_t begin, int64_t end) {
        std::vector<at::Tensor> entry(sources.size());
        for (int64_t b = begin; b < end; ++b) {
          const size_t i = small[b];
          for (size_t k = 0; k < sources.size(); ++k) {
            entry[k] = sources[k][i];
          }
          // Dense with equal strides (checked above): no ATen op runs here,
          // and the nested parallel_for inside runs inline.
          reduce_add_n(entry, outs[i], accumulate);
        }
      });
}
} // namespace cpu

void reduce_add_lists(const TensorList2D& sources, at::TensorList outs, bool accumulate) {
  TORCH_CHECK(
      !sources.empty(), "reduce_add_lists: expected at least one source list, but got none");
  for (size_t k = 0; k < sources.size(); ++k) {
    TORCH_CHECK(
        sources[k].size() == outs.size(), "reduce_add_lists: expected sources[", k, "] to hold ",
        outs.size(), " tensors (one per output), but it holds ", sources[k].size());
  }
  std::vector<at::Tensor> column(sources.size());
  bool all_cpu = true;
  for (size_t i = 0; i < outs.size(); ++i) {
    for (size_t k = 0; k < sources.size(); ++k) {
      column[k] = sources[k][i];
    }
    // Argument checks of the single-output form, without running it.
    check_reduce_args(column, outs[i]);
    all_cpu = all_cpu && outs[i].is_cpu();
  }
  if (all_cpu) {
    cpu::reduce_add_lists(sources, outs, accumulate);
    return;
  }
  for (size_t i = 0; i < outs.size(); ++i) {
    for (size_t k = 0; k < sources.size(); ++k) {
      column[k] = sources[k][i];
    }
    reduce_add_n(column, outs[i], accumulate);
  }
}

void reduce_add_n(at::TensorList sources, const at::Tensor& out, bool accumulate) {
  check_reduce_args(sources, out);
  if (out.is_cpu()) {
    cpu::reduce_add_n(sources, out, accumulate);
#ifdef DPCORE_WITH_CUDA
  } else if (out.is_cuda()) {
    cuda::reduce_add_n(sources, out, accumulate);
#endif
  } else {
    detail::reduce_add_n_aten(sources, out, accumulate);
  }
}

} // namespace dpcore
