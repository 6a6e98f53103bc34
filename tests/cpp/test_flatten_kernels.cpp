// Device helpers (device.h), coalescing (flatten.h) and the kernels
// (kernels.h): pack / unpack / reduce_add_n / reduce_add_lists on CPU, and
// as operators through the dispatcher.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <gtest/gtest.h>

#include <set>
#include <vector>

#include "dpcore/comm.h"
#include "dpcore/device.h"
#include "dpcore/flatten.h"
#include "dpcore/kernels.h"
#include "helpers.h"

using dpcore_test::close_values;
using dpcore_test::cpus;
using dpcore_test::same_values;
using dpcore_test::values;

// -------------------------------------------------------------------- device

TEST(Device, NormalizeAndCheck) {
  EXPECT_EQ(dpcore::normalize_device(c10::Device(c10::kCPU, 0)), c10::Device(c10::kCPU));
  EXPECT_FALSE(dpcore::normalize_device(c10::Device(c10::kCPU, 0)).has_index());
  const std::vector<c10::Device> in = {
      c10::Device(c10::kCPU, 0), c10::Device(c10::kCPU), c10::Device(c10::kCPU, 0)};
  const auto out = dpcore::check_devices(in, "test");
  ASSERT_EQ(out.size(), 3u);
  for (const auto& d : out) {
    EXPECT_EQ(d, c10::Device(c10::kCPU));
    EXPECT_FALSE(d.has_index());
  }
  EXPECT_EQ(dpcore::check_devices(cpus(4), "test").size(), 4u);
  EXPECT_EQ(dpcore::current_device(c10::kCPU), c10::Device(c10::kCPU));
  EXPECT_FALSE(dpcore::supports_events(c10::kCPU));
  EXPECT_FALSE(dpcore::supports_events(c10::kMeta));
  EXPECT_TRUE(dpcore::supports_events(c10::kCUDA));
}

TEST(Device, DirectAccessAndStreamOrdering) {
  const c10::Device cpu(c10::kCPU);
  // The same memory is always readable; CPU and meta are not peers.
  EXPECT_TRUE(dpcore::can_access_directly(cpu, c10::Device(c10::kCPU, 0)));
  EXPECT_TRUE(dpcore::can_access_directly(dpcore_test::meta(), dpcore_test::meta()));
  EXPECT_FALSE(dpcore::can_access_directly(cpu, dpcore_test::meta()));
  EXPECT_FALSE(dpcore::can_access_directly(dpcore_test::meta(), cpu));
  EXPECT_EQ(dpcore::current_stream(c10::Device(c10::kCPU, 0)), c10::Stream(c10::Stream::DEFAULT, cpu));
  // CPU work is synchronous: ordering is a no-op, also across device types.
  EXPECT_NO_THROW(dpcore::order_after(cpu, cpu));
  EXPECT_NO_THROW(dpcore::order_after(cpu, dpcore_test::meta()));
}

// ------------------------------------------------------------------- flatten

TEST(FlatLayout, FlatAlias) {
  // A dense tensor alone in its layout: a 1-D view of its own bytes.
  for (const at::Tensor& t :
       {values({3, 4}), values({4, 3}).t(), values({2, 3, 4, 5}).contiguous(at::MemoryFormat::ChannelsLast),
        values({5, 3}).narrow(0, 1, 3)}) {
    const auto layout = dpcore::FlatLayout::of({t});
    const at::Tensor alias = dpcore::flat_alias(t, layout);
    ASSERT_TRUE(alias.defined());
    EXPECT_EQ(alias.dim(), 1);
    EXPECT_EQ(alias.numel(), t.numel());
    EXPECT_EQ(alias.data_ptr(), t.data_ptr());
    EXPECT_TRUE(same_values(alias, dpcore::flatten({t}, layout)));
  }
  // Not dense, or not alone: no alias.
  const at::Tensor strided = values({4, 6}).slice(1, 0, 6, 2);
  EXPECT_FALSE(dpcore::flat_alias(strided, dpcore::FlatLayout::of({strided})).defined());
  const at::Tensor a = values({2});
  EXPECT_FALSE(dpcore::flat_alias(a, dpcore::FlatLayout::of({a, a})).defined());
}

TEST(FlatLayout, OffsetsSizesAndStrides) {
  const std::vector<at::Tensor> list = {
      values({2, 3}),
      values({3, 4}).t(),                                              // dense, permuted
      values({4, 6}).slice(1, 0, 6, 2),                                // not dense
      values({2, 3, 4, 5}).contiguous(at::MemoryFormat::ChannelsLast), // dense
      values({0, 5}),
      values({}),
  };
  const auto layout = dpcore::FlatLayout::of(list);
  EXPECT_EQ(layout.dtype, at::kFloat);
  ASSERT_EQ(layout.size(), list.size());
  EXPECT_EQ(layout.offsets, (std::vector<int64_t>{0, 6, 18, 30, 150, 150}));
  EXPECT_EQ(layout.numel, 151);
  for (size_t i = 0; i < list.size(); ++i) {
    EXPECT_EQ(at::IntArrayRef(layout.sizes[i]), list[i].sizes());
  }
  EXPECT_EQ(at::IntArrayRef(layout.strides[1]), list[1].strides());
  EXPECT_EQ(at::IntArrayRef(layout.strides[2]), (std::vector<int64_t>{3, 1}));
  EXPECT_EQ(at::IntArrayRef(layout.strides[3]), list[3].strides());
  EXPECT_TRUE(layout.matches(0, list[0]));
  EXPECT_TRUE(layout.matches(1, list[1]));
  EXPECT_FALSE(layout.matches(2, list[2]));
  EXPECT_TRUE(layout.matches(2, list[2].contiguous()));
  EXPECT_TRUE(layout.matches(3, list[3]));
  EXPECT_FALSE(layout.matches(3, list[3].contiguous()));
  EXPECT_FALSE(layout.matches(0, list[1]));

  const auto none = dpcore::FlatLayout::of({});
  EXPECT_EQ(none.size(), 0u);
  EXPECT_EQ(none.numel, 0);
  EXPECT_EQ(none.dtype, c10::ScalarType::Undefined);
  EXPECT_EQ(dpcore::FlatLayout::of({values({3}, at::kHalf)}).dtype, at::kHalf);
}

TEST(FlatLayout, FlattenViewAndUnflatten) {
  const std::vector<at::Tensor> list = {
      values({2, 3}, at::kDouble, 1), values({3, 4}, at::kDouble, 2).t(),
      values({4, 6}, at::kDouble, 3).slice(1, 0, 6, 2),
      values({2, 3, 4, 5}, at::kDouble, 4).contiguous(at::MemoryFormat::ChannelsLast),
      values({0}, at::kDouble)};
  const auto layout = dpcore::FlatLayout::of(list);
  const at::Tensor flat = dpcore::flatten(list, layout);
  EXPECT_EQ(flat.dim(), 1);
  EXPECT_EQ(flat.numel(), layout.numel);
  EXPECT_EQ(flat.scalar_type(), at::kDouble);
  for (size_t i = 0; i < list.size(); ++i) {
    EXPECT_TRUE(same_values(layout.view(flat, i), list[i])) << i;
    EXPECT_FALSE(list[i].numel() > 0 && list[i].is_alias_of(flat));
  }
  // The dense tensors are stored in memory order: the flat slice equals the
  // tensor's own bytes.
  EXPECT_TRUE(same_values(
      flat.narrow(0, layout.offsets[1], 12), list[1].as_strided({12}, {1}, list[1].storage_offset())));
  EXPECT_TRUE(same_values(
      flat.narrow(0, layout.offsets[3], 120), list[3].as_strided({120}, {1}, list[3].storage_offset())));
  EXPECT_TRUE(layout.view(flat, 3).is_contiguous(at::MemoryFormat::ChannelsLast));

  // view() shares flat's version counter; unflatten() gives each its own.
  const at::Tensor v = layout.view(flat, 0);
  EXPECT_TRUE(v.is_alias_of(flat));
  const auto views = layout.unflatten(flat);
  ASSERT_EQ(views.size(), list.size());
  for (size_t i = 0; i < views.size(); ++i) {
    EXPECT_TRUE(same_values(views[i], list[i]));
    EXPECT_TRUE(views[i].is_alias_of(flat));
  }
  const auto flat_version = flat._version();
  const auto other = views[1]._version();
  views[0].add_(1);
  EXPECT_EQ(views[1]._version(), other);
  EXPECT_EQ(flat._version(), flat_version);
  EXPECT_TRUE(same_values(layout.view(flat, 0), list[0] + 1));

  // flatten of a list whose layout has a sub-tensor offset (flat not at 0).
  const at::Tensor offset_flat = at::zeros({layout.numel + 3}, at::kDouble).narrow(0, 3, layout.numel);
  const auto views2 = layout.unflatten(offset_flat);
  EXPECT_EQ(views2[0].data_ptr(), offset_flat.data_ptr());
}

TEST(Buckets, GroupByDtypeInOrder) {
  const std::vector<at::Tensor> list = {
      values({4}, at::kFloat),    // 0: 16 B
      values({2}, at::kDouble),   // 1: 16 B
      values({3}, at::kFloat),    // 2: 12 B
      values({5}, at::kLong),     // 3: 40 B
      values({2, 2}).to_sparse(), // 4: sparse
      values({6}, at::kHalf),     // 5: 12 B
      values({1}, at::kFloat),    // 6: 4 B
      values({0}, at::kDouble),   // 7: 0 B
  };
  const auto big = dpcore::make_buckets(list, dpcore::kDefaultBucketBytes);
  ASSERT_EQ(big.size(), 5u);
  EXPECT_EQ(big[0].indices, (std::vector<size_t>{0, 2, 6}));
  EXPECT_EQ(big[0].nbytes, 32);
  EXPECT_FALSE(big[0].sparse);
  EXPECT_EQ(big[1].indices, (std::vector<size_t>{1, 7}));
  EXPECT_EQ(big[2].indices, (std::vector<size_t>{3}));
  EXPECT_EQ(big[3].indices, (std::vector<size_t>{4}));
  EXPECT_TRUE(big[3].sparse);
  EXPECT_EQ(big[4].indices, (std::vector<size_t>{5}));

  // 1 byte: every non-empty dense tensor closes its bucket; the empty double
  // joins nothing open (the double bucket was closed) and gets its own.
  const auto tiny = dpcore::make_buckets(list, 1);
  ASSERT_EQ(tiny.size(), 8u);
  for (size_t b = 0; b < tiny.size(); ++b) {
    EXPECT_EQ(tiny[b].indices, (std::vector<size_t>{b}));
  }

  // 20 bytes: float 0 (16) + float 2 (12) = 28 >= 20 closes, so float 6
  // opens a new bucket; the double bucket (16 B) is still open for 7.
  const auto mid = dpcore::make_buckets(list, 20);
  std::vector<std::vector<size_t>> groups;
  for (const auto& b : mid) {
    groups.push_back(b.indices);
  }
  EXPECT_EQ(groups, (std::vector<std::vector<size_t>>{{0, 2}, {1, 7}, {3}, {4}, {5}, {6}}));

  for (const int64_t bytes : {1, 7, 20, 64, 1 << 20}) {
    std::multiset<size_t> seen;
    for (const auto& b : dpcore::make_buckets(list, bytes)) {
      ASSERT_FALSE(b.indices.empty());
      for (size_t i : b.indices) {
        seen.insert(i);
        EXPECT_EQ(list[i].scalar_type(), list[b.indices[0]].scalar_type());
      }
      for (size_t j = 1; j < b.indices.size(); ++j) {
        EXPECT_LT(b.indices[j - 1], b.indices[j]);
      }
    }
    EXPECT_EQ(seen, (std::multiset<size_t>{0, 1, 2, 3, 4, 5, 6, 7}));
  }

  const auto sel = big[0].members(list);
  ASSERT_EQ(sel.size(), 3u);
  EXPECT_TRUE(sel[0].is_same(list[0]));
  EXPECT_TRUE(sel[1].is_same(list[2]));
  EXPECT_TRUE(sel[2].is_same(list[6]));
  EXPECT_TRUE(dpcore::make_buckets({}, 1).empty());
}

// ---------------------------------------------------------------- pack/unpack

TEST(Pack, ManySmallTensorsRoundTrip) {
  std::vector<at::Tensor> list;
  list.reserve(3000);
  const at::Tensor all = at::arange(3000 * 3500, at::kFloat);
  for (int64_t i = 0; i < 3000; ++i) {
    list.push_back(all.narrow(0, i * 3500, 3500).clone());
  }
  const auto layout = dpcore::FlatLayout::of(list);
  EXPECT_EQ(layout.numel, 3000 * 3500);
  at::Tensor flat = at::empty({layout.numel}, at::kFloat);
  dpcore::pack(list, layout, flat);
  EXPECT_TRUE(same_values(flat, all));
  std::vector<at::Tensor> back;
  back.reserve(3000);
  for (int64_t i = 0; i < 3000; ++i) {
    back.push_back(at::zeros({3500}, at::kFloat));
  }
  dpcore::unpack(flat, layout, back);
  for (int64_t i = 0; i < 3000; ++i) {
    ASSERT_TRUE(same_values(back[i], list[i])) << i;
  }
}

TEST(Pack, MixedStridesRoundTrip) {
  for (const auto dtype : {at::kFloat, at::kHalf, at::kLong}) {
    const std::vector<at::Tensor> list = {
        values({3, 5}, dtype, 1),
        values({5, 3}, dtype, 2).t(),
        values({6, 10}, dtype, 3).slice(1, 1, 10, 3),
        values({2, 3, 4, 5}, dtype, 4).contiguous(at::MemoryFormat::ChannelsLast),
        values({0, 2}, dtype),
        values({}, dtype, 5),
        values({400, 300}, dtype, 6),                     // >= 256 KiB for float/long
        values({300, 400}, dtype, 7).t(),                 // large, permuted
        values({300, 800}, dtype, 8).slice(1, 0, 800, 2), // large, not dense
        values({1, 7}, dtype, 9).expand({3, 7}),          // overlapping (stride 0)
    };
    const auto layout = dpcore::FlatLayout::of(list);
    at::Tensor flat = at::full({layout.numel}, -1, dtype);
    dpcore::pack(list, layout, flat);
    for (size_t i = 0; i < list.size(); ++i) {
      EXPECT_TRUE(same_values(layout.view(flat, i), list[i])) << dtype << " " << i;
    }
    // Unpack into targets of the same shapes but other strides.
    std::vector<at::Tensor> targets = {
        at::zeros({5, 3}, dtype).t(),     at::zeros({3, 5}, dtype),
        at::zeros({6, 3}, dtype),         at::zeros({2, 3, 4, 5}, dtype),
        at::zeros({0, 2}, dtype),         at::zeros({}, dtype),
        at::zeros({300, 400}, dtype).t(), at::zeros({400, 300}, dtype),
        at::zeros({300, 400}, dtype),     at::zeros({3, 14}, dtype).slice(1, 0, 14, 2),
    };
    dpcore::unpack(flat, layout, targets);
    for (size_t i = 0; i < list.size(); ++i) {
      EXPECT_TRUE(same_values(targets[i], list[i])) << dtype << " " << i;
    }
    // And into the layout's own strides (the memcpy path).
    std::vector<at::Tensor> same_strides;
    for (size_t i = 0; i < list.size(); ++i) {
      same_strides.push_back(at::empty_strided(layout.sizes[i], layout.strides[i], dtype).zero_());
    }
    dpcore::unpack(flat, layout, same_strides);
    for (size_t i = 0; i < list.size(); ++i) {
      EXPECT_TRUE(same_values(same_strides[i], list[i])) << dtype << " " << i;
    }
  }
}

TEST(Pack, EmptyListAndMetaGenericPath) {
  const auto layout = dpcore::FlatLayout::of({});
  const at::Tensor flat = at::empty({0});
  dpcore::pack({}, layout, flat);
  dpcore::unpack(flat, layout, {});
  // A non-CPU, non-CUDA device takes the generic (ATen copy) path.
  const std::vector<at::Tensor> list = {dpcore_test::meta_tensor({2, 3}), dpcore_test::meta_tensor({4})};
  const auto meta_layout = dpcore::FlatLayout::of(list);
  const at::Tensor meta_flat = dpcore_test::meta_tensor({10});
  dpcore::pack(list, meta_layout, meta_flat);
  dpcore::unpack(meta_flat, meta_layout, list);
}

// pack_multi writes what K packs would, bit for bit, whatever the strides,
// sizes (pieces of 64 KiB and below), empty members and K.
TEST(Pack, MultiEqualsSeparatePacks) {
  for (const auto dtype : {at::kFloat, at::kHalf, at::kByte}) {
    const std::vector<at::Tensor> list = {
        values({3, 5}, dtype, 1),
        values({5, 3}, dtype, 2).t(),
        values({6, 10}, dtype, 3).slice(1, 1, 10, 3), // not dense: through flats[0]
        values({2, 3, 4, 5}, dtype, 4).contiguous(at::MemoryFormat::ChannelsLast),
        values({0, 2}, dtype),
        values({}, dtype, 5),
        values({400, 300}, dtype, 6),                     // several pieces
        values({1, 7}, dtype, 9).expand({3, 7}),          // overlapping (stride 0)
        values({100003}, dtype, 10).narrow(0, 1, 100002), // misaligned, several pieces
    };
    const auto layout = dpcore::FlatLayout::of(list);
    at::Tensor expected = at::full({layout.numel}, -1, dtype);
    dpcore::pack(list, layout, expected);
    for (const size_t k : {1, 2, 5}) {
      std::vector<at::Tensor> flats;
      for (size_t d = 0; d < k; ++d) {
        flats.push_back(at::full({layout.numel}, 7, dtype));
      }
      dpcore::pack_multi(list, layout, flats);
      for (size_t d = 0; d < k; ++d) {
        EXPECT_TRUE(at::equal(flats[d], expected)) << dtype << " k=" << k << " flat " << d;
      }
    }
  }
  // A member with a lazy negative bit is written by value into every flat.
  const at::Tensor base = values({6});
  const std::vector<at::Tensor> lazy = {at::_neg_view(base), base};
  const auto lazy_layout = dpcore::FlatLayout::of(lazy);
  const std::vector<at::Tensor> flats = {at::empty({12}), at::empty({12}), at::empty({12})};
  dpcore::pack_multi(lazy, lazy_layout, flats);
  for (const at::Tensor& flat : flats) {
    EXPECT_TRUE(same_values(flat, at::cat({-base, base})));
  }
}

TEST(Pack, MultiEmptyAndMetaGenericPath) {
  dpcore::pack_multi({}, dpcore::FlatLayout::of({}), {at::empty({0}), at::empty({0})});
  const std::vector<at::Tensor> list = {dpcore_test::meta_tensor({2, 3}), dpcore_test::meta_tensor({4})};
  const auto meta_layout = dpcore::FlatLayout::of(list);
  dpcore::pack_multi(list, meta_layout, {dpcore_test::meta_tensor({10}), dpcore_test::meta_tensor({10})});
}

// -------------------------------------------------------------- reduce_add_n

namespace {

at::Tensor add_chain(const std::vector<at::Tensor>& sources, const at::Tensor* initial) {
  at::Tensor sum = initial ? initial->clone() : sources[0].clone();
  for (size_t k = initial ? 0 : 1; k < sources.size(); ++k) {
    sum = at::add(sum, sources[k]);
  }
  return sum;
}

} // namespace

TEST(ReduceAddN, ValuesSizesDtypesAndAccumulate) {
  for (const auto dtype : {at::kFloat, at::kDouble, at::kLong, at::kInt, at::kHalf, at::kBFloat16}) {
    for (const int64_t n : {0, 1, 7, 100003}) {
      for (size_t k = 1; k <= 5; ++k) {
        std::vector<at::Tensor> sources;
        for (size_t i = 0; i < k; ++i) {
          sources.push_back(values({n}, dtype, static_cast<int64_t>(i) * 31));
        }
        const at::Tensor initial = values({n}, dtype, 1000);
        for (const bool accumulate : {false, true}) {
          at::Tensor out = accumulate ? initial.clone() : at::full({n}, 77, dtype);
          dpcore::reduce_add_n(sources, out, accumulate);
          const at::Tensor expected = add_chain(sources, accumulate ? &initial : nullptr);
          if (dtype == at::kHalf || dtype == at::kBFloat16) {
            ASSERT_TRUE(close_values(out, expected, 1e-2, 1e-1))
                << dtype << " n=" << n << " k=" << k << " accumulate=" << accumulate;
          } else {
            ASSERT_TRUE(same_values(out, expected))
                << dtype << " n=" << n << " k=" << k << " accumulate=" << accumulate;
          }
        }
      }
    }
  }
}

TEST(ReduceAddN, StridedSourcesAndOutputs) {
  const at::Tensor a = values({7, 9}, at::kFloat, 1);
  const at::Tensor b = values({9, 7}, at::kFloat, 2).t();
  const at::Tensor c = values({7, 18}, at::kFloat, 3).slice(1, 0, 18, 2);
  const at::Tensor d = values({9}, at::kFloat, 4).expand({7, 9});
  for (const bool accumulate : {false, true}) {
    for (const at::Tensor& out_base :
         {at::ones({7, 9}), at::ones({9, 7}).t(), at::ones({7, 27}).slice(1, 0, 27, 3)}) {
      at::Tensor out = out_base.clone(at::MemoryFormat::Preserve);
      if (!out_base.is_non_overlapping_and_dense()) {
        out = out_base; // keep the non-dense view
      }
      const at::Tensor before = out.clone();
      dpcore::reduce_add_n({a, b, c, d}, out, accumulate);
      const at::Tensor expected = accumulate ? before + a + b + c + d : a + b + c + d;
      EXPECT_TRUE(same_values(out, expected)) << "accumulate=" << accumulate;
    }
  }
  // All transposed (dense, equal strides: the fast path) with a channels_last trio.
  const at::Tensor x = values({2, 3, 4, 5}, at::kDouble, 1).contiguous(at::MemoryFormat::ChannelsLast);
  const at::Tensor y = values({2, 3, 4, 5}, at::kDouble, 2).contiguous(at::MemoryFormat::ChannelsLast);
  at::Tensor out = at::empty_like(x);
  dpcore::reduce_add_n({x, y}, out, false);
  EXPECT_TRUE(same_values(out, x + y));
  EXPECT_TRUE(out.is_contiguous(at::MemoryFormat::ChannelsLast));
}

TEST(ReduceAddN, OutAliasesASource) {
  at::Tensor out = values({50}, at::kFloat, 1);
  const at::Tensor original = out.clone();
  const at::Tensor other = values({50}, at::kFloat, 2);
  dpcore::reduce_add_n({out, other}, out, false);
  EXPECT_TRUE(same_values(out, original + other));
}

TEST(ReduceAddN, MetaGenericPath) {
  const at::Tensor a = dpcore_test::meta_tensor({3, 4});
  at::Tensor out = dpcore_test::meta_tensor({3, 4});
  dpcore::reduce_add_n({a, a}, out, true);
  EXPECT_EQ(out.sizes(), a.sizes());
}

TEST(ReduceAddLists, ManyTensors) {
  for (const bool accumulate : {false, true}) {
    for (size_t k = 1; k <= 4; ++k) {
      dpcore::TensorList2D sources(k);
      std::vector<at::Tensor> outs;
      std::vector<at::Tensor> initial;
      for (int64_t i = 0; i < 400; ++i) {
        const int64_t n = (i * 37) % 300; // includes 0
        for (size_t s = 0; s < k; ++s) {
          sources[s].push_back(values({n}, at::kFloat, i + static_cast<int64_t>(s) * 101));
        }
        initial.push_back(values({n}, at::kFloat, i + 5000));
        outs.push_back(initial.back().clone());
      }
      // A large entry and a strided one.
      for (size_t s = 0; s < k; ++s) {
        sources[s].push_back(values({300, 300}, at::kFloat, static_cast<int64_t>(s)));
        sources[s].push_back(values({20, 10}, at::kFloat, static_cast<int64_t>(s) + 9).t());
      }
      initial.push_back(values({300, 300}, at::kFloat, 77));
      outs.push_back(initial.back().clone());
      initial.push_back(values({10, 20}, at::kFloat, 78));
      outs.push_back(initial.back().clone());

      dpcore::reduce_add_lists(sources, outs, accumulate);
      for (size_t i = 0; i < outs.size(); ++i) {
        std::vector<at::Tensor> column;
        for (size_t s = 0; s < k; ++s) {
          column.push_back(sources[s][i]);
        }
        ASSERT_TRUE(same_values(outs[i], add_chain(column, accumulate ? &initial[i] : nullptr)))
            << "entry " << i << " k=" << k << " accumulate=" << accumulate;
      }
    }
  }
  dpcore::reduce_add_lists({{}, {}}, {}, false);
}

// ----------------------------------------------------------------- operators

// The operators' static registrations reach a binary linked with the core:
// the schema, Meta and Conjugate/Negative entries (ops.cpp) and the CPU
// implementations registered at the bottom of kernels/*.cpp.
TEST(Operators, RegisteredPerBackend) {
  for (const char* name : {"dpcore::pack", "dpcore::pack_multi", "dpcore::unpack", "dpcore::reduce_add_n"}) {
    const auto op = c10::Dispatcher::singleton().findSchema({name, ""});
    ASSERT_TRUE(op.has_value()) << name << " has no schema";
    for (const c10::DispatchKey key :
         {c10::DispatchKey::CPU, c10::DispatchKey::Meta, c10::DispatchKey::Conjugate,
          c10::DispatchKey::Negative}) {
      EXPECT_TRUE(op->hasKernelForDispatchKey(key)) << name << " has no kernel for " << key;
    }
#ifndef DPCORE_WITH_CUDA
    EXPECT_FALSE(op->hasKernelForDispatchKey(c10::DispatchKey::CUDA)) << name;
#endif
  }
}

TEST(Operators, CallThroughTheDispatcher) {
  auto& dispatcher = c10::Dispatcher::singleton();
  const auto pack =
      dispatcher.findSchemaOrThrow("dpcore::pack", "").typed<void(at::TensorList, const at::Tensor&)>();
  const auto unpack =
      dispatcher.findSchemaOrThrow("dpcore::unpack", "").typed<void(const at::Tensor&, at::TensorList)>();
  const auto reduce_add_n = dispatcher.findSchemaOrThrow("dpcore::reduce_add_n", "")
                                .typed<void(at::TensorList, const at::Tensor&, bool)>();

  const std::vector<at::Tensor> list = {values({2, 3}), values({4, 2}, at::kFloat, 5).t()};
  const at::Tensor flat = at::empty({14});
  pack.call(list, flat);
  const auto views = dpcore::FlatLayout::of(list).unflatten(flat);
  EXPECT_TRUE(same_values(views[0], list[0]));
  EXPECT_TRUE(same_values(views[1], list[1]));

  // A lazily conjugated output is written through (the Conjugate
  // fallthrough): the generic fallback would refuse a mutable conj tensor.
  const at::Tensor complex = at::complex(values({5}), values({5}, at::kFloat, 3));
  const at::Tensor base = at::zeros({5}, at::kComplexFloat);
  unpack.call(complex, {base.conj()});
  EXPECT_TRUE(same_values(base, complex.conj().resolve_conj()));

  const at::Tensor out = at::empty({2, 3});
  reduce_add_n.call({list[0], list[0], list[0]}, out, false);
  EXPECT_TRUE(same_values(out, list[0] * 3));
  EXPECT_C10_ERROR(
      "reduce_add_n: expected sources[1] of shape [2, 3]",
      reduce_add_n.call({list[0], values({3})}, out, false));

  // Meta tensors reach the Meta implementations: checks only.
  const std::vector<at::Tensor> meta = {dpcore_test::meta_tensor({2, 3}), dpcore_test::meta_tensor({4})};
  EXPECT_NO_THROW(pack.call(meta, dpcore_test::meta_tensor({10})));
  EXPECT_C10_ERROR(
      "pack: expected 'flat' to hold every element of the tensors",
      pack.call(meta, dpcore_test::meta_tensor({9})));
}
