// The ring collectives (reduce_scatter, all_gather, all_reduce and their
// coalesced forms) on lists of CPU devices, against reference sums in ring
// order, and the traffic counters (traffic.h) of the ring and of a
// broadcast.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <vector>

#include "dpcore/comm.h"
#include "dpcore/traffic.h"
#include "helpers.h"

using dpcore_test::cpus;
using dpcore_test::same_values;
using dpcore_test::values;

namespace {

const std::vector<at::ScalarType> kDtypes = {at::kFloat, at::kDouble, at::kLong, at::kBFloat16};

// Random-ish inputs whose sums depend on the order (not for kLong).
at::Tensor noisy(int64_t numel, at::ScalarType dtype, int64_t seed) {
  if (dtype == at::kLong) {
    return values({numel}, dtype, seed);
  }
  at::manual_seed(seed);
  return at::randn({numel}, at::kDouble).mul_(100).to(dtype);
}

// Segment i of the sum of `inputs` (flattened) in ring order:
// ((inputs[i+1] + inputs[i+2]) + ...) + inputs[i], rounded at each step.
at::Tensor ring_sum(const std::vector<at::Tensor>& inputs, size_t i, int64_t offset, int64_t size) {
  const size_t n = inputs.size();
  at::Tensor acc = inputs[(i + 1) % n].reshape({-1}).narrow(0, offset, size).clone();
  for (size_t step = 2; step <= n; ++step) {
    acc = acc + inputs[(i + step) % n].reshape({-1}).narrow(0, offset, size);
  }
  return acc;
}

std::vector<int64_t> offsets_of(const std::vector<int64_t>& sizes) {
  std::vector<int64_t> offsets(sizes.size(), 0);
  std::partial_sum(sizes.begin(), sizes.end() - 1, offsets.begin() + 1);
  return offsets;
}

const dpcore::SlotTraffic& slot(dpcore::TrafficKind kind, size_t i) {
  static std::array<std::vector<dpcore::SlotTraffic>, dpcore::kTrafficKinds> table;
  table = dpcore::traffic_table();
  auto& list = table[static_cast<size_t>(kind)];
  if (list.size() <= i) {
    list.resize(i + 1);
  }
  return list[i];
}

} // namespace

// ---------------------------------------------------------------- values

TEST(ReduceScatter, RingOrderSumsEveryDtypeAndSize) {
  for (size_t n = 1; n <= 4; ++n) {
    for (const at::ScalarType dtype : kDtypes) {
      for (const int64_t numel : {int64_t{0}, int64_t{1}, int64_t{7}, int64_t{1000}}) {
        std::vector<at::Tensor> inputs;
        for (size_t j = 0; j < n; ++j) {
          inputs.push_back(noisy(numel, dtype, static_cast<int64_t>(j) + 1));
        }
        const auto sizes = dpcore::balanced_chunk_sizes(numel, static_cast<int64_t>(n));
        const auto offsets = offsets_of(sizes);
        const auto out = dpcore::reduce_scatter(inputs, cpus(n));
        ASSERT_EQ(out.size(), n);
        for (size_t i = 0; i < n; ++i) {
          EXPECT_TRUE(same_values(out[i], ring_sum(inputs, i, offsets[i], sizes[i])))
              << "n=" << n << " dtype=" << dtype << " numel=" << numel << " segment " << i;
        }
      }
    }
  }
}

TEST(ReduceScatter, UnevenSizesAndShapes) {
  // Inputs of one numel but different shapes and strides; sizes with empties.
  const std::vector<at::Tensor> inputs = {
      values({4, 6}, at::kFloat, 1), values({6, 4}, at::kFloat, 2).t(), values({24}, at::kFloat, 3)};
  const std::vector<int64_t> sizes = {0, 17, 7};
  const auto out = dpcore::reduce_scatter(inputs, cpus(3), sizes);
  const at::Tensor sum = inputs[0].reshape({-1}) + inputs[1].reshape({-1}) + inputs[2].reshape({-1});
  const auto offsets = offsets_of(sizes);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_TRUE(same_values(out[i], sum.narrow(0, offsets[i], sizes[i])));
  }
}

TEST(ReduceScatter, OneDeviceIsACopy) {
  const at::Tensor t = values({3, 4}, at::kDouble);
  const auto out = dpcore::reduce_scatter({t}, cpus(1));
  ASSERT_EQ(out.size(), 1u);
  EXPECT_TRUE(same_values(out[0], t.reshape({-1})));
  EXPECT_FALSE(out[0].is_alias_of(t));
}

TEST(AllGather, ConcatenatesUnevenShards) {
  for (size_t n = 1; n <= 4; ++n) {
    for (const at::ScalarType dtype : kDtypes) {
      std::vector<at::Tensor> shards;
      for (size_t i = 0; i < n; ++i) {
        shards.push_back(
            values({static_cast<int64_t>(i % 3 == 1 ? 0 : 5 + i)}, dtype, static_cast<int64_t>(i)));
      }
      const at::Tensor expected = at::cat(shards);
      const auto out = dpcore::all_gather(shards, cpus(n));
      ASSERT_EQ(out.size(), n);
      for (size_t j = 0; j < n; ++j) {
        EXPECT_TRUE(same_values(out[j], expected)) << "n=" << n << " dtype=" << dtype << " slot " << j;
        EXPECT_FALSE(out[j].is_alias_of(shards[j]));
      }
    }
  }
}

TEST(AllGather, IntoFlatBuffersInPlace) {
  // ZeRO's layout: each shard is the view of its place in its own buffer.
  const std::vector<int64_t> sizes = {4, 3, 0, 5};
  const auto offsets = offsets_of(sizes);
  std::vector<at::Tensor> outs;
  std::vector<at::Tensor> shards;
  std::vector<at::Tensor> expected_parts;
  for (size_t j = 0; j < sizes.size(); ++j) {
    outs.push_back(at::full({12}, -1.0, at::kDouble));
    shards.push_back(outs[j].narrow(0, offsets[j], sizes[j]));
    shards[j].copy_(values({sizes[j]}, at::kDouble, static_cast<int64_t>(j) * 10));
    expected_parts.push_back(shards[j].clone());
  }
  const void* first = outs[0].data_ptr();
  dpcore::all_gather_out(shards, outs);
  const at::Tensor expected = at::cat(expected_parts);
  for (const at::Tensor& out : outs) {
    EXPECT_TRUE(same_values(out, expected));
  }
  EXPECT_EQ(outs[0].data_ptr(), first);
}

TEST(AllReduce, InPlaceBitIdentical) {
  for (size_t n = 1; n <= 4; ++n) {
    for (const at::ScalarType dtype : kDtypes) {
      std::vector<at::Tensor> inputs;
      for (size_t j = 0; j < n; ++j) {
        inputs.push_back(noisy(37, dtype, static_cast<int64_t>(j) + 5).reshape({37}));
      }
      inputs[0] = inputs[0].repeat({2}).slice(0, 0, 74, 2); // not contiguous
      std::vector<at::Tensor> before;
      for (const at::Tensor& t : inputs) {
        before.push_back(t.clone());
      }
      const auto sizes = dpcore::balanced_chunk_sizes(37, static_cast<int64_t>(n));
      const auto offsets = offsets_of(sizes);
      std::vector<at::Tensor> parts;
      for (size_t i = 0; i < n; ++i) {
        parts.push_back(ring_sum(before, i, offsets[i], sizes[i]));
      }
      const at::Tensor expected = at::cat(parts);
      dpcore::all_reduce(inputs, cpus(n));
      for (size_t j = 0; j < n; ++j) {
        EXPECT_TRUE(same_values(inputs[j], expected)) << "n=" << n << " dtype=" << dtype << " slot " << j;
      }
    }
  }
}

// ---------------------------------------------------------------- coalesced

TEST(ReduceScatterCoalesced, SeveralDtypesEmptiesAndOwners) {
  for (size_t n = 1; n <= 4; ++n) {
    for (const int64_t bucket : {int64_t{1}, int64_t{64}, dpcore::kDefaultBucketBytes}) {
      const std::vector<std::vector<int64_t>> shapes = {{3, 4}, {0},    {5},    {2, 3, 2}, {7},
                                                        {},     {6, 6}, {0, 2}, {9}};
      dpcore::TensorList2D lists(n);
      std::vector<int64_t> owners;
      for (size_t k = 0; k < shapes.size(); ++k) {
        owners.push_back(static_cast<int64_t>((k * 3) % n));
        for (size_t j = 0; j < n; ++j) {
          at::Tensor t = values(shapes[k], kDtypes[k % kDtypes.size()], static_cast<int64_t>(j * 7 + k));
          if (j == 1 && t.dim() == 2) {
            t = t.t().contiguous().t(); // other strides on one device
          }
          lists[j].push_back(t);
        }
      }
      const auto result = dpcore::reduce_scatter_coalesced(lists, cpus(n), owners, bucket);
      ASSERT_EQ(result.size(), shapes.size());
      for (size_t k = 0; k < shapes.size(); ++k) {
        at::Tensor expected = lists[0][k].clone();
        for (size_t j = 1; j < n; ++j) {
          expected = expected + lists[j][k];
        }
        EXPECT_TRUE(same_values(result[k], expected)) << "n=" << n << " bucket=" << bucket << " tensor " << k;
      }
    }
  }
}

TEST(AllGatherCoalesced, EveryTensorOnEveryDeviceAndIntoOuts) {
  for (size_t n = 1; n <= 4; ++n) {
    const std::vector<std::vector<int64_t>> shapes = {{3, 4}, {0}, {5}, {2, 3, 2}, {7}, {}, {6, 6}};
    std::vector<at::Tensor> tensors;
    std::vector<int64_t> owners;
    for (size_t k = 0; k < shapes.size(); ++k) {
      tensors.push_back(values(shapes[k], kDtypes[k % kDtypes.size()], static_cast<int64_t>(k)));
      owners.push_back(static_cast<int64_t>((k + 1) % n));
    }
    const auto result = dpcore::all_gather_coalesced(tensors, owners, cpus(n), std::nullopt, 40);
    ASSERT_EQ(result.size(), n);
    for (size_t d = 0; d < n; ++d) {
      for (size_t k = 0; k < shapes.size(); ++k) {
        EXPECT_TRUE(same_values(result[d][k], tensors[k]));
        EXPECT_EQ(result[d][k].is_same(tensors[k]), static_cast<int64_t>(d) == owners[k]);
      }
    }
    // Into given outs, the owner's own entry being the tensor itself.
    dpcore::TensorList2D outs(n);
    for (size_t d = 0; d < n; ++d) {
      for (size_t k = 0; k < shapes.size(); ++k) {
        outs[d].push_back(static_cast<int64_t>(d) == owners[k] ? tensors[k] : at::zeros_like(tensors[k]));
      }
    }
    const auto written = dpcore::all_gather_coalesced(tensors, owners, cpus(n), outs, 40);
    for (size_t d = 0; d < n; ++d) {
      for (size_t k = 0; k < shapes.size(); ++k) {
        EXPECT_TRUE(written[d][k].is_same(outs[d][k]));
        EXPECT_TRUE(same_values(outs[d][k], tensors[k]));
      }
    }
  }
}

// ---------------------------------------------------------------- traffic

TEST(Traffic, RingSpreadsEvenSegments) {
  for (size_t n = 2; n <= 4; ++n) {
    const int64_t numel = 1200; // divisible by 2, 3, 4
    std::vector<at::Tensor> inputs;
    for (size_t j = 0; j < n; ++j) {
      inputs.push_back(values({numel}, at::kFloat, static_cast<int64_t>(j)));
    }
    dpcore::reset_traffic();
    dpcore::all_reduce(inputs, cpus(n));
    const int64_t total = numel * 4;
    for (const auto kind : {dpcore::TrafficKind::ReduceScatter, dpcore::TrafficKind::AllGather}) {
      double mean = 0;
      for (size_t i = 0; i < n; ++i) {
        mean += static_cast<double>(slot(kind, i).sent) / static_cast<double>(n);
      }
      EXPECT_DOUBLE_EQ(
          mean, static_cast<double>(total) * static_cast<double>(n - 1) / static_cast<double>(n));
      for (size_t i = 0; i < n; ++i) {
        EXPECT_LE(static_cast<double>(slot(kind, i).sent), 1.1 * mean);
        EXPECT_LE(static_cast<double>(slot(kind, i).received), 1.1 * mean);
        EXPECT_GE(static_cast<double>(slot(kind, i).sent), mean / 1.1);
      }
    }
  }
}

TEST(Traffic, RingUnevenSegmentsExact) {
  const std::vector<int64_t> sizes = {10, 0, 3, 21};
  const int64_t numel = 34;
  const size_t n = sizes.size();
  std::vector<at::Tensor> inputs;
  for (size_t j = 0; j < n; ++j) {
    inputs.push_back(values({numel}, at::kDouble, static_cast<int64_t>(j)));
  }
  dpcore::reset_traffic();
  const auto shards = dpcore::reduce_scatter(inputs, cpus(n), sizes);
  (void)dpcore::all_gather(shards, cpus(n));
  const int64_t total = numel * 8;
  for (size_t i = 0; i < n; ++i) {
    const int64_t own = sizes[i] * 8;
    const int64_t before = sizes[(i + n - 1) % n] * 8;
    const int64_t after = sizes[(i + 1) % n] * 8;
    EXPECT_EQ(slot(dpcore::TrafficKind::ReduceScatter, i).sent, total - own) << "slot " << i;
    EXPECT_EQ(slot(dpcore::TrafficKind::ReduceScatter, i).received, total - before) << "slot " << i;
    EXPECT_EQ(slot(dpcore::TrafficKind::AllGather, i).sent, total - after) << "slot " << i;
    EXPECT_EQ(slot(dpcore::TrafficKind::AllGather, i).received, total - own) << "slot " << i;
  }
}

TEST(Traffic, CoalescedRingSendsAllButTheOwnSegment) {
  const size_t n = 3;
  dpcore::TensorList2D lists(n);
  const std::vector<int64_t> owners = {2, 0, 0, 1, 2};
  const std::vector<int64_t> numels = {5, 7, 0, 11, 2};
  for (size_t j = 0; j < n; ++j) {
    for (size_t k = 0; k < numels.size(); ++k) {
      lists[j].push_back(values({numels[k]}, k % 2 ? at::kFloat : at::kDouble, static_cast<int64_t>(j + k)));
    }
  }
  dpcore::reset_traffic();
  (void)dpcore::reduce_scatter_coalesced(lists, cpus(n), owners, 16);
  int64_t total = 0;
  std::vector<int64_t> own(n, 0);
  for (size_t k = 0; k < numels.size(); ++k) {
    const int64_t bytes = numels[k] * (k % 2 ? 4 : 8);
    total += bytes;
    own[static_cast<size_t>(owners[k])] += bytes;
  }
  for (size_t i = 0; i < n; ++i) {
    EXPECT_EQ(slot(dpcore::TrafficKind::ReduceScatter, i).sent, total - own[i]) << "slot " << i;
  }
}

TEST(Traffic, BroadcastSendsFromTheSourceSlot) {
  const at::Tensor t = values({10, 10}, at::kFloat);
  dpcore::reset_traffic();
  (void)dpcore::broadcast(t, cpus(4));
  EXPECT_EQ(slot(dpcore::TrafficKind::Broadcast, 0).sent, 3 * 400);
  EXPECT_EQ(slot(dpcore::TrafficKind::Broadcast, 0).received, 0);
  for (size_t i = 1; i < 4; ++i) {
    EXPECT_EQ(slot(dpcore::TrafficKind::Broadcast, i).received, 400);
    EXPECT_EQ(slot(dpcore::TrafficKind::Broadcast, i).sent, 0);
  }
  // The coalesced form: devices[0] is slot 0, whatever the bucket size.
  dpcore::reset_traffic();
  (void)dpcore::broadcast_coalesced({t, values({3}, at::kLong)}, cpus(3), 1);
  EXPECT_EQ(slot(dpcore::TrafficKind::Broadcast, 0).sent, 2 * (400 + 24));
  EXPECT_EQ(slot(dpcore::TrafficKind::Broadcast, 2).received, 400 + 24);
  // A reduce onto the first input's device: inputs 1.. send to slot 0.
  dpcore::reset_traffic();
  (void)dpcore::reduce_add({t, t, t}, c10::Device(c10::kCPU));
  EXPECT_EQ(slot(dpcore::TrafficKind::ReduceAdd, 0).received, 2 * 400);
  EXPECT_EQ(slot(dpcore::TrafficKind::ReduceAdd, 0).sent, 0);
  EXPECT_EQ(slot(dpcore::TrafficKind::ReduceAdd, 2).sent, 400);
  // Scatter's chunks on the source's device are views: nothing moves.
  dpcore::reset_traffic();
  (void)dpcore::scatter(t, cpus(4));
  EXPECT_EQ(dpcore::traffic_table()[static_cast<size_t>(dpcore::TrafficKind::Scatter)].size(), 0u);
  dpcore::reset_traffic();
  for (const auto& kind : dpcore::traffic_table()) {
    EXPECT_TRUE(kind.empty());
  }
}

// ---------------------------------------------------------------- misuse

TEST(RingErrors, NameTheArgument) {
  const at::Tensor a = values({6}, at::kFloat);
  EXPECT_C10_ERROR(
      "reduce_scatter: expected one tensor in 'inputs' per device (len(devices) = 3), but got 2",
      dpcore::reduce_scatter({a, a}, cpus(3)));
  EXPECT_C10_ERROR(
      "reduce_scatter: expected inputs[1] to have 6 elements, as inputs[0] has, but it has 5",
      dpcore::reduce_scatter({a, values({5}, at::kFloat)}, cpus(2)));
  EXPECT_C10_ERROR(
      "reduce_scatter: expected inputs[1] of dtype Float, as inputs[0] is, but it is Double",
      dpcore::reduce_scatter({a, values({6}, at::kDouble)}, cpus(2)));
  EXPECT_C10_ERROR(
      "reduce_scatter: expected 'sizes' to sum to 6 (the elements of each input), but they sum to 5",
      dpcore::reduce_scatter({a, a}, cpus(2), std::vector<int64_t>{2, 3}));
  EXPECT_C10_ERROR(
      "reduce_scatter: expected non-negative sizes, but sizes[0] is -1",
      dpcore::reduce_scatter({a, a}, cpus(2), std::vector<int64_t>{-1, 7}));
  EXPECT_C10_ERROR(
      "reduce_scatter: expected dense (strided) tensors, but inputs[1] has layout Sparse",
      dpcore::reduce_scatter({a, a.to_sparse()}, cpus(2)));
  EXPECT_C10_ERROR(
      "all_gather: expected shards[0] to be 1-D, but it has shape [2, 3]",
      dpcore::all_gather({a.view({2, 3}), a.view({2, 3})}, cpus(2)));
  EXPECT_C10_ERROR(
      "all_reduce: inputs[1] and inputs[0] overlap in memory (fully)", dpcore::all_reduce({a, a}, cpus(2)));
  EXPECT_C10_ERROR(
      "reduce_scatter_coalesced: expected owners[1] in [0, 2) (an index into devices), but it is 2",
      dpcore::reduce_scatter_coalesced({{a, a}, {a, a}}, cpus(2), std::vector<int64_t>{0, 2}));
  EXPECT_C10_ERROR(
      "reduce_scatter_coalesced: expected tensors[1][0] of shape [6], as tensors[0][0] is, but it has shape "
      "[2, 3]",
      dpcore::reduce_scatter_coalesced({{a}, {a.view({2, 3})}}, cpus(2), std::vector<int64_t>{0}));
  EXPECT_C10_ERROR(
      "all_gather_coalesced: expected one entry of 'owners' per tensor (2 in tensors), but got 1",
      dpcore::all_gather_coalesced({a, a}, std::vector<int64_t>{0}, cpus(2)));
  EXPECT_C10_ERROR(
      "all_gather_coalesced: expected outs[1][0] of dtype Float, as tensors[0] is, but it is Long",
      dpcore::all_gather_coalesced(
          {a}, std::vector<int64_t>{0}, cpus(2), dpcore::TensorList2D{{a}, {values({6}, at::kLong)}}));
}
