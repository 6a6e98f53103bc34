// The index arithmetic of a PackedSequence split by whole sequences between
// replicas and of PackedSequences joined back into one (the rules:
// docs/samples.md, docs/design.md "PackedSequence"). CPU int64 tensors in and
// out; the data rows themselves are moved by the front end (one index_select
// and one Scatter or Gather). Includes no dpcore header.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <vector>

namespace dpcore {

// The order of one PackedSequence: its sequences' lengths (original order),
// its sorted_indices (0..n-1 where it had none) and whether it had them.
struct PackedLayout {
  at::Tensor lengths;
  at::Tensor sorted_indices;
  bool given_sorted = false;
};

// The fields of one replica's part: batch_sizes, and sorted_indices and
// unsorted_indices where the input had sorted_indices.
struct PackedFields {
  at::Tensor batch_sizes;
  std::optional<at::Tensor> sorted_indices;
  std::optional<at::Tensor> unsorted_indices;
};

struct PackedSplit {
  PackedLayout layout;
  // The batch's packed row of each row of the replicas' parts concatenated
  // in replica order (each part's rows in its own packed order).
  at::Tensor order;
  // The inverse of `order` (for each of the batch's packed rows, its row
  // among the parts concatenated); none where `order` is the identity.
  std::optional<at::Tensor> back;
  std::vector<int64_t> rows; // packed rows of each part
  std::vector<PackedFields> parts;
};

// The split of the PackedSequence with these `batch_sizes` (1-D, positive,
// non-increasing) and `sorted_indices` (a permutation of its batch_sizes[0]
// sequences, or none) into parts of its next `sizes[j]` sequences (original
// order; the sizes sum to its sequence count, a size may be 0).
PackedSplit packed_split(
    const at::Tensor& batch_sizes, const std::optional<at::Tensor>& sorted_indices,
    const std::vector<int64_t>& sizes);

struct PackedJoin {
  PackedFields fields;
  // For each row of the joined PackedSequence, its row among the parts' data
  // concatenated in part order.
  at::Tensor source;
};

// One PackedSequence of the sequences of parts k = 0, 1, ... (batch_sizes[k],
// sorted_indices[k]), in that order: sorted as the first of `layouts` whose
// lengths are the joined lengths (with sorted_indices and unsorted_indices
// where it had them), else stably longest first (without them where that
// order is the identity and no part had sorted_indices).
PackedJoin packed_join(
    const std::vector<at::Tensor>& batch_sizes, const std::vector<std::optional<at::Tensor>>& sorted_indices,
    const std::vector<PackedLayout>& layouts);

// One split PackedSequence input, as the gather of the call's outputs sees it.
struct PackedRows {
  std::vector<int64_t> rows;         // packed rows of each part
  std::vector<int64_t> sequences;    // sequences of each part
  bool in_order = false;             // the parts' rows concatenated are in the batch's packed order
  std::vector<PackedFields> parts;   // the fields each part was given
  std::optional<PackedFields> whole; // the input's own fields
};

// What one output of a call with PackedSequence inputs is, from the
// replicas' tensors of it (docs/design.md, "PackedSequence"): the first rule
// that fits, in this order.
enum class PackedOutput {
  kAsAny,        // gathered as any output: 0-dim on every replica, or one row per sequence along dim
  kField,        // field `field` (0 batch_sizes, 1 sorted_indices, 2 unsorted_indices) of the parts of
                 // split `split`: on every replica that very tensor, else a tensor of its values
  kFieldsDiffer, // equal to fields `field` and `other` of the parts, which differ for the whole batch
  kData,         // packed data of split `split`: each replica's packed rows along dim 0
  kLengthOne,    // one row per sequence and per packed row along dim 0, the packed order not the identity
  kUnfit,        // none of these
};

struct PackedRule {
  PackedOutput kind = PackedOutput::kAsAny;
  int64_t split = -1;
  int64_t field = -1;
  int64_t other = -1;
};

// The rule of the output whose replicas' tensors are `parts` (one per part
// of each split), of a call whose PackedSequence inputs were split as
// `splits`; `dim` is the gather's.
PackedRule packed_output(
    const std::vector<at::Tensor>& parts, int64_t dim, const std::vector<PackedRows>& splits);

} // namespace dpcore
