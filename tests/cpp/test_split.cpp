// The split arithmetic (split.h): proportional_sizes, split_sizes and
// plan_split's rules and faults against small cases computed by hand.
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "dpcore/split.h"

using dpcore::SplitFault;
using Longs = std::vector<int64_t>;
using Sizes = std::vector<std::optional<int64_t>>;

TEST(ProportionalSizes, LargestRemainderTiesToTheLowerIndex) {
  EXPECT_EQ(dpcore::proportional_sizes(8, {1, 3}), (Longs{2, 6}));
  EXPECT_EQ(dpcore::proportional_sizes(10, {1, 1, 1}), (Longs{4, 3, 3}));
  EXPECT_EQ(dpcore::proportional_sizes(7, {0, 1, 2, 3}), (Longs{0, 1, 2, 4}));
  EXPECT_EQ(dpcore::proportional_sizes(5, {0.5, 0.5}), (Longs{3, 2}));
  EXPECT_EQ(dpcore::proportional_sizes(0, {1, 2}), (Longs{0, 0}));
}

TEST(ProportionalSizes, ExactForAnyDoubles) {
  // 0.1, 0.2, 0.3 as doubles: 10 * 0.3 / (0.1 + 0.2 + 0.3) is a little under 5 in exact arithmetic.
  EXPECT_EQ(dpcore::proportional_sizes(10, {0.1, 0.2, 0.3}), (Longs{2, 3, 5}));
  // Exponents 600 powers of two apart, and a total near 2^62.
  EXPECT_EQ(dpcore::proportional_sizes(5, {1e300, 1e-300}), (Longs{5, 0}));
  EXPECT_EQ(
      dpcore::proportional_sizes(int64_t{1} << 62, {1, 1}), (Longs{int64_t{1} << 61, int64_t{1} << 61}));
  EXPECT_EQ(dpcore::proportional_sizes(3, {5e-324, 5e-324, 1e-323}), (Longs{1, 1, 1}));
}

TEST(ProportionalSizes, RefusesBadWeights) {
  EXPECT_THROW(dpcore::proportional_sizes(4, {0, 0}), c10::ValueError);
  EXPECT_THROW(dpcore::proportional_sizes(4, {1, -1}), c10::ValueError);
  EXPECT_THROW(dpcore::proportional_sizes(-1, {1}), c10::ValueError);
}

TEST(SplitSizes, BalancedChunkSizesOrWeights) {
  EXPECT_EQ(dpcore::split_sizes(10, 4, std::nullopt, std::nullopt), (Longs{3, 3, 2, 2}));
  EXPECT_EQ(dpcore::split_sizes(5, 3, Longs{3, 0, 2}, std::nullopt), (Longs{3, 0, 2}));
  EXPECT_EQ(dpcore::split_sizes(8, 2, std::nullopt, std::vector<double>{1, 3}), (Longs{2, 6}));
  try {
    dpcore::split_sizes(5, 2, Longs{1, 2}, std::nullopt);
    FAIL() << "expected a ValueError";
  } catch (const c10::ValueError& e) {
    EXPECT_STREQ(
        e.what_without_backtrace(),
        "chunk_sizes: expected sizes summing to the batch size 5, but [1, 2] sum to 3");
  }
  EXPECT_THROW(dpcore::split_sizes(-1, 2, std::nullopt, std::nullopt), c10::ValueError);
  EXPECT_THROW(dpcore::split_sizes(4, 0, std::nullopt, std::nullopt), c10::ValueError);
}

TEST(PlanSplit, OneSizeIsTheBatch) {
  const dpcore::SplitPlan plan =
      dpcore::plan_split({std::nullopt, 7, std::nullopt}, 3, std::nullopt, std::nullopt, {});
  EXPECT_EQ(plan.fault, SplitFault::kNone);
  EXPECT_EQ(plan.batch, 7);
  EXPECT_EQ(plan.sizes, (Longs{3, 2, 2}));
  EXPECT_EQ(plan.replicas, 3);
  const dpcore::SplitPlan none = dpcore::plan_split({std::nullopt}, 3, std::nullopt, std::nullopt, {});
  EXPECT_FALSE(none.batch.has_value());
  EXPECT_TRUE(none.sizes.empty());
  EXPECT_EQ(none.replicas, 1);
}

TEST(PlanSplit, OneRowPerReplicaOrPerDevice) {
  // A batch of 3 on 4 devices runs on 3 replicas: a tensor of size 3 is the batch, 4 one row per device (3b).
  dpcore::SplitPlan plan = dpcore::plan_split({3, 4}, 4, std::nullopt, std::nullopt, {});
  EXPECT_EQ(plan.batch, 3);
  EXPECT_EQ(plan.sizes, (Longs{1, 1, 1, 0}));
  EXPECT_EQ(plan.replicas, 3);
  plan = dpcore::plan_split({4, 1}, 4, std::nullopt, std::nullopt, {});
  EXPECT_EQ(plan.batch, 1);
  EXPECT_EQ(plan.sizes, (Longs{1, 0, 0, 0}));
  EXPECT_EQ(plan.replicas, 1);
  plan = dpcore::plan_split({5, 2}, 3, Longs{3, 0, 2}, std::nullopt, {});
  EXPECT_EQ(plan.batch, 5);
  EXPECT_EQ(plan.replicas, 2);
}

TEST(PlanSplit, FaultsNameTheEntries) {
  dpcore::SplitPlan plan = dpcore::plan_split({2, 3, 5}, 2, std::nullopt, std::nullopt, {});
  EXPECT_EQ(plan.fault, SplitFault::kSize);
  EXPECT_EQ(plan.at, 1);
  EXPECT_EQ(plan.first, 0);
  EXPECT_EQ(plan.per, 2);
  // Size 2 is the replica count of a batch of 4 on 2 devices: the entry named is the 5.
  plan = dpcore::plan_split({4, 2, 5}, 2, std::nullopt, std::nullopt, {});
  EXPECT_EQ(plan.fault, SplitFault::kSize);
  EXPECT_EQ(plan.at, 2);
  // chunk_sizes that fit no batch: no replica count to offer.
  plan = dpcore::plan_split({5, 4}, 3, Longs{3, 0, 3}, std::nullopt, {});
  EXPECT_EQ(plan.fault, SplitFault::kSize);
  EXPECT_FALSE(plan.per.has_value());
  EXPECT_THROW(dpcore::plan_split({5}, 3, Longs{3, 0, 3}, std::nullopt, {}), c10::ValueError);
}

TEST(PlanSplit, UnitsGiveTheBatch) {
  dpcore::SplitPlan plan = dpcore::plan_split({4, std::nullopt, 2}, 2, std::nullopt, std::nullopt, {4, 4});
  EXPECT_EQ(plan.fault, SplitFault::kNone);
  EXPECT_EQ(plan.batch, 4);
  EXPECT_EQ(plan.sizes, (Longs{2, 2}));
  plan = dpcore::plan_split({}, 2, std::nullopt, std::nullopt, {4, 3});
  EXPECT_EQ(plan.fault, SplitFault::kUnitCount);
  EXPECT_EQ(plan.at, 1);
  plan = dpcore::plan_split({4, 3}, 2, std::nullopt, std::nullopt, {4});
  EXPECT_EQ(plan.fault, SplitFault::kUnitSize);
  EXPECT_EQ(plan.at, 1);
  EXPECT_EQ(plan.replicas, 2);
}
