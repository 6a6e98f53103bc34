// reduce_add_n: out (+)= the sum of K equally shaped tensors, in one pass.
// CPU implementation (the reference), the device dispatch, and the CPU
// registration of the operator torch.ops.dpcore.reduce_add_n.
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <memory>
#include <type_traits>
#include <vector>

#include "dpcore/device.h"
#include "dpcore/kernels.h"

namespace dpcore {
namespace {

constexpr int64_t kGrain = 32 * 1024;
// Sources summed in one pass; more are folded in by further passes.
constexpr size_t kMaxFused = 8;

// out[j] (+)= sum_k sources[k][j] for j in [0, n), K fixed at compile time
// so that the loop vectorizes with one load per source and one store per
// element (K reads and one write: the memory-traffic minimum). out_t is the
// element type or, for a multi-pass sum of half types, float.
// Compiled for AVX2 and for the baseline ISA, picked at load time (GCC's
// function multiversioning): the wheel must run on any x86-64.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define DPCORE_TARGET_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define DPCORE_TARGET_CLONES
#endif

template <typename scalar_t, typename out_t, size_t K>
DPCORE_TARGET_CLONES void reduce_fixed(
    const scalar_t* const* sources, out_t* out, int64_t n, bool accumulate) {
  using acc_t = at::opmath_type<scalar_t>;
  const scalar_t* s[K];
  for (size_t k = 0; k < K; ++k) {
    s[k] = sources[k];
  }
  if (accumulate) {
    for (int64_t j = 0; j < n; ++j) {
      acc_t acc = static_cast<acc_t>(out[j]);
      for (size_t k = 0; k < K; ++k) {
        acc += static_cast<acc_t>(s[k][j]);
      }
      out[j] = static_cast<out_t>(acc);
    }
  } else {
    for (int64_t j = 0; j < n; ++j) {
      acc_t acc = static_cast<acc_t>(s[0][j]);
      for (size_t k = 1; k < K; ++k) {
        acc += static_cast<acc_t>(s[k][j]);
      }
      out[j] = static_cast<out_t>(acc);
    }
  }
}

template <typename scalar_t, typename out_t>
void reduce_group(const scalar_t* const* sources, size_t count, out_t* out, int64_t n, bool accumulate) {
  switch (count) {
    case 1:
      return reduce_fixed<scalar_t, out_t, 1>(sources, out, n, accumulate);
    case 2:
      return reduce_fixed<scalar_t, out_t, 2>(sources, out, n, accumulate);
    case 3:
      return reduce_fixed<scalar_t, out_t, 3>(sources, out, n, accumulate);
    case 4:
      return reduce_fixed<scalar_t, out_t, 4>(sources, out, n, accumulate);
    case 5:
      return reduce_fixed<scalar_t, out_t, 5>(sources, out, n, accumulate);
    case 6:
      return reduce_fixed<scalar_t, out_t, 6>(sources, out, n, accumulate);
    case 7:
      return reduce_fixed<scalar_t, out_t, 7>(sources, out, n, accumulate);
    default:
      return reduce_fixed<scalar_t, out_t, kMaxFused>(sources, out, n, accumulate);
  }
}

// out[0, n) (+)= the sum of `count` sources, serially, over cache-sized
// blocks with up to kMaxFused sources per pass (later passes find the block
// in cache). With more sources, half types are summed in a float buffer so
// that nothing is rounded between passes.
template <typename scalar_t>
void reduce_range(const scalar_t* const* sources, size_t count, scalar_t* out, int64_t n, bool accumulate) {
  using acc_t = at::opmath_type<scalar_t>;
  constexpr int64_t kBlock = 16 * 1024;
  if (std::is_same_v<acc_t, scalar_t> || count <= kMaxFused) {
    for (size_t first = 0; first < count; first += kMaxFused) {
      reduce_group<scalar_t, scalar_t>(
          sources + first, std::min(kMaxFused, count - first), out, n, accumulate || first > 0);
    }
    return;
  }
  const auto buffer = std::make_unique<acc_t[]>(kBlock);
  std::vector<const scalar_t*> shifted(count);
  for (int64_t start = 0; start < n; start += kBlock) {
    const int64_t len = std::min(n, start + kBlock) - start;
    for (size_t k = 0; k < count; ++k) {
      shifted[k] = sources[k] + start;
    }
    for (int64_t j = 0; j < len; ++j) {
      buffer[j] = accumulate ? static_cast<acc_t>(out[start + j]) : acc_t(0);
    }
    for (size_t first = 0; first < count; first += kMaxFused) {
      reduce_group<scalar_t, acc_t>(
          shifted.data() + first, std::min(kMaxFused, count - first), buffer.get(), len, true);
    }
    for (int64_t j = 0; j < len; ++j) {
      out[start + j] = static_cast<scalar_t>(buffer[j]);
    }
  }
}

// reduce_range over [0, n), its elements spread over the intra-op threads.
template <typename scalar_t>
void reduce_dense(const std::vector<const scalar_t*>& sources, scalar_t* out, int64_t n, bool accumulate) {
  const size_t count = sources.size();
  at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
    std::vector<const scalar_t*> shifted(count);
    for (size_t k = 0; k < count; ++k) {
      shifted[k] = sources[k] + begin;
    }
    reduce_range<scalar_t>(shifted.data(), count, out + begin, end - begin, accumulate);
  });
}

// Whether sources[k][i] for every k has outs[i]'s dtype and strides and is
// dense (then entry i is summed through raw pointers).
bool entry_is_dense(const TensorList2D& sources, const at::Tensor& out, size_t i, at::ScalarType dtype) {
  // detail::same_dense_layout on column i, without building the column.
  if (out.scalar_type() != dtype || !is_plain_dense(out)) {
    return false;
  }
  return std::all_of(sources.begin(), sources.end(), [&](const std::vector<at::Tensor>& list) {
    return list[i].strides().equals(out.strides()) && is_plain_dense(list[i]);
  });
}

} // namespace

namespace detail {

void check_reduce_add_n_args(at::TensorList sources, const at::Tensor& out) {
  TORCH_CHECK(!sources.empty(), "reduce_add_n: expected at least one source tensor, but got none");
  TORCH_CHECK(out.defined(), "reduce_add_n: expected a defined 'out' tensor");
  TORCH_CHECK(
      out.layout() == c10::kStrided, "reduce_add_n: expected a dense 'out', but it has layout ",
      out.layout());
  for (size_t i = 0; i < sources.size(); ++i) {
    const at::Tensor& s = sources[i];
    TORCH_CHECK(
        s.device() == out.device() || can_access_directly(out.device(), s.device()),
        "reduce_add_n: expected sources[", i, "] on ", out.device(), " (the device of 'out') ",
        "or on a device whose memory it can read directly (peer access), but it is on ", s.device());
    TORCH_CHECK(
        s.scalar_type() == out.scalar_type(), "reduce_add_n: expected sources[", i, "] of dtype ",
        out.scalar_type(), " (the dtype of 'out'), but it is ", s.scalar_type());
    TORCH_CHECK(
        s.sizes().equals(out.sizes()), "reduce_add_n: expected sources[", i, "] of shape ", out.sizes(),
        " (the shape of 'out'), but it has shape ", s.sizes());
    TORCH_CHECK(
        s.layout() == c10::kStrided, "reduce_add_n: expected dense sources, but sources[", i, "] has layout ",
        s.layout());
  }
}

bool same_dense_layout(at::TensorList sources, const at::Tensor& out) {
  if (!is_plain_dense(out)) {
    return false;
  }
  return std::all_of(sources.begin(), sources.end(), [&](const at::Tensor& s) {
    return s.strides().equals(out.strides()) && is_plain_dense(s);
  });
}

void reduce_add_n_aten(at::TensorList sources, const at::Tensor& out, bool accumulate) {
  c10::NoGradGuard no_grad;
  const bool low_precision = out.scalar_type() == at::kHalf || out.scalar_type() == at::kBFloat16;
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
  if (outs.empty()) {
    return;
  }
  // Large or irregular entries one by one (each spread over the threads);
  // the small dense ones, by raw pointers, as one parallel loop over entries
  // (3000 tensors of 3500 floats cost no per-tensor dispatch).
  const size_t count = sources.size();
  const at::ScalarType dtype = outs[0].scalar_type();
  std::vector<size_t> small;
  small.reserve(outs.size());
  std::vector<at::Tensor> column;
  for (size_t i = 0; i < outs.size(); ++i) {
    const int64_t nbytes = static_cast<int64_t>(outs[i].numel() * outs[i].element_size());
    if (nbytes == 0) {
      continue;
    }
    if (nbytes < detail::kLargeTensorBytes && entry_is_dense(sources, outs[i], i, dtype)) {
      small.push_back(i);
      continue;
    }
    take_column(sources, i, column);
    reduce_add_n(column, outs[i], accumulate);
  }
  if (small.empty()) {
    return;
  }
  AT_DISPATCH_ALL_TYPES_AND_COMPLEX_AND3(
      at::kHalf, at::kBFloat16, at::kBool, dtype, "dpcore::reduce_add_lists", [&] {
        std::vector<const scalar_t*> pointers(small.size() * count);
        std::vector<scalar_t*> targets(small.size());
        std::vector<int64_t> lengths(small.size());
        for (size_t b = 0; b < small.size(); ++b) {
          const size_t i = small[b];
          for (size_t k = 0; k < count; ++k) {
            pointers[b * count + k] = sources[k][i].const_data_ptr<scalar_t>();
          }
          targets[b] = outs[i].mutable_data_ptr<scalar_t>();
          lengths[b] = outs[i].numel();
        }
        at::parallel_for(
            0, static_cast<int64_t>(small.size()), detail::kTensorsPerTask, [&](int64_t begin, int64_t end) {
              for (int64_t b = begin; b < end; ++b) {
                reduce_range<scalar_t>(
                    pointers.data() + b * count, count, targets[b], lengths[b], accumulate);
              }
            });
      });
}
} // namespace cpu

void reduce_add_lists(const TensorList2D& sources, at::TensorList outs, bool accumulate) {
  TORCH_CHECK(!sources.empty(), "reduce_add_lists: expected at least one source list, but got none");
  for (size_t k = 0; k < sources.size(); ++k) {
    TORCH_CHECK(
        sources[k].size() == outs.size(), "reduce_add_lists: expected sources[", k, "] to hold ", outs.size(),
        " tensors (one per output), but it holds ", sources[k].size());
  }
  std::vector<at::Tensor> column;
  bool all_cpu = true;
  for (size_t i = 0; i < outs.size(); ++i) {
    take_column(sources, i, column);
    // Argument checks of the single-output form, without running it.
    detail::check_reduce_add_n_args(column, outs[i]);
    all_cpu = all_cpu && outs[i].is_cpu();
  }
  if (all_cpu) {
    cpu::reduce_add_lists(sources, outs, accumulate);
    return;
  }
  for (size_t i = 0; i < outs.size(); ++i) {
    take_column(sources, i, column);
    reduce_add_n(column, outs[i], accumulate);
  }
}

void reduce_add_n(at::TensorList sources, const at::Tensor& out, bool accumulate) {
  detail::check_reduce_add_n_args(sources, out);
  detail::backend_for(out.device()).reduce_add_n(sources, out, accumulate);
}

} // namespace dpcore

TORCH_LIBRARY_IMPL(dpcore, CPU, m) {
  m.impl("reduce_add_n", &dpcore::detail::reduce_add_n_op<&dpcore::cpu::reduce_add_n>);
}
