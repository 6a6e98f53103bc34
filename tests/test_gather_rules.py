"""The gather's rules for outputs that are not plain batch tensors (issue 39), each
with small hand-written modules compared with the bare module on one device
(float64) on ["cpu"] * 2 and ["cpu"] * 3 with uneven chunks (7 rows: 4+3, 3+2+2):

1. An output leaf that holds tensors is never listed: caches of the
   integrations table (transformers' Cache and its layers) are gathered by
   their attributes; any other object holding tensors (by its ``__dict__``,
   its ``__slots__``, an iteration that raises, one never tried) is a
   TypeError naming its path, register_pytree_node and gather=False.
   Strings, numbers and None gather as torch's do.
2. Inside a cache (an iterable rebuilt from its elements, or an object
   gathered by its attributes) a 0-dim tensor or other value without a batch
   is one state of the whole batch: kept once where every replica returns the
   same, else a ValueError naming it. Elsewhere 0-dim outputs are stacked.
3. A list as long as its replica's rows on every replica, some entry not a
   batch, holds one entry per sample: concatenated in replica order. A list
   of batch tensors keeps torch's rule; other mismatches stay errors.
4. Batch x batch outputs and outputs batched along dim 1 keep their refusal.
5. Every output of a call with a PackedSequence input is recombined (packed
   data, batch_sizes, sorted_indices, unsorted_indices, one row per sequence)
   or is a ValueError naming it.

transformers-specific checks (Mamba's and Jamba's caches, Mistral's sliding
window fed back in, LLaVA's per-image features in training) run where
transformers is installed.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from typing import Any

import pytest
import torch
import torch.utils._pytree as torch_pytree
from torch import nn
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

import dpcore
from dpcore import _pytree as pt

LISTS = [pytest.param(["cpu"] * 2, id="cpu*2"), pytest.param(["cpu"] * 3, id="cpu*3")]
BATCH = 7
TOL = {"rtol": 1e-10, "atol": 1e-10}


def assert_same(got: Any, want: Any, path: str = "output") -> None:
    """`got` equals `want`: tensors (shape, dtype, values), containers and objects' attributes walked."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), f"{path}: expected a tensor, got {type(got).__name__}"
        assert got.shape == want.shape and got.dtype == want.dtype, f"{path}: {got.shape} {want.shape}"
        torch.testing.assert_close(got, want, **TOL, msg=lambda m: f"{path}: {m}")
        return
    assert type(got) is type(want), f"{path}: expected {type(want).__name__}, got {type(got).__name__}"
    if isinstance(want, Mapping):
        assert list(got) == list(want), f"{path}: keys {list(got)} != {list(want)}"
        for key in want:
            assert_same(got[key], want[key], f"{path}[{key!r}]")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), f"{path}: length {len(got)} != {len(want)}"
        for i, (a, b) in enumerate(zip(got, want)):
            assert_same(a, b, f"{path}[{i}]")
    elif hasattr(want, "__dict__") and not isinstance(want, (nn.Module, type)):
        assert_same(vars(got), vars(want), f"{path}.__dict__")
    else:
        assert got == want, f"{path}: {got!r} != {want!r}"


def _x(rows: int = BATCH, width: int = 3, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, width, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


class _Returns(nn.Module):
    """Returns ``make(self.lin(x))``: a linear layer, then the output under test."""

    def __init__(self, make: Any) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(3, 4).double()
        self.make = make

    def forward(self, x: torch.Tensor) -> Any:
        return self.make(self.lin(x))


# ---------------------------------------------------------------------------
# 1. An output leaf holding tensors: gathered by a rule for its type, or an error naming it
# ---------------------------------------------------------------------------


class _Plain:
    def __init__(self, h: torch.Tensor) -> None:
        self.h = h


class _Slotted:
    __slots__ = ("h", "steps")

    def __init__(self, h: torch.Tensor) -> None:
        self.h, self.steps = h, 3


class _Raising:
    """Sized and iterable, but its iteration raises (as DynamicCache's over Mamba's layers does)."""

    def __init__(self, h: torch.Tensor) -> None:
        self.layers = [{"conv": h}]

    def __len__(self) -> int:
        return 1

    def __iter__(self) -> Iterator[torch.Tensor]:
        raise AttributeError("'LinearAttentionLayer' object has no attribute 'keys'")


class _Unsized:
    """Iterable without a length: never iterated."""

    def __init__(self, h: torch.Tensor) -> None:
        self.h = h

    def __iter__(self) -> Iterator[torch.Tensor]:
        while True:
            yield self.h


class _Deep:
    def __init__(self, h: torch.Tensor) -> None:
        self.inner = _Plain(h)
        self.note = "deep"


HOLDERS = [
    pytest.param(_Plain, id="__dict__"),
    pytest.param(_Slotted, id="__slots__"),
    pytest.param(_Raising, id="iteration-raises"),
    pytest.param(_Unsized, id="unsized-iterable"),
    pytest.param(_Deep, id="nested-object"),
    pytest.param(lambda h: nn.Linear(2, 2), id="nn.Module"),
]


@pytest.mark.parametrize("devices", LISTS)
@pytest.mark.parametrize("holder", HOLDERS)
def test_an_object_holding_tensors_is_an_error_naming_its_path(devices: list[str], holder: Any) -> None:
    dp = dpcore.DataParallel(_Returns(lambda h: {"logits": h, "state": holder(h)}), devices)
    with pytest.raises(TypeError, match=r"gather: output\['state'\] is a \w+ that holds tensors") as info:
        dp(_x())
    assert "torch.utils._pytree.register_pytree_node" in str(info.value) and "gather=False" in str(info.value)
    per_replica = dpcore.DataParallel(dp.module, devices, gather=False)(_x())
    assert len(per_replica) == len(devices) and all(type(o["state"]) is type(holder(_x())) for o in per_replica)


def test_a_lone_replica_holding_tensors_is_the_same_error() -> None:
    """The rule does not depend on how many replicas ran (a batch smaller than the devices)."""
    dp = dpcore.DataParallel(_Returns(lambda h: (h, _Plain(h))), ["cpu"] * 3)
    with pytest.raises(TypeError, match=r"gather: output\[1\] is a _Plain that holds tensors"):
        dp(_x(rows=1))


@pytest.mark.parametrize("devices", LISTS)
def test_a_registered_holder_is_gathered_as_on_one_device(devices: list[str]) -> None:
    """The fix the error names: the type registered with torch's pytree is split and joined by it."""

    class Registered(_Plain):
        pass

    torch_pytree.register_pytree_node(Registered, lambda o: ([o.h], None), lambda values, _: Registered(*values))
    try:
        module = _Returns(lambda h: {"logits": h, "state": Registered(h * 2)})
        out = dpcore.DataParallel(module, devices)(_x())
        assert_same(out, module(_x()))
    finally:
        torch_pytree._deregister_pytree_node(Registered)


@pytest.mark.parametrize("devices", LISTS)
def test_strings_numbers_and_none_gather_as_torch(devices: list[str]) -> None:
    """Non-tensor leaves without tensors: listed per replica (strings, numbers, objects), None kept."""
    empty = _Plain(None)
    dp = dpcore.DataParallel(_Returns(lambda h: (h, "note", 3, None, empty)), devices)
    out = dp(_x())
    k = len(devices)
    assert out[1:] == (["note"] * k, [3] * k, None, [empty] * k)


# ---------------------------------------------------------------------------
# Objects gathered by their attributes (the integrations table's rule), without transformers
# ---------------------------------------------------------------------------


class Layer:
    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None
        self.window = torch.tensor(4)  # 0-dim, equal on every replica
        self.seen = 0
        self.device = torch.device("cpu")
        self.states: dict[int, torch.Tensor] = {}

    def update(self, h: torch.Tensor) -> None:
        self.keys = h if self.keys is None else torch.cat([self.keys, h], dim=1)
        self.states[0] = h.sum(1, keepdim=True)
        self.seen += h.shape[1]


class Cache:
    """A stand-in for a library cache: its state in attributes, not iterable, no constructor from parts."""

    def __init__(self, layers: int) -> None:
        self.layers = [Layer() for _ in range(layers)]


@pytest.fixture
def integrated(monkeypatch: pytest.MonkeyPatch) -> None:
    """This module's Cache and Layer in the integrations table (as transformers' are)."""
    monkeypatch.setattr(pt, "INTEGRATIONS", pt.INTEGRATIONS | {(__name__, "Cache"), (__name__, "Layer")})
    pt.NODES.clear()
    yield
    pt.NODES.clear()


class _Cached(nn.Module):
    def __init__(self, counter: Any = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(3, 4).double()
        self.counter = counter

    def forward(self, x: torch.Tensor, cache: Cache | None = None) -> dict[str, Any]:
        cache = Cache(2) if cache is None else cache
        h = self.lin(x)
        for layer in cache.layers:
            layer.update(h.unsqueeze(1))
            if self.counter is not None:
                layer.window = self.counter(x)
        return {"logits": h, "cache": cache}


@pytest.mark.parametrize("devices", LISTS)
def test_an_integrated_cache_is_gathered_by_its_attributes_and_fed_back(devices: list[str], integrated: None) -> None:
    """Tensors concatenated along the batch, the 0-dim window and the counts kept once, a nested dict
    walked; fed back in, the cache is split by its attributes: two steps equal one device's."""
    module = _Cached()
    dp = dpcore.DataParallel(module, devices)
    expected, out = module(_x()), dp(_x())
    assert_same(out, expected)
    assert out["cache"].layers[0].window.dim() == 0 and out["cache"].layers[1].seen == 1
    assert_same(dp(_x(seed=1), cache=out["cache"]), module(_x(seed=1), cache=expected["cache"]))


@pytest.mark.parametrize("devices", LISTS)
def test_a_cache_state_that_differs_between_replicas_names_it(devices: list[str], integrated: None) -> None:
    dp = dpcore.DataParallel(_Cached(counter=lambda x: torch.tensor(x.shape[0])), devices)
    with pytest.raises(
        ValueError,
        match=r"gather: output\['cache'\]\.layers\[0\]\.window of replica 1 is tensor\([23], dtype=torch.int64\) but",
    ):
        dp(_x())
    ints = dpcore.DataParallel(_Returns(lambda h: {"cache": _with_seen(h)}), devices)
    with pytest.raises(
        ValueError, match=r"output\['cache'\]\.layers\[0\]\.seen of replica 1 is [23] but replica 0's is [34]"
    ):
        ints(_x())


def _with_seen(h: torch.Tensor) -> Cache:
    cache = Cache(1)
    cache.layers[0].update(h.unsqueeze(1))
    cache.layers[0].seen = h.shape[0]  # per replica: not one state of the batch
    return cache


# ---------------------------------------------------------------------------
# 2. 0-dim tensors: stacked where torch stacks them, kept once inside a cache
# ---------------------------------------------------------------------------


class IterCache:
    """A cache DataParallel rebuilds from its elements (torch's rule): (keys, window) per layer."""

    def __init__(self, layers: Any = ()) -> None:
        self.layers = [tuple(layer) for layer in layers]

    def __len__(self) -> int:
        return len(self.layers)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
        return iter(self.layers)


@pytest.mark.parametrize("devices", LISTS)
def test_zero_dim_outputs_are_stacked_outside_caches(devices: list[str]) -> None:
    """Top level and in plain containers: one entry per replica, as torch's gather does."""

    def make(h: torch.Tensor) -> Any:
        return h.sum(), {"loss": h.mean(), "rows": h}

    module = _Returns(make)
    total, out = dpcore.DataParallel(module, devices)(_x())
    assert total.shape == (len(devices),) and out["loss"].shape == (len(devices),)
    sizes = [4, 3] if len(devices) == 2 else [3, 2, 2]
    chunks = _x().split(sizes)
    torch.testing.assert_close(total, torch.stack([module(c)[0] for c in chunks]), **TOL)
    assert_same(out["rows"], module(_x())[1]["rows"])


@pytest.mark.parametrize("devices", LISTS)
def test_equal_zero_dim_tensors_inside_an_iterable_cache_are_kept_once(devices: list[str]) -> None:
    module = _Returns(lambda h: IterCache([(h.unsqueeze(1), torch.tensor(4))]))
    out = dpcore.DataParallel(module, devices)(_x())
    assert_same(out, module(_x()))
    assert out.layers[0][1].shape == () and int(out.layers[0][1]) == 4
    differs = _Returns(lambda h: IterCache([(h, h.new_tensor(float(h.shape[0])))]))
    with pytest.raises(
        ValueError, match=r"gather: output\[0\]\[1\] of replica 1 is tensor\([23]\.0.*a 0-dim tensor inside"
    ):
        dpcore.DataParallel(differs, devices)(_x())


# ---------------------------------------------------------------------------
# 3. Lists with one entry per sample
# ---------------------------------------------------------------------------


class _PerSample(nn.Module):
    """One feature tensor per sample, of a size that depends on the sample (as LLaVA's per-image features),
    and a caption per sample; with ``batch_list``, also a list of two batch tensors."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(3, 4).double()

    def forward(self, x: torch.Tensor) -> dict[str, Any]:
        h = self.lin(x)
        counts = (x[:, 0].abs() * 3).long() % 3 + 3  # never the replicas' rows here
        features = [row.expand(int(n), 4) * n for row, n in zip(h, counts)]
        return {"features": features, "captions": [f"n={int(n)}" for n in counts], "pair": [h, h * 2]}


@pytest.mark.parametrize(
    ("devices", "rows"), [(["cpu"] * 2, BATCH), (["cpu"] * 3, BATCH), (["cpu"] * 2, 4), (["cpu"] * 3, 6)]
)
def test_a_list_with_one_entry_per_sample_is_concatenated(devices: list[str], rows: int) -> None:
    """Uneven chunks (lists of different lengths) and even ones (a two-entry list of batch tensors with two
    rows per replica keeps torch's rule), forward and backward equal to one device."""
    module = _PerSample()
    dp_module = copy.deepcopy(module)
    x = _x(rows)
    expected, out = module(x), dpcore.DataParallel(dp_module, devices)(x)
    assert_same(out, expected)
    sum(f.sum() * (i + 1) for i, f in enumerate(out["features"])).backward()
    sum(f.sum() * (i + 1) for i, f in enumerate(expected["features"])).backward()
    for p, q in zip(dp_module.parameters(), module.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **TOL)


def test_lists_that_are_not_one_entry_per_sample_are_still_refused() -> None:
    dp = dpcore.DataParallel(_Returns(lambda h: [h[i : i + 1] for i in range(h.shape[0] // 2)]), ["cpu"] * 2)
    with pytest.raises(
        ValueError, match=r"gather: output of replica 1 is a list of length 1 but replica 0's is a list"
    ):
        dp(_x())
    batches = dpcore.DataParallel(_Returns(lambda h: [h] * h.shape[0]), ["cpu"] * 2)  # batch tensors, lengths differ
    with pytest.raises(ValueError, match=r"every replica must return the same structure"):
        batches(_x())


# ---------------------------------------------------------------------------
# 4. Right refusals keep their messages
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("devices", LISTS)
def test_batch_by_batch_and_dim_one_outputs_are_refused(devices: list[str]) -> None:
    similarity = dpcore.DataParallel(_Returns(lambda h: {"logits_per_image": h @ h.T}), devices)
    with pytest.raises(RuntimeError, match=r"gather: output\['logits_per_image'\]: .*in every dimension but 0"):
        similarity(_x())
    mems = dpcore.DataParallel(_Returns(lambda h: {"mems": [h.unsqueeze(0).expand(5, -1, -1)]}), devices)
    with pytest.raises(RuntimeError, match=r"gather: output\['mems'\]\[0\]: .*in every dimension but 0"):
        mems(_x())


# ---------------------------------------------------------------------------
# 5. Outputs of a call with a PackedSequence input
# ---------------------------------------------------------------------------

LENGTHS = [3, 7, 1, 6, 4, 3, 2]  # sorted: 7, 6, 4, 3, 3, 2, 1


class _Fields(nn.Module):
    """An RNN over packed input returning its output's fields, one tensor each (with ``copies``, copies of
    them), and what pad_packed_sequence makes of it: the padded batch (batch first) and the lengths; with
    ``time_major``, the padded batch time first (batched along dim 1), which cannot be recombined."""

    def __init__(self, time_major: bool = False, copies: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.rnn = nn.GRU(3, 4).double()
        self.time_major, self.copies = time_major, copies

    def forward(self, packed: PackedSequence) -> Any:
        out, _ = self.rnn(packed)
        if self.time_major:
            return {"padded": pad_packed_sequence(out)[0]}
        padded, lengths = pad_packed_sequence(out, batch_first=True, total_length=7)
        fields = [out.batch_sizes, out.sorted_indices, out.unsorted_indices]
        if self.copies:
            fields = [None if f is None else f.clone() for f in fields]
        return (out.data, *fields, padded, lengths)


def _packed(enforce_sorted: bool, lengths: list[int] = LENGTHS) -> PackedSequence:
    lens = torch.tensor(sorted(lengths, reverse=True) if enforce_sorted else lengths)
    x = torch.randn(len(lengths), 7, 3, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    return pack_padded_sequence(x, lens, batch_first=True, enforce_sorted=enforce_sorted)


INVOLUTIONS = [3, 1, 2, 5, 4, 7, 6]  # on 3 replicas each part's sorted_indices is its own inverse; the batch's not


@pytest.mark.parametrize("enforce_sorted", [False, True])
@pytest.mark.parametrize("devices", [*LISTS, pytest.param(["cpu"] * 4, id="cpu*4")])
def test_every_output_of_a_packed_call_is_recombined(devices: list[str], enforce_sorted: bool) -> None:
    """batch_sizes comes back as the input's (7, 6, 5, 3, 2, 2, 1), not the replicas' joined; the indices
    as the input's (None where it had none); data, the padded batch and lengths as on one device. The
    fields are told apart by identity (an RNN passes its input's on), also where their values are alike
    (INVOLUTIONS); copies of them by value (on 2 replicas LENGTHS' parts tell sorted from unsorted)."""
    for lengths, copies in ((LENGTHS, False), (INVOLUTIONS, False), (LENGTHS, len(devices) == 2)):
        module = _Fields(copies=copies)
        packed = _packed(enforce_sorted, lengths)
        with torch.no_grad():
            expected, out = module(packed), dpcore.DataParallel(module, devices)(packed)
        assert torch.equal(out[1], packed.batch_sizes) and out[1].device == torch.device("cpu")
        assert out[1] is packed.batch_sizes or copies  # as the bare RNN passes it on
        assert (out[2] is None) == enforce_sorted
        assert_same(out, expected)


@pytest.mark.parametrize("devices", LISTS)
def test_a_packed_call_output_that_cannot_be_recombined_names_it(devices: list[str]) -> None:
    dp = dpcore.DataParallel(_Fields(time_major=True), devices)
    with torch.no_grad(), pytest.raises(ValueError, match=r"gather: output\['padded'\]: its shapes on the replicas"):
        dp(_packed(False))
    weights = dpcore.DataParallel(_PackedWeight(), devices)
    with pytest.raises(ValueError, match=r"gather: output\[1\]: .*neither one row per sequence along dim 0") as info:
        weights(_packed(False))
    assert "gather=False" in str(info.value)


class _PackedWeight(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.rnn = nn.GRU(3, 4).double()

    def forward(self, packed: PackedSequence) -> tuple[torch.Tensor, torch.Tensor]:
        out, h = self.rnn(packed)
        return h[-1], self.rnn.weight_hh_l0  # a weight: no batch at all


def test_sorted_and_unsorted_index_copies_that_look_the_same_are_an_error() -> None:
    """Copies of each replica's sorted_indices, which here equal their inverse while the batch's differ: an
    index output cannot be told to be either, so it is an error, never a guess."""
    dp = dpcore.DataParallel(_Fields(copies=True), ["cpu"] * 3)
    packed = _packed(False, INVOLUTIONS)
    assert not torch.equal(packed.sorted_indices, packed.unsorted_indices)
    with torch.no_grad(), pytest.raises(ValueError, match=r"gather: output\[2\]: on every replica it equals both"):
        dp(packed)


# ---------------------------------------------------------------------------
# transformers: the caches of the integrations table, LLaVA's per-image list
# ---------------------------------------------------------------------------


def _transformers() -> Any:
    return pytest.importorskip("transformers")


TEXT = {"vocab_size": 50, "hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2}
TEXT |= {"num_key_value_heads": 1, "intermediate_size": 24, "max_position_embeddings": 32, "pad_token_id": 0}


def _model(kind: str, cls: str, **fields: Any) -> nn.Module:
    transformers = _transformers()
    config = transformers.AutoConfig.for_model(kind, **fields)
    torch.manual_seed(0)
    return getattr(transformers, cls)(config).double().eval()


def _ids(rows: int = BATCH, steps: int = 6, seed: int = 3) -> torch.Tensor:
    return torch.randint(3, 50, (rows, steps), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("devices", LISTS)
@pytest.mark.parametrize(
    ("kind", "cls", "fields"),
    [
        ("mamba", "MambaForCausalLM", {"state_size": 4, "expand": 2, "conv_kernel": 3}),
        (
            "jamba",
            "JambaForCausalLM",
            {"num_experts": 2, "attn_layer_period": 2, "attn_layer_offset": 1, "mamba_d_state": 4}
            | {"mamba_dt_rank": 4, "use_mamba_kernels": False, "experts_implementation": "eager"},
        ),
    ],
    ids=["mamba", "jamba"],
)
def test_state_space_caches_are_gathered_by_their_attributes(
    devices: list[str], kind: str, cls: str, fields: dict[str, Any]
) -> None:
    """Their DynamicCache cannot be iterated (its layers have no keys): gathered, not listed."""
    model = _model(kind, cls, **(TEXT | fields))
    with torch.no_grad():
        expected = model(_ids(), use_cache=True)
        out = dpcore.DataParallel(model, devices)(_ids(), use_cache=True)
    assert type(out.cache).__name__ == "DynamicCache"
    torch.testing.assert_close(out.logits, expected.logits, rtol=1e-5, atol=1e-7)  # float32 inside (scan)
    for got, want in zip(out.cache.layers, expected.cache.layers):
        assert type(got) is type(want)
        for name, value in vars(want).items():
            if isinstance(value, dict):
                for key, tensor in value.items():
                    if isinstance(tensor, torch.Tensor):
                        torch.testing.assert_close(vars(got)[name][key], tensor, rtol=1e-5, atol=1e-7)
                    else:
                        assert vars(got)[name][key] == tensor
            elif not isinstance(value, torch.Tensor):
                assert vars(got)[name] == value, name


@pytest.mark.parametrize("devices", LISTS)
@pytest.mark.parametrize(
    ("kind", "cls", "fields"),
    [
        ("mistral", "MistralForCausalLM", {"sliding_window": 3}),
        ("gemma2", "Gemma2ForCausalLM", {"sliding_window": 3, "head_dim": 8}),
    ],
    ids=["mistral", "gemma2"],
)
def test_sliding_window_caches_decode_as_on_one_device(
    devices: list[str], kind: str, cls: str, fields: dict[str, Any]
) -> None:
    """use_cache=True: the cache's 0-dim window and its seen-token counts kept once; the gathered cache fed
    back in for two decoding steps (split by its attributes) equals the bare model's, field by field."""
    model = _model(kind, cls, **(TEXT | fields))
    dp = dpcore.DataParallel(model, devices)
    tol = {"rtol": 1e-5, "atol": 1e-7} if kind == "gemma2" else TOL
    with torch.no_grad():
        expected, out = model(_ids(), use_cache=True), dp(_ids(), use_cache=True)
        for step in range(2):
            torch.testing.assert_close(out.logits, expected.logits, **tol)
            for got, want in zip(out.cache.layers, expected.cache.layers):
                assert vars(got).keys() == vars(want).keys()
                assert got.get_seq_length() == want.get_seq_length()
                torch.testing.assert_close(got.keys, want.keys, **tol)
            ids = _ids(steps=1, seed=10 + step)
            expected = model(ids, cache=expected.cache, use_cache=True)
            out = dp(ids, cache=out.cache, use_cache=True)


@pytest.mark.parametrize("devices", LISTS)
def test_llava_trains_as_on_one_device(devices: list[str]) -> None:
    """Its image_outputs.pooler_output has one entry per image: concatenated in replica order."""
    vision = {"model_type": "clip_vision_model", "image_size": 8, "patch_size": 4, "hidden_size": 16}
    vision |= {"num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 24}
    text = TEXT | {"model_type": "llama"}
    model = _model(
        "llava", "LlavaForConditionalGeneration", vision_config=vision, text_config=text, image_token_index=2
    )
    model.train()
    reference = copy.deepcopy(model)
    g = torch.Generator().manual_seed(4)
    ids = torch.cat([torch.full((BATCH, 4), 2), _ids(steps=3)], dim=1)
    inputs = {"input_ids": ids, "pixel_values": torch.randn(BATCH, 3, 8, 8, generator=g, dtype=torch.float64)}
    inputs["labels"] = ids.masked_fill(ids == 2, -100)
    out = dpcore.DataParallel(model, devices, model_loss="rows")(**inputs)
    expected = reference(**inputs)
    features = out.image_outputs.pooler_output
    assert type(features) is list and len(features) == BATCH
    for a, b in zip(features, expected.image_outputs.pooler_output):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(out.loss, expected.loss, rtol=1e-6, atol=1e-8)  # float32 losses inside
    out.loss.backward()
    expected.loss.backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")


def test_the_integrations_table_names_every_library_type_in_one_place() -> None:
    """The pipeline decides by the table (module, class) without importing a library: a class of
    transformers' cache_utils, a subclass of one elsewhere, Reformer's cache; not a look-alike."""
    transformers = _transformers()
    from transformers.models.reformer.modeling_reformer import ReformerDynamicCache

    pt.check_registry()

    class MyCache(transformers.DynamicCache):
        pass

    look_alike = type("DynamicCache", (), {"__init__": lambda self: setattr(self, "h", torch.zeros(1))})
    assert pt.node_of(transformers.DynamicCache()).kind is pt.OBJECT
    assert pt.node_of(MyCache()).kind is pt.OBJECT
    assert pt.node_of(ReformerDynamicCache()).kind is pt.OBJECT
    assert pt.node_of(look_alike()).kind is pt.LEAF
