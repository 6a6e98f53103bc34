// Synchronized BatchNorm: one replica's share of a BatchNorm call whose
// statistics are those of the whole batch over all replicas of a parallel
// call. No Python here: the interception of BatchNorm calls is
// dpcore/sync_batchnorm.py, the binding csrc/python/sync_batchnorm.cpp.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <tuple>

#include "dpcore/rendezvous.h"

namespace dpcore {

// Where processes synchronize too: turns the statistics of this process's
// batch (its replicas' combined per-channel mean and biased variance, and
// the values per channel) into those of every process's batch together,
// differentiable with respect to mean and variance. Called on rank 0 only,
// once per BatchNorm call, with the call's key. The Python binding wraps a
// callable (dpcore/sync_batchnorm.py's, over a torch.distributed group).
using CombineAcross = std::function<std::tuple<at::Tensor, at::Tensor, int64_t>(
    const std::string& key, const at::Tensor& mean, const at::Tensor& var, int64_t count)>;

// BatchNorm in training mode of `input` (N, C, ...) on replica `rank`, with
// the mean and biased variance of every replica's input together:
//   1. this replica's per-channel mean and biased variance (two passes);
//   2. one exchange of (mean, variance, count) through `rendezvous` under `key`;
//   3. the global statistics by the parallel-variance formula (each replica
//      weighted by its count: mean = sum n_i m_i / N, var = sum n_i (v_i +
//      (m_i - mean)^2) / N; numerically stable, unlike sums of squares);
//   3b. with `across` (processes synchronize too): rank 0 passes the
//      combined statistics to `across` and hands its result to the other
//      ranks in a second round under key + " (every process)"; the global
//      count is the result's;
//   4. with `update_running_stats`, the running statistics become
//      (1 - momentum) running + momentum batch statistic, with the unbiased
//      variance var N / (N - 1) (one replica does this, on its buffers);
//   5. the output (x - mean) / sqrt(var + eps) * weight + bias.
// Differentiable (C++ autograd nodes, double backward included) with respect
// to input, weight and bias, through the other replicas' statistics too: the
// exchanged statistics keep their autograd history, so backward sums every
// replica's gradients with respect to the global statistics without any
// exchange (nothing in backward waits). Reduced-precision inputs are
// normalized in float32 and returned in their own dtype. Raises
// RendezvousBroken when the rendezvous breaks, c10::ValueError for an input
// without a channel dimension or a global count of 1 (0 or 1 values of this
// process are fine with `across` when others have more), and whatever
// `across` throws.
at::Tensor sync_batch_norm(
    Rendezvous& rendezvous, size_t rank, const std::string& key, const at::Tensor& input,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    const std::optional<at::Tensor>& running_mean, const std::optional<at::Tensor>& running_var,
    bool update_running_stats, double momentum, double eps, const CombineAcross& across = {});

} // namespace dpcore
