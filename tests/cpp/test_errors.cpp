// Every argument check of the C++ core raises c10::Error with a message that
// names what is wrong. One test per source file / entry point.
#include <ATen/ATen.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

#include "dpcore/comm.h"
#include "dpcore/device.h"
#include "dpcore/env.h"
#include "dpcore/flatten.h"
#include "dpcore/kernels.h"
#include "helpers.h"

using dpcore_test::cpus;
using dpcore_test::meta;
using dpcore_test::meta_tensor;
using dpcore_test::values;

namespace {

const std::vector<c10::Device> kNoDevices;

// The message check_devices gives for device type `type` when that type's
// guard is not loaded (CUDA in a CPU build) or no device is visible.
std::string unusable_device_needle(c10::DeviceType type) {
  return c10::impl::hasDeviceGuardImpl(type) ? "device(s) are visible"
                                             : "no support for that device type loaded";
}

at::Tensor csr() {
  return values({3, 4}).to_sparse_csr();
}

} // namespace

// -------------------------------------------------------------------- device

TEST(Errors, CheckDevices) {
  EXPECT_C10_ERROR(
      "op1: expected at least one device in 'devs', but the list is empty",
      dpcore::check_devices(kNoDevices, "op1", "devs"));
  EXPECT_C10_ERROR(
      "to be of one device type, but devs[0] is cpu and devs[1] is meta",
      dpcore::check_devices(std::vector<c10::Device>{c10::kCPU, meta()}, "op", "devs"));
  EXPECT_C10_ERROR(
      "expected all of 'devices' to be of one device type, but devices[0] is meta:0 and devices[1] is cpu",
      dpcore::check_devices(std::vector<c10::Device>{c10::Device(c10::kMeta, 0), c10::kCPU}, "op"));
  // Devices are checked in order: an unusable devices[0] is reported first.
  EXPECT_C10_ERROR(
      "devices[0] is meta, but only 1 meta device(s) are visible",
      dpcore::check_devices(std::vector<c10::Device>{meta(), c10::kCPU}, "op"));
  // Meta has a (no-op) guard: one device, and an index is required.
  EXPECT_C10_ERROR(
      "op: devices[0] is meta, but only 1 meta device(s) are visible",
      dpcore::check_devices(std::vector<c10::Device>{meta()}, "op"));
  EXPECT_C10_ERROR(
      "devices[1] is meta:3, but only 1 meta device(s) are visible",
      dpcore::check_devices(
          std::vector<c10::Device>{c10::Device(c10::kMeta, 0), c10::Device(c10::kMeta, 3)}, "op"));
  // No CUDA device is visible in this build / on this machine.
  EXPECT_C10_ERROR(
      unusable_device_needle(c10::kCUDA),
      dpcore::check_devices(std::vector<c10::Device>{c10::Device(c10::kCUDA, 0)}, "op"));
  EXPECT_C10_ERROR(
      unusable_device_needle(c10::kXLA),
      dpcore::check_devices(std::vector<c10::Device>{c10::Device(c10::kXLA, 0)}, "op"));
}

TEST(Errors, CurrentDevice) {
  if (!c10::impl::hasDeviceGuardImpl(c10::kXLA)) {
    EXPECT_C10_ERROR("no support for device type XLA is loaded", dpcore::current_device(c10::kXLA));
  }
  if (!c10::impl::hasDeviceGuardImpl(c10::kCUDA)) {
    EXPECT_C10_ERROR("no support for device type CUDA is loaded", dpcore::current_device(c10::kCUDA));
  }
  // At least one of the two is absent in a CPU-only test binary.
  EXPECT_FALSE(c10::impl::hasDeviceGuardImpl(c10::kXLA) && c10::impl::hasDeviceGuardImpl(c10::kCUDA));
}

// ------------------------------------------------------------------- flatten

TEST(Errors, FlatLayoutAndBuckets) {
  EXPECT_C10_ERROR(
      "flatten: expected dense tensors, but tensor 1 has layout Sparse",
      dpcore::FlatLayout::of({values({2}), values({2, 2}).to_sparse()}));
  EXPECT_C10_ERROR(
      "flatten: expected all tensors to have dtype Float (the dtype of tensor 0), but tensor 2 has "
      "dtype Double",
      dpcore::FlatLayout::of({values({2}), values({3}), values({2}, at::kDouble)}));

  for (const int64_t bad : {0, -1, -1024}) {
    EXPECT_C10_ERROR(
        "expected bucket_bytes (buffer_size) to be positive, but got " + std::to_string(bad),
        dpcore::make_buckets({values({2})}, bad));
    EXPECT_C10_ERROR("to be positive", dpcore::make_buckets({}, bad));
  }
  EXPECT_C10_ERROR(
      "expected a defined tensor at index 1", dpcore::make_buckets({values({2}), at::Tensor()}, 64));
  EXPECT_C10_ERROR(
      "expected dense or sparse COO tensors, but tensor 1 has layout SparseCsr",
      dpcore::make_buckets({values({2}), csr()}, 64));

  const auto layout = dpcore::FlatLayout::of({});
  EXPECT_C10_ERROR("flatten: expected at least one tensor", dpcore::flatten({}, layout));
}

// ---------------------------------------------------------------- pack/unpack

TEST(Errors, PackAndUnpack) {
  const std::vector<at::Tensor> list = {values({2, 3}), values({4})};
  const auto layout = dpcore::FlatLayout::of(list); // 10 floats
  const at::Tensor flat = at::empty({10});
  for (const bool to_flat : {true, false}) {
    const std::string op = to_flat ? "pack: " : "unpack: ";
    auto run = [&](at::TensorList tensors, const at::Tensor& f) {
      if (to_flat) {
        dpcore::pack(tensors, layout, f);
      } else {
        dpcore::unpack(f, layout, tensors);
      }
    };
    // Sanity: the valid call does not throw.
    EXPECT_NO_THROW(run(list, flat));
    EXPECT_C10_ERROR(op + "expected 2 tensors (the layout's entries), but got 1", run({list[0]}, flat));
    EXPECT_C10_ERROR(op + "expected 2 tensors", run({list[0], list[1], list[1]}, flat));
    EXPECT_C10_ERROR(op + "expected 'flat' to be a contiguous 1-D tensor", run(list, at::empty({2, 5})));
    EXPECT_C10_ERROR(
        op + "expected 'flat' to be a contiguous 1-D tensor", run(list, at::empty({20}).slice(0, 0, 20, 2)));
    EXPECT_C10_ERROR(op + "expected 'flat' to have 10 elements, but it has 11", run(list, at::empty({11})));
    EXPECT_C10_ERROR(
        op + "expected 'flat' of dtype Float, but it is Double", run(list, at::empty({10}, at::kDouble)));
    EXPECT_C10_ERROR(
        op + "expected tensor 1 on cpu (the device of 'flat'), but it is on meta",
        run({list[0], meta_tensor({4})}, flat));
    EXPECT_C10_ERROR(op + "expected tensor 0 on meta (the device of 'flat')", run(list, meta_tensor({10})));
    EXPECT_C10_ERROR(
        op + "expected tensor 1 of dtype Float, but it is Long",
        run({list[0], values({4}, at::kLong)}, flat));
    EXPECT_C10_ERROR(
        op + "expected tensor 0 of shape [2, 3], but it has shape [3, 2]",
        run({values({3, 2}), list[1]}, flat));
    EXPECT_C10_ERROR(
        op + "expected tensor 1 of shape [4], but it has shape [2, 2]", run({list[0], values({2, 2})}, flat));
  }
}

TEST(Errors, PackMulti) {
  const std::vector<at::Tensor> list = {values({2, 3}), values({4})};
  const auto layout = dpcore::FlatLayout::of(list); // 10 floats
  const at::Tensor flat = at::empty({10});
  // Sanity: the valid call does not throw.
  EXPECT_NO_THROW(dpcore::pack_multi(list, layout, {flat, at::empty({10})}));
  EXPECT_C10_ERROR(
      "pack_multi: expected at least one tensor in 'flats', but it is empty",
      dpcore::pack_multi(list, layout, {}));
  EXPECT_C10_ERROR(
      "pack_multi: expected 2 tensors (the layout's entries), but got 1",
      dpcore::pack_multi({list[0]}, layout, {flat}));
  EXPECT_C10_ERROR(
      "pack_multi: expected flats[1] to be a defined tensor",
      dpcore::pack_multi(list, layout, {flat, at::Tensor()}));
  EXPECT_C10_ERROR(
      "pack_multi: expected flats[1] to be a contiguous 1-D tensor, but it has sizes [2, 5]",
      dpcore::pack_multi(list, layout, {flat, at::empty({2, 5})}));
  EXPECT_C10_ERROR(
      "pack_multi: expected flats[2] to have 10 elements, but it has 11",
      dpcore::pack_multi(list, layout, {flat, flat, at::empty({11})}));
  EXPECT_C10_ERROR(
      "pack_multi: expected flats[0] of dtype Float, but it is Double",
      dpcore::pack_multi(list, layout, {at::empty({10}, at::kDouble)}));
  EXPECT_C10_ERROR(
      "pack_multi: expected every flat buffer on cpu (the device of flats[0]), but flats[1] is on meta",
      dpcore::pack_multi(list, layout, {flat, meta_tensor({10})}));
  EXPECT_C10_ERROR(
      "pack_multi: expected tensor 1 on cpu (the device of flats[0]), but it is on meta",
      dpcore::pack_multi({list[0], meta_tensor({4})}, layout, {flat}));
  EXPECT_C10_ERROR(
      "pack_multi: expected tensor 0 of shape [2, 3], but it has shape [3, 2]",
      dpcore::pack_multi({values({3, 2}), list[1]}, layout, {flat}));
}

// -------------------------------------------------------------- reduce_add_n

TEST(Errors, ReduceAddN) {
  const at::Tensor a = values({2, 3});
  at::Tensor out = at::empty({2, 3});
  EXPECT_NO_THROW(dpcore::reduce_add_n({a, a}, out, false));
  EXPECT_C10_ERROR(
      "reduce_add_n: expected at least one source tensor, but got none",
      dpcore::reduce_add_n({}, out, false));
  EXPECT_C10_ERROR(
      "reduce_add_n: expected a defined 'out' tensor", dpcore::reduce_add_n({a}, at::Tensor(), false));
  EXPECT_C10_ERROR(
      "reduce_add_n: expected a dense 'out', but it has layout Sparse",
      dpcore::reduce_add_n({a}, a.to_sparse(), false));
  EXPECT_C10_ERROR(
      "expected sources[1] on cpu (the device of 'out') or on a device whose memory "
      "it can read directly (peer access), but it is on meta",
      dpcore::reduce_add_n({a, meta_tensor({2, 3})}, out, true));
  EXPECT_C10_ERROR(
      "expected sources[0] of dtype Float (the dtype of 'out'), but it is Double",
      dpcore::reduce_add_n({a.to(at::kDouble)}, out, false));
  EXPECT_C10_ERROR(
      "expected sources[2] of dtype Float (the dtype of 'out'), but it is Half",
      dpcore::reduce_add_n({a, a, a.to(at::kHalf)}, out, false));
  EXPECT_C10_ERROR(
      "expected sources[1] of shape [2, 3] (the shape of 'out'), but it has shape [3, 2]",
      dpcore::reduce_add_n({a, values({3, 2})}, out, false));
  EXPECT_C10_ERROR(
      "expected sources[0] of shape [2, 3] (the shape of 'out'), but it has shape [6]",
      dpcore::reduce_add_n({values({6})}, out, true));
  EXPECT_C10_ERROR(
      "reduce_add_n: expected dense sources, but sources[1] has layout Sparse",
      dpcore::reduce_add_n({a, a.to_sparse()}, out, false));
}

TEST(Errors, ReduceAddLists) {
  const at::Tensor a = values({4});
  std::vector<at::Tensor> outs = {at::empty({4}), at::empty({4})};
  EXPECT_C10_ERROR(
      "reduce_add_lists: expected at least one source list, but got none",
      dpcore::reduce_add_lists({}, outs, false));
  EXPECT_C10_ERROR(
      "reduce_add_lists: expected sources[1] to hold 2 tensors (one per output), but it holds 1",
      dpcore::reduce_add_lists({{a, a}, {a}}, outs, false));
  EXPECT_C10_ERROR("(the shape of 'out')", dpcore::reduce_add_lists({{a, a}, {a, values({5})}}, outs, false));
  EXPECT_C10_ERROR("(the dtype of 'out')", dpcore::reduce_add_lists({{a, a.to(at::kLong)}}, outs, true));
  // Nothing was written before the checks failed.
  std::vector<at::Tensor> zeros = {at::zeros({4}), at::zeros({4})};
  EXPECT_C10_ERROR("(the shape of 'out')", dpcore::reduce_add_lists({{a, values({5})}}, zeros, false));
  EXPECT_TRUE(at::equal(zeros[0], at::zeros({4})));
}

// ----------------------------------------------------------------- broadcast

TEST(Errors, Broadcast) {
  const at::Tensor t = values({2, 3});
  EXPECT_C10_ERROR("broadcast: expected a defined 'tensor'", dpcore::broadcast(at::Tensor(), cpus(2)));
  EXPECT_C10_ERROR(
      "broadcast: expected at least one device in 'devices', but the list is empty",
      dpcore::broadcast(t, kNoDevices));
  EXPECT_C10_ERROR(
      "broadcast: expected all of 'devices' to be of one device type",
      dpcore::broadcast(t, std::vector<c10::Device>{c10::kCPU, meta()}));
  EXPECT_C10_ERROR(
      unusable_device_needle(c10::kCUDA),
      dpcore::broadcast(t, std::vector<c10::Device>{c10::Device(c10::kCUDA, 0)}));
}

TEST(Errors, BroadcastOut) {
  const at::Tensor t = values({2, 3});
  EXPECT_C10_ERROR(
      "broadcast: expected a defined 'tensor'", dpcore::broadcast_out(at::Tensor(), {at::empty({2, 3})}));
  EXPECT_C10_ERROR(
      "broadcast: expected at least one tensor in 'out', but it is empty", dpcore::broadcast_out(t, {}));
  EXPECT_C10_ERROR(
      "broadcast: expected out[1] to be a defined tensor",
      dpcore::broadcast_out(t, {at::empty({2, 3}), at::Tensor()}));
  EXPECT_C10_ERROR(
      "expected all output tensors on devices of type cpu (the type of out[0]), but output tensor at "
      "index 1 is on meta",
      dpcore::broadcast_out(t, {at::empty({2, 3}), meta_tensor({2, 3})}));
  EXPECT_C10_ERROR(
      "expected all output tensors to have the shape of the source tensor [2, 3], but output tensor at "
      "index 2 has shape [3, 2]",
      dpcore::broadcast_out(t, {at::empty({2, 3}), at::empty({2, 3}), at::empty({3, 2})}));
  EXPECT_C10_ERROR(
      "expected all output tensors to have the dtype of the source tensor (Float), but output tensor at "
      "index 0 has dtype Long",
      dpcore::broadcast_out(t, {at::empty({2, 3}, at::kLong)}));
}

TEST(Errors, BroadcastCoalesced) {
  const std::vector<at::Tensor> list = {values({2}), values({3}, at::kDouble)};
  EXPECT_C10_ERROR(
      "broadcast_coalesced: expected at least one device in 'devices'",
      dpcore::broadcast_coalesced(list, kNoDevices));
  EXPECT_C10_ERROR(
      "broadcast_coalesced: expected all of 'devices' to be of one device type",
      dpcore::broadcast_coalesced(list, std::vector<c10::Device>{c10::kCPU, meta()}));
  EXPECT_C10_ERROR(
      "broadcast_coalesced: tensors[1] is undefined",
      dpcore::broadcast_coalesced({list[0], at::Tensor()}, cpus(2)));
  EXPECT_C10_ERROR(
      "broadcast_coalesced: expected all tensors on devices[0] (cpu), but tensors[1] is on meta",
      dpcore::broadcast_coalesced({list[0], meta_tensor({3})}, cpus(2)));
  EXPECT_C10_ERROR(
      "expected bucket_bytes (buffer_size) to be positive, but got 0",
      dpcore::broadcast_coalesced(list, cpus(2), 0));
  EXPECT_C10_ERROR("to be positive, but got -8", dpcore::broadcast_coalesced(list, cpus(2), -8));
  EXPECT_C10_ERROR(
      "expected dense or sparse COO tensors, but tensor 2 has layout SparseCsr",
      dpcore::broadcast_coalesced({list[0], list[1], csr()}, cpus(2)));
}

TEST(Errors, BroadcastFlatInto) {
  const std::vector<at::Tensor> members = {values({2, 3}), values({4})};
  const auto layout = dpcore::FlatLayout::of(members);
  EXPECT_C10_ERROR(
      "broadcast_flat_into: expected at least one tensor",
      dpcore::broadcast_flat_into({}, layout, {at::empty({10})}));
  // Every buffer is checked, named by its index in 'flats', before any is written.
  EXPECT_C10_ERROR(
      "broadcast_flat_into: expected flats[1] to have 10 elements, but it has 9",
      dpcore::broadcast_flat_into(members, layout, {at::empty({10}), at::empty({9})}));
  EXPECT_C10_ERROR(
      "broadcast_flat_into: expected flats[0] of dtype Float, but it is Half",
      dpcore::broadcast_flat_into(members, layout, {at::empty({10}, at::kHalf)}));
  EXPECT_C10_ERROR(
      "broadcast_flat_into: expected flats[2] to be a contiguous 1-D tensor",
      dpcore::broadcast_flat_into(members, layout, {at::empty({10}), meta_tensor({10}), at::empty({2, 5})}));
  const at::Tensor untouched = at::full({10}, 5.0);
  EXPECT_C10_ERROR(
      "broadcast_flat_into: expected flats[1] to have 10 elements",
      dpcore::broadcast_flat_into(members, layout, {untouched, at::empty({9})}));
  EXPECT_TRUE(at::equal(untouched, at::full({10}, 5.0)));
}

// ---------------------------------------------------------------- reduce_add

TEST(Errors, ReduceAdd) {
  const at::Tensor a = values({2, 3});
  EXPECT_C10_ERROR(
      "reduce_add: expected at least one tensor to reduce, but got none",
      dpcore::reduce_add({}, std::nullopt));
  EXPECT_C10_ERROR("reduce_add: inputs[1] is undefined", dpcore::reduce_add({a, at::Tensor()}, std::nullopt));
  EXPECT_C10_ERROR(
      "reduce_add: expected all tensors to have the shape [2, 3] of inputs[0], but inputs[2] has "
      "shape [3, 2]",
      dpcore::reduce_add({a, a, values({3, 2})}, std::nullopt));
  EXPECT_C10_ERROR(
      "reduce_add: expected all tensors to have the dtype Float of inputs[0], but inputs[1] has dtype "
      "Int",
      dpcore::reduce_add({a, a.to(at::kInt)}, std::nullopt));
  EXPECT_C10_ERROR(
      "reduce_add: expected all tensors to have the layout Strided of inputs[0], but inputs[1] has "
      "layout Sparse",
      dpcore::reduce_add({a, a.to_sparse()}, std::nullopt));
  EXPECT_C10_ERROR(
      "reduce_add: expected all tensors on devices of one type, but inputs[0] is on cpu and inputs[1] "
      "is on meta",
      dpcore::reduce_add({a, meta_tensor({2, 3})}, std::nullopt));
  EXPECT_C10_ERROR(
      "reduce_add: destination[0] is meta, but only 1 meta device(s) are visible",
      dpcore::reduce_add({a, a}, meta()));
  EXPECT_C10_ERROR(
      "reduce_add: destination[0] is meta",
      dpcore::reduce_add({meta_tensor({2}), meta_tensor({2})}, std::nullopt));
  EXPECT_C10_ERROR(
      unusable_device_needle(c10::kCUDA), dpcore::reduce_add({a, a}, c10::Device(c10::kCUDA, 0)));
  // Only dense and sparse COO tensors are summable.
  EXPECT_C10_ERROR(
      "reduce_add: expected dense or sparse COO tensors, but inputs[0] has layout SparseCsr",
      dpcore::reduce_add({csr(), csr()}, std::nullopt));
  EXPECT_C10_ERROR(
      "reduce_add: expected dense or sparse COO tensors, but inputs[1] has layout SparseCsr",
      dpcore::reduce_add({a, csr()}, std::nullopt));
}

TEST(Errors, ReduceAddCoalesced) {
  const at::Tensor a = values({2, 3});
  const at::Tensor b = values({4}, at::kLong);
  EXPECT_C10_ERROR(
      "reduce_add_coalesced: expected at least one list of tensors in 'inputs'",
      dpcore::reduce_add_coalesced({}, std::nullopt));
  EXPECT_C10_ERROR(
      "reduce_add_coalesced: expected inputs[1] to hold 2 tensors, as inputs[0] does, but it holds 1",
      dpcore::reduce_add_coalesced({{a, b}, {a}}, std::nullopt));
  EXPECT_C10_ERROR(
      "expected inputs[2] to hold 2 tensors, as inputs[0] does, but it holds 3",
      dpcore::reduce_add_coalesced({{a, b}, {a, b}, {a, b, b}}, std::nullopt));
  EXPECT_C10_ERROR(
      "reduce_add_coalesced: inputs[1][0] is undefined",
      dpcore::reduce_add_coalesced({{a, b}, {at::Tensor(), b}}, std::nullopt));
  EXPECT_C10_ERROR(
      "reduce_add_coalesced: expected all of inputs[0] on one device, but inputs[0][0] is on cpu and "
      "inputs[0][1] is on meta",
      dpcore::reduce_add_coalesced({{a, meta_tensor({4}, at::kLong)}, {a, b}}, std::nullopt));
  EXPECT_C10_ERROR(
      "reduce_add_coalesced: expected all tensors to have the shape [4] of inputs[0][1], but "
      "inputs[1][1] has shape [5]",
      dpcore::reduce_add_coalesced({{a, b}, {a, values({5}, at::kLong)}}, std::nullopt));
  EXPECT_C10_ERROR(
      "expected all tensors to have the dtype Float of inputs[0][0], but inputs[2][0] has dtype "
      "Double",
      dpcore::reduce_add_coalesced({{a, b}, {a, b}, {a.to(at::kDouble), b}}, std::nullopt));
  EXPECT_C10_ERROR(
      "expected all tensors to have the layout Strided of inputs[0][0], but inputs[1][0] has "
      "layout Sparse",
      dpcore::reduce_add_coalesced({{a, b}, {a.to_sparse(), b}}, std::nullopt));
  EXPECT_C10_ERROR(
      "reduce_add_coalesced: expected all tensors on devices of one type, but inputs[0][0] is on cpu "
      "and inputs[1][0] is on meta",
      dpcore::reduce_add_coalesced(
          {{a, b}, {meta_tensor({2, 3}), meta_tensor({4}, at::kLong)}}, std::nullopt));
  EXPECT_C10_ERROR(
      "reduce_add_coalesced: the devices of inputs[0] is meta, but only 1 meta device(s) are visible",
      dpcore::reduce_add_coalesced({{meta_tensor({2})}, {meta_tensor({2})}}, std::nullopt));
  EXPECT_C10_ERROR(
      "reduce_add_coalesced: destination[0] is meta", dpcore::reduce_add_coalesced({{a, b}, {a, b}}, meta()));
  EXPECT_C10_ERROR(
      unusable_device_needle(c10::kCUDA),
      dpcore::reduce_add_coalesced({{a, b}, {a, b}}, c10::Device(c10::kCUDA, 0)));
  EXPECT_C10_ERROR(
      "expected bucket_bytes (buffer_size) to be positive, but got 0",
      dpcore::reduce_add_coalesced({{a, b}, {a, b}}, std::nullopt, 0));
  EXPECT_C10_ERROR(
      "to be positive, but got -1", dpcore::reduce_add_coalesced({{a, b}, {a, b}}, std::nullopt, -1));
  EXPECT_C10_ERROR(
      "reduce_add_coalesced: expected dense or sparse COO tensors, but inputs[0][1] has layout "
      "SparseCsr",
      dpcore::reduce_add_coalesced({{a, csr()}, {a, csr()}}, std::nullopt));
}

// ------------------------------------------------------------------- scatter

TEST(Errors, BalancedChunkSizes) {
  EXPECT_C10_ERROR("balanced_chunk_sizes: expected parts > 0, but got 0", dpcore::balanced_chunk_sizes(4, 0));
  EXPECT_C10_ERROR("expected parts > 0, but got -2", dpcore::balanced_chunk_sizes(4, -2));
  EXPECT_C10_ERROR(
      "balanced_chunk_sizes: expected total >= 0, but got -1", dpcore::balanced_chunk_sizes(-1, 3));
}

TEST(Errors, Scatter) {
  const at::Tensor t = values({10, 3});
  const c10::Stream cpu_stream(c10::Stream::DEFAULT, c10::Device(c10::kCPU));
  const c10::Stream meta_stream(c10::Stream::DEFAULT, c10::Device(c10::kMeta));
  EXPECT_C10_ERROR("scatter: expected a defined 'tensor'", dpcore::scatter(at::Tensor(), cpus(2)));
  EXPECT_C10_ERROR(
      "scatter: expected a tensor with at least one dimension, but got a 0-dim tensor",
      dpcore::scatter(values({}), cpus(2)));
  EXPECT_C10_ERROR("Dimension out of range", dpcore::scatter(t, cpus(2), std::nullopt, 2));
  EXPECT_C10_ERROR("Dimension out of range", dpcore::scatter(t, cpus(2), std::nullopt, -3));
  EXPECT_C10_ERROR("scatter: expected at least one device in 'devices'", dpcore::scatter(t, kNoDevices));
  EXPECT_C10_ERROR(
      "scatter: expected all of 'devices' to be of one device type",
      dpcore::scatter(t, std::vector<c10::Device>{c10::kCPU, meta()}));
  EXPECT_C10_ERROR(
      unusable_device_needle(c10::kCUDA),
      dpcore::scatter(t, std::vector<c10::Device>{c10::Device(c10::kCUDA, 0)}));
  EXPECT_C10_ERROR(
      "scatter: expected one chunk size per device: len(devices) = 3, but len(chunk_sizes) = 2",
      dpcore::scatter(t, cpus(3), std::vector<int64_t>{5, 5}));
  EXPECT_C10_ERROR(
      "scatter: expected non-negative chunk sizes, but chunk_sizes[1] is -1",
      dpcore::scatter(t, cpus(3), std::vector<int64_t>{6, -1, 5}));
  EXPECT_C10_ERROR(
      "scatter: expected chunk_sizes to sum to 10 (the size of dim 0 of the tensor), but they sum to 9",
      dpcore::scatter(t, cpus(3), std::vector<int64_t>{3, 3, 3}));
  EXPECT_C10_ERROR(
      "expected chunk_sizes to sum to 3 (the size of dim 1 of the tensor), but they sum to 4",
      dpcore::scatter(t, cpus(2), std::vector<int64_t>{2, 2}, -1));
  EXPECT_C10_ERROR(
      "scatter: expected one entry of 'streams' per device (3), but got 2",
      dpcore::scatter(t, cpus(3), std::nullopt, 0, dpcore::StreamList{cpu_stream, cpu_stream}));
  EXPECT_C10_ERROR(
      "scatter: expected streams[1] on cpu (the device at that index), but it is on meta",
      dpcore::scatter(t, cpus(2), std::nullopt, 0, dpcore::StreamList{std::nullopt, meta_stream}));
  // Dense tensors only; the message says what takes sparse ones.
  EXPECT_C10_ERROR(
      "scatter: expected dense (strided) tensors, but 'tensor' has layout Sparse: dpcore's scatter and "
      "gather take dense tensors only (broadcast, broadcast_coalesced, reduce_add and reduce_add_coalesced "
      "take sparse COO tensors too)",
      dpcore::scatter(t.to_sparse(), cpus(2)));
  EXPECT_C10_ERROR("'tensor' has layout SparseCsr", dpcore::scatter(csr(), cpus(2)));
}

TEST(Errors, ScatterOut) {
  const at::Tensor t = values({10, 3});
  auto out = [](int64_t rows) { return at::empty({rows, 3}); };
  const c10::Stream meta_stream(c10::Stream::DEFAULT, c10::Device(c10::kMeta));
  EXPECT_NO_THROW(dpcore::scatter_out(t, {out(4), out(6)}));
  EXPECT_C10_ERROR("scatter: expected a defined 'tensor'", dpcore::scatter_out(at::Tensor(), {out(4)}));
  EXPECT_C10_ERROR("0-dim tensor", dpcore::scatter_out(values({}), {out(4)}));
  EXPECT_C10_ERROR("Dimension out of range", dpcore::scatter_out(t, {out(10)}, 5));
  EXPECT_C10_ERROR(
      "scatter: expected at least one tensor in 'out', but it is empty", dpcore::scatter_out(t, {}));
  EXPECT_C10_ERROR("scatter: out[1] is undefined", dpcore::scatter_out(t, {out(4), at::Tensor()}));
  EXPECT_C10_ERROR(
      "scatter: expected out[1] to have 2 dimensions, as the tensor does, but it has 1",
      dpcore::scatter_out(t, {out(4), at::empty({18})}));
  EXPECT_C10_ERROR(
      "scatter: output tensor at index 1 has shape [6, 4], but expected the tensor's shape [10, 3] in "
      "every dimension but 0",
      dpcore::scatter_out(t, {out(4), at::empty({6, 4})}));
  EXPECT_C10_ERROR(
      "in every dimension but 1", dpcore::scatter_out(t, {at::empty({9, 1}), at::empty({10, 2})}, -1));
  EXPECT_C10_ERROR(
      "scatter: expected out[0] of dtype Float, but it is Double",
      dpcore::scatter_out(t, {at::empty({4, 3}, at::kDouble), out(6)}));
  EXPECT_C10_ERROR(
      "scatter: total size of the output tensors along dim 0 (9) does not match the size of the source "
      "tensor (10)",
      dpcore::scatter_out(t, {out(4), out(5)}));
  EXPECT_C10_ERROR(
      "scatter: expected all of 'the devices of out' to be of one device type",
      dpcore::scatter_out(t, {out(4), meta_tensor({6, 3})}));
  EXPECT_C10_ERROR(
      "scatter: the devices of out[0] is meta",
      dpcore::scatter_out(t, {meta_tensor({4, 3}), meta_tensor({6, 3})}));
  EXPECT_C10_ERROR(
      "scatter: expected one entry of 'streams' per device (2), but got 1",
      dpcore::scatter_out(t, {out(4), out(6)}, 0, dpcore::StreamList{std::nullopt}));
  EXPECT_C10_ERROR(
      "scatter: expected streams[0] on cpu",
      dpcore::scatter_out(t, {out(4), out(6)}, 0, dpcore::StreamList{meta_stream, std::nullopt}));
  EXPECT_C10_ERROR(
      "scatter: expected dense (strided) tensors, but 'tensor' has layout Sparse",
      dpcore::scatter_out(t.to_sparse(), {out(4), out(6)}));
  EXPECT_C10_ERROR(
      "scatter: expected dense (strided) tensors, but out[1] has layout Sparse",
      dpcore::scatter_out(t, {out(4), out(6).to_sparse()}));

  // Outs sharing memory with the tensor or with each other: nothing is written.
  at::Tensor x = values({10, 3});
  const at::Tensor before = x.clone();
  at::Tensor other = at::zeros({6, 3});
  EXPECT_C10_ERROR(
      "scatter: out[0] and 'tensor' overlap in memory (partly): an output must not share memory",
      dpcore::scatter_out(x, {x.narrow(0, 6, 4), other.narrow(0, 0, 6)}));
  EXPECT_C10_ERROR(
      "scatter: out[1] and 'tensor' overlap in memory (partly)",
      dpcore::scatter_out(x, {other, x.narrow(0, 0, 4)}));
  EXPECT_C10_ERROR("scatter: out[0] and 'tensor' overlap in memory (fully)", dpcore::scatter_out(x, {x}));
  EXPECT_TRUE(at::equal(x, before));
  EXPECT_TRUE(at::equal(other, at::zeros({6, 3})));
  at::Tensor buffer = at::zeros({12, 3});
  EXPECT_C10_ERROR(
      "scatter: out[1] and out[0] overlap in memory (partly)",
      dpcore::scatter_out(t, {buffer.narrow(0, 0, 4), buffer.narrow(0, 2, 6)}));
  EXPECT_C10_ERROR(
      "scatter: out[2] and out[0] overlap in memory (fully)",
      dpcore::scatter_out(t, {buffer.narrow(0, 0, 4), out(2), buffer.narrow(0, 0, 4)}));
  EXPECT_C10_ERROR(
      "scatter: out[0] has internal overlap (more than one of its elements refer to one memory location",
      dpcore::scatter_out(t, {at::zeros({1, 3}).expand({4, 3}), out(6)}));
  // Non-dense outs interleaved with the tensor (overlap not decidable
  // cheaply) are written from a copy of it: right values either way.
  at::Tensor grid = values({4, 2});
  const at::Tensor grid0 = grid.clone();
  EXPECT_NO_THROW(dpcore::scatter_out(grid, {grid.narrow(1, 1, 1), grid.narrow(1, 0, 1)}, 1));
  EXPECT_TRUE(at::equal(grid, grid0.flip(1))); // the two columns swapped
  // Disjoint parts of one buffer are fine, interleaved columns included.
  EXPECT_NO_THROW(dpcore::scatter_out(t, {buffer.narrow(0, 0, 4), buffer.narrow(0, 4, 6)}));
  at::Tensor columns = at::zeros({10, 6});
  EXPECT_NO_THROW(
      dpcore::scatter_out(values({10, 6}), {columns.narrow(1, 0, 2), columns.narrow(1, 2, 4)}, 1));
  EXPECT_TRUE(at::equal(columns, values({10, 6})));
}

// -------------------------------------------------------------------- gather

TEST(Errors, Gather) {
  const at::Tensor a = values({2, 3});
  EXPECT_C10_ERROR("gather: expected at least one tensor to gather from", dpcore::gather({}, 0));
  EXPECT_C10_ERROR("gather: tensors[0] is undefined", dpcore::gather({at::Tensor(), a}, 0));
  EXPECT_C10_ERROR(
      "gather: expected tensors with at least one dimension, but tensors[0] is 0-dim",
      dpcore::gather({values({}), values({})}, 0));
  EXPECT_C10_ERROR("Dimension out of range", dpcore::gather({a, a}, 2));
  EXPECT_C10_ERROR("Dimension out of range", dpcore::gather({a, a}, -3));
  EXPECT_C10_ERROR("gather: tensors[2] is undefined", dpcore::gather({a, a, at::Tensor()}, 0));
  EXPECT_C10_ERROR(
      "gather: expected all tensors to have 2 dimensions, as tensors[0] does, but tensors[1] has 1",
      dpcore::gather({a, values({3})}, 0));
  EXPECT_C10_ERROR(
      "expected all tensors to have 2 dimensions, as tensors[0] does, but tensors[1] has 0",
      dpcore::gather({a, values({})}, 0));
  EXPECT_C10_ERROR(
      "gather: expected all tensors of dtype Float, as tensors[0] is, but tensors[1] is Long",
      dpcore::gather({a, values({2, 3}, at::kLong)}, 0));
  EXPECT_C10_ERROR(
      "gather: expected all tensors on devices of one type, but tensors[0] is on cpu and tensors[1] is "
      "on meta",
      dpcore::gather({a, meta_tensor({2, 3})}, 0));
  EXPECT_C10_ERROR(
      "gather: input tensor at index 1 has invalid shape [2, 4]: expected [2, 3] in every dimension but 0",
      dpcore::gather({a, values({2, 4})}, 0));
  EXPECT_C10_ERROR(
      "has invalid shape [3, 3]: expected [2, 3] in every dimension but 1",
      dpcore::gather({a, values({3, 3})}, -1));
  EXPECT_C10_ERROR(
      "gather: destination[0] is meta, but only 1 meta device(s) are visible",
      dpcore::gather({a, a}, 0, meta()));
  EXPECT_C10_ERROR("gather: destination[0] is meta", dpcore::gather({meta_tensor({2}), meta_tensor({2})}, 0));
  EXPECT_C10_ERROR(unusable_device_needle(c10::kCUDA), dpcore::gather({a, a}, 0, c10::Device(c10::kCUDA, 0)));
  EXPECT_C10_ERROR(
      "gather: expected dense (strided) tensors, but tensors[1] has layout Sparse: dpcore's scatter and "
      "gather take dense tensors only",
      dpcore::gather({a, a.to_sparse()}, 0));
  EXPECT_C10_ERROR(
      "gather: expected dense (strided) tensors, but tensors[0] has layout SparseCsr",
      dpcore::gather({values({4, 4}).to_sparse_csr(), values({4, 4})}, 0));
}

TEST(Errors, GatherOut) {
  const at::Tensor a = values({2, 3});
  EXPECT_NO_THROW(dpcore::gather_out({a, a}, at::empty({4, 3}), 0));
  EXPECT_C10_ERROR(
      "gather: expected at least one tensor to gather from", dpcore::gather_out({}, at::empty({4})));
  EXPECT_C10_ERROR("is 0-dim", dpcore::gather_out({values({})}, at::empty({1})));
  EXPECT_C10_ERROR("has invalid shape", dpcore::gather_out({a, values({3, 2})}, at::empty({5, 3})));
  EXPECT_C10_ERROR("gather: expected a defined 'out' tensor", dpcore::gather_out({a, a}, at::Tensor()));
  EXPECT_C10_ERROR(
      "gather: expected 'out' of shape [4, 3] (the inputs joined along dim 0), but it has shape [4, 4]",
      dpcore::gather_out({a, a}, at::empty({4, 4})));
  EXPECT_C10_ERROR(
      "expected 'out' of shape [2, 6] (the inputs joined along dim 1), but it has shape [4, 3]",
      dpcore::gather_out({a, a}, at::empty({4, 3}), -1));
  EXPECT_C10_ERROR(
      "gather: expected 'out' of dtype Float, but it is Half",
      dpcore::gather_out({a, a}, at::empty({4, 3}, at::kHalf)));
  EXPECT_C10_ERROR(
      "gather: expected dense (strided) tensors, but tensors[0] has layout Sparse",
      dpcore::gather_out({a.to_sparse(), a}, at::empty({4, 3})));
  EXPECT_C10_ERROR(
      "gather: expected dense (strided) tensors, but 'out' has layout Sparse",
      dpcore::gather_out({a, a}, at::zeros({4, 3}).to_sparse()));

  // An out sharing memory with the inputs: nothing is written.
  at::Tensor x = values({8});
  const at::Tensor before = x.clone();
  EXPECT_C10_ERROR(
      "gather: 'out' and tensors[0] overlap in memory (partly): an output must not share memory with the "
      "inputs or the other outputs, or writing it would change values before they are read",
      dpcore::gather_out({x.narrow(0, 4, 4), x.narrow(0, 0, 4)}, x));
  EXPECT_C10_ERROR(
      "gather: 'out' and tensors[1] overlap in memory (partly)",
      dpcore::gather_out({values({4}), x.narrow(0, 2, 4)}, x));
  EXPECT_C10_ERROR("gather: 'out' and tensors[0] overlap in memory (fully)", dpcore::gather_out({x}, x));
  EXPECT_TRUE(at::equal(x, before));
  // Non-dense inputs interleaved with `out` (overlap not decidable cheaply)
  // are read from copies: right values either way.
  at::Tensor grid = values({4, 4});
  const at::Tensor grid0 = grid.clone();
  EXPECT_NO_THROW(dpcore::gather_out({grid.narrow(1, 2, 2), grid.narrow(1, 0, 2)}, grid, 1));
  EXPECT_TRUE(at::equal(grid, at::cat({grid0.narrow(1, 2, 2), grid0.narrow(1, 0, 2)}, 1)));
  EXPECT_C10_ERROR(
      "gather: 'out' has internal overlap", dpcore::gather_out({a, a}, at::zeros({1, 3}).expand({4, 3})));
  // Disjoint parts of one buffer are fine.
  at::Tensor buffer = values({16});
  EXPECT_NO_THROW(
      dpcore::gather_out({buffer.narrow(0, 4, 4), buffer.narrow(0, 0, 4)}, buffer.narrow(0, 8, 8)));
  EXPECT_TRUE(at::equal(buffer.narrow(0, 8, 4), values({16}).narrow(0, 4, 4)));
  at::Tensor wide = values({4, 8});
  const at::Tensor wide0 = wide.clone();
  EXPECT_NO_THROW(dpcore::gather_out({wide.narrow(1, 6, 2), wide.narrow(1, 4, 2)}, wide.narrow(1, 0, 4), 1));
  EXPECT_TRUE(at::equal(wide.narrow(1, 0, 4), at::cat({wide0.narrow(1, 6, 2), wide0.narrow(1, 4, 2)}, 1)));
}

// ----------------------------------------------------------------- settings

TEST(Errors, EnvironmentSettings) {
  const char* name = "DPCORE_TEST_SETTING";
  unsetenv(name);
  EXPECT_EQ(dpcore::env_int(name, 7, 1), 7);
  setenv(name, "", 1);
  EXPECT_EQ(dpcore::env_int(name, 7, 1), 7);
  setenv(name, "16", 1);
  EXPECT_EQ(dpcore::env_int(name, 7, 1), 16);
  for (const char* bad : {"0", "-3", "8MB", "abc", "99999999999999999999999"}) {
    setenv(name, bad, 1);
    EXPECT_C10_ERROR(
        std::string("expected the environment variable DPCORE_TEST_SETTING to be an integer of at ") +
            "least 1, but it is '" + bad + "'",
        dpcore::env_int(name, 7, 1));
  }
  unsetenv(name);
}
