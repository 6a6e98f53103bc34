// Bindings of the PackedSequence index arithmetic (csrc/dpcore/packed.h):
// dpcore._C.packed_split, packed_join and packed_output, as tuples (the
// last reads dpcore._packed.Rows, a NamedTuple). A PackedSequence's
// sorted_indices sit on its data's device: they are copied to the CPU here.
#include <torch/csrc/utils/pybind.h>

#include <cstdint>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

#include "dpcore/packed.h"
#include "python/bindings.h"

namespace py = pybind11;

namespace dpcore {
namespace python {
namespace {

using MaybeTensor = std::optional<at::Tensor>;
using Fields = std::tuple<at::Tensor, MaybeTensor, MaybeTensor>;
using Layout = std::tuple<at::Tensor, at::Tensor, bool>;

MaybeTensor on_host(const MaybeTensor& t) {
  return t ? MaybeTensor(t->to(at::kCPU, at::kLong)) : std::nullopt;
}

// dpcore._packed.Rows: (rows, sequences, back, parts, fields).
using Rows = std::tuple<
    std::vector<int64_t>, std::vector<int64_t>, MaybeTensor, std::vector<Fields>, std::optional<Fields>>;

Fields to_tuple(const PackedFields& f) {
  return {f.batch_sizes, f.sorted_indices, f.unsorted_indices};
}

PackedFields from_tuple(const Fields& f) {
  return {std::get<0>(f), std::get<1>(f), std::get<2>(f)};
}

const char* name_of(PackedOutput kind) {
  switch (kind) {
    case PackedOutput::kAsAny:
      return "as_any";
    case PackedOutput::kField:
      return "field";
    case PackedOutput::kFieldsDiffer:
      return "fields_differ";
    case PackedOutput::kData:
      return "data";
    case PackedOutput::kLengthOne:
      return "length_one";
    case PackedOutput::kUnfit:
      return "unfit";
  }
  return "unfit";
}

} // namespace

void bind_packed(py::module_& m) {
  m.def(
      "packed_split",
      [](const at::Tensor& batch_sizes, const MaybeTensor& sorted_indices,
         const std::vector<int64_t>& sizes) {
        PackedSplit s = packed_split(batch_sizes, on_host(sorted_indices), sizes);
        std::vector<Fields> parts;
        for (const PackedFields& f : s.parts) {
          parts.push_back(to_tuple(f));
        }
        const PackedLayout& l = s.layout;
        return std::make_tuple(
            Layout{l.lengths, l.sorted_indices, l.given_sorted}, s.order, s.back, s.rows, parts);
      },
      py::arg("batch_sizes"), py::arg("sorted_indices"), py::arg("sizes"),
      "(layout (lengths, sorted_indices, given_sorted), order, back, rows, parts) of the split of a "
      "PackedSequence into its next sizes[j] sequences (csrc/dpcore/packed.h).");
  m.def(
      "packed_join",
      [](const std::vector<at::Tensor>& batch_sizes, const std::vector<MaybeTensor>& sorted_indices,
         const std::vector<Layout>& layouts) {
        std::vector<MaybeTensor> host;
        for (const MaybeTensor& t : sorted_indices) {
          host.push_back(on_host(t));
        }
        std::vector<PackedLayout> given;
        for (const auto& [lengths, sorted, given_sorted] : layouts) {
          given.push_back({lengths, sorted, given_sorted});
        }
        PackedJoin j = packed_join(batch_sizes, host, given);
        return std::make_tuple(to_tuple(j.fields), j.source);
      },
      py::arg("batch_sizes"), py::arg("sorted_indices"), py::arg("layouts"),
      "((batch_sizes, sorted_indices, unsorted_indices), source) of the PackedSequences with these fields "
      "joined into one (csrc/dpcore/packed.h).");
  m.def(
      "packed_output",
      [](const std::vector<at::Tensor>& parts, int64_t dim, const std::vector<Rows>& splits) {
        std::vector<PackedRows> rows;
        for (const auto& [counts, sequences, back, fields, whole] : splits) {
          PackedRows r{counts, sequences, !back.has_value(), {}, std::nullopt};
          for (const Fields& f : fields) {
            r.parts.push_back(from_tuple(f));
          }
          if (whole) {
            r.whole = from_tuple(*whole);
          }
          rows.push_back(std::move(r));
        }
        const PackedRule rule = packed_output(parts, dim, rows);
        return std::make_tuple(name_of(rule.kind), rule.split, rule.field, rule.other);
      },
      py::arg("parts"), py::arg("dim"), py::arg("splits"),
      "(kind, split, field, other): the rule of one output of a call with PackedSequence inputs split as "
      "`splits` (csrc/dpcore/packed.h, packed_output).");
}

} // namespace python
} // namespace dpcore
