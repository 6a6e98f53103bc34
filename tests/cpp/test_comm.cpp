// Values, aliasing, version counters and memory formats of dpcore's
// collectives (comm.h) on lists of CPU devices.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <optional>
#include <set>
#include <vector>

#include "dpcore/comm.h"
#include "helpers.h"

using dpcore_test::close_values;
using dpcore_test::cpus;
using dpcore_test::same_values;
using dpcore_test::values;

namespace {

// A list of tensors exercising the coalescing paths: several dtypes
// interleaved, contiguous, transposed, sliced (not dense), channels_last,
// 0-element, 0-dim, a sparse COO tensor and one large tensor.
std::vector<at::Tensor> mixed_list(int64_t seed = 0, bool with_sparse = true) {
  std::vector<at::Tensor> list;
  list.push_back(values({5, 3}, at::kFloat, seed + 1));
  list.push_back(values({4}, at::kDouble, seed + 2));
  list.push_back(values({3, 6}, at::kFloat, seed + 3).t()); // transposed
  list.push_back(values({7}, at::kLong, seed + 4));
  list.push_back(values({6, 8}, at::kFloat, seed + 5).slice(1, 1, 7, 2)); // sliced
  list.push_back(values({2, 3, 4, 5}, at::kFloat, seed + 6).contiguous(at::MemoryFormat::ChannelsLast));
  list.push_back(values({0, 3}, at::kFloat, seed + 7)); // empty
  list.push_back(values({9}, at::kHalf, seed + 8));
  list.push_back(values({}, at::kDouble, seed + 9)); // 0-dim
  if (with_sparse) {
    list.push_back(values({4, 5}, at::kFloat, seed + 10).relu_().to_sparse());
  }
  list.push_back(values({3, 4}, at::kLong, seed + 11).t());
  if (with_sparse) {
    list.push_back(values({6}, at::kLong, seed + 15).relu_().to_sparse());
  }
  list.push_back(values({300, 257}, at::kFloat, seed + 12)); // > 256 KiB
  list.push_back(values({0}, at::kHalf, seed + 13));
  list.push_back(values({11}, at::kHalf, seed + 14));
  return list;
}

const std::vector<int64_t> kBucketSizes = {1, 64, 1000, dpcore::kDefaultBucketBytes};

} // namespace

// ---------------------------------------------------------------- broadcast

TEST(Broadcast, ValuesAndAliasing) {
  for (size_t k = 1; k <= 4; ++k) {
    const at::Tensor t = values({4, 5}, at::kFloat);
    const auto result = dpcore::broadcast(t, cpus(k));
    ASSERT_EQ(result.size(), k);
    EXPECT_TRUE(result[0].is_same(t));
    std::set<const void*> pointers{t.data_ptr()};
    for (size_t i = 1; i < k; ++i) {
      EXPECT_TRUE(same_values(result[i], t));
      EXPECT_FALSE(result[i].is_same(t));
      EXPECT_TRUE(pointers.insert(result[i].data_ptr()).second) << "replica " << i << " aliases";
      EXPECT_TRUE(result[i].device().is_cpu());
      EXPECT_FALSE(result[i].requires_grad());
    }
    // Every replica but the first owns its storage.
    if (k > 1) {
      result[1].add_(1);
      EXPECT_TRUE(same_values(t, values({4, 5}, at::kFloat)));
    }
  }
}

TEST(Broadcast, CpuIndexIsNormalised) {
  const at::Tensor t = values({3}, at::kLong);
  const std::vector<c10::Device> devices = {c10::Device(c10::kCPU, 0), c10::Device(c10::kCPU)};
  const auto result = dpcore::broadcast(t, devices);
  ASSERT_EQ(result.size(), 2u);
  EXPECT_TRUE(result[0].is_same(t));
  EXPECT_NE(result[1].data_ptr(), t.data_ptr());
  EXPECT_TRUE(same_values(result[1], t));
}

TEST(Broadcast, MemoryFormatsDtypesAndEmpty) {
  const std::vector<at::Tensor> inputs = {
      values({2, 3, 4, 5}, at::kFloat).contiguous(at::MemoryFormat::ChannelsLast),
      values({3, 6}, at::kDouble).t(),
      values({6, 8}, at::kLong).slice(1, 1, 7, 2),
      values({0, 4}, at::kHalf),
      values({}, at::kFloat),
      values({3, 3}, at::kFloat).to_sparse(),
  };
  for (const at::Tensor& t : inputs) {
    const auto result = dpcore::broadcast(t, cpus(3));
    EXPECT_TRUE(result[0].is_same(t));
    for (size_t i = 1; i < 3; ++i) {
      EXPECT_TRUE(same_values(result[i], t));
      if (t.layout() == at::kStrided && t.is_non_overlapping_and_dense()) {
        EXPECT_EQ(result[i].strides(), t.strides()) << "dense strides are kept";
      }
    }
  }
  const auto cl = dpcore::broadcast(inputs[0], cpus(2));
  EXPECT_TRUE(cl[1].is_contiguous(at::MemoryFormat::ChannelsLast));
}

TEST(Broadcast, Out) {
  const at::Tensor t = values({3, 4}, at::kFloat);
  std::vector<at::Tensor> outs = {
      at::zeros({3, 4}), at::zeros({4, 3}).t(), at::zeros({3, 8}).slice(1, 0, 8, 2), t};
  dpcore::broadcast_out(t, outs);
  for (const at::Tensor& out : outs) {
    EXPECT_TRUE(same_values(out, t));
  }
  EXPECT_TRUE(same_values(t, values({3, 4}, at::kFloat)));
}

// ------------------------------------------------------- broadcast_coalesced

TEST(BroadcastCoalesced, MatchesPerTensorBroadcastForEveryBucketSize) {
  const auto inputs = mixed_list();
  for (const int64_t bucket : kBucketSizes) {
    for (size_t k = 1; k <= 4; ++k) {
      SCOPED_TRACE(testing::Message() << "bucket_bytes=" << bucket << " k=" << k);
      const auto result = dpcore::broadcast_coalesced(inputs, cpus(k), bucket);
      ASSERT_EQ(result.size(), k);
      for (size_t d = 0; d < k; ++d) {
        ASSERT_EQ(result[d].size(), inputs.size());
        for (size_t i = 0; i < inputs.size(); ++i) {
          const at::Tensor& out = result[d][i];
          const at::Tensor& in = inputs[i];
          if (d == 0) {
            EXPECT_TRUE(out.is_same(in)) << "result[0][" << i << "] is the input";
            continue;
          }
          EXPECT_TRUE(same_values(out, in)) << "tensor " << i << " on device " << d;
          EXPECT_TRUE(same_values(out, dpcore::broadcast(in, cpus(2))[1]));
          EXPECT_FALSE(out.requires_grad());
          if (in.numel() > 0 && !in.is_sparse()) {
            EXPECT_FALSE(out.is_alias_of(in)) << "tensor " << i << " on device " << d;
          }
          if (!in.is_sparse() && in.is_non_overlapping_and_dense()) {
            EXPECT_EQ(out.strides(), in.strides()) << "tensor " << i;
          }
        }
      }
      // No two replicas share storage.
      for (size_t d = 1; d < k; ++d) {
        for (size_t e = d + 1; e < k; ++e) {
          for (size_t i = 0; i < inputs.size(); ++i) {
            if (inputs[i].numel() > 0 && !inputs[i].is_sparse()) {
              EXPECT_FALSE(result[d][i].is_alias_of(result[e][i]));
            }
          }
        }
      }
    }
  }
}

TEST(BroadcastCoalesced, ChannelsLastKept) {
  const std::vector<at::Tensor> inputs = {
      values({2, 3, 4, 5}, at::kFloat).contiguous(at::MemoryFormat::ChannelsLast),
      values({2, 3, 4, 5}, at::kFloat, 7).contiguous(at::MemoryFormat::ChannelsLast),
      values({3}, at::kFloat)};
  for (const int64_t bucket : kBucketSizes) {
    const auto result = dpcore::broadcast_coalesced(inputs, cpus(3), bucket);
    for (size_t d = 1; d < 3; ++d) {
      EXPECT_TRUE(result[d][0].is_contiguous(at::MemoryFormat::ChannelsLast));
      EXPECT_TRUE(result[d][1].is_contiguous(at::MemoryFormat::ChannelsLast));
      EXPECT_TRUE(same_values(result[d][0], inputs[0]));
      EXPECT_TRUE(same_values(result[d][1], inputs[1]));
      EXPECT_TRUE(same_values(result[d][2], inputs[2]));
    }
  }
}

TEST(BroadcastCoalesced, OutputsShareABucketButHaveOwnVersionCounters) {
  const std::vector<at::Tensor> inputs = {
      values({4}, at::kFloat, 1), values({5}, at::kFloat, 2), values({6}, at::kFloat, 3)};
  const auto result = dpcore::broadcast_coalesced(inputs, cpus(3));
  for (size_t d = 1; d < 3; ++d) {
    // One bucket: the three outputs are views of one buffer...
    EXPECT_TRUE(result[d][0].is_alias_of(result[d][1]));
    EXPECT_TRUE(result[d][1].is_alias_of(result[d][2]));
  }
  // ...yet an in-place change of one bumps only its own version counter.
  const auto v0 = result[1][0]._version();
  const auto v1 = result[1][1]._version();
  const auto v2 = result[1][2]._version();
  const auto w1 = result[2][1]._version();
  result[1][1].add_(1);
  EXPECT_EQ(result[1][1]._version(), v1 + 1);
  EXPECT_EQ(result[1][0]._version(), v0);
  EXPECT_EQ(result[1][2]._version(), v2);
  EXPECT_EQ(result[2][1]._version(), w1);
  // ...and changes only its own elements.
  EXPECT_TRUE(same_values(result[1][0], inputs[0]));
  EXPECT_TRUE(same_values(result[1][2], inputs[2]));
  EXPECT_TRUE(same_values(result[2][1], inputs[1]));
  EXPECT_TRUE(same_values(result[1][1], inputs[1] + 1));
  EXPECT_TRUE(same_values(inputs[1], values({5}, at::kFloat, 2)));
}

TEST(BroadcastCoalesced, EmptyListAndOneDevice) {
  const auto none = dpcore::broadcast_coalesced({}, cpus(3));
  ASSERT_EQ(none.size(), 3u);
  for (const auto& list : none) {
    EXPECT_TRUE(list.empty());
  }
  const auto inputs = mixed_list();
  const auto one = dpcore::broadcast_coalesced(inputs, cpus(1), 64);
  ASSERT_EQ(one.size(), 1u);
  for (size_t i = 0; i < inputs.size(); ++i) {
    EXPECT_TRUE(one[0][i].is_same(inputs[i]));
  }
}

TEST(BroadcastFlatInto, PacksIntoEveryBuffer) {
  const std::vector<at::Tensor> members = {
      values({2, 3}, at::kDouble, 1), values({4, 3}, at::kDouble, 2).t(),
      values({2, 3, 4, 5}, at::kDouble, 3).contiguous(at::MemoryFormat::ChannelsLast),
      values({6, 4}, at::kDouble, 4).slice(1, 0, 4, 2)};
  const auto layout = dpcore::FlatLayout::of(members);
  std::vector<at::Tensor> flats = {
      at::zeros({layout.numel}, at::kDouble), at::zeros({layout.numel}, at::kDouble)};
  dpcore::broadcast_flat_into(members, layout, flats);
  for (const at::Tensor& flat : flats) {
    for (size_t i = 0; i < members.size(); ++i) {
      EXPECT_TRUE(same_values(layout.view(flat, i), members[i])) << i;
    }
  }
  // A single dense member (the one-block fast path).
  const std::vector<at::Tensor> one = {members[2]};
  const auto one_layout = dpcore::FlatLayout::of(one);
  std::vector<at::Tensor> one_flat = {at::zeros({one_layout.numel}, at::kDouble)};
  dpcore::broadcast_flat_into(one, one_layout, one_flat);
  EXPECT_TRUE(same_values(one_layout.view(one_flat[0], 0), members[2]));
}

// ---------------------------------------------------------------- reduce_add

TEST(ReduceAdd, DenseValuesAllDtypes) {
  for (const auto dtype : {at::kFloat, at::kDouble, at::kLong, at::kInt, at::kHalf}) {
    for (size_t k = 1; k <= 4; ++k) {
      std::vector<at::Tensor> inputs;
      for (size_t i = 0; i < k; ++i) {
        inputs.push_back(values({6, 7}, dtype, static_cast<int64_t>(i) * 13));
      }
      at::Tensor expected = inputs[0].clone();
      for (size_t i = 1; i < k; ++i) {
        expected = expected + inputs[i];
      }
      for (const auto& dest : {std::optional<c10::Device>(), std::optional<c10::Device>(c10::kCPU)}) {
        const at::Tensor out = dpcore::reduce_add(inputs, dest);
        EXPECT_TRUE(out.device().is_cpu());
        if (dtype == at::kHalf) {
          EXPECT_TRUE(close_values(out, expected, 1e-3, 1e-2));
        } else {
          EXPECT_TRUE(same_values(out, expected)) << dtype << " k=" << k;
        }
        for (const at::Tensor& in : inputs) {
          EXPECT_FALSE(out.is_alias_of(in)) << "reduce_add returns a new tensor";
        }
      }
    }
  }
}

TEST(ReduceAdd, HalfAccumulatesInFloat) {
  // 2048 + 1 + 1 in half: a half accumulator gives 2048 (ties to even) twice;
  // a float one gives 2050, which half represents.
  const at::Tensor big = at::full({3}, 2048.0, at::kHalf);
  const at::Tensor one = at::ones({3}, at::kHalf);
  const at::Tensor out = dpcore::reduce_add({big, one, one}, std::nullopt);
  EXPECT_TRUE(same_values(out, at::full({3}, 2050.0, at::kHalf)));
}

TEST(ReduceAdd, NonContiguousAndChannelsLast) {
  const at::Tensor a = values({3, 6}, at::kFloat, 1).t();
  const at::Tensor b = values({6, 3}, at::kFloat, 2);
  const at::Tensor c = values({6, 6}, at::kFloat, 3).slice(1, 0, 6, 2);
  EXPECT_TRUE(same_values(dpcore::reduce_add({a, b, c}, std::nullopt), a + b + c));
  EXPECT_TRUE(same_values(dpcore::reduce_add({c, a}, std::nullopt), c + a));
  EXPECT_TRUE(same_values(dpcore::reduce_add({a, a}, std::nullopt), a + a));

  const at::Tensor x = values({2, 3, 4, 5}, at::kFloat, 1).contiguous(at::MemoryFormat::ChannelsLast);
  const at::Tensor y = values({2, 3, 4, 5}, at::kFloat, 2).contiguous(at::MemoryFormat::ChannelsLast);
  const at::Tensor out = dpcore::reduce_add({x, y}, std::nullopt);
  EXPECT_TRUE(same_values(out, x + y));
  EXPECT_TRUE(out.is_contiguous(at::MemoryFormat::ChannelsLast));
}

TEST(ReduceAdd, Empty) {
  const at::Tensor a = at::empty({0, 3});
  const at::Tensor out = dpcore::reduce_add({a, a, a}, std::nullopt);
  EXPECT_EQ(out.sizes(), a.sizes());
  const at::Tensor s = dpcore::reduce_add({values({}, at::kLong, 3), values({}, at::kLong, 4)}, std::nullopt);
  EXPECT_TRUE(same_values(s, values({}, at::kLong, 3) + values({}, at::kLong, 4)));
}

TEST(ReduceAdd, Sparse) {
  for (const auto dtype : {at::kFloat, at::kDouble, at::kLong}) {
    for (size_t k = 1; k <= 4; ++k) {
      std::vector<at::Tensor> dense;
      std::vector<at::Tensor> sparse;
      for (size_t i = 0; i < k; ++i) {
        dense.push_back(values({5, 4}, dtype, static_cast<int64_t>(i) * 7).relu_());
        sparse.push_back(dense.back().to_sparse());
      }
      at::Tensor expected = dense[0].clone();
      for (size_t i = 1; i < k; ++i) {
        expected += dense[i];
      }
      const at::Tensor out = dpcore::reduce_add(sparse, c10::Device(c10::kCPU));
      EXPECT_TRUE(out.is_sparse());
      EXPECT_TRUE(same_values(out.to_dense(), expected)) << dtype << " k=" << k;
      // A new tensor: the first input is untouched.
      EXPECT_TRUE(same_values(sparse[0].to_dense(), dense[0]));
      EXPECT_FALSE(out.is_same(sparse[0]));
    }
  }
}

// ------------------------------------------------------ reduce_add_coalesced

TEST(ReduceAddCoalesced, MatchesPerTensorReduceAddForEveryBucketSize) {
  for (const int64_t bucket : kBucketSizes) {
    for (size_t k = 1; k <= 4; ++k) {
      SCOPED_TRACE(testing::Message() << "bucket_bytes=" << bucket << " k=" << k);
      dpcore::TensorList2D inputs;
      for (size_t d = 0; d < k; ++d) {
        inputs.push_back(mixed_list(static_cast<int64_t>(d) * 5));
      }
      const auto result = dpcore::reduce_add_coalesced(inputs, std::nullopt, bucket);
      ASSERT_EQ(result.size(), inputs[0].size());
      for (size_t i = 0; i < result.size(); ++i) {
        std::vector<at::Tensor> column;
        for (size_t d = 0; d < k; ++d) {
          column.push_back(inputs[d][i]);
        }
        const at::Tensor expected = dpcore::reduce_add(column, std::nullopt);
        if (expected.scalar_type() == at::kHalf) {
          EXPECT_TRUE(close_values(result[i], expected, 1e-3, 1e-2)) << "tensor " << i;
        } else {
          EXPECT_TRUE(same_values(result[i], expected)) << "tensor " << i;
        }
        EXPECT_EQ(result[i].is_sparse(), inputs[0][i].is_sparse());
        EXPECT_FALSE(result[i].requires_grad());
        for (size_t d = 0; d < k; ++d) {
          if (inputs[d][i].numel() > 0 && !inputs[d][i].is_sparse()) {
            EXPECT_FALSE(result[i].is_alias_of(inputs[d][i]));
          }
        }
        if (!inputs[0][i].is_sparse() && inputs[0][i].is_non_overlapping_and_dense()) {
          EXPECT_EQ(result[i].strides(), inputs[0][i].strides()) << "tensor " << i;
        }
      }
      EXPECT_TRUE(result[5].is_contiguous(at::MemoryFormat::ChannelsLast));
    }
  }
}

TEST(ReduceAddCoalesced, MixedStridesAcrossLists) {
  // Device 0's list contiguous, device 1's transposed / channels_last copies.
  const at::Tensor a0 = values({4, 6}, at::kFloat, 1);
  const at::Tensor a1 = values({6, 4}, at::kFloat, 2).t();
  const at::Tensor b0 = values({2, 3, 4, 5}, at::kDouble, 3);
  const at::Tensor b1 = values({2, 3, 4, 5}, at::kDouble, 4).contiguous(at::MemoryFormat::ChannelsLast);
  for (const int64_t bucket : kBucketSizes) {
    const auto result = dpcore::reduce_add_coalesced({{a0, b0}, {a1, b1}}, std::nullopt, bucket);
    EXPECT_TRUE(same_values(result[0], a0 + a1));
    EXPECT_TRUE(same_values(result[1], b0 + b1));
  }
}

TEST(ReduceAddCoalesced, OwnVersionCounters) {
  dpcore::TensorList2D inputs;
  for (int64_t d = 0; d < 3; ++d) {
    inputs.push_back(
        {values({4}, at::kFloat, d), values({5}, at::kFloat, d + 1), values({6}, at::kFloat, d + 2)});
  }
  const auto result = dpcore::reduce_add_coalesced(inputs, c10::Device(c10::kCPU));
  ASSERT_EQ(result.size(), 3u);
  EXPECT_TRUE(result[0].is_alias_of(result[1])) << "one bucket, one buffer";
  EXPECT_TRUE(result[1].is_alias_of(result[2]));
  const auto v0 = result[0]._version();
  const auto v2 = result[2]._version();
  const at::Tensor before0 = result[0].clone();
  const at::Tensor before2 = result[2].clone();
  result[1].mul_(2);
  EXPECT_EQ(result[0]._version(), v0);
  EXPECT_EQ(result[2]._version(), v2);
  EXPECT_TRUE(same_values(result[0], before0));
  EXPECT_TRUE(same_values(result[2], before2));
}

TEST(ReduceAddCoalesced, EmptyLists) {
  const auto result = dpcore::reduce_add_coalesced({{}, {}, {}}, std::nullopt);
  EXPECT_TRUE(result.empty());
  const at::Tensor e = at::empty({0}, at::kHalf);
  const auto zeros = dpcore::reduce_add_coalesced({{e, e}, {e, e}}, std::nullopt, 1);
  ASSERT_EQ(zeros.size(), 2u);
  EXPECT_EQ(zeros[0].numel(), 0);
  EXPECT_EQ(zeros[1].scalar_type(), at::kHalf);
}

// ------------------------------------------------------------------- scatter

TEST(Scatter, BalancedChunkSizes) {
  EXPECT_EQ(dpcore::balanced_chunk_sizes(10, 4), (std::vector<int64_t>{3, 3, 2, 2}));
  EXPECT_EQ(dpcore::balanced_chunk_sizes(3, 4), (std::vector<int64_t>{1, 1, 1, 0}));
  EXPECT_EQ(dpcore::balanced_chunk_sizes(8, 4), (std::vector<int64_t>{2, 2, 2, 2}));
  EXPECT_EQ(dpcore::balanced_chunk_sizes(0, 3), (std::vector<int64_t>{0, 0, 0}));
  EXPECT_EQ(dpcore::balanced_chunk_sizes(7, 1), (std::vector<int64_t>{7}));
  EXPECT_EQ(dpcore::balanced_chunk_sizes(11, 3), (std::vector<int64_t>{4, 4, 3}));
}

TEST(Scatter, DefaultBalancedSplit) {
  const at::Tensor t = values({10, 3}, at::kFloat);
  const auto chunks = dpcore::scatter(t, cpus(4));
  ASSERT_EQ(chunks.size(), 4u);
  const std::vector<int64_t> sizes = {3, 3, 2, 2};
  int64_t start = 0;
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(chunks[i].size(0), sizes[i]);
    EXPECT_TRUE(same_values(chunks[i], t.narrow(0, start, sizes[i])));
    start += sizes[i];
  }
  // The chunk for the source's device is a view of it.
  EXPECT_TRUE(chunks[0].is_alias_of(t));
  EXPECT_EQ(chunks[0].data_ptr(), t.data_ptr());

  const at::Tensor small = values({3, 2}, at::kLong);
  const auto few = dpcore::scatter(small, cpus(4));
  ASSERT_EQ(few.size(), 4u);
  EXPECT_EQ(few[0].size(0), 1);
  EXPECT_EQ(few[1].size(0), 1);
  EXPECT_EQ(few[2].size(0), 1);
  EXPECT_EQ(few[3].size(0), 0);
  EXPECT_EQ(few[3].size(1), 2);
  EXPECT_TRUE(same_values(few[2], small.narrow(0, 2, 1)));
}

TEST(Scatter, SeparateChunksAreTensorsOfTheirOwn) {
  for (size_t k = 1; k <= 4; ++k) {
    const at::Tensor t = values({7, 3}, at::kDouble);
    const auto chunks = dpcore::scatter(t, cpus(k), std::nullopt, 0, std::nullopt, /*separate=*/true);
    ASSERT_EQ(chunks.size(), k);
    EXPECT_TRUE(same_values(at::cat(chunks, 0), t));
    int64_t start = 0;
    for (size_t i = 0; i < k; ++i) {
      EXPECT_TRUE(chunks[i].is_alias_of(t)) << "chunk " << i << " shares the tensor's storage";
      EXPECT_FALSE(chunks[i].is_view()) << "chunk " << i;
      EXPECT_EQ(chunks[i].storage_offset(), start * 3);
      start += chunks[i].size(0);
    }
    // Only the first shares the tensor's version counter.
    const auto versions = [&] {
      std::vector<int64_t> v{static_cast<int64_t>(t._version())};
      for (const at::Tensor& c : chunks) {
        v.push_back(static_cast<int64_t>(c._version()));
      }
      return v;
    };
    const auto before = versions();
    chunks.back().add_(1);
    auto after = versions();
    EXPECT_EQ(after.back(), before.back() + 1);
    EXPECT_EQ(after[0], before[0] + (k == 1 ? 1 : 0));
    EXPECT_DOUBLE_EQ(t[6][0].item<double>(), values({7, 3}, at::kDouble)[6][0].item<double>() + 1);
    chunks.front().add_(1);
    EXPECT_EQ(versions()[0], after[0] + 1);
    for (size_t i = 1; i < k; ++i) {
      EXPECT_EQ(versions()[i + 1], after[i + 1]) << "chunk " << i;
    }
  }
  // Without `separate`, views (comm.scatter's rule).
  const at::Tensor t = values({4, 2}, at::kFloat);
  for (const at::Tensor& chunk : dpcore::scatter(t, cpus(2))) {
    EXPECT_TRUE(chunk.is_view());
  }
}

TEST(Scatter, ChunkSizesAndDims) {
  const at::Tensor t = values({4, 9, 5}, at::kDouble);
  const std::vector<int64_t> sizes = {4, 0, 5};
  for (const int64_t dim : {1, -2}) {
    const auto chunks = dpcore::scatter(t, cpus(3), sizes, dim);
    ASSERT_EQ(chunks.size(), 3u);
    EXPECT_TRUE(same_values(chunks[0], t.narrow(1, 0, 4)));
    EXPECT_TRUE(same_values(chunks[1], t.narrow(1, 4, 0)));
    EXPECT_TRUE(same_values(chunks[2], t.narrow(1, 4, 5)));
    EXPECT_TRUE(chunks[0].is_alias_of(t));
  }
  for (const int64_t dim : {2, -1}) {
    const auto chunks = dpcore::scatter(t, cpus(2), std::nullopt, dim);
    EXPECT_TRUE(same_values(chunks[0], t.narrow(2, 0, 3)));
    EXPECT_TRUE(same_values(chunks[1], t.narrow(2, 3, 2)));
  }
  for (size_t k = 1; k <= 4; ++k) {
    const auto chunks = dpcore::scatter(t, cpus(k), std::nullopt, 0);
    ASSERT_EQ(chunks.size(), k);
    EXPECT_TRUE(same_values(at::cat(chunks, 0), t));
  }
}

TEST(Scatter, NonContiguousAndChannelsLast) {
  const at::Tensor t = values({5, 8}, at::kFloat).t(); // 8 x 5, transposed
  const auto chunks = dpcore::scatter(t, cpus(3));
  EXPECT_TRUE(same_values(at::cat(chunks, 0), t));
  const at::Tensor cl = values({4, 3, 2, 5}, at::kFloat).contiguous(at::MemoryFormat::ChannelsLast);
  const auto parts = dpcore::scatter(cl, cpus(2));
  for (const at::Tensor& part : parts) {
    EXPECT_TRUE(part.is_contiguous(at::MemoryFormat::ChannelsLast));
  }
  EXPECT_TRUE(same_values(at::cat(parts, 0), cl));
}

TEST(Scatter, WithStreams) {
  const at::Tensor t = values({6, 2}, at::kFloat);
  const c10::Stream cpu_stream(c10::Stream::DEFAULT, c10::Device(c10::kCPU));
  const dpcore::StreamList streams = {cpu_stream, std::nullopt, cpu_stream};
  const auto chunks = dpcore::scatter(t, cpus(3), std::nullopt, 0, streams);
  EXPECT_TRUE(same_values(at::cat(chunks, 0), t));

  std::vector<at::Tensor> outs = {at::zeros({1, 2}), at::zeros({5, 2})};
  dpcore::scatter_out(t, outs, 0, dpcore::StreamList{std::nullopt, cpu_stream});
  EXPECT_TRUE(same_values(outs[0], t.narrow(0, 0, 1)));
  EXPECT_TRUE(same_values(outs[1], t.narrow(0, 1, 5)));
}

TEST(Scatter, Out) {
  const at::Tensor t = values({3, 7}, at::kLong);
  std::vector<at::Tensor> outs = {
      at::zeros({3, 2}, at::kLong), at::zeros({3, 0}, at::kLong), at::zeros({5, 3}, at::kLong).t()};
  for (const int64_t dim : {1, -1}) {
    for (auto& out : outs) {
      out.zero_();
    }
    dpcore::scatter_out(t, outs, dim);
    EXPECT_TRUE(same_values(outs[0], t.narrow(1, 0, 2)));
    EXPECT_TRUE(same_values(outs[2], t.narrow(1, 2, 5)));
    EXPECT_FALSE(outs[0].is_alias_of(t));
  }
}

// -------------------------------------------------------------------- gather

TEST(Gather, ValuesAlongDims) {
  const std::vector<at::Tensor> parts = {
      values({2, 3, 4}, at::kFloat, 1), values({2, 1, 4}, at::kFloat, 2), values({2, 5, 4}, at::kFloat, 3)};
  for (const int64_t dim : {1, -2}) {
    const at::Tensor out = dpcore::gather(parts, dim);
    EXPECT_TRUE(same_values(out, at::cat(parts, 1)));
    EXPECT_TRUE(out.device().is_cpu());
    const at::Tensor out2 = dpcore::gather(parts, dim, c10::Device(c10::kCPU));
    EXPECT_TRUE(same_values(out2, at::cat(parts, 1)));
  }
  const std::vector<at::Tensor> rows = {
      values({1, 3}, at::kHalf, 1), values({0, 3}, at::kHalf), values({4, 3}, at::kHalf, 2)};
  EXPECT_TRUE(same_values(dpcore::gather(rows, 0), at::cat(rows, 0)));
  const std::vector<at::Tensor> cols = {values({3, 2}, at::kLong, 1), values({3, 4}, at::kLong, 2)};
  EXPECT_TRUE(same_values(dpcore::gather(cols, -1), at::cat(cols, 1)));
  // A single tensor: a copy, not the tensor itself.
  const at::Tensor single = dpcore::gather({parts[0]}, 0);
  EXPECT_TRUE(same_values(single, parts[0]));
  EXPECT_FALSE(single.is_alias_of(parts[0]));
}

TEST(Gather, NonContiguousAndChannelsLast) {
  const at::Tensor a = values({4, 3}, at::kFloat, 1).t();
  const at::Tensor b = values({3, 8}, at::kFloat, 2).slice(1, 0, 8, 2);
  EXPECT_TRUE(same_values(dpcore::gather({a, b}, 0), at::cat({a, b}, 0)));

  const at::Tensor x = values({2, 3, 4, 5}, at::kFloat, 1).contiguous(at::MemoryFormat::ChannelsLast);
  const at::Tensor y = values({3, 3, 4, 5}, at::kFloat, 2).contiguous(at::MemoryFormat::ChannelsLast);
  const at::Tensor all_cl = dpcore::gather({x, y}, 0);
  EXPECT_TRUE(all_cl.is_contiguous(at::MemoryFormat::ChannelsLast));
  EXPECT_TRUE(same_values(all_cl, at::cat({x, y}, 0)));

  const at::Tensor z = values({3, 3, 4, 5}, at::kFloat, 3);
  const at::Tensor mixed = dpcore::gather({x, z}, 0);
  EXPECT_TRUE(mixed.is_contiguous());
  EXPECT_TRUE(same_values(mixed, at::cat({x, z}, 0)));
}

TEST(Gather, Out) {
  const std::vector<at::Tensor> parts = {values({2, 3}, at::kDouble, 1), values({2, 4}, at::kDouble, 2)};
  for (const int64_t dim : {1, -1}) {
    at::Tensor out = at::zeros({2, 7}, at::kDouble);
    dpcore::gather_out(parts, out, dim);
    EXPECT_TRUE(same_values(out, at::cat(parts, 1)));
  }
  at::Tensor out_t = at::zeros({7, 2}, at::kDouble).t();
  dpcore::gather_out(parts, out_t, 1);
  EXPECT_TRUE(same_values(out_t, at::cat(parts, 1)));
}

TEST(ScatterGather, RoundTrip) {
  for (size_t k = 1; k <= 4; ++k) {
    for (const int64_t dim : {0, 1, -1}) {
      const at::Tensor t = values({7, 5, 3}, at::kFloat, static_cast<int64_t>(k));
      const auto chunks = dpcore::scatter(t, cpus(k), std::nullopt, dim);
      EXPECT_TRUE(same_values(dpcore::gather(chunks, dim), t)) << "k=" << k << " dim=" << dim;
    }
  }
}
