// ReplicaBuffers (replica_buffers.h) on lists of CPU devices: what refresh
// copies, and write(), which leaves a copy that a shard of the sharded
// optimizer updated out of the next refresh.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <vector>

#include "dpcore/replica_buffers.h"
#include "helpers.h"

using dpcore_test::cpus;
using dpcore_test::same_values;
using dpcore_test::values;

namespace {

// Three masters of 6, 4 and 5 doubles (48, 32 and 40 bytes).
std::vector<at::Tensor> masters() {
  return {values({2, 3}, at::kDouble, 1), values({4}, at::kDouble, 2), values({5}, at::kDouble, 3)};
}

} // namespace

TEST(ReplicaBuffers, RefreshCopiesOnlyWhenAMasterChanged) {
  std::vector<at::Tensor> m = masters();
  dpcore::ReplicaBuffers buffers(m, cpus(2));
  auto copies = buffers.refresh(m);
  EXPECT_EQ(buffers.last_copied_bytes(), (std::vector<int64_t>{120, 120}));
  for (size_t d = 0; d < 2; ++d) {
    for (size_t i = 0; i < m.size(); ++i) {
      EXPECT_TRUE(same_values(copies[d][i], m[i]));
    }
  }
  buffers.refresh(m);
  EXPECT_EQ(buffers.last_copied_bytes(), (std::vector<int64_t>{0, 0}));
  m[1].add_(1.0);
  copies = buffers.refresh(m);
  EXPECT_EQ(buffers.last_copied_bytes(), (std::vector<int64_t>{120, 120})); // the bucket, whole
  EXPECT_TRUE(same_values(copies[1][1], m[1]));
}

TEST(ReplicaBuffers, WrittenCopiesAreNotCopiedAgain) {
  std::vector<at::Tensor> m = masters();
  dpcore::ReplicaBuffers buffers(m, cpus(3));
  auto before = buffers.refresh(m);
  const int64_t version = before[1][0]._version();
  // Entries 0 and 2 updated where target 1 holds them (a shard stepped there), then on the master.
  std::vector<at::Tensor> updated = {m[0] * 2, m[1], m[2] * 3};
  for (int64_t i : {0, 2}) {
    m[i].copy_(updated[i]);
    buffers.write(1, i, updated[i], m[i]);
  }
  EXPECT_GT(before[1][0]._version(), version); // a graph that saved the old copy is refused
  EXPECT_TRUE(same_values(before[1][0], updated[0]));
  auto after = buffers.refresh(m);
  // Target 1 takes only entry 1 (32 bytes); the others the bucket.
  EXPECT_EQ(buffers.last_copied_bytes(), (std::vector<int64_t>{120, 32, 120}));
  for (size_t d = 0; d < 3; ++d) {
    for (size_t i = 0; i < m.size(); ++i) {
      EXPECT_TRUE(same_values(after[d][i], m[i])) << d << ", " << i;
    }
  }
  // A write is used once: the master changing again is copied everywhere.
  m[0].add_(1.0);
  after = buffers.refresh(m);
  EXPECT_EQ(buffers.last_copied_bytes(), (std::vector<int64_t>{120, 120, 120}));
  EXPECT_TRUE(same_values(after[1][0], m[0]));
}

TEST(ReplicaBuffers, AWriteIsIgnoredWhereTheMasterOrTheCopyChangedSince) {
  std::vector<at::Tensor> m = masters();
  dpcore::ReplicaBuffers buffers(m, cpus(2));
  auto copies = buffers.refresh(m);
  at::Tensor value = m[1] + 1;
  m[1].copy_(value);
  buffers.write(0, 1, value, m[1]);
  m[1].add_(1.0); // the master moved on: the written copy is stale
  copies = buffers.refresh(m);
  EXPECT_EQ(buffers.last_copied_bytes(), (std::vector<int64_t>{120, 120}));
  EXPECT_TRUE(same_values(copies[0][1], m[1]));
  value = m[2] + 1;
  m[2].copy_(value);
  buffers.write(0, 2, value, m[2]);
  copies[0][2].add_(5.0); // the copy changed in place since the write
  copies = buffers.refresh(m);
  EXPECT_EQ(buffers.last_copied_bytes(), (std::vector<int64_t>{120, 120}));
  EXPECT_TRUE(same_values(copies[0][2], m[2]));
}

TEST(ReplicaBuffers, InvalidateDropsWrites) {
  std::vector<at::Tensor> m = masters();
  dpcore::ReplicaBuffers buffers(m, cpus(2));
  buffers.refresh(m);
  at::Tensor value = m[0] - 1;
  m[0].copy_(value);
  buffers.write(1, 0, value, m[0]);
  buffers.invalidate();
  buffers.refresh(m);
  EXPECT_EQ(buffers.last_copied_bytes(), (std::vector<int64_t>{120, 120}));
}

TEST(ReplicaBuffers, WriteChecksItsArguments) {
  std::vector<at::Tensor> m = masters();
  dpcore::ReplicaBuffers buffers(m, cpus(2));
  EXPECT_THROW(buffers.write(2, 0, m[0], m[0]), c10::Error);                // no target 2
  EXPECT_THROW(buffers.write(0, 3, m[0], m[0]), c10::Error);                // no entry 3
  EXPECT_THROW(buffers.write(0, 1, m[0], m[1]), c10::Error);                // a value of another shape
  EXPECT_THROW(buffers.write(0, 0, m[0].to(at::kFloat), m[0]), c10::Error); // another dtype
  try {
    buffers.write(0, 0, m[0], m[1]);
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(
        std::string(e.what_without_backtrace()).find("expected the master of entry 0"), std::string::npos);
  }
}

TEST(ReplicaBuffers, ViewsWrittenThenMarkedCurrentAreNotCopied) {
  std::vector<at::Tensor> m = masters();
  dpcore::ReplicaBuffers buffers(m, cpus(3));
  auto before = buffers.refresh(m);
  // Every entry updated in place on the master and, by a collective, in every target's views (an all-gather).
  for (at::Tensor& t : m) {
    t.mul_(2.0);
  }
  const int64_t version = before[0][1]._version();
  for (int64_t d = 0; d < 3; ++d) {
    std::vector<at::Tensor> views = buffers.views(d);
    ASSERT_EQ(views.size(), m.size());
    for (size_t i = 0; i < m.size(); ++i) {
      EXPECT_EQ(views[i].data_ptr(), before[d][i].data_ptr()); // the persistent buffer, no copy
      views[i].copy_(m[i]);
    }
    if (d < 2) {
      buffers.mark_current(d, {0, 1, 2}, m);
    } else {
      buffers.mark_current(d, {1}, {m[1]}); // target 2: only entry 1 marked
    }
  }
  EXPECT_GT(before[0][1]._version(), version + 1); // the view's write and the mark: old graphs refused
  auto after = buffers.refresh(m);
  EXPECT_EQ(buffers.last_copied_bytes(), (std::vector<int64_t>{0, 0, 88})); // target 2: entries 0 and 2
  for (size_t d = 0; d < 3; ++d) {
    for (size_t i = 0; i < m.size(); ++i) {
      EXPECT_TRUE(same_values(after[d][i], m[i])) << d << ", " << i;
    }
  }
  EXPECT_THROW(buffers.mark_current(3, {0}, {m[0]}), c10::Error);    // no target 3
  EXPECT_THROW(buffers.mark_current(0, {0}, {m[1]}), c10::Error);    // not entry 0's master
  EXPECT_THROW(buffers.mark_current(0, {0, 1}, {m[0]}), c10::Error); // one master per entry
  EXPECT_THROW(buffers.views(-1), c10::Error);
}
