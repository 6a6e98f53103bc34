// The split arithmetic of the scatter (docs/design.md, "Scatter"): how many
// rows of a batch each device gets (balanced, chunk sizes as given, or in
// proportion to weights) and plan_split, which of a call's tensor sizes is
// the batch. Plain integers and doubles in and out, checked by the front end
// (dpcore/_split.py); the messages that name an input's path are the
// binding's (csrc/python/split.cpp). Includes no dpcore header.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

namespace dpcore {

// `total` rows split in proportion to `weights` (finite, >= 0, a positive
// sum) by the largest remainder, ties to the lower index: exact for any
// doubles (their quotas are compared as rationals, never rounded).
std::vector<int64_t> proportional_sizes(int64_t total, const std::vector<double>& weights);

// How many of `batch` rows each of `n_devices` devices gets: `chunk_sizes`
// as given (ValueError unless they sum to `batch`), in proportion to
// `weights`, else balanced (balanced_chunk_sizes). ValueError naming
// `batch` or `n_devices` where it is negative or below 1.
std::vector<int64_t> split_sizes(
    int64_t batch, int64_t n_devices, const std::optional<std::vector<int64_t>>& chunk_sizes,
    const std::optional<std::vector<double>>& weights);

// Why plan_split found no batch (the binding names the inputs' paths).
enum class SplitFault {
  kNone,
  kUnitCount, // unit `at` holds another count than unit 0
  kUnitSize,  // entry `at` has neither the units' batch nor the replica count
  kSize,      // entry `at` has neither entry `first`'s size nor `per` (the replicas of that batch, if any)
};

struct SplitPlan {
  std::optional<int64_t> batch; // none without a tensor to split
  std::vector<int64_t> sizes;   // each device's rows
  int64_t replicas = 1;         // devices with rows, at least 1
  SplitFault fault = SplitFault::kNone;
  int64_t at = -1;
  int64_t first = -1;
  std::optional<int64_t> per;
};

// The scatter's rules for one call (dpcore/_split.py, plan_split): `sizes`
// holds each tensor's size along the split dim (none for a 0-dim tensor),
// `units` the count of each input split by whole samples. 0. The first
// unit's count is the batch, which the others must have. 1. A 0-dim tensor
// goes whole to every replica. 2. One size is the batch. 3. Of two sizes b
// and r, b is the batch where a batch of b runs on r replicas, 3b. or on
// fewer than r, the device count. 4. Anything else is a fault. A chunk_sizes
// that does not sum to the batch chosen is a ValueError (split_sizes').
SplitPlan plan_split(
    const std::vector<std::optional<int64_t>>& sizes, int64_t n_devices,
    const std::optional<std::vector<int64_t>>& chunk_sizes, const std::optional<std::vector<double>>& weights,
    const std::vector<int64_t>& units);

} // namespace dpcore
