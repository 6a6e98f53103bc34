// Shared helpers of the dpcore gtest suite.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/Device.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <string>
#include <utility>
#include <vector>

namespace dpcore_test {

// k CPU "devices" (repeats of the one CPU).
inline std::vector<c10::Device> cpus(size_t k) {
  return std::vector<c10::Device>(k, c10::Device(c10::kCPU));
}

inline c10::Device meta() {
  return c10::Device(c10::kMeta);
}

inline at::Tensor meta_tensor(at::IntArrayRef sizes, at::ScalarType dtype = at::kFloat) {
  return at::empty(sizes, at::TensorOptions().dtype(dtype).device(c10::kMeta));
}

// A CPU tensor of `dtype` with deterministic, distinct-ish values (exact in
// every dtype used: small integers).
inline at::Tensor values(at::IntArrayRef sizes, at::ScalarType dtype = at::kFloat, int64_t seed = 0) {
  const int64_t n = c10::multiply_integers(sizes);
  at::Tensor base = at::arange(n, at::kLong).add_(seed).remainder_(97).sub_(48);
  return base.to(dtype).reshape(sizes);
}

// Exact equality of values, dtype and shape; sparse tensors are compared dense.
inline ::testing::AssertionResult same_values(const at::Tensor& a, const at::Tensor& b) {
  if (!a.defined() || !b.defined()) {
    return ::testing::AssertionFailure() << "undefined tensor";
  }
  if (a.scalar_type() != b.scalar_type()) {
    return ::testing::AssertionFailure() << "dtype " << a.scalar_type() << " vs " << b.scalar_type();
  }
  if (!a.sizes().equals(b.sizes())) {
    return ::testing::AssertionFailure() << "shape " << a.sizes() << " vs " << b.sizes();
  }
  if (a.layout() != b.layout()) {
    return ::testing::AssertionFailure() << "layout " << a.layout() << " vs " << b.layout();
  }
  const at::Tensor da = a.is_sparse() ? a.to_dense() : a;
  const at::Tensor db = b.is_sparse() ? b.to_dense() : b;
  if (!at::equal(da, db)) {
    return ::testing::AssertionFailure() << "values differ:\n" << da << "\nvs\n" << db;
  }
  return ::testing::AssertionSuccess();
}

inline ::testing::AssertionResult close_values(
    const at::Tensor& a, const at::Tensor& b, double rtol, double atol) {
  if (a.scalar_type() != b.scalar_type() || !a.sizes().equals(b.sizes())) {
    return ::testing::AssertionFailure()
           << "dtype/shape " << a.scalar_type() << a.sizes() << " vs " << b.scalar_type() << b.sizes();
  }
  const at::Tensor da = (a.is_sparse() ? a.to_dense() : a).to(at::kDouble);
  const at::Tensor db = (b.is_sparse() ? b.to_dense() : b).to(at::kDouble);
  if (!at::allclose(da, db, rtol, atol)) {
    return ::testing::AssertionFailure()
           << "values not close: max abs diff " << (da - db).abs().max().item<double>();
  }
  return ::testing::AssertionSuccess();
}

// Runs `fn`, which must throw c10::Error (or a subclass) whose message
// (without backtrace) contains `needle`.
template <typename F>
::testing::AssertionResult throws_c10(F&& fn, const std::string& needle) {
  try {
    std::forward<F>(fn)();
  } catch (const c10::Error& e) {
    const std::string msg = e.what_without_backtrace();
    if (msg.find(needle) == std::string::npos) {
      return ::testing::AssertionFailure() << "c10::Error thrown, but its message lacks '" << needle << "':\n"
                                           << msg;
    }
    return ::testing::AssertionSuccess();
  } catch (const std::exception& e) {
    return ::testing::AssertionFailure()
           << "expected c10::Error containing '" << needle << "', got std::exception: " << e.what();
  }
  return ::testing::AssertionFailure()
         << "expected c10::Error containing '" << needle << "', but nothing was thrown";
}

} // namespace dpcore_test

// EXPECT_C10_ERROR("substring of the message", statement): the statement
// (commas allowed) must throw c10::Error with that substring.
#define EXPECT_C10_ERROR(needle, ...) \
  EXPECT_TRUE(::dpcore_test::throws_c10([&]() { (void)(__VA_ARGS__); }, (needle)))
