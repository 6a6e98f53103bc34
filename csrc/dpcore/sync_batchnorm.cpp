#define TORCH_ASSERT_ONLY_METHOD_OPERATORS

#include "dpcore/sync_batchnorm.h"

#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/batch_norm.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/native_batch_norm_backward.h>
#include <ATen/ops/ones_like.h>
#include <ATen/ops/rsqrt.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/tensor.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <tuple>
#include <utility>
#include <vector>

#include "dpcore/device.h"

namespace dpcore {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Every dimension but the channels (dim 1).
std::vector<int64_t> reduce_dims(const at::Tensor& x) {
  std::vector<int64_t> dims{0};
  for (int64_t d = 2; d < x.dim(); ++d) {
    dims.push_back(d);
  }
  return dims;
}

// (1, C, 1, ...): how a per-channel vector broadcasts against `x`.
std::vector<int64_t> channel_shape(const at::Tensor& x) {
  std::vector<int64_t> shape(static_cast<size_t>(x.dim()), 1);
  shape[1] = -1;
  return shape;
}

// Values per channel in `x`.
int64_t per_channel(const at::Tensor& x) {
  return x.size(1) == 0 ? 0 : x.numel() / x.size(1);
}

// (mean, biased variance) per channel of one replica's input, in two passes
// (as exact as var_mean, and on the CPU several times faster than its
// reduction over (0, 2, ...)). Backward: dx = g_mean / n + 2 g_var (x - mean) / n.
struct LocalStats : public torch::autograd::Function<LocalStats> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x) {
    const auto dims = reduce_dims(x);
    const double n = static_cast<double>(std::max<int64_t>(1, per_channel(x)));
    at::Tensor mean = x.sum(dims).div_(n);
    at::Tensor var = (x - mean.view(channel_shape(x))).square_().sum(dims).div_(n);
    ctx->save_for_backward({x, mean});
    return {mean, var};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& x = saved[0];
    const at::Tensor& mean = saved[1];
    const double n = static_cast<double>(std::max<int64_t>(1, per_channel(x)));
    const at::Tensor scale = grads[1] * (2.0 / n);
    const at::Tensor shift = grads[0] / n;
    // create_graph: plain differentiable operations; so too without values
    // (an empty local batch across processes), where the CPU kernel divides by 0.
    if (at::GradMode::is_enabled() || x.numel() == 0) {
      const auto shape = channel_shape(x);
      return {(x - mean.view(shape)) * scale.view(shape) + shift.view(shape)};
    }
    // (x - mean) * scale + shift in one pass: the inference BatchNorm kernel
    // with unit variance and eps 0 is exactly that per-channel affine map.
    return {at::batch_norm(x, scale, shift, mean, at::ones_like(mean), false, 0.0, 0.0, false)};
  }
};

// The parallel-variance formula over K replicas, one autograd node. Inputs:
// weights n_i / N (K), then m_0, v_0, m_1, v_1, ...; outputs mean = sum w_i
// m_i and var = sum w_i (v_i + (m_i - mean)^2). Backward: d m_i = w_i (g_mean
// + 2 (m_i - mean) g_var), d v_i = w_i g_var (the terms through mean cancel,
// since sum w_i (m_i - mean) = 0; under create_graph the saved mean carries them).
struct Combine : public torch::autograd::Function<Combine> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& weights, at::TensorList stats) {
    std::vector<at::Tensor> means;
    std::vector<at::Tensor> vars;
    for (size_t i = 0; i < stats.size(); i += 2) {
      means.push_back(stats[i]);
      vars.push_back(stats[i + 1]);
    }
    const at::Tensor m = at::stack(means);
    const at::Tensor mean = at::matmul(weights, m);
    const at::Tensor var = at::matmul(weights, at::stack(vars) + (m - mean).square_());
    variable_list to_save{weights, mean};
    to_save.insert(to_save.end(), means.begin(), means.end());
    ctx->save_for_backward(std::move(to_save));
    return {mean, var};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor w = saved[0].unsqueeze(1);
    const at::Tensor& mean = saved[1];
    const std::vector<at::Tensor> means(saved.begin() + 2, saved.end());
    const at::Tensor d_means = w * (grads[0] + 2.0 * (at::stack(means) - mean) * grads[1]);
    const at::Tensor d_vars = w * grads[1];
    variable_list out{at::Tensor()};
    for (size_t i = 0; i < means.size(); ++i) {
      out.push_back(d_means[static_cast<int64_t>(i)]);
      out.push_back(d_vars[static_cast<int64_t>(i)]);
    }
    return out;
  }
};

// (x - mean) / sqrt(var + eps) * weight + bias per channel, differentiable
// with respect to x, mean, var, weight and bias. Forward is the native
// inference kernel; backward the native BatchNorm backward in its inference
// form (dx = dy weight invstd, dweight = sum dy (x - mean) invstd, dbias =
// sum dy) plus, from the same sums, d mean = -weight invstd dbias and d var =
// -weight invstd^2 dweight / 2. Under create_graph the same formulas run as
// plain differentiable operations.
struct Normalize : public torch::autograd::Function<Normalize> {
  static at::Tensor forward(
      AutogradContext* ctx, const at::Tensor& x, const at::Tensor& mean, const at::Tensor& var,
      const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias, double eps) {
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["has_bias"] = bias.has_value() && bias->defined();
    ctx->save_for_backward({x, mean, var, weight.value_or(at::Tensor())});
    return at::batch_norm(
        x, weight, bias, mean, var, /*training=*/false, 0.0, eps, at::globalContext().userEnabledCuDNN());
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& x = saved[0];
    const at::Tensor& mean = saved[1];
    const at::Tensor& var = saved[2];
    const at::Tensor& weight = saved[3];
    const double eps = ctx->saved_data["eps"].toDouble();
    const at::Tensor& dy = grads[0];
    const at::Tensor invstd = at::rsqrt(var + eps);
    const at::Tensor w = weight.defined() ? weight : at::ones_like(mean);
    at::Tensor dx;
    at::Tensor dw;
    at::Tensor sum_dy;
    if (at::GradMode::is_enabled() || x.numel() == 0) { // create_graph, or no values: plain formulas
      const auto shape = channel_shape(x);
      const auto dims = reduce_dims(x);
      sum_dy = dy.sum(dims);
      dw = (dy * (x - mean.view(shape))).sum(dims) * invstd;
      dx = dy * (invstd * w).view(shape);
    } else {
      // grad_output in the input's memory format: torch's CPU kernel (2.13) gives wrong results for a
      // batch of one whose grad_output is channels_last-strided (its batch stride is free: size 1)
      // while the input is contiguous, as a 1-row chunk after a flatten(2).transpose(1, 2) gets it.
      const auto format = x.suggest_memory_format();
      std::tie(dx, dw, sum_dy) = at::native_batch_norm_backward(
          dy.contiguous(format), x.contiguous(format), w, mean, var, {}, {}, false, eps, {true, true, true});
    }
    const at::Tensor d_mean = -(invstd * w) * sum_dy;
    const at::Tensor d_var = (-0.5 * invstd * invstd * w) * dw;
    return {
        dx,
        d_mean,
        d_var,
        weight.defined() ? dw : at::Tensor(),
        ctx->saved_data["has_bias"].toBool() ? sum_dy : at::Tensor(),
        at::Tensor()};
  }
};

// `t` in `dtype`, differentiably, when it is defined and differs.
std::optional<at::Tensor> as_dtype(const std::optional<at::Tensor>& t, at::ScalarType dtype) {
  if (!t || !t->defined() || t->scalar_type() == dtype) {
    return t;
  }
  return t->to(dtype);
}

} // namespace

at::Tensor sync_batch_norm(
    Rendezvous& rendezvous, size_t rank, const std::string& key, const at::Tensor& input,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    const std::optional<at::Tensor>& running_mean, const std::optional<at::Tensor>& running_var,
    bool update_running_stats, double momentum, double eps, const CombineAcross& across) {
  TORCH_CHECK_VALUE(
      input.dim() >= 2, "sync_batch_norm: expected an input of shape (N, C, ...), but got shape ",
      input.sizes());
  const bool full = input.scalar_type() == at::kFloat || input.scalar_type() == at::kDouble;
  const at::Tensor x = full ? input : input.to(at::kFloat);
  const auto local = LocalStats::apply(x);
  const int64_t count = per_channel(x);
  std::optional<c10::Stream> stream;
  if (!x.device().is_cpu()) {
    stream = current_stream(x.device());
  }
  const c10::Device device = x.device();
  // A tensor of another replica's contribution, on this replica's device
  // (the copy ordered after the stream it was produced on).
  const auto fetch = [&device](const Contribution& c, const at::Tensor& t) {
    if (t.device() == device) {
      return t;
    }
    if (c.stream) { // the copy is ordered after this thread's current stream of the source device
      wait_stream(current_stream(t.device()), *c.stream);
    }
    return t.to(device);
  };
  const std::vector<Contribution> all =
      rendezvous.exchange(rank, key, Contribution{{local[0], local[1]}, count, stream});

  int64_t total = 0;
  for (const Contribution& c : all) {
    total += c.count;
  }
  const char* over = across ? " over all replicas of every process" : " over all replicas";
  TORCH_CHECK_VALUE(
      across || total > 1, "Expected more than 1 value per channel when training, got ", total, over,
      " (input size ", input.sizes(), " on replica ", rank, ")");
  at::Tensor mean;
  at::Tensor var;
  if (!across || rank == 0) { // with `across`, only rank 0's combination is used
    std::vector<double> shares;
    std::vector<at::Tensor> stats;
    for (const Contribution& c : all) {
      // A process without values (an empty local batch) has the weights 0, not 0 / 0.
      shares.push_back(total == 0 ? 0.0 : static_cast<double>(c.count) / static_cast<double>(total));
      for (const at::Tensor& t : c.tensors) {
        stats.push_back(fetch(c, t));
      }
    }
    at::Tensor weights = at::tensor(shares, at::TensorOptions().dtype(at::kDouble)).to(x.scalar_type());
    if (!device.is_cpu()) { // from pinned memory: no wait for the device's queued work
      weights = weights.pin_memory().to(device, /*non_blocking=*/true);
    }
    const auto combined = Combine::apply(weights, at::TensorList(stats));
    mean = combined[0];
    var = combined[1];
  }
  if (across) {
    std::vector<at::Tensor> mine;
    int64_t everywhere = 0;
    if (rank == 0) {
      std::tie(mean, var, everywhere) = across(key, mean, var, total);
      mine = {mean, var};
    }
    const std::vector<Contribution> shared = rendezvous.exchange(
        rank, key + " (every process)", Contribution{std::move(mine), everywhere, stream});
    const Contribution& first = shared[0];
    total = first.count;
    if (rank != 0) {
      mean = fetch(first, first.tensors[0]);
      var = fetch(first, first.tensors[1]);
    }
    TORCH_CHECK_VALUE(
        total > 1, "Expected more than 1 value per channel when training, got ", total, over, " (input size ",
        input.sizes(), " on replica ", rank, ")");
  }

  if (update_running_stats) {
    at::NoGradGuard no_grad;
    if (running_mean && running_mean->defined()) {
      running_mean->lerp_(mean.to(running_mean->scalar_type()), momentum);
    }
    if (running_var && running_var->defined()) {
      const double unbiased = static_cast<double>(total) / static_cast<double>(total - 1);
      running_var->lerp_((var * unbiased).to(running_var->scalar_type()), momentum);
    }
  }
  const at::Tensor out =
      Normalize::apply(x, mean, var, as_dtype(weight, x.scalar_type()), as_dtype(bias, x.scalar_type()), eps);
  return full ? out : out.to(input.scalar_type());
}

} // namespace dpcore
