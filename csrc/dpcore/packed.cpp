#define TORCH_ASSERT_ONLY_METHOD_OPERATORS

#include "dpcore/packed.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/equal.h>
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <algorithm>
#include <numeric>
#include <string>
#include <utility>

namespace dpcore {
namespace {

using Longs = std::vector<int64_t>;

at::Tensor to_tensor(const Longs& v) {
  at::Tensor t = at::empty({static_cast<int64_t>(v.size())}, at::TensorOptions().dtype(at::kLong));
  std::copy(v.begin(), v.end(), t.data_ptr<int64_t>());
  return t;
}

// The values of `t`, a 1-D CPU int64 tensor (checked; `name` in the message).
Longs values_of(const at::Tensor& t, const std::string& what, const std::string& name) {
  TORCH_CHECK(t.defined(), what, ": expected ", name, " to be a tensor, found an undefined tensor");
  TORCH_CHECK(
      t.device().is_cpu() && t.scalar_type() == at::kLong && t.dim() == 1, what, ": expected ", name,
      " to be a 1-D CPU int64 tensor, found a ", t.dim(), "-D ", t.scalar_type(), " tensor on ", t.device());
  const at::Tensor c = t.contiguous();
  const int64_t* p = c.const_data_ptr<int64_t>();
  return Longs(p, p + c.numel());
}

// Checks that `p` is a permutation of 0..n-1.
void check_permutation(const Longs& p, int64_t n, const std::string& what, const std::string& name) {
  TORCH_CHECK(
      static_cast<int64_t>(p.size()) == n, what, ": expected ", name, " to hold ", n, " indices, found ",
      p.size());
  std::vector<bool> seen(n, false);
  for (size_t i = 0; i < p.size(); ++i) {
    TORCH_CHECK(
        p[i] >= 0 && p[i] < n && !seen[p[i]], what, ": expected ", name, " to be a permutation of 0..", n - 1,
        ", found ", name, "[", i, "] = ", p[i], p[i] >= 0 && p[i] < n ? " twice" : " (out of range)");
    seen[p[i]] = true;
  }
}

Longs inverse(const Longs& p) {
  Longs inv(p.size());
  for (size_t i = 0; i < p.size(); ++i) {
    inv[p[i]] = static_cast<int64_t>(i);
  }
  return inv;
}

bool is_identity(const Longs& p) {
  for (size_t i = 0; i < p.size(); ++i) {
    if (p[i] != static_cast<int64_t>(i)) {
      return false;
    }
  }
  return true;
}

// One PackedSequence's batch_sizes, sorted_indices (0..n-1 where not given)
// and lengths (original order), checked.
struct Host {
  Longs batch_sizes, sorted, lengths;
  bool given = false;
};

Host host_layout(
    const at::Tensor& batch_sizes, const std::optional<at::Tensor>& sorted_indices, const std::string& what) {
  Host h;
  h.batch_sizes = values_of(batch_sizes, what, "batch_sizes");
  const Longs& b = h.batch_sizes;
  for (size_t t = 0; t < b.size(); ++t) {
    TORCH_CHECK(b[t] > 0, what, ": expected positive batch_sizes, found batch_sizes[", t, "] = ", b[t]);
    TORCH_CHECK(
        t == 0 || b[t] <= b[t - 1], what, ": expected non-increasing batch_sizes, found batch_sizes[", t,
        "] = ", b[t], " after ", b[t == 0 ? 0 : t - 1]);
  }
  const int64_t n = b.empty() ? 0 : b[0];
  h.given = sorted_indices.has_value() && sorted_indices->defined();
  if (h.given) {
    h.sorted = values_of(*sorted_indices, what, "sorted_indices");
    check_permutation(h.sorted, n, what, "sorted_indices");
  } else {
    h.sorted.resize(n);
    std::iota(h.sorted.begin(), h.sorted.end(), 0);
  }
  h.lengths.assign(n, 0);
  for (int64_t size : b) {
    for (int64_t p = 0; p < size; ++p) {
      ++h.lengths[h.sorted[p]];
    }
  }
  return h;
}

// Whether part j has counts[j] rows along `dim`, for every j.
bool fits(const std::vector<at::Tensor>& parts, const Longs& counts, int64_t dim) {
  if (parts.size() != counts.size()) {
    return false;
  }
  for (size_t j = 0; j < parts.size(); ++j) {
    const int64_t d = parts[j].dim();
    if (dim < -d || dim >= d || parts[j].size(dim) != counts[j]) {
      return false;
    }
  }
  return true;
}

// Field i of `f` (0 batch_sizes, 1 sorted_indices, 2 unsorted_indices); undefined where not given.
at::Tensor field_at(const PackedFields& f, int64_t i) {
  return i == 0 ? f.batch_sizes : (i == 1 ? f.sorted_indices : f.unsorted_indices).value_or(at::Tensor());
}

bool same_values(const at::Tensor& a, const at::Tensor& b) {
  return a.defined() && b.defined() && at::equal(a.cpu(), b.cpu());
}

// The fields of the parts of `split` that every part of `parts` is (the
// first such), else those that every part equals in value.
Longs fields_of(const std::vector<at::Tensor>& parts, const PackedRows& split) {
  if (parts.size() != split.parts.size() || !split.whole) {
    return {};
  }
  for (const at::Tensor& t : parts) {
    if (t.dim() != 1 || t.scalar_type() != at::kLong) {
      return {};
    }
  }
  const auto every = [&](auto&& same, int64_t i) {
    for (size_t j = 0; j < parts.size(); ++j) {
      if (!same(parts[j], field_at(split.parts[j], i))) {
        return false;
      }
    }
    return true;
  };
  const auto is = [](const at::Tensor& a, const at::Tensor& b) { return a.is_same(b); };
  Longs found;
  for (int64_t i = 0; i < 3 && found.empty(); ++i) {
    if (every(is, i)) {
      found.push_back(i);
    }
  }
  if (!found.empty()) {
    return found;
  }
  for (int64_t i = 0; i < 3; ++i) {
    if (every(same_values, i)) {
      found.push_back(i);
    }
  }
  return found;
}

} // namespace

PackedSplit packed_split(
    const at::Tensor& batch_sizes, const std::optional<at::Tensor>& sorted_indices, const Longs& sizes) {
  const Host h = host_layout(batch_sizes, sorted_indices, "packed_split");
  const int64_t n = static_cast<int64_t>(h.lengths.size());
  const size_t replicas = sizes.size();
  TORCH_CHECK(replicas > 0, "packed_split: expected at least one size, found none");
  for (size_t j = 0; j < replicas; ++j) {
    TORCH_CHECK(
        sizes[j] >= 0, "packed_split: expected sizes of at least 0, found sizes[", j, "] = ", sizes[j]);
  }
  TORCH_CHECK(
      std::accumulate(sizes.begin(), sizes.end(), int64_t{0}) == n,
      "packed_split: expected sizes that sum to the ", n, " sequences of the PackedSequence, found sizes ",
      c10::Join(", ", sizes));
  Longs owner, starts; // the part of each sequence (original order); each part's first sequence
  owner.reserve(n);
  for (size_t j = 0; j < replicas; ++j) {
    starts.push_back(static_cast<int64_t>(owner.size()));
    owner.insert(owner.end(), sizes[j], static_cast<int64_t>(j));
  }

  PackedSplit out;
  out.rows.assign(replicas, 0);
  for (int64_t i = 0; i < n; ++i) {
    out.rows[owner[i]] += h.lengths[i];
  }
  Longs next(replicas, 0); // where each part's next row goes in `order`
  std::partial_sum(out.rows.begin(), out.rows.end() - 1, next.begin() + 1);
  std::vector<Longs> local_sizes(replicas), mine(replicas);
  Longs order(std::accumulate(out.rows.begin(), out.rows.end(), int64_t{0}));
  Longs at_step(replicas);
  int64_t row = 0;
  for (int64_t size : h.batch_sizes) {
    std::fill(at_step.begin(), at_step.end(), 0);
    for (int64_t p = 0; p < size; ++p, ++row) {
      const int64_t j = owner[h.sorted[p]];
      order[next[j]++] = row;
      ++at_step[j];
    }
    for (size_t j = 0; j < replicas; ++j) {
      if (at_step[j] > 0) {
        local_sizes[j].push_back(at_step[j]);
      }
    }
  }
  for (int64_t i : h.sorted) {
    mine[owner[i]].push_back(i - starts[owner[i]]);
  }
  for (size_t j = 0; j < replicas; ++j) {
    PackedFields fields{to_tensor(local_sizes[j]), std::nullopt, std::nullopt};
    if (h.given) {
      fields.sorted_indices = to_tensor(mine[j]);
      fields.unsorted_indices = to_tensor(inverse(mine[j]));
    }
    out.parts.push_back(std::move(fields));
  }
  if (!is_identity(order)) {
    out.back = to_tensor(inverse(order));
  }
  out.order = to_tensor(order);
  out.layout = {to_tensor(h.lengths), to_tensor(h.sorted), h.given};
  return out;
}

PackedJoin packed_join(
    const std::vector<at::Tensor>& batch_sizes, const std::vector<std::optional<at::Tensor>>& sorted_indices,
    const std::vector<PackedLayout>& layouts) {
  TORCH_CHECK(
      batch_sizes.size() == sorted_indices.size(),
      "packed_join: expected one sorted_indices (or None) per batch_sizes, found ", batch_sizes.size(),
      " batch_sizes and ", sorted_indices.size(), " sorted_indices");
  Longs lengths;
  std::vector<std::pair<int64_t, int64_t>> sources; // (time, joined sequence) of each row, part after part
  bool any_given = false;
  for (size_t k = 0; k < batch_sizes.size(); ++k) {
    const Host h = host_layout(batch_sizes[k], sorted_indices[k], c10::str("packed_join: part ", k));
    const int64_t offset = static_cast<int64_t>(lengths.size());
    for (size_t t = 0; t < h.batch_sizes.size(); ++t) {
      for (int64_t p = 0; p < h.batch_sizes[t]; ++p) {
        sources.emplace_back(static_cast<int64_t>(t), h.sorted[p] + offset);
      }
    }
    lengths.insert(lengths.end(), h.lengths.begin(), h.lengths.end());
    any_given = any_given || h.given;
  }
  const int64_t n = static_cast<int64_t>(lengths.size());

  Longs order;
  bool given = false, matched = false;
  for (size_t i = 0; i < layouts.size() && !matched; ++i) {
    const std::string name = c10::str("layouts[", i, "]");
    matched = values_of(layouts[i].lengths, "packed_join", name + ".lengths") == lengths;
    if (matched) {
      order = values_of(layouts[i].sorted_indices, "packed_join", name + ".sorted_indices");
      check_permutation(order, n, "packed_join", name + ".sorted_indices");
      given = layouts[i].given_sorted;
    }
  }
  if (!matched) {
    order.resize(n);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(
        order.begin(), order.end(), [&](int64_t a, int64_t b) { return lengths[a] > lengths[b]; });
    given = any_given || !is_identity(order);
  }

  const int64_t steps = n > 0 ? *std::max_element(lengths.begin(), lengths.end()) : 0;
  Longs longer(steps + 1, 0); // longer[t]: sequences of length t, then (suffix sums) longer than t - 1
  for (int64_t length : lengths) {
    ++longer[length];
  }
  Longs joined_sizes(steps), step_starts(steps);
  int64_t count = 0;
  for (int64_t t = steps - 1; t >= 0; --t) {
    count += longer[t + 1];
    joined_sizes[t] = count;
  }
  if (steps > 0) {
    std::partial_sum(joined_sizes.begin(), joined_sizes.end() - 1, step_starts.begin() + 1);
  }
  const Longs position = inverse(order);
  Longs source(sources.size());
  for (size_t g = 0; g < sources.size(); ++g) {
    source[step_starts[sources[g].first] + position[sources[g].second]] = static_cast<int64_t>(g);
  }
  PackedJoin out{{to_tensor(joined_sizes), std::nullopt, std::nullopt}, to_tensor(source)};
  if (given) {
    out.fields.sorted_indices = to_tensor(order);
    out.fields.unsorted_indices = to_tensor(position);
  }
  return out;
}

PackedRule packed_output(
    const std::vector<at::Tensor>& parts, int64_t dim, const std::vector<PackedRows>& splits) {
  using K = PackedOutput;
  if (std::all_of(parts.begin(), parts.end(), [](const at::Tensor& t) { return t.dim() == 0; })) {
    return {K::kAsAny};
  }
  std::vector<std::pair<int64_t, int64_t>> found; // (split, field)
  for (size_t s = 0; s < splits.size(); ++s) {
    for (int64_t i : fields_of(parts, splits[s])) {
      found.emplace_back(static_cast<int64_t>(s), i);
    }
  }
  if (!found.empty()) {
    const auto [split, field] = found[0];
    const at::Tensor first = field_at(*splits[split].whole, field);
    for (const auto& [s, i] : found) {
      if (!same_values(field_at(*splits[s].whole, i), first)) {
        return {K::kFieldsDiffer, split, field, i};
      }
    }
    return {K::kField, split, field};
  }
  const bool first_dim = dim == 0 || dim == -parts[0].dim();
  for (size_t s = 0; s < splits.size(); ++s) {
    const PackedRows& split = splits[s];
    if (!fits(parts, split.rows, 0)) {
      continue;
    }
    if (!fits(parts, split.sequences, dim)) {
      return split.in_order && first_dim ? PackedRule{K::kAsAny}
                                         : PackedRule{K::kData, static_cast<int64_t>(s)};
    }
    return !first_dim || split.in_order ? PackedRule{K::kAsAny}
                                        : PackedRule{K::kLengthOne, static_cast<int64_t>(s)};
  }
  for (const PackedRows& split : splits) {
    if (fits(parts, split.sequences, dim)) {
      return {K::kAsAny};
    }
  }
  return {K::kUnfit};
}

} // namespace dpcore
