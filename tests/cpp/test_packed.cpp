// The PackedSequence index arithmetic (packed.h): packed_split, packed_join
// and packed_output against small cases computed by hand.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "dpcore/packed.h"
#include "helpers.h"

using dpcore::PackedFields;
using dpcore::PackedOutput;
using dpcore::PackedRows;
using dpcore_test::same_values;

namespace {

at::Tensor longs(std::vector<int64_t> v) {
  return at::tensor(v, at::kLong);
}

// Each part j of `split` has these batch_sizes and (where given) sorted_indices.
void expect_part(
    const dpcore::PackedSplit& split, size_t j, std::vector<int64_t> batch_sizes,
    std::optional<std::vector<int64_t>> sorted, std::optional<std::vector<int64_t>> unsorted) {
  SCOPED_TRACE(testing::Message() << "part " << j);
  const PackedFields& f = split.parts.at(j);
  EXPECT_TRUE(same_values(f.batch_sizes, longs(batch_sizes)));
  ASSERT_EQ(f.sorted_indices.has_value(), sorted.has_value());
  ASSERT_EQ(f.unsorted_indices.has_value(), unsorted.has_value());
  if (sorted) {
    EXPECT_TRUE(same_values(*f.sorted_indices, longs(*sorted)));
    EXPECT_TRUE(same_values(*f.unsorted_indices, longs(*unsorted)));
  }
}

// lengths 2, 3, 1 (unsorted): sorted_indices 1 0 2, batch_sizes 3 2 1; packed
// rows: step 0: sequences 1 0 2 (rows 0-2), step 1: 1 0 (rows 3-4), step 2: 1.
const std::vector<int64_t> kUnsortedSizes = {3, 2, 1};
const std::vector<int64_t> kUnsortedOrder = {1, 0, 2};

} // namespace

TEST(PackedSplit, UnsortedBatch) {
  // Part 0: sequence 0 (rows 1, 4); part 1: sequences 1, 2 (rows 0, 2, 3, 5).
  const auto s = dpcore::packed_split(longs(kUnsortedSizes), longs(kUnsortedOrder), {1, 2});
  EXPECT_TRUE(same_values(s.layout.lengths, longs({2, 3, 1})));
  EXPECT_TRUE(same_values(s.layout.sorted_indices, longs(kUnsortedOrder)));
  EXPECT_TRUE(s.layout.given_sorted);
  EXPECT_EQ(s.rows, (std::vector<int64_t>{2, 4}));
  EXPECT_TRUE(same_values(s.order, longs({1, 4, 0, 2, 3, 5})));
  ASSERT_TRUE(s.back.has_value());
  EXPECT_TRUE(same_values(*s.back, longs({2, 0, 3, 4, 1, 5})));
  expect_part(s, 0, {1, 1}, std::vector<int64_t>{0}, std::vector<int64_t>{0});
  expect_part(s, 1, {2, 1, 1}, std::vector<int64_t>{0, 1}, std::vector<int64_t>{0, 1});
}

TEST(PackedSplit, TiesWithoutSortedIndices) {
  // lengths 2 2 1 1 (sorted, no sorted_indices): batch_sizes 4 2.
  const auto s = dpcore::packed_split(longs({4, 2}), std::nullopt, {2, 2});
  EXPECT_TRUE(same_values(s.layout.lengths, longs({2, 2, 1, 1})));
  EXPECT_TRUE(same_values(s.layout.sorted_indices, longs({0, 1, 2, 3})));
  EXPECT_FALSE(s.layout.given_sorted);
  EXPECT_EQ(s.rows, (std::vector<int64_t>{4, 2}));
  EXPECT_TRUE(same_values(s.order, longs({0, 1, 4, 5, 2, 3})));
  ASSERT_TRUE(s.back.has_value());
  EXPECT_TRUE(same_values(*s.back, longs({0, 1, 4, 5, 2, 3})));
  expect_part(s, 0, {2, 2}, std::nullopt, std::nullopt);
  expect_part(s, 1, {2}, std::nullopt, std::nullopt);
}

TEST(PackedSplit, OneSequenceAndEmptyParts) {
  for (const std::vector<int64_t>& sizes : {std::vector<int64_t>{1}, {0, 1}, {1, 0}, {0, 1, 0}}) {
    SCOPED_TRACE(testing::Message() << "sizes " << c10::ArrayRef<int64_t>(sizes));
    const auto s = dpcore::packed_split(longs({1, 1, 1}), longs({0}), sizes);
    EXPECT_TRUE(same_values(s.layout.lengths, longs({3})));
    EXPECT_TRUE(same_values(s.order, longs({0, 1, 2})));
    EXPECT_FALSE(s.back.has_value()); // the identity
    ASSERT_EQ(s.parts.size(), sizes.size());
    for (size_t j = 0; j < sizes.size(); ++j) {
      EXPECT_EQ(s.rows[j], 3 * sizes[j]);
      if (sizes[j] == 0) {
        expect_part(s, j, {}, std::vector<int64_t>{}, std::vector<int64_t>{});
      } else {
        expect_part(s, j, {1, 1, 1}, std::vector<int64_t>{0}, std::vector<int64_t>{0});
      }
    }
  }
  // An empty part between two others of the unsorted batch.
  const auto s = dpcore::packed_split(longs(kUnsortedSizes), longs(kUnsortedOrder), {1, 0, 2});
  EXPECT_EQ(s.rows, (std::vector<int64_t>{2, 0, 4}));
  EXPECT_TRUE(same_values(s.order, longs({1, 4, 0, 2, 3, 5})));
  expect_part(s, 1, {}, std::vector<int64_t>{}, std::vector<int64_t>{});
  // No sequences at all.
  const auto none = dpcore::packed_split(longs({}), std::nullopt, {0, 0});
  EXPECT_EQ(none.rows, (std::vector<int64_t>{0, 0}));
  EXPECT_EQ(none.order.numel(), 0);
  EXPECT_FALSE(none.back.has_value());
}

TEST(PackedSplit, BadInputSaysExpectedAndFound) {
  EXPECT_C10_ERROR(
      "expected sizes that sum to the 3 sequences of the PackedSequence, found sizes 1, 1",
      dpcore::packed_split(longs(kUnsortedSizes), longs(kUnsortedOrder), {1, 1}));
  EXPECT_C10_ERROR(
      "expected sizes of at least 0, found sizes[0] = -1",
      dpcore::packed_split(longs(kUnsortedSizes), std::nullopt, {-1, 4}));
  EXPECT_C10_ERROR(
      "expected sorted_indices to be a permutation of 0..2, found sorted_indices[1] = 0 twice",
      dpcore::packed_split(longs(kUnsortedSizes), longs({0, 0, 2}), {3}));
  EXPECT_C10_ERROR(
      "found sorted_indices[2] = 3 (out of range)",
      dpcore::packed_split(longs(kUnsortedSizes), longs({0, 1, 3}), {3}));
  EXPECT_C10_ERROR(
      "expected sorted_indices to hold 3 indices, found 2",
      dpcore::packed_split(longs(kUnsortedSizes), longs({0, 1}), {3}));
  EXPECT_C10_ERROR(
      "expected non-increasing batch_sizes, found batch_sizes[1] = 3 after 2",
      dpcore::packed_split(longs({2, 3}), std::nullopt, {2}));
  EXPECT_C10_ERROR(
      "expected batch_sizes to be a 1-D CPU int64 tensor, found a 1-D Int tensor on cpu",
      dpcore::packed_split(longs({2, 1}).to(at::kInt), std::nullopt, {2}));
}

TEST(PackedJoin, BackIntoTheSplitsLayout) {
  // The parts of the unsorted batch split {1, 2}: gathered rows (part 0, then
  // part 1) go back to joined rows 1 4 | 0 2 3 5, the split's order.
  const auto s = dpcore::packed_split(longs(kUnsortedSizes), longs(kUnsortedOrder), {1, 2});
  const auto j = dpcore::packed_join(
      {s.parts[0].batch_sizes, s.parts[1].batch_sizes},
      {s.parts[0].sorted_indices, s.parts[1].sorted_indices}, {s.layout});
  EXPECT_TRUE(same_values(j.fields.batch_sizes, longs(kUnsortedSizes)));
  ASSERT_TRUE(j.fields.sorted_indices.has_value() && j.fields.unsorted_indices.has_value());
  EXPECT_TRUE(same_values(*j.fields.sorted_indices, longs(kUnsortedOrder)));
  EXPECT_TRUE(same_values(*j.fields.unsorted_indices, longs({1, 0, 2})));
  EXPECT_TRUE(same_values(j.source, *s.back));
}

TEST(PackedJoin, StablyLongestFirstWithoutALayout) {
  // Part 0: one sequence of length 1; part 1: two of length 2 (no
  // sorted_indices). Joined lengths 1 2 2: order 1 2 0, batch_sizes 3 2;
  // gathered rows (0,s0) (0,s1) (0,s2) (1,s1) (1,s2) go to joined rows
  // 2 0 1 3 4.
  const auto j = dpcore::packed_join({longs({1}), longs({2, 2})}, {std::nullopt, std::nullopt}, {});
  EXPECT_TRUE(same_values(j.fields.batch_sizes, longs({3, 2})));
  ASSERT_TRUE(j.fields.sorted_indices.has_value());
  EXPECT_TRUE(same_values(*j.fields.sorted_indices, longs({1, 2, 0})));
  EXPECT_TRUE(same_values(*j.fields.unsorted_indices, longs({2, 0, 1})));
  EXPECT_TRUE(same_values(j.source, longs({1, 2, 0, 3, 4})));
  // Ties already longest first, no sorted_indices anywhere: none joined.
  // Lengths 2 2 | 1 1: gathered rows (0,s0) (0,s1) (1,s0) (1,s1) (0,s2) (0,s3)
  // go to joined rows 0 1 4 5 2 3.
  const auto k = dpcore::packed_join({longs({2, 2}), longs({2})}, {std::nullopt, std::nullopt}, {});
  EXPECT_TRUE(same_values(k.fields.batch_sizes, longs({4, 2})));
  EXPECT_FALSE(k.fields.sorted_indices.has_value());
  EXPECT_FALSE(k.fields.unsorted_indices.has_value());
  EXPECT_TRUE(same_values(k.source, longs({0, 1, 4, 5, 2, 3})));
  // With sorted_indices on a part, the identity order is kept explicitly.
  const auto given = dpcore::packed_join({longs({1}), longs({1})}, {longs({0}), std::nullopt}, {});
  ASSERT_TRUE(given.fields.sorted_indices.has_value());
  EXPECT_TRUE(same_values(*given.fields.sorted_indices, longs({0, 1})));
  // A layout of other lengths is passed over; empty parts join to nothing.
  const auto other = dpcore::packed_join({longs({1})}, {std::nullopt}, {{longs({2}), longs({0}), true}});
  EXPECT_FALSE(other.fields.sorted_indices.has_value());
  const auto empty = dpcore::packed_join({longs({}), longs({})}, {std::nullopt, std::nullopt}, {});
  EXPECT_EQ(empty.fields.batch_sizes.numel(), 0);
  EXPECT_EQ(empty.source.numel(), 0);
  EXPECT_C10_ERROR(
      "packed_join: part 1: expected positive batch_sizes, found batch_sizes[0] = 0",
      dpcore::packed_join({longs({1}), longs({0})}, {std::nullopt, std::nullopt}, {}));
}

TEST(PackedOutput, Rules) {
  // The unsorted batch split {1, 2}: rows 2 4, sequences 1 2.
  const auto s = dpcore::packed_split(longs(kUnsortedSizes), longs(kUnsortedOrder), {1, 2});
  const PackedFields whole{longs(kUnsortedSizes), longs(kUnsortedOrder), longs({1, 0, 2})};
  const std::vector<PackedRows> splits = {{s.rows, {1, 2}, !s.back.has_value(), s.parts, whole}};
  const auto kind = [&](std::vector<at::Tensor> parts, int64_t dim) {
    return dpcore::packed_output(parts, dim, splits);
  };
  EXPECT_EQ(kind({at::zeros({}), at::zeros({})}, 0).kind, PackedOutput::kAsAny);
  EXPECT_EQ(kind({at::zeros({1, 5}), at::zeros({2, 5})}, 0).kind, PackedOutput::kAsAny);
  EXPECT_EQ(kind({at::zeros({5, 1}), at::zeros({5, 2})}, -1).kind, PackedOutput::kAsAny);
  const auto data = kind({at::zeros({2, 5}), at::zeros({4, 5})}, 0);
  EXPECT_EQ(data.kind, PackedOutput::kData);
  EXPECT_EQ(data.split, 0);
  EXPECT_EQ(kind({at::zeros({2, 5}), at::zeros({5, 5})}, 0).kind, PackedOutput::kUnfit);
  EXPECT_EQ(kind({at::zeros({2}), at::zeros({4})}, 1).kind, PackedOutput::kData); // dim past a 1-D part
  // The parts' own sorted_indices (the very tensors), and copies of their batch_sizes.
  const auto field = kind({*s.parts[0].sorted_indices, *s.parts[1].sorted_indices}, 0);
  EXPECT_EQ(field.kind, PackedOutput::kField);
  EXPECT_EQ(field.field, 1);
  const auto copies = kind({s.parts[0].batch_sizes.clone(), s.parts[1].batch_sizes.clone()}, 0);
  EXPECT_EQ(copies.kind, PackedOutput::kField);
  EXPECT_EQ(copies.field, 0);
  // Copies equal to both sorted_ and unsorted_indices of the parts (0 and 0 1):
  // the same for the whole batch (1 0 2 both) here, so the first.
  const auto both = kind({longs({0}), longs({0, 1})}, 0);
  EXPECT_EQ(both.kind, PackedOutput::kField);
  EXPECT_EQ(both.field, 1);
  // Whole fields that differ: an error naming both.
  std::vector<PackedRows> differ = splits;
  differ[0].whole = PackedFields{longs(kUnsortedSizes), longs({1, 2, 0}), longs({2, 0, 1})};
  const auto rule = dpcore::packed_output({longs({0}), longs({0, 1})}, 0, differ);
  EXPECT_EQ(rule.kind, PackedOutput::kFieldsDiffer);
  EXPECT_EQ(rule.field, 1);
  EXPECT_EQ(rule.other, 2);

  // Every length 1, sorted_indices 1 0, split {1, 1}: a row per sequence is a
  // row per packed row, and the packed order is not the identity.
  const auto ones = dpcore::packed_split(longs({2}), longs({1, 0}), {1, 1});
  ASSERT_TRUE(ones.back.has_value());
  const std::vector<PackedRows> one_rows = {{ones.rows, {1, 1}, false, ones.parts, std::nullopt}};
  const std::vector<at::Tensor> rows = {at::zeros({1, 3}), at::zeros({1, 3})};
  EXPECT_EQ(dpcore::packed_output(rows, 0, one_rows).kind, PackedOutput::kLengthOne);
  EXPECT_EQ(dpcore::packed_output(rows, 1, one_rows).kind, PackedOutput::kData); // 3 along dim 1
  const std::vector<at::Tensor> columns = {at::zeros({1, 1}), at::zeros({1, 1})};
  EXPECT_EQ(dpcore::packed_output(columns, 1, one_rows).kind, PackedOutput::kAsAny);
}
