#define TORCH_ASSERT_ONLY_METHOD_OPERATORS

#include "dpcore/split.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <numeric>
#include <string>

#include "dpcore/comm.h"

namespace dpcore {
namespace {

// An unsigned integer of any size: little-endian 32-bit words, no high zero
// word. Just what the exact largest-remainder split needs.
using Big = std::vector<uint32_t>;

void trim(Big& a) {
  while (!a.empty() && a.back() == 0) {
    a.pop_back();
  }
}

Big shifted(uint64_t value, int64_t bits) {
  Big out(static_cast<size_t>(bits / 32), 0);
  const unsigned __int128 v = static_cast<unsigned __int128>(value) << (bits % 32);
  for (int k = 0; k < 3; ++k) {
    out.push_back(static_cast<uint32_t>(v >> (32 * k)));
  }
  trim(out);
  return out;
}

void add_to(Big& a, const Big& b) {
  a.resize(std::max(a.size(), b.size()) + 1, 0);
  uint64_t carry = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    carry += static_cast<uint64_t>(a[i]) + (i < b.size() ? b[i] : 0);
    a[i] = static_cast<uint32_t>(carry);
    carry >>= 32;
  }
  trim(a);
}

Big times(const Big& a, uint64_t m) {
  Big out;
  unsigned __int128 carry = 0;
  for (uint32_t word : a) {
    carry += static_cast<unsigned __int128>(word) * m;
    out.push_back(static_cast<uint32_t>(carry));
    carry >>= 32;
  }
  for (; carry != 0; carry >>= 32) {
    out.push_back(static_cast<uint32_t>(carry));
  }
  trim(out);
  return out;
}

int compare(const Big& a, const Big& b) {
  if (a.size() != b.size()) {
    return a.size() < b.size() ? -1 : 1;
  }
  for (size_t i = a.size(); i-- > 0;) {
    if (a[i] != b[i]) {
      return a[i] < b[i] ? -1 : 1;
    }
  }
  return 0;
}

Big minus(const Big& a, const Big& b) { // a >= b
  Big out(a);
  int64_t borrow = 0;
  for (size_t i = 0; i < out.size(); ++i) {
    int64_t d = static_cast<int64_t>(out[i]) - (i < b.size() ? b[i] : 0) - borrow;
    borrow = d < 0;
    out[i] = static_cast<uint32_t>(d + (borrow << 32));
  }
  trim(out);
  return out;
}

// The replicas a split makes: devices with rows, at least 1.
int64_t replicas_of(const std::vector<int64_t>& sizes) {
  return std::max<int64_t>(1, std::count_if(sizes.begin(), sizes.end(), [](int64_t s) { return s > 0; }));
}

// split_sizes of checked arguments; none where chunk_sizes do not sum to `batch`.
std::optional<std::vector<int64_t>> sizes_for(
    int64_t batch, int64_t n_devices, const std::optional<std::vector<int64_t>>& chunk_sizes,
    const std::optional<std::vector<double>>& weights) {
  if (chunk_sizes) {
    if (std::accumulate(chunk_sizes->begin(), chunk_sizes->end(), int64_t{0}) != batch) {
      return std::nullopt;
    }
    return *chunk_sizes;
  }
  return weights ? proportional_sizes(batch, *weights) : balanced_chunk_sizes(batch, n_devices);
}

// sizes_for, a ValueError where chunk_sizes do not sum to `batch`.
std::vector<int64_t> checked_sizes_for(
    int64_t batch, int64_t n_devices, const std::optional<std::vector<int64_t>>& chunk_sizes,
    const std::optional<std::vector<double>>& weights) {
  std::optional<std::vector<int64_t>> sizes = sizes_for(batch, n_devices, chunk_sizes, weights);
  if (!sizes) {
    std::string given;
    for (int64_t s : *chunk_sizes) {
      given += (given.empty() ? "" : ", ") + std::to_string(s);
    }
    TORCH_CHECK_VALUE(
        false, "chunk_sizes: expected sizes summing to the batch size ", batch, ", but [", given, "] sum to ",
        std::accumulate(chunk_sizes->begin(), chunk_sizes->end(), int64_t{0}));
  }
  return *sizes;
}

} // namespace

std::vector<int64_t> proportional_sizes(int64_t total, const std::vector<double>& weights) {
  TORCH_CHECK_VALUE(total >= 0, "proportional_sizes: expected total >= 0, but got ", total);
  // Each weight is M * 2^e (M an integer of 53 bits at most); scaled by 2^-emin every one is an integer A.
  std::vector<uint64_t> mantissa(weights.size(), 0);
  std::vector<int64_t> exponent(weights.size(), 0);
  int64_t emin = INT64_MAX;
  for (size_t i = 0; i < weights.size(); ++i) {
    TORCH_CHECK_VALUE(
        std::isfinite(weights[i]) && weights[i] >= 0, "proportional_sizes: expected weights[", i,
        "] finite and >= 0, but got ", weights[i]);
    int e = 0;
    mantissa[i] = static_cast<uint64_t>(std::ldexp(std::frexp(std::fabs(weights[i]), &e), 53));
    exponent[i] = e - 53;
    if (mantissa[i] != 0) {
      emin = std::min(emin, exponent[i]);
    }
  }
  TORCH_CHECK_VALUE(emin != INT64_MAX, "proportional_sizes: expected a positive sum of weights, but got 0");
  std::vector<Big> share;
  Big whole;
  for (size_t i = 0; i < weights.size(); ++i) {
    share.push_back(shifted(mantissa[i], mantissa[i] ? exponent[i] - emin : 0));
    add_to(whole, share.back());
  }
  // Quota i is total * A_i / sum(A): floor q_i (at most total, found by bisection), remainder r_i over
  // sum(A).
  std::vector<int64_t> sizes;
  std::vector<Big> remainder;
  int64_t given = 0;
  for (const Big& a : share) {
    const Big scaled = times(a, static_cast<uint64_t>(total));
    int64_t low = 0, high = total;
    while (low < high) {
      const int64_t mid = low + (high - low + 1) / 2;
      if (compare(times(whole, static_cast<uint64_t>(mid)), scaled) <= 0) {
        low = mid;
      } else {
        high = mid - 1;
      }
    }
    sizes.push_back(low);
    remainder.push_back(minus(scaled, times(whole, static_cast<uint64_t>(low))));
    given += low;
  }
  std::vector<size_t> order(sizes.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return compare(remainder[a], remainder[b]) > 0;
  });
  for (int64_t k = 0; k < total - given; ++k) {
    sizes[order[k]] += 1;
  }
  return sizes;
}

std::vector<int64_t> split_sizes(
    int64_t batch, int64_t n_devices, const std::optional<std::vector<int64_t>>& chunk_sizes,
    const std::optional<std::vector<double>>& weights) {
  TORCH_CHECK_VALUE(batch >= 0, "batch: expected a non-negative size, but got ", batch);
  TORCH_CHECK_VALUE(n_devices >= 1, "n_devices: expected at least one device, but got ", n_devices);
  return checked_sizes_for(batch, n_devices, chunk_sizes, weights);
}

SplitPlan plan_split(
    const std::vector<std::optional<int64_t>>& sizes, int64_t n_devices,
    const std::optional<std::vector<int64_t>>& chunk_sizes, const std::optional<std::vector<double>>& weights,
    const std::vector<int64_t>& units) {
  SplitPlan plan;
  if (!units.empty()) { // 0.
    for (size_t k = 1; k < units.size(); ++k) {
      if (units[k] != units[0]) {
        plan.fault = SplitFault::kUnitCount;
        plan.at = static_cast<int64_t>(k);
        return plan;
      }
    }
    plan.batch = units[0];
    plan.sizes = checked_sizes_for(units[0], n_devices, chunk_sizes, weights);
    plan.replicas = replicas_of(plan.sizes);
    for (size_t i = 0; i < sizes.size(); ++i) {
      const std::optional<int64_t>& s = sizes[i];
      if (s && *s != units[0] && *s != plan.replicas && !(*s == n_devices && n_devices > plan.replicas)) {
        plan.fault = SplitFault::kUnitSize;
        plan.at = static_cast<int64_t>(i);
        return plan;
      }
    }
    return plan;
  }
  std::vector<int64_t> distinct; // the sizes, in the order first met
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (sizes[i] && std::find(distinct.begin(), distinct.end(), *sizes[i]) == distinct.end()) {
      plan.first = plan.first < 0 ? static_cast<int64_t>(i) : plan.first;
      distinct.push_back(*sizes[i]);
    }
  }
  if (distinct.empty()) { // 1.
    return plan;
  }
  const int64_t first = distinct[0];
  if (distinct.size() == 1) { // 2.
    plan.batch = first;
    plan.sizes = checked_sizes_for(first, n_devices, chunk_sizes, weights);
    plan.replicas = replicas_of(plan.sizes);
    return plan;
  }
  struct Candidate {
    int64_t batch, other;
    std::vector<int64_t> sizes;
  };
  std::vector<Candidate> candidates; // 3. either size as the batch under the split given
  for (int k = 0; distinct.size() == 2 && k < 2; ++k) {
    if (auto s = sizes_for(distinct[k], n_devices, chunk_sizes, weights)) {
      candidates.push_back({distinct[k], distinct[1 - k], *s});
    }
  }
  for (int rule = 0; rule < 2; ++rule) { // 3., then 3b.
    for (const Candidate& c : candidates) {
      const int64_t replicas = replicas_of(c.sizes);
      if (rule == 0 ? replicas == c.other : c.other == n_devices && n_devices > replicas) {
        plan.batch = c.batch;
        plan.sizes = c.sizes;
        plan.replicas = replicas;
        return plan;
      }
    }
  }
  // 4. The first size that is neither the first's nor the replica count that gives, else the first not the
  // first's.
  plan.fault = SplitFault::kSize;
  if (auto s = sizes_for(first, n_devices, chunk_sizes, weights)) {
    plan.per = replicas_of(*s);
  }
  for (int pass = 0; pass < 2 && plan.at < 0; ++pass) {
    for (size_t i = 0; i < sizes.size() && plan.at < 0; ++i) {
      if (sizes[i] && *sizes[i] != first && (pass == 1 || !plan.per || *sizes[i] != *plan.per)) {
        plan.at = static_cast<int64_t>(i);
      }
    }
  }
  return plan;
}

} // namespace dpcore
