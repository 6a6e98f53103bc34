"""Library containers through scatter, gather and DataParallel: types
registered with ``torch.utils._pytree`` and iterables rebuilt as
torch.nn.DataParallel's gather rebuilds them (transformers' KV caches), as
outputs and as inputs, on ["cpu"] * 2 and ["cpu"] * 3 with uneven chunks,
against single-device runs in float64; and the CUDA-graph signature that the
pytree spec gives (on the CPU stand-in for torch.cuda of test_cuda_graphs).

The caches here are stand-ins with transformers' constructor contract for
DataParallel (transformers itself is not needed): ``DynamicCache`` iterates
as one ``(key, value)`` tuple per layer and is constructible from such an
iterable; ``EncoderDecoderCache`` iterates as ``(self_key, self_value,
cross_key, cross_value)`` per layer and is constructible from one such
iterable or from two caches.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
import torch.utils._pytree as torch_pytree
from torch import nn

import dpcore
from dpcore import _graphs
from dpcore import _pytree as pt
from dpcore.scatter_gather import scatter_kwargs
from test_cuda_graphs import STEPS, _FakeGraph, stand_in_cuda  # noqa: F401 - the fixture is used by name

LISTS = [pytest.param(["cpu"] * 2, id="cpu*2"), pytest.param(["cpu"] * 3, id="cpu*3")]
BATCH = 7  # uneven on 2 (4, 3) and 3 (3, 2, 2) replicas
TOL = {"rtol": 1e-9, "atol": 1e-9}


# ---------------------------------------------------------------------------
# Stand-ins for transformers' caches and ModelOutput
# ---------------------------------------------------------------------------


class DynamicCache:
    """transformers' DynamicCache as DataParallel sees it."""

    def __init__(self, ddp_cache_data: Iterable[tuple[torch.Tensor, torch.Tensor]] | None = None) -> None:
        self.key_cache: list[torch.Tensor] = []
        self.value_cache: list[torch.Tensor] = []
        if ddp_cache_data is not None:
            for layer, (key, value) in enumerate(ddp_cache_data):
                self.update(key, value, layer)

    def update(self, key: torch.Tensor, value: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Appends a layer's new keys and values along the sequence (dim -2)
        and returns the layer's whole keys and values."""
        if layer < len(self.key_cache):
            self.key_cache[layer] = torch.cat([self.key_cache[layer], key], dim=-2)
            self.value_cache[layer] = torch.cat([self.value_cache[layer], value], dim=-2)
        else:
            self.key_cache.append(key)
            self.value_cache.append(value)
        return self.key_cache[layer], self.value_cache[layer]

    def __len__(self) -> int:
        return len(self.key_cache)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for layer in range(len(self)):
            yield (self.key_cache[layer], self.value_cache[layer])


class EncoderDecoderCache:
    """transformers' EncoderDecoderCache as DataParallel sees it."""

    def __init__(self, *caches: Any) -> None:
        if len(caches) == 1:
            self.self_attention_cache = DynamicCache()
            self.cross_attention_cache = DynamicCache()
            for layer, states in enumerate(caches[0]):
                self.self_attention_cache.update(states[0], states[1], layer)
                if len(states) > 2:
                    self.cross_attention_cache.update(states[2], states[3], layer)
        elif len(caches) == 2:
            self.self_attention_cache, self.cross_attention_cache = caches
        else:
            raise ValueError(f"expected 1 or 2 arguments, got {len(caches)}")

    def __len__(self) -> int:
        return len(self.self_attention_cache)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
        for layer in range(len(self)):
            yield (
                self.self_attention_cache.key_cache[layer],
                self.self_attention_cache.value_cache[layer],
                self.cross_attention_cache.key_cache[layer],
                self.cross_attention_cache.value_cache[layer],
            )


@dataclasses.dataclass
class CausalLMOutput:
    """A ModelOutput stand-in, registered as transformers registers its
    outputs: the fields that are not None, keyed by name."""

    logits: torch.Tensor | None = None
    past_key_values: Any = None
    note: str | None = None


def _output_flatten(out: CausalLMOutput) -> tuple[list[Any], Any]:
    names = [f.name for f in dataclasses.fields(out) if getattr(out, f.name) is not None]
    return [getattr(out, n) for n in names], names


def _output_unflatten(values: Iterable[Any], names: Any) -> CausalLMOutput:
    return CausalLMOutput(**dict(zip(names, values)))


@dataclasses.dataclass
class Sample:
    """Registered with register_dataclass, its ``meta`` field dropped: the
    registration, not dpcore's dataclass rule, decides what a replica gets."""

    x: torch.Tensor
    mask: torch.Tensor
    meta: str = "default"


class Box:
    """Not a dataclass, not iterable: a container only through its
    torch.utils._pytree registration."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, scale: float) -> None:
        self.x, self.y, self.scale = x, y, scale


def _register() -> None:
    if CausalLMOutput not in torch_pytree.SUPPORTED_NODES:
        torch_pytree.register_pytree_node(CausalLMOutput, _output_flatten, _output_unflatten)
    if Sample not in torch_pytree.SUPPORTED_NODES:
        torch_pytree.register_dataclass(Sample, field_names=["x", "mask"], drop_field_names=["meta"])
    if Box not in torch_pytree.SUPPORTED_NODES:
        torch_pytree.register_pytree_node(
            Box, lambda b: ([b.x, b.y], b.scale), lambda values, scale: Box(*values, scale)
        )


_register()


# ---------------------------------------------------------------------------
# A tiny causal decoder with a KV cache
# ---------------------------------------------------------------------------


class TinyDecoder(nn.Module):
    """Single-head causal attention layers over an embedding; the cache holds
    each layer's keys and values as [batch, 1, seq, width]."""

    def __init__(self, layers: int = 2, width: int = 8, vocab: int = 11) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.qkv = nn.ModuleList([nn.Linear(width, 3 * width) for _ in range(layers)])
        self.proj = nn.ModuleList([nn.Linear(width, width) for _ in range(layers)])
        self.head = nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor, past_key_values: DynamicCache | None = None) -> CausalLMOutput:
        cache = DynamicCache() if past_key_values is None else past_key_values
        past = cache.key_cache[0].shape[-2] if len(cache) else 0
        x = self.embed(ids)
        steps = ids.shape[1]
        allowed = torch.ones(steps, past + steps, dtype=torch.bool).tril(diagonal=past)
        for layer, (qkv, proj) in enumerate(zip(self.qkv, self.proj)):
            q, k, v = qkv(x).chunk(3, dim=-1)
            k, v = cache.update(k.unsqueeze(1), v.unsqueeze(1), layer)
            scores = q.unsqueeze(1) @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
            attn = scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1) @ v
            x = x + proj(attn.squeeze(1))
        return CausalLMOutput(logits=self.head(x), past_key_values=cache)


def _decoder(seed: int = 0) -> TinyDecoder:
    torch.manual_seed(seed)
    return TinyDecoder().double()


def _ids(batch: int = BATCH, steps: int = 3, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 11, (batch, steps), generator=torch.Generator().manual_seed(seed))


def _clone_cache(cache: DynamicCache) -> DynamicCache:
    return DynamicCache((k.clone(), v.clone()) for k, v in cache)


def _assert_caches_close(got: Any, expected: DynamicCache) -> None:
    assert type(got) is DynamicCache, f"expected one DynamicCache for the whole batch, got {type(got).__name__}"
    assert len(got) == len(expected)
    for (gk, gv), (ek, ev) in zip(got, expected):
        torch.testing.assert_close(gk, ek, **TOL)
        torch.testing.assert_close(gv, ev, **TOL)


# ---------------------------------------------------------------------------
# Outputs: one cache for the whole batch
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("devices", LISTS)
def test_cache_output_gathers_into_one_cache_equal_to_single_device(devices: list[str]) -> None:
    model = _decoder()
    dp = dpcore.DataParallel(model, devices)
    ids = _ids()
    expected = model(ids)
    out = dp(ids)
    assert type(out) is CausalLMOutput and out.note is None
    torch.testing.assert_close(out.logits, expected.logits, **TOL)
    _assert_caches_close(out.past_key_values, expected.past_key_values)
    assert out.past_key_values.key_cache[0].shape == (BATCH, 1, 3, 8)


@pytest.mark.parametrize("devices", LISTS)
def test_cache_fed_back_is_split_along_the_batch(devices: list[str]) -> None:
    """Prefill on one device, then decoding steps that feed the cache back in
    (first the single-device cache, then the gathered one), equal to the
    same steps on one device."""
    model = _decoder()
    dp = dpcore.DataParallel(model, devices)
    ref = model(_ids())
    ref_cache, dp_cache = ref.past_key_values, _clone_cache(ref.past_key_values)
    for step in range(3):
        next_ids = _ids(steps=1, seed=10 + step)
        ref = model(next_ids, past_key_values=ref_cache)
        out = dp(next_ids, past_key_values=dp_cache)
        torch.testing.assert_close(out.logits, ref.logits, **TOL)
        _assert_caches_close(out.past_key_values, ref.past_key_values)
        ref_cache, dp_cache = ref.past_key_values, out.past_key_values
    assert dp_cache.key_cache[0].shape == (BATCH, 1, 6, 8)


@pytest.mark.parametrize("devices", LISTS)
def test_training_through_a_cache_equals_single_device(devices: list[str]) -> None:
    """Five SGD steps on a loss over two decoding steps, the second fed the
    first's cache, and over the cache tensors themselves: the gradients
    flow through the split and the gathered cache."""
    ref_model, dp_model = _decoder(), _decoder()
    dp = dpcore.DataParallel(dp_model, devices)
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.1, momentum=0.9)
    dp_opt = torch.optim.SGD(dp_model.parameters(), lr=0.1, momentum=0.9)

    def loss_of(run: nn.Module, ids: torch.Tensor, next_ids: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        first = run(ids)
        second = run(next_ids, past_key_values=first.past_key_values)
        keys = sum(k.pow(2).mean() for k, _ in second.past_key_values)
        return nn.functional.cross_entropy(second.logits[:, -1], target) + 0.1 * keys

    for step in range(5):
        ids, next_ids = _ids(seed=step), _ids(steps=1, seed=100 + step)
        target = torch.randint(0, 11, (BATCH,), generator=torch.Generator().manual_seed(200 + step))
        for run, opt in ((ref_model, ref_opt), (dp, dp_opt)):
            opt.zero_grad()
            loss_of(run, ids, next_ids, target).backward()
            opt.step()
        for p, q in zip(ref_model.parameters(), dp_model.parameters()):
            torch.testing.assert_close(q, p, **TOL)


@pytest.mark.parametrize("devices", LISTS)
def test_encoder_decoder_cache_round_trip(devices: list[str]) -> None:
    g = torch.Generator().manual_seed(3)
    layers = [tuple(torch.randn(BATCH, 2, 4, 3, generator=g, dtype=torch.float64) for _ in range(4)) for _ in range(2)]
    cache = EncoderDecoderCache(layers)
    parts = dpcore.scatter(cache, devices)
    assert len(parts) == len(devices) and all(type(p) is EncoderDecoderCache for p in parts)
    sizes = [p.self_attention_cache.key_cache[0].shape[0] for p in parts]
    assert sizes == [4, 3] if len(devices) == 2 else sizes == [3, 2, 2]
    assert all(p.cross_attention_cache.value_cache[1].shape[0] == s for p, s in zip(parts, sizes))
    back = dpcore.gather(parts, "cpu")
    assert type(back) is EncoderDecoderCache and len(back) == 2
    for got, expected in zip(back, layers):
        assert all(torch.equal(a, b) for a, b in zip(got, expected))


class _CrossScale(nn.Module):
    """Scales every tensor of an encoder-decoder cache by a parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor([0.5, 2.0, -1.0, 3.0], dtype=torch.float64))

    def forward(self, x: torch.Tensor, cache: EncoderDecoderCache) -> tuple[torch.Tensor, EncoderDecoderCache]:
        scaled = EncoderDecoderCache(tuple(t * w for t, w in zip(states, self.w)) for states in cache)
        return x * self.w.sum(), scaled


@pytest.mark.parametrize("devices", LISTS)
def test_encoder_decoder_cache_through_data_parallel_equals_single_device(devices: list[str]) -> None:
    g = torch.Generator().manual_seed(4)
    x = torch.randn(BATCH, 3, generator=g, dtype=torch.float64)
    layers = [tuple(torch.randn(BATCH, 2, 4, 3, generator=g, dtype=torch.float64) for _ in range(4)) for _ in range(3)]
    ref_model = _CrossScale()
    dp_model = _CrossScale()
    dp = dpcore.DataParallel(dp_model, devices)
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.01)
    dp_opt = torch.optim.SGD(dp_model.parameters(), lr=0.01)
    for _ in range(3):
        for run, opt in ((ref_model, ref_opt), (dp, dp_opt)):
            opt.zero_grad()
            y, cache = run(x, EncoderDecoderCache(layers))
            assert type(cache) is EncoderDecoderCache and len(cache) == 3
            assert cache.cross_attention_cache.key_cache[2].shape == (BATCH, 2, 4, 3)
            loss = y.pow(2).mean() + sum((t.sum(dim=(1, 2, 3)) * torch.arange(BATCH)).sum() for s in cache for t in s)
            loss.backward()
            opt.step()
        torch.testing.assert_close(dp_model.w, ref_model.w, **TOL)


# ---------------------------------------------------------------------------
# torch.utils._pytree-registered types, in and out
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("devices", LISTS)
def test_registered_types_are_split_and_joined_through_their_registration(devices: list[str]) -> None:
    x = torch.arange(BATCH * 2, dtype=torch.float64).reshape(BATCH, 2)
    sample = Sample(x, x[:, 0] > 3, meta="kept by dpcore's dataclass rule, dropped by the registration")
    box = Box(x * 10, x[:, 1], 0.5)
    args, kwargs, sizes, _ = scatter_kwargs((sample,), {"box": box}, devices)
    assert sizes == ([4, 3] if len(devices) == 2 else [3, 2, 2])
    start = 0
    for a, kw, size in zip(args, kwargs, sizes):
        part = a[0]
        assert type(part) is Sample and part.meta == "default"  # built by the registered unflatten
        assert torch.equal(part.x, x[start : start + size]) and torch.equal(part.mask, x[start : start + size, 0] > 3)
        assert type(kw["box"]) is Box and kw["box"].scale == 0.5
        assert torch.equal(kw["box"].x, x[start : start + size] * 10)
        start += size
    back = dpcore.gather([kw["box"] for kw in kwargs], "cpu")
    assert type(back) is Box and back.scale == 0.5 and torch.equal(back.x, box.x) and torch.equal(back.y, box.y)
    parts = dpcore.scatter(sample, devices)
    joined = dpcore.gather(parts, "cpu")
    assert type(joined) is Sample and torch.equal(joined.x, x) and joined.meta == "default"


class _BoxModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.lin = nn.Linear(2, 3).double()

    def forward(self, sample: Sample, box: Box) -> CausalLMOutput:
        h = self.lin(sample.x * box.scale + box.x) * sample.mask.unsqueeze(1)
        return CausalLMOutput(logits=h, past_key_values=DynamicCache([(h.unsqueeze(1), box.y.reshape(-1, 1, 1))]))


class _OutputLoss(nn.Module):
    """A loss over the registered output and its cache (mean over the batch)."""

    reduction = "mean"

    def forward(self, out: CausalLMOutput, target: torch.Tensor) -> torch.Tensor:
        assert type(out.past_key_values) is DynamicCache
        key = out.past_key_values.key_cache[0].squeeze(1)
        return nn.functional.cross_entropy(out.logits + 0.1 * key, target)


@pytest.mark.parametrize("devices", LISTS)
def test_registered_inputs_and_outputs_with_criterion_equal_single_device(devices: list[str]) -> None:
    ref_model, dp_model = _BoxModel(), _BoxModel()
    criterion = _OutputLoss()
    dp = dpcore.DataParallel(dp_model, devices, criterion=criterion)
    plain = dpcore.DataParallel(dp_model, devices)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=0.05)
    dp_opt = torch.optim.AdamW(dp_model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(6)
    for _ in range(4):
        x = torch.randn(BATCH, 2, generator=g, dtype=torch.float64)
        sample = Sample(x, torch.rand(BATCH, generator=g) > 0.2)
        box = Box(torch.randn(BATCH, 2, generator=g, dtype=torch.float64), torch.randn(BATCH, generator=g), 0.7)
        target = torch.randint(0, 3, (BATCH,), generator=g)
        with torch.no_grad():
            gathered, expected = plain(sample, box), ref_model(sample, box)
        assert type(gathered) is CausalLMOutput
        torch.testing.assert_close(gathered.logits, expected.logits, **TOL)
        _assert_caches_close(gathered.past_key_values, expected.past_key_values)
        ref_opt.zero_grad()
        ref_loss = criterion(ref_model(sample, box), target)
        ref_loss.backward()
        ref_opt.step()
        dp_opt.zero_grad()
        loss = dp(sample, box, target)
        loss.backward()
        dp_opt.step()
        torch.testing.assert_close(loss, ref_loss, **TOL)
        for p, q in zip(ref_model.parameters(), dp_model.parameters()):
            torch.testing.assert_close(q, p, **TOL)


# ---------------------------------------------------------------------------
# Errors name the path; true leaves stay leaves
# ---------------------------------------------------------------------------


def test_cache_with_a_wrong_batch_size_names_its_path() -> None:
    x = torch.zeros(BATCH, 2)
    cache = DynamicCache([(torch.zeros(BATCH, 1, 2, 2), torch.zeros(BATCH, 1, 2, 2)), (torch.zeros(3, 1, 2, 2), x)])
    with pytest.raises(
        ValueError, match=r"kwargs\['past_key_values'\]\[1\]\[0\] has size 3 along dim 0 but inputs\[0\] has size 7"
    ):
        scatter_kwargs((x,), {"past_key_values": cache}, ["cpu"] * 2)
    sample = Sample(x, torch.zeros(5))
    with pytest.raises(ValueError, match=r"inputs\[0\]\.mask has size 5 along dim 0 but inputs\[0\]\.x has size 7"):
        scatter_kwargs((sample,), None, ["cpu"] * 2)


class _Pairish:
    """Iterable, but not constructible from an iterable of its elements."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor) -> None:
        self.a, self.b = a, b

    def __len__(self) -> int:
        return 2

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter((self.a, self.b))


def test_iterable_that_cannot_be_rebuilt_is_an_error_naming_its_path() -> None:
    p = _Pairish(torch.zeros(4), torch.zeros(4))
    with pytest.raises(
        TypeError, match=r"kwargs\['p'\] is a _Pairish, an iterable holding tensors.*register_pytree_node.*Broadcast"
    ):
        scatter_kwargs((), {"p": p}, ["cpu"] * 2)
    args, kwargs, _, _ = scatter_kwargs((torch.zeros(4),), {"p": dpcore.Broadcast(p)}, ["cpu"] * 2)
    assert all(kw["p"] is p for kw in kwargs)  # passed whole, as asked
    with pytest.raises(TypeError, match=r"gather: output\[1\] is a _Pairish.*gather=False"):
        dpcore.gather([(torch.zeros(2), p), (torch.zeros(2), p)], "cpu")


class _Endless:
    """Iterable without a length (it never ends): never iterated."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t

    def __iter__(self) -> Iterator[torch.Tensor]:
        while True:
            yield self.t


class _Unreadable:
    """Iterable whose iteration raises: a leaf, as before."""

    def __len__(self) -> int:
        return 1

    def __iter__(self) -> Iterator[torch.Tensor]:
        raise TypeError("not iterable today")


def test_true_leaves_are_passed_by_reference_and_gathered_into_lists() -> None:
    x = torch.zeros(4, 2)
    gen = (i for i in range(3))
    leaves = (
        "text",
        b"bytes",
        torch.Size([2, 3]),
        range(3),
        {1, 2},
        np.zeros((4, 2)),
        gen,
        nn.Linear(2, 2),
        {"a": 1}.keys(),
        _Endless(torch.zeros(4)),
        _Unreadable(),
    )
    args, _, _, _ = scatter_kwargs((x, *leaves), None, ["cpu"] * 2)
    for a in args:
        assert all(got is leaf for got, leaf in zip(a[1:], leaves))
    assert next(gen) == 0  # never iterated
    no_tensors = DynamicCache()  # an iterable without a tensor is a leaf
    args, _, _, _ = scatter_kwargs((x, no_tensors), None, ["cpu"] * 2)
    assert all(a[1] is no_tensors for a in args)
    out = dpcore.gather(
        [(torch.zeros(1), torch.Size([1]), no_tensors, "s"), (torch.zeros(1), torch.Size([1]), no_tensors, "t")], "cpu"
    )
    assert out[1] == [torch.Size([1])] * 2 and out[2] == [no_tensors, no_tensors] and out[3] == ["s", "t"]


def test_mismatched_registered_contexts_name_the_path() -> None:
    a = CausalLMOutput(logits=torch.zeros(1), note="x")
    b = CausalLMOutput(logits=torch.zeros(1))
    with pytest.raises(
        ValueError,
        match=r"gather: output of replica 1 is a CausalLMOutput but replica 0's is a CausalLMOutput \(its structure differs",
    ):
        dpcore.gather([a, b], "cpu")
    one = DynamicCache([(torch.zeros(1, 1), torch.zeros(1, 1))])
    two = DynamicCache([(torch.zeros(1, 1), torch.zeros(1, 1))] * 2)
    with pytest.raises(
        ValueError,
        match=r"gather: output\['c'\] of replica 1 is a DynamicCache of 2 elements but replica 0's is a DynamicCache of 1 elements",
    ):
        dpcore.gather([{"c": one}, {"c": two}], "cpu")


def test_one_flatten_rebuilds_every_container() -> None:
    cache = DynamicCache([(torch.ones(2, 1), torch.zeros(2, 1))])
    tree = (
        {"out": CausalLMOutput(logits=torch.ones(2), past_key_values=cache)},
        [Box(torch.ones(2), torch.ones(2), 1.0)],
        "s",
    )
    tensors, spec = pt.flatten(tree)
    assert len(tensors) == spec.num_tensors == 5
    rebuilt = spec.unflatten([t * 2 for t in tensors])
    assert type(rebuilt[0]["out"]) is CausalLMOutput and type(rebuilt[0]["out"].past_key_values) is DynamicCache
    assert torch.equal(rebuilt[0]["out"].past_key_values.key_cache[0], torch.full((2, 1), 2.0))
    assert type(rebuilt[1][0]) is Box and rebuilt[2] == "s"
    mapped = pt.map_tensors(torch.neg, tree)
    assert torch.equal(mapped[1][0].y, -torch.ones(2))
    assert pt.tensor_path(tree, spec, 2, "root") == "root[0]['out'][1][0][1]"  # CausalLMOutput has no key function
    assert pt.tensor_path(tree, spec, 4, "root") == "root[1][0][1]"


# ---------------------------------------------------------------------------
# The CUDA-graph signature is the spec (CPU stand-in)
# ---------------------------------------------------------------------------


def _key(args: tuple[Any, ...], kwargs: dict[str, Any] | None = None) -> Any:
    return _graphs.call_signature([args], [kwargs or {}], [0], [])


def test_signature_of_registered_types_and_caches() -> None:
    def cache(layers: int, seq: int = 2) -> DynamicCache:
        return DynamicCache([(torch.zeros(3, 1, seq, 4), torch.zeros(3, 1, seq, 4)) for _ in range(layers)])

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_graphs, "_DEVICE_TYPE", "cpu")
        # the same structure and shapes in new objects: the same key
        assert _key((torch.zeros(3, 1),), {"past_key_values": cache(2)}) == _key(
            (torch.zeros(3, 1),), {"past_key_values": cache(2)}
        )
        assert hash(_key((), {"c": cache(2)})) == hash(_key((), {"c": cache(2)}))
        assert _key((), {"c": cache(2)}) != _key((), {"c": cache(3)})  # layers
        assert _key((), {"c": cache(2)}) != _key((), {"c": cache(2, seq=3)})  # shapes
        out = CausalLMOutput(logits=torch.zeros(3))  # an unhashable registered context (a list of names)
        assert _key((out,)) == _key((CausalLMOutput(logits=torch.zeros(3)),))
        assert _key((out,)) != _key((CausalLMOutput(logits=torch.zeros(3), note="n"),))
        assert _key((Box(torch.zeros(1), torch.zeros(1), 1.0),)) != _key((Box(torch.zeros(1), torch.zeros(1), 2.0),))
    with pytest.raises(_graphs.Uncapturable, match=r"replica 0's input\[1\]\['c'\]\[0\]\[0\] is a tensor on cpu"):
        _key((), {"c": cache(2)})


class _CachedLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.lin = nn.Linear(6, 3).double()

    def forward(self, x: torch.Tensor, past_key_values: DynamicCache) -> CausalLMOutput:
        h = self.lin(x)
        key = past_key_values.key_cache[0]
        return CausalLMOutput(logits=h + key.sum(dim=1, keepdim=True), past_key_values=DynamicCache([(key * 2, h)]))


def test_stand_in_cache_fed_back_every_call_is_captured_once(stand_in_cuda: list[str]) -> None:
    """A new cache object every call, of the same structure and shapes: one
    signature, captured once and replayed, the cache's tensors placeholders
    of the graph (not baked in)."""
    dp = dpcore.DataParallel(_CachedLinear(), ["cpu"] * 3)
    dp._graphs = _graphs.GraphRunner()
    g = torch.Generator().manual_seed(8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(STEPS):
            x = torch.randn(BATCH, 6, generator=g, dtype=torch.float64)
            cache = DynamicCache([(torch.randn(BATCH, 3, generator=g, dtype=torch.float64), torch.zeros(BATCH, 3))])
            out = dp(x, past_key_values=cache)
            assert type(out) is CausalLMOutput and type(out.past_key_values) is DynamicCache
            assert out.past_key_values.value_cache[0].shape == (BATCH, 3)
            out.logits.sum().backward()
    assert len(dp._graphs._entries) == 1
    assert stand_in_cuda.count("capture") == 3 * 2
    assert stand_in_cuda.count("replay") == 3 * 2 * (STEPS - _graphs.WARMUP_CALLS)
    graphs = next(iter(dp._graphs._entries.values())).graphs
    assert [len(g.static_inputs) for g in graphs] == [3, 3, 3]  # x, and the cache's key and value
    assert [g.static_inputs[1].shape[0] for g in graphs] == [3, 2, 2]
