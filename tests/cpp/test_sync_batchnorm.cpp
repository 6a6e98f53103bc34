// sync_batch_norm: replicas on threads, each with a chunk of the batch, give
// what at::batch_norm gives on the whole batch (output, gradients of input,
// weight and bias, running statistics), for uneven chunks, chunks of one row
// with channels_last-strided gradients, and without affine parameters; reduced precision keeps its dtype; bad
// inputs are named.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "dpcore/rendezvous.h"
#include "dpcore/sync_batchnorm.h"

namespace {

using namespace std::chrono_literals;

void expect_close(const at::Tensor& actual, const at::Tensor& expected, const std::string& what) {
  ASSERT_TRUE(actual.defined()) << what;
  ASSERT_EQ(actual.sizes(), expected.sizes()) << what;
  EXPECT_TRUE(at::allclose(actual, expected, 1e-9, 1e-10))
      << what << ": largest difference " << (actual - expected).abs().max().item<double>();
}

struct Case {
  std::vector<int64_t> shape; // whole batch
  std::vector<int64_t> chunks;
  bool affine;
  // The output read through out.flatten(2).transpose(1, 2) (LeViT's patch embeddings): each replica's
  // gradient arrives channels_last-strided, with a free batch stride where its chunk has one row.
  bool transposed = false;
};

// The output as the loss reads it.
at::Tensor read(const at::Tensor& out, bool transposed) {
  return transposed ? out.flatten(2).transpose(1, 2) : out;
}

void check_against_whole_batch(const Case& c) {
  at::manual_seed(0);
  const auto options = at::TensorOptions().dtype(at::kDouble);
  const at::Tensor x = at::randn(c.shape, options) * 2 + 1;
  const int64_t channels = c.shape[1];
  const at::Tensor w = at::rand({channels}, options) + 0.5;
  const at::Tensor b = at::rand({channels}, options) - 0.5;

  // Reference: one device, the whole batch.
  at::Tensor xr = x.clone().requires_grad_();
  at::Tensor wr = w.clone().requires_grad_();
  at::Tensor br = b.clone().requires_grad_();
  at::Tensor mean_r = at::zeros({channels}, options);
  at::Tensor var_r = at::ones({channels}, options);
  const at::Tensor out_r = at::batch_norm(
      xr, c.affine ? wr : at::Tensor(), c.affine ? br : at::Tensor(), mean_r, var_r, true, 0.1, 1e-5, false);
  const at::Tensor projection = at::randn(read(out_r, c.transposed).sizes(), options); // contiguous
  (read(out_r, c.transposed) * projection).sum().backward();

  // Replicas on threads, one chunk each.
  at::Tensor xs = x.clone().requires_grad_();
  at::Tensor ws = w.clone().requires_grad_();
  at::Tensor bs = b.clone().requires_grad_();
  at::Tensor mean_s = at::zeros({channels}, options);
  at::Tensor var_s = at::ones({channels}, options);
  const auto parts = xs.split_with_sizes(c.chunks);
  dpcore::Rendezvous rendezvous(parts.size(), 20s);
  std::vector<at::Tensor> outs(parts.size());
  std::vector<std::thread> threads;
  for (size_t rank = 0; rank < parts.size(); ++rank) {
    threads.emplace_back([&, rank] {
      outs[rank] = dpcore::sync_batch_norm(
          rendezvous, rank, "BatchNorm 'bn' (call 1)", parts[rank],
          c.affine ? std::optional<at::Tensor>(ws) : std::nullopt,
          c.affine ? std::optional<at::Tensor>(bs) : std::nullopt, mean_s, var_s, rank == 0, 0.1, 1e-5);
      rendezvous.finish(rank);
    });
  }
  for (auto& t : threads) {
    t.join();
  }
  ASSERT_FALSE(rendezvous.broken()) << rendezvous.reason();
  std::vector<at::Tensor> read_outs;
  for (const at::Tensor& out : outs) {
    read_outs.push_back(read(out, c.transposed));
  }
  const at::Tensor out_s = at::cat(outs);
  (at::cat(read_outs) * projection).sum().backward();

  expect_close(out_s, out_r, "output");
  expect_close(xs.grad(), xr.grad(), "input gradient");
  if (c.affine) {
    expect_close(ws.grad(), wr.grad(), "weight gradient");
    expect_close(bs.grad(), br.grad(), "bias gradient");
  }
  expect_close(mean_s, mean_r, "running mean");
  expect_close(var_s, var_r, "running variance");
}

TEST(SyncBatchNorm, MatchesTheWholeBatchWithUnevenChunks) {
  check_against_whole_batch({{8, 3}, {4, 1, 3}, true});
  check_against_whole_batch({{9, 4, 5}, {3, 3, 3}, true});
  check_against_whole_batch({{7, 2, 3, 4}, {2, 5}, false});
  check_against_whole_batch({{5, 3, 2, 2, 3}, {1, 1, 1, 2}, true});
}

TEST(SyncBatchNorm, MatchesTheWholeBatchWithChannelsLastGradientsOnChunksOfOne) {
  // torch's CPU native_batch_norm_backward (2.13) is wrong for such a gradient with a contiguous input
  // of one row; the normalization gives it the input's memory format.
  check_against_whole_batch({{5, 16, 2, 2}, {2, 2, 1}, true, true});
  check_against_whole_batch({{3, 8, 3, 5}, {1, 1, 1}, false, true});
  check_against_whole_batch({{4, 8, 2, 3, 2}, {1, 3}, true, true});
  check_against_whole_batch({{3, 6, 7}, {1, 2}, true, true});
}

TEST(SyncBatchNorm, ReducedPrecisionKeepsItsDtype) {
  dpcore::Rendezvous rendezvous(1, 5s);
  const at::Tensor x = at::randn({6, 3}).to(at::kBFloat16);
  const at::Tensor out = dpcore::sync_batch_norm(
      rendezvous, 0, "k", x, std::nullopt, std::nullopt, std::nullopt, std::nullopt, false, 0.1, 1e-5);
  EXPECT_EQ(out.scalar_type(), at::kBFloat16);
  const at::Tensor expected = at::batch_norm(x.to(at::kFloat), {}, {}, {}, {}, true, 0.1, 1e-5, false);
  EXPECT_TRUE(at::allclose(out.to(at::kFloat), expected, 0.02, 0.05));
}

TEST(SyncBatchNorm, NamesBadInputs) {
  dpcore::Rendezvous rendezvous(1, 5s);
  try {
    dpcore::sync_batch_norm(
        rendezvous, 0, "k", at::randn({4}), std::nullopt, std::nullopt, std::nullopt, std::nullopt, false,
        0.1, 1e-5);
    FAIL() << "expected c10::ValueError";
  } catch (const c10::ValueError& e) {
    EXPECT_NE(
        std::string(e.what_without_backtrace())
            .find("expected an input of shape (N, C, ...), but got shape [4]"),
        std::string::npos);
  }
  try {
    dpcore::sync_batch_norm(
        rendezvous, 0, "k", at::randn({1, 3}), std::nullopt, std::nullopt, std::nullopt, std::nullopt, false,
        0.1, 1e-5);
    FAIL() << "expected c10::ValueError";
  } catch (const c10::ValueError& e) {
    EXPECT_NE(
        std::string(e.what_without_backtrace())
            .find("Expected more than 1 value per channel when training, got 1"),
        std::string::npos);
  }
}

} // namespace
