// The kernels as PyTorch operators: torch.ops.dpcore.pack, .pack_multi,
// .unpack and .reduce_add_n. Here: their schema, the Meta implementations (which check
// shapes and dtypes only, so the ops trace under torch.compile with fake
// tensors) and the Conjugate/Negative fallthroughs. The backends register
// their implementations at the bottom of their own files: CPU in
// kernels/pack.cpp and kernels/reduce_add_n.cpp, CUDA in cuda/pack.cu and
// cuda/reduce_add_n.cu. No Python here: torch/library.h is libtorch.
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS

#include <ATen/core/Tensor.h>
#include <torch/library.h>

namespace dpcore {
namespace {

// Meta (fake) implementations: checks that hold for symbolic shapes too,
// so the ops trace under torch.compile with dynamic shapes.
void check_flat_meta(at::TensorList tensors, const at::Tensor& flat, const char* op) {
  c10::SymInt total = 0;
  for (const at::Tensor& t : tensors) {
    total = total + t.sym_numel();
  }
  TORCH_CHECK(flat.dim() == 1, op, ": expected 'flat' to be 1-D, but it has ", flat.dim(), " dims");
  TORCH_SYM_CHECK(
      flat.sym_numel().sym_eq(total), op, ": expected 'flat' to hold every element of the tensors");
  for (size_t i = 0; i < tensors.size(); ++i) {
    TORCH_CHECK(
        tensors[i].scalar_type() == flat.scalar_type(), op, ": expected tensor ", i, " of dtype ",
        flat.scalar_type(), " (the dtype of 'flat'), but it is ", tensors[i].scalar_type());
  }
}

void pack_meta(at::TensorList tensors, const at::Tensor& flat) {
  check_flat_meta(tensors, flat, "pack");
}

void pack_multi_meta(at::TensorList tensors, at::TensorList flats) {
  TORCH_CHECK(!flats.empty(), "pack_multi: expected at least one tensor in 'flats', but it is empty");
  for (const at::Tensor& flat : flats) {
    check_flat_meta(tensors, flat, "pack_multi");
  }
}

void unpack_meta(const at::Tensor& flat, at::TensorList tensors) {
  check_flat_meta(tensors, flat, "unpack");
}

void reduce_add_n_meta(at::TensorList sources, const at::Tensor& out, bool /*accumulate*/) {
  TORCH_CHECK(!sources.empty(), "reduce_add_n: expected at least one source tensor, but got none");
  for (size_t i = 0; i < sources.size(); ++i) {
    TORCH_CHECK(
        sources[i].scalar_type() == out.scalar_type() && sources[i].dim() == out.dim(),
        "reduce_add_n: expected sources[", i, "] of dtype ", out.scalar_type(), " with ", out.dim(),
        " dims, but it is ", sources[i].scalar_type(), " with ", sources[i].dim());
    for (int64_t d = 0; d < out.dim(); ++d) {
      TORCH_SYM_CHECK(
          sources[i].sym_size(d).sym_eq(out.sym_size(d)), "reduce_add_n: expected sources[", i,
          "] to have the shape of 'out'");
    }
  }
}

} // namespace
} // namespace dpcore

TORCH_LIBRARY(dpcore, m) {
  m.def("pack(Tensor[] tensors, Tensor(a!) flat) -> ()");
  m.def("pack_multi(Tensor[] tensors, Tensor(a!)[] flats) -> ()");
  m.def("unpack(Tensor flat, Tensor(a!)[] tensors) -> ()");
  m.def("reduce_add_n(Tensor[] sources, Tensor(a!) out, bool accumulate=False) -> ()");
}

// Tensors with a lazy conjugate or negative bit reach the implementations
// as they are (their byte-level fast paths take only plain tensors, and ATen
// copies resolve the rest): no materialised copies of inputs, and mutable
// outputs with such a bit work, which the generic fallbacks refuse.
TORCH_LIBRARY_IMPL(dpcore, Conjugate, m) {
  m.impl("pack", torch::CppFunction::makeFallthrough());
  m.impl("pack_multi", torch::CppFunction::makeFallthrough());
  m.impl("unpack", torch::CppFunction::makeFallthrough());
  m.impl("reduce_add_n", torch::CppFunction::makeFallthrough());
}

TORCH_LIBRARY_IMPL(dpcore, Negative, m) {
  m.impl("pack", torch::CppFunction::makeFallthrough());
  m.impl("pack_multi", torch::CppFunction::makeFallthrough());
  m.impl("unpack", torch::CppFunction::makeFallthrough());
  m.impl("reduce_add_n", torch::CppFunction::makeFallthrough());
}

TORCH_LIBRARY_IMPL(dpcore, Meta, m) {
  m.impl("pack", &dpcore::pack_meta);
  m.impl("pack_multi", &dpcore::pack_multi_meta);
  m.impl("unpack", &dpcore::unpack_meta);
  m.impl("reduce_add_n", &dpcore::reduce_add_n_meta);
}
