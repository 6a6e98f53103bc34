"""Methods other than forward, data parallel: ``dp.generate`` and
``dp.parallel(name)`` (dpcore/_methods.py, docs/generate.md).

Hugging Face models are built here from tiny configs with random weights
(nothing downloaded), in float64, so that a replica's greedy and beam
choices on its chunk are the bare model's on the whole batch. The eos token
of each model is chosen as the first token the model generates for the
rows of the last replica, so that replica stops after one step while the
others go on: its worker returns early, and the gathered result must still
be the bare model's, padding and all."""

from __future__ import annotations

import math
import threading
from typing import Any

import pytest
import torch
from torch import nn

import dpcore

LISTS = [pytest.param(["cpu"] * k, id=f"cpu*{k}") for k in (2, 3, 4)]
ROWS = 7  # uneven on every list: 4+3, 3+2+2, 2+2+2+1


def _gpt2(pad: int | None = 0) -> nn.Module:
    t = pytest.importorskip("transformers")
    config = t.GPT2Config(
        vocab_size=50, n_positions=64, n_embd=16, n_layer=2, n_head=2, bos_token_id=1, eos_token_id=2, pad_token_id=pad
    )
    torch.manual_seed(0)
    return t.GPT2LMHeadModel(config).double().eval()


def _llama() -> nn.Module:
    t = pytest.importorskip("transformers")
    config = t.LlamaConfig(
        vocab_size=50,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    return t.LlamaForCausalLM(config).double().eval()


def _t5() -> nn.Module:
    t = pytest.importorskip("transformers")
    config = t.T5Config(
        vocab_size=50,
        d_model=16,
        d_kv=8,
        d_ff=32,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=2,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=1,
    )
    torch.manual_seed(0)
    return t.T5ForConditionalGeneration(config).double().eval()


MODELS = [pytest.param(_gpt2, id="gpt2"), pytest.param(_llama, id="llama"), pytest.param(_t5, id="t5")]


def _batch(model: nn.Module, last: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ROWS prompts, padded as the model expects (decoder-only: on the left,
    in two rows; T5: on the right), whose last `last` rows are alike; the
    model's eos becomes its first greedy token for them, so they stop at once."""
    ids = torch.randint(3, 50, (ROWS, 6), generator=torch.Generator().manual_seed(1))
    ids[ROWS - last :] = ids[ROWS - 1]
    mask = torch.ones_like(ids)
    if model.config.is_encoder_decoder:
        ids[0, -2:], mask[0, -2:] = 0, 0
    else:
        ids[0, :2], mask[0, :2] = 0, 0
        ids[2, :3], mask[2, :3] = 0, 0
    stop = model.generate(ids[-1:], attention_mask=mask[-1:], max_new_tokens=1, do_sample=False)[0, -1]
    model.generation_config.eos_token_id = int(stop)
    return ids, mask


def _last_rows(devices: list[str]) -> int:
    """The rows of the last replica for ROWS rows over `devices` (balanced split)."""
    return ROWS // len(devices)


def _equal_where_computed(ours: tuple[torch.Tensor, ...], theirs: tuple[torch.Tensor, ...]) -> None:
    """Per-step tensors: the same steps; each row either the bare model's or all NaN (a step its replica did not run)."""
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        missing = torch.isnan(a).all(-1)
        assert torch.equal(torch.where(missing[:, None], b, a), b)


@pytest.mark.parametrize("devices", LISTS)
@pytest.mark.parametrize("make", MODELS)
def test_greedy_is_the_bare_models(make: Any, devices: list[str]) -> None:
    model = make()
    ids, mask = _batch(model, _last_rows(devices))
    settings = {"max_new_tokens": 8, "do_sample": False}
    bare = model.generate(ids, attention_mask=mask, **settings)
    dp = dpcore.DataParallel(model, devices)
    assert torch.equal(dp.generate(ids, attention_mask=mask, **settings), bare)
    per_replica = dpcore.DataParallel(model, devices, gather=False).generate(ids, attention_mask=mask, **settings)
    lengths = [out.size(1) for out in per_replica]
    assert len(lengths) == len(devices) and lengths[-1] < max(lengths) == bare.size(1)  # the last one stopped early
    # its rows are padded as the bare model pads finished rows: the pad token after eos
    assert torch.all(bare[-1, lengths[-1] :] == model.generation_config.pad_token_id)

    full = model.generate(ids, attention_mask=mask, **settings, return_dict_in_generate=True, output_scores=True)
    ours = dp.generate(ids, attention_mask=mask, **settings, return_dict_in_generate=True, output_scores=True)
    assert type(ours) is type(full) and torch.equal(ours.sequences, full.sequences)
    _equal_where_computed(ours.scores, full.scores)


@pytest.mark.parametrize("devices", [LISTS[0], LISTS[1]])
@pytest.mark.parametrize("make", MODELS)
def test_beam_search_and_return_sequences_in_the_bare_models_order(make: Any, devices: list[str]) -> None:
    model = make()
    ids, mask = _batch(model, _last_rows(devices))
    settings = {"max_new_tokens": 8, "do_sample": False, "num_beams": 3, "num_return_sequences": 2}
    settings.update(return_dict_in_generate=True, output_scores=True, output_logits=True)
    bare = model.generate(ids, attention_mask=mask, **settings)
    ours = dpcore.DataParallel(model, devices).generate(ids, attention_mask=mask, **settings)
    assert ours.sequences.shape == (2 * ROWS, bare.sequences.size(1))
    assert torch.equal(ours.sequences, bare.sequences)
    assert torch.equal(ours.sequences_scores, bare.sequences_scores)
    assert torch.equal(ours.beam_indices, bare.beam_indices)  # indices into the whole batch's beams
    _equal_where_computed(ours.scores, bare.scores)
    _equal_where_computed(ours.logits, bare.logits)


def test_beam_search_pads_shorter_beams_as_transformers_does() -> None:
    """transformers fills a beam search's shorter sequences with the pad
    token, or the eos token where the pad token is 0 (Llama's here)."""
    model = _llama()
    ids, mask = _batch(model, 2)
    settings = {"max_new_tokens": 10, "do_sample": False, "num_beams": 3}
    bare = model.generate(ids, attention_mask=mask, **settings)
    per_replica = dpcore.DataParallel(model, ["cpu"] * 3, gather=False).generate(ids, attention_mask=mask, **settings)
    assert len({out.size(1) for out in per_replica}) > 1  # the replicas' sequences differ in length
    assert torch.equal(dpcore.DataParallel(model, ["cpu"] * 3).generate(ids, attention_mask=mask, **settings), bare)


def test_uneven_chunk_sizes_and_an_output_device() -> None:
    model = _gpt2()
    ids, mask = _batch(model, 1)
    dp = dpcore.DataParallel(model, ["cpu"] * 3, chunk_sizes=[2, 4, 1], output_device="cpu")
    settings = {"max_new_tokens": 6, "do_sample": False, "num_beams": 2}
    assert torch.equal(
        dp.generate(ids, attention_mask=mask, **settings), model.generate(ids, attention_mask=mask, **settings)
    )


def test_the_pad_token_is_the_eos_token_where_there_is_none() -> None:
    model = _gpt2(pad=None)
    ids, mask = _batch(model, 2)
    bare = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    ours = dpcore.DataParallel(model, ["cpu"] * 3).generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    assert torch.equal(ours, bare) and bare[-1, -1] == model.generation_config.eos_token_id
    # a pad token given to the call is the one used
    bare = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=7)
    ours = dpcore.DataParallel(model, ["cpu"] * 3).generate(
        ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=7
    )
    assert torch.equal(ours, bare) and bare[-1, -1] == 7


def test_rows_stopped_without_an_eos_token_are_an_error_naming_it() -> None:
    """Without an eos token the bare model keeps generating for rows a
    stopping criterion finished: a replica that returned cannot say what it
    would have generated, so the call refuses rather than pad."""
    transformers = pytest.importorskip("transformers")
    model = _gpt2()

    class ShortRows(transformers.StoppingCriteria):  # rows whose first token is small stop after two tokens
        def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
            return (input_ids[:, 0] < 20) & (input_ids.size(1) >= 8)

    ids = torch.randint(20, 50, (4, 6), generator=torch.Generator().manual_seed(1))
    ids[2:, 0] = 5
    settings = {"max_new_tokens": 5, "do_sample": False, "eos_token_id": None, "stopping_criteria": [ShortRows()]}
    dp = dpcore.DataParallel(model, ["cpu"] * 2)
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel\.generate \(data parallel\).*eos_token_id"):
        dp.generate(ids, **settings)


def test_sampling_is_reproducible_under_a_seed() -> None:
    model = _gpt2()
    ids, mask = _batch(model, 2)
    dp = dpcore.DataParallel(model, ["cpu"] * 3)
    settings = {"max_new_tokens": 8, "do_sample": True, "num_return_sequences": 2, "top_k": 0}

    def sample(seed: int) -> torch.Tensor:
        torch.manual_seed(seed)
        return dp.generate(ids, attention_mask=mask, **settings)

    first = sample(0)
    assert first.shape[0] == 2 * ROWS
    assert torch.equal(sample(0), first)
    assert not torch.equal(sample(1), first)


def test_generate_runs_on_every_replica() -> None:
    """What dp.generate did before: the module's own generate, one replica
    on the whole batch. Now every replica runs forwards, each on its rows."""
    model = _gpt2()
    ids, mask = _batch(model, 1)
    rows: dict[int, set[int]] = {}
    lock = threading.Lock()

    def record(module: nn.Module, args: Any, kwargs: Any) -> None:
        with lock:
            rows.setdefault(id(module), set()).add(kwargs["input_ids"].size(0))

    model.register_forward_pre_hook(record, with_kwargs=True)
    dpcore.DataParallel(model, ["cpu"] * 3).generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    assert sorted(max(r) for r in rows.values()) == [2, 2, 3]


def test_generate_is_the_modules_where_it_has_none_or_runs_as_is() -> None:
    dp = dpcore.DataParallel(nn.Linear(2, 2), ["cpu"] * 2)
    assert not hasattr(dp, "generate")
    model = _gpt2()
    ids, mask = _batch(model, 1)
    if not torch.cuda.is_available():  # no list and no GPU: the module runs as is
        alone = dpcore.DataParallel(model)
        assert alone.device_ids == []
        settings = {"max_new_tokens": 4, "do_sample": False}
        assert torch.equal(
            alone.generate(ids, attention_mask=mask, **settings), model.generate(ids, attention_mask=mask, **settings)
        )
    with pytest.raises(ValueError, match=r"generate \(data parallel\): .*dimension 0.*dim=1"):
        dpcore.DataParallel(model, ["cpu"] * 2, dim=1).generate(ids, max_new_tokens=2)


def test_seq2seq_trainer_predicts_with_generate_through_the_wrapper(tmp_path: Any) -> None:
    transformers = pytest.importorskip("transformers")
    model = _t5().float()
    generator = torch.Generator().manual_seed(1)
    data = [
        {
            "input_ids": torch.randint(2, 50, (6,), generator=generator),
            "labels": torch.randint(2, 50, (4,), generator=generator),
        }
        for _ in range(6)
    ]
    seen: set[int] = set()
    model.register_forward_pre_hook(lambda module, args: seen.add(id(module)))
    args = transformers.Seq2SeqTrainingArguments(
        str(tmp_path),
        predict_with_generate=True,
        generation_max_length=8,
        use_cpu=True,
        report_to=[],
        per_device_eval_batch_size=6,
    )
    bare = transformers.Seq2SeqTrainer(model=model, args=args).predict(data).predictions
    assert len(seen) == 1
    ours = transformers.Seq2SeqTrainer(model=dpcore.DataParallel(model, ["cpu"] * 2), args=args).predict(data)
    assert (ours.predictions == bare).all() and len(seen) == 2


# ---------------------------------------------------------------------------
# Any method by name: dp.parallel(name)
# ---------------------------------------------------------------------------


class Encoder(nn.Module):
    """A method that returns as many columns as its chunk's longest row (lengths in column 0)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(2.0, dtype=torch.float64))
        self.plain = lambda x: x  # a function stored on the instance: not a method

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale

    def encode(self, x: torch.Tensor) -> dict[str, Any]:
        width = int(x[:, 0].max())
        codes = (x[:, 1:] * self.scale)[:, :width]
        return {"codes": codes, "tokens": x[:, 1 : 1 + width].long(), "rows": x.size(0)}

    def uneven(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(x for _ in range(int(x[0, 0])))


def _lengths_batch() -> torch.Tensor:
    x = torch.rand(5, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    x[:, 0] = torch.tensor([2, 5, 1, 3, 2], dtype=torch.float64)
    return x


def test_parallel_method_pads_to_the_largest_with_pad_value() -> None:
    model = Encoder()
    x = _lengths_batch()
    dp = dpcore.DataParallel(model, ["cpu"] * 2, criterion=nn.MSELoss())  # no loss rule for a method
    out = dp.parallel("encode", pad_value=-1)(x)
    # replica 0 has rows 0..2 (width 5), replica 1 rows 3..4 (width 3): padded to 5 with -1
    assert out["codes"].shape == (5, 5) and out["tokens"].dtype == torch.long and out["rows"] == [3, 2]
    torch.testing.assert_close(out["codes"][:3], model.encode(x[:3])["codes"], rtol=0, atol=0)
    torch.testing.assert_close(out["codes"][3:, :3], model.encode(x[3:])["codes"], rtol=0, atol=0)
    assert torch.all(out["codes"][3:, 3:] == -1) and torch.all(out["tokens"][3:, 3:] == -1)
    # differentiable, as the bare model's method is: the gradient of the computed entries
    out["codes"][out["codes"] != -1].sum().backward()
    grad = model.scale.grad.clone()
    model.scale.grad = None
    (model.encode(x[:3])["codes"].sum() + model.encode(x[3:])["codes"].sum()).backward()
    torch.testing.assert_close(grad, model.scale.grad)
    # a method that needs no padding gathers as forward does
    assert torch.equal(dp.parallel("forward")(x), model(x))


def test_parallel_method_errors_name_the_method() -> None:
    dp = dpcore.DataParallel(Encoder(), ["cpu"] * 2)
    x = _lengths_batch()
    with pytest.raises(
        ValueError, match=r"Encoder\.encode \(data parallel\): output\['codes'\] has shape .*pad_value="
    ):
        dp.parallel("encode")(x)
    with pytest.raises(ValueError, match=r"pad_value=0\.5 cannot pad output\['tokens'\], a torch\.int64 tensor"):
        dp.parallel("encode", pad_value=0.5)(x)
    with pytest.raises(AttributeError, match=r"parallel\('decode'\): the module, a Encoder, has no method 'decode'"):
        dp.parallel("decode")
    with pytest.raises(TypeError, match=r"parallel\('plain'\): Encoder\.plain is a function, not a method"):
        dp.parallel("plain")
    with pytest.raises(TypeError, match=r"pad_value: expected a number"):
        dp.parallel("encode", pad_value="0")
    with pytest.raises(
        ValueError, match=r"Encoder\.uneven \(data parallel\): the replicas' results cannot be gathered"
    ):
        dp.parallel("uneven")(x)


def test_parallel_method_keeps_gather_false_and_runs_a_submodule() -> None:
    model = Encoder()
    x = _lengths_batch()
    per_replica = dpcore.DataParallel(model, ["cpu"] * 2, gather=False).parallel("encode")(x)
    assert [p["codes"].shape for p in per_replica] == [(3, 5), (2, 3)]
    # a torch.compile wrapper hands out its inner module's methods: each replica's own
    compiled = dpcore.DataParallel(torch.compile(model, backend="eager"), ["cpu"] * 2)
    assert torch.equal(compiled.parallel("encode", pad_value=0)(x)["codes"][:3], model.encode(x[:3])["codes"])
    t5 = _t5()
    ids = torch.randint(2, 50, (5, 6), generator=torch.Generator().manual_seed(2))
    ours = dpcore.DataParallel(t5, ["cpu"] * 3).parallel("encoder")(input_ids=ids)
    torch.testing.assert_close(ours.last_hidden_state, t5.encoder(input_ids=ids).last_hidden_state, rtol=0, atol=1e-12)


def test_the_nan_rule_of_generate_is_the_declared_default() -> None:
    """generate's per-step outputs and cache are padded with NaN, unless
    dp.parallel("generate", pad_value=...) declares another value."""
    model = _gpt2()
    ids, mask = _batch(model, 2)
    settings = {"max_new_tokens": 5, "do_sample": False, "return_dict_in_generate": True, "output_scores": True}
    dp = dpcore.DataParallel(model, ["cpu"] * 3)
    nan = dp.generate(ids, attention_mask=mask, **settings)
    assert torch.isnan(nan.scores[-1][-2:]).all() and not torch.isnan(nan.scores[-1][:-2]).any()
    keys = nan.cache.layers[0].keys
    assert torch.isnan(keys[-2:, :, -1]).all() and not torch.isnan(keys[:-2]).any()
    low = dp.parallel("generate", pad_value=-math.inf)(ids, attention_mask=mask, **settings)
    assert torch.equal(low.sequences, nan.sequences) and torch.all(low.scores[-1][-2:] == -math.inf)


def test_bench_generate_reports_both_ratios(tmp_path: Any) -> None:
    pytest.importorskip("transformers")
    import json

    from dpcore.bench import generate as bench_generate

    out = tmp_path / "generate.json"
    result = bench_generate.main(["--devices", "cpu:2", "--quick", "--new-tokens", "2", "--json", str(out)])
    assert [row["search"] for row in result["rows"]] == ["greedy", "beam 4"]
    for row in result["rows"]:
        assert row["new_tokens"] == 2 and row["bare_tokens_per_s"] > 0 and row["dpcore_tokens_per_s"] > 0
        assert row["ratio_min"] <= row["ratio_median"] <= row["ratio_max"]
        assert row["one_thread_ratio_min"] <= row["one_thread_ratio_median"] <= row["one_thread_ratio_max"]
    assert json.loads(out.read_text())["env"]["load_average"] is not None
    with pytest.raises(SystemExit) as exit_info:
        bench_generate.main(["--devices", "cpu:2", "--new-tokens", "0"])
    assert exit_info.value.code == 2
