"""transformers' model classes, each built from a tiny config, through the
wrapper on 2 and 3 CPU devices, compared with the bare model on one device.

Each architecture is one row of ZOO: its model class, its config's fields
and the kind of inputs it takes. The one test body builds the model in
float64, seeded, with every dropout, layer-drop and masking probability set
to 0 (so training mode is deterministic), deep-copies it, and checks:

- an inference forward (eval mode, no labels): every output, caches and
  other structured outputs walked to their tensors and plain fields;
- a training call (labels given, ``model_loss="rows"``): every output and
  the loss, then every parameter's gradient after ``loss.backward()`` and
  every buffer (models with BatchNorm run with ``sync_batchnorm=True``).

Tolerances are float64's (1e-10), except for the models that compute in
float32 whatever their dtype (TOL32). A batch of 5 rows gives uneven chunks
on 2 and 3 devices (3+2, 2+2+1). Outputs that the wrapper rightly refuses
(CLIP's and SigLIP's batch x batch logits, XLNet's ``mems`` with the batch
in dim 1) are tests of the error.
"""

from __future__ import annotations

import copy
import dataclasses
import re
from collections.abc import Callable, Mapping
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dpcore

transformers = pytest.importorskip("transformers")

TOL = {"rtol": 1e-10, "atol": 1e-10}
# For models that compute in float32 whatever their dtype (Gemma's norms, Mamba's scan and logits): the
# replicas' sums over rows round in another order there.
TOL32 = {"rtol": 1e-5, "atol": 1e-7}
ROWS = 5  # 3+2 on 2 devices, 2+2+1 on 3
SEQ = 8
VOCAB = 99

Inputs = Callable[[Any, torch.Generator], dict[str, Any]]

# ---------------------------------------------------------------------------
# Inputs, by kind (each gets the model's config and a seeded generator)
# ---------------------------------------------------------------------------


def _ids(g: torch.Generator, rows: int = ROWS, seq: int = SEQ, low: int = 4, high: int = VOCAB) -> torch.Tensor:
    return torch.randint(low, high, (rows, seq), generator=g)


def _mask(rows: int = ROWS, seq: int = SEQ) -> torch.Tensor:
    mask = torch.ones(rows, seq, dtype=torch.long)
    mask[1, -3:] = 0  # two padded rows, in different chunks
    mask[3, -1:] = 0
    return mask


def lm(config: Any, g: torch.Generator) -> dict[str, Any]:
    """Tokens with a padded mask, and themselves as labels (causal LMs shift them, masked LMs do not)."""
    ids = _ids(g)
    return {"input_ids": ids, "attention_mask": _mask(), "labels": ids}


def classify(config: Any, g: torch.Generator) -> dict[str, Any]:
    return {"input_ids": _ids(g), "attention_mask": _mask(), "labels": torch.randint(0, 2, (ROWS,), generator=g)}


def token_classify(config: Any, g: torch.Generator) -> dict[str, Any]:
    return {"input_ids": _ids(g), "attention_mask": _mask(), "labels": torch.randint(0, 2, (ROWS, SEQ), generator=g)}


def multiple_choice(config: Any, g: torch.Generator) -> dict[str, Any]:
    ids = torch.stack([_ids(g) for _ in range(3)], dim=1)  # [rows, 3 choices, seq]
    return {"input_ids": ids, "labels": torch.randint(0, 3, (ROWS,), generator=g)}


def question_answering(config: Any, g: torch.Generator) -> dict[str, Any]:
    ids = _ids(g)
    ids[:, 1] = getattr(config, "question_token_id", 3)  # Splinter's heads start at its question token
    # No attention mask: Splinter's float64 logits are NaN with one (on one device as well).
    start, end = torch.tensor([0, 2, 7, 1, 6]), torch.tensor([3, 5, 7, 4, 6])
    return {"input_ids": ids, "start_positions": start, "end_positions": end}


def seq2seq(config: Any, g: torch.Generator) -> dict[str, Any]:
    return {"input_ids": _ids(g), "attention_mask": _mask(), "labels": _ids(g, seq=5)}


def image(config: Any, g: torch.Generator) -> dict[str, Any]:
    size = config.image_size
    pixels = torch.randn(ROWS, config.num_channels, size, size, generator=g, dtype=torch.float64)
    return {"pixel_values": pixels, "labels": torch.randint(0, config.num_labels, (ROWS,), generator=g)}


def ctc(config: Any, g: torch.Generator) -> dict[str, Any]:
    audio = torch.randn(ROWS, 1024, generator=g, dtype=torch.float64)
    labels = torch.randint(1, config.vocab_size, (ROWS, 4), generator=g)
    labels[2, 3:] = -100  # a shorter transcript
    return {"input_values": audio, "labels": labels}


def audio_classify(config: Any, g: torch.Generator) -> dict[str, Any]:
    audio = torch.randn(ROWS, 1024, generator=g, dtype=torch.float64)
    return {"input_values": audio, "labels": torch.randint(0, config.num_labels, (ROWS,), generator=g)}


def speech_seq2seq(config: Any, g: torch.Generator) -> dict[str, Any]:
    frames = 2 * config.max_source_positions
    features = torch.randn(ROWS, config.num_mel_bins, frames, generator=g, dtype=torch.float64)
    return {"input_features": features, "labels": _ids(g, seq=5)}


def speech_features(config: Any, g: torch.Generator) -> dict[str, Any]:
    features = torch.randn(ROWS, 20, config.input_feat_per_channel, generator=g, dtype=torch.float64)
    return {"input_features": features, "labels": _ids(g, seq=5)}


def image_text(config: Any, g: torch.Generator) -> dict[str, Any]:
    vision = config.vision_config
    pixels = torch.randn(ROWS, 3, vision.image_size, vision.image_size, generator=g, dtype=torch.float64)
    return {"input_ids": _ids(g), "pixel_values": pixels, "return_loss": True}


def xlnet(config: Any, g: torch.Generator) -> dict[str, Any]:
    ids = _ids(g)
    return {"input_ids": ids, "labels": ids}


def llava(config: Any, g: torch.Generator) -> dict[str, Any]:
    vision = config.vision_config
    patches = (vision.image_size // vision.patch_size) ** 2
    ids = torch.cat([torch.full((ROWS, patches), config.image_token_index), _ids(g, seq=4)], dim=1)
    pixels = torch.randn(ROWS, 3, vision.image_size, vision.image_size, generator=g, dtype=torch.float64)
    labels = ids.masked_fill(ids == config.image_token_index, -100)
    return {"input_ids": ids, "pixel_values": pixels, "labels": labels}


# ---------------------------------------------------------------------------
# The zoo
# ---------------------------------------------------------------------------

TEXT = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 37,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
SEQ2SEQ = {
    "vocab_size": VOCAB,
    "d_model": 32,
    "encoder_layers": 2,
    "decoder_layers": 2,
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 4,
    "encoder_ffn_dim": 37,
    "decoder_ffn_dim": 37,
    "max_position_embeddings": 64,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "decoder_start_token_id": 2,
}
T5 = {"vocab_size": VOCAB, "d_model": 32, "d_kv": 8, "d_ff": 37, "num_layers": 2, "num_heads": 4}
T5 |= {"decoder_start_token_id": 0, "pad_token_id": 0, "eos_token_id": 1}
VIT = {"image_size": 32, "patch_size": 8, "num_channels": 3, "hidden_size": 32, "num_hidden_layers": 2}
VIT |= {"num_attention_heads": 4, "intermediate_size": 37}
CONV = {"num_channels": 3, "image_size": 32, "embedding_size": 8, "hidden_sizes": [8, 16], "depths": [1, 1]}
WAV2VEC2 = {"vocab_size": 32, "hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2}
WAV2VEC2 |= {"intermediate_size": 20, "conv_dim": (16, 16, 16), "conv_stride": (4, 4, 4), "conv_kernel": (8, 8, 8)}
WAV2VEC2 |= {"num_conv_pos_embeddings": 16, "num_conv_pos_embedding_groups": 2, "ctc_loss_reduction": "mean"}
MAMBA = {"vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 2, "state_size": 8, "expand": 2}
MAMBA |= {"conv_kernel": 4, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
CLIP_TEXT = {"vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 4}
CLIP_TEXT |= {"intermediate_size": 37, "max_position_embeddings": 16}
CLIP_VISION = {"image_size": 16, "patch_size": 4, "hidden_size": 32, "num_hidden_layers": 1}
CLIP_VISION |= {"num_attention_heads": 4, "intermediate_size": 37}


@dataclasses.dataclass(frozen=True)
class Arch:
    """One architecture: its class, its config (``AutoConfig.for_model(kind, **fields)``) and its inputs."""

    name: str
    cls: str
    kind: str
    fields: Mapping[str, Any]
    inputs: Inputs
    tol: Mapping[str, float] = dataclasses.field(default_factory=lambda: TOL)


def _text(
    name: str, cls: str, inputs: Inputs = lm, kind: str = "", tol: Mapping[str, float] = TOL, **fields: Any
) -> Arch:
    return Arch(name, cls, kind or name, TEXT | fields, inputs, tol)


ZOO: list[Arch] = [
    # decoder LMs
    _text("gpt2", "GPT2LMHeadModel"),
    _text("gpt2-classifier", "GPT2ForSequenceClassification", classify, "gpt2"),
    _text("llama", "LlamaForCausalLM"),
    _text("llama-classifier", "LlamaForSequenceClassification", classify, "llama"),
    _text("mistral-sliding-window", "MistralForCausalLM", kind="mistral", sliding_window=4),
    _text("mixtral", "MixtralForCausalLM", num_local_experts=4, num_experts_per_tok=2, experts_implementation="eager"),
    _text("gemma", "GemmaForCausalLM", tol=TOL32, head_dim=8),
    _text("gemma2", "Gemma2ForCausalLM", tol=TOL32, head_dim=8, sliding_window=4),
    _text("gemma3-text", "Gemma3ForCausalLM", kind="gemma3_text", tol=TOL32, head_dim=8, sliding_window=4),
    _text("qwen2", "Qwen2ForCausalLM"),
    _text("qwen3", "Qwen3ForCausalLM", head_dim=8),
    _text("phi", "PhiForCausalLM"),
    _text("phi3", "Phi3ForCausalLM"),
    _text("opt", "OPTForCausalLM", ffn_dim=37, word_embed_proj_dim=32),
    _text("bloom", "BloomForCausalLM", n_layer=2, n_head=4),
    _text("falcon", "FalconForCausalLM"),
    _text("gpt-neox", "GPTNeoXForCausalLM", kind="gpt_neox"),
    _text("gptj", "GPTJForCausalLM", rotary_dim=4),
    _text("codegen", "CodeGenForCausalLM", rotary_dim=4),
    _text("gpt-bigcode", "GPTBigCodeForCausalLM", kind="gpt_bigcode"),
    _text("olmo", "OlmoForCausalLM"),
    _text("starcoder2", "Starcoder2ForCausalLM"),
    _text("stablelm", "StableLmForCausalLM"),
    # encoders
    _text("bert", "BertForMaskedLM", lm),
    _text("bert-classifier", "BertForSequenceClassification", classify, "bert"),
    _text("roberta", "RobertaForMaskedLM", lm),
    _text("xlm-roberta", "XLMRobertaForMaskedLM", lm, "xlm-roberta"),
    _text("distilbert", "DistilBertForMaskedLM", lm, dim=32, n_layers=2, n_heads=4, hidden_dim=37),
    _text("albert", "AlbertForMaskedLM", lm, embedding_size=16),
    _text("electra", "ElectraForMaskedLM", lm, embedding_size=16),
    _text("deberta", "DebertaForMaskedLM", lm),
    _text("deberta-v2", "DebertaV2ForMaskedLM", lm, "deberta-v2"),
    _text("mpnet", "MPNetForMaskedLM", lm),
    _text("roformer", "RoFormerForMaskedLM", lm),
    _text("convbert", "ConvBertForMaskedLM", lm),
    _text("ernie", "ErnieForMaskedLM", lm),
    _text("bert-qa", "BertForQuestionAnswering", question_answering, "bert"),
    _text("bert-token-classifier", "BertForTokenClassification", token_classify, "bert"),
    _text("bert-multiple-choice", "BertForMultipleChoice", multiple_choice, "bert"),
    _text("splinter-qa", "SplinterForQuestionAnswering", question_answering, "splinter", question_token_id=3),
    # seq2seq
    Arch("t5", "T5ForConditionalGeneration", "t5", T5, seq2seq),
    Arch("bart", "BartForConditionalGeneration", "bart", SEQ2SEQ, seq2seq),
    Arch("marian", "MarianMTModel", "marian", SEQ2SEQ, seq2seq),
    Arch("pegasus", "PegasusForConditionalGeneration", "pegasus", SEQ2SEQ, seq2seq),
    Arch("mbart", "MBartForConditionalGeneration", "mbart", SEQ2SEQ, seq2seq),
    Arch("blenderbot-small", "BlenderbotSmallForConditionalGeneration", "blenderbot-small", SEQ2SEQ, seq2seq),
    Arch("m2m-100", "M2M100ForConditionalGeneration", "m2m_100", SEQ2SEQ, seq2seq),
    # vision
    Arch("vit", "ViTForImageClassification", "vit", VIT, image),
    Arch("deit", "DeiTForImageClassification", "deit", VIT, image),
    Arch("beit", "BeitForImageClassification", "beit", VIT | {"vocab_size": 32}, image),
    Arch("dinov2", "Dinov2ForImageClassification", "dinov2", VIT, image),
    Arch("convnext", "ConvNextForImageClassification", "convnext", CONV | {"num_stages": 2}, image),
    Arch("resnet", "ResNetForImageClassification", "resnet", CONV | {"layer_type": "basic"}, image),
    Arch("regnet", "RegNetForImageClassification", "regnet", CONV | {"groups_width": 8}, image),
    Arch(
        "swin",
        "SwinForImageClassification",
        "swin",
        {"image_size": 32, "patch_size": 4, "embed_dim": 16, "depths": [1, 1], "num_heads": [2, 2], "window_size": 4},
        image,
    ),
    Arch(
        "levit",
        "LevitForImageClassification",
        "levit",
        {
            "image_size": 64,
            "patch_size": 16,
            "hidden_sizes": [16, 32, 48],
            "num_attention_heads": [1, 2, 3],
            "depths": [1, 1, 1],
            "key_dim": [8, 8, 8],
            "mlp_ratio": [2, 2, 2],
            "attention_ratio": [2, 2, 2],
        },
        image,
    ),
    Arch(
        "mobilenet-v2",
        "MobileNetV2ForImageClassification",
        "mobilenet_v2",
        {"image_size": 32, "depth_multiplier": 0.25},
        image,
    ),
    Arch(
        "segformer",
        "SegformerForImageClassification",
        "segformer",
        {"image_size": 32, "num_encoder_blocks": 2, "depths": [1, 1], "sr_ratios": [2, 1], "hidden_sizes": [16, 32]}
        | {"patch_sizes": [7, 3], "strides": [4, 2], "num_attention_heads": [1, 2], "mlp_ratios": [2, 2]},
        image,
    ),
    Arch(
        "poolformer",
        "PoolFormerForImageClassification",
        "poolformer",
        {"image_size": 32, "num_encoder_blocks": 2, "depths": [1, 1], "hidden_sizes": [16, 32]}
        | {"patch_sizes": [7, 3], "strides": [4, 2], "padding": [2, 1]},
        image,
    ),
    # audio
    Arch("wav2vec2", "Wav2Vec2ForCTC", "wav2vec2", WAV2VEC2, ctc),
    Arch("wav2vec2-classifier", "Wav2Vec2ForSequenceClassification", "wav2vec2", WAV2VEC2, audio_classify),
    Arch("hubert", "HubertForCTC", "hubert", WAV2VEC2, ctc),
    Arch("wavlm", "WavLMForCTC", "wavlm", WAV2VEC2, ctc),
    Arch("data2vec-audio", "Data2VecAudioForCTC", "data2vec-audio", WAV2VEC2, ctc),
    Arch(
        "whisper",
        "WhisperForConditionalGeneration",
        "whisper",
        SEQ2SEQ | {"d_model": 16, "num_mel_bins": 8, "max_source_positions": 15, "max_target_positions": 20},
        speech_seq2seq,
    ),
    Arch(
        "speech-to-text",
        "Speech2TextForConditionalGeneration",
        "speech_to_text",
        SEQ2SEQ
        | {"input_feat_per_channel": 8, "conv_channels": 8, "max_source_positions": 30, "max_target_positions": 20},
        speech_features,
    ),
    Arch("sew", "SEWForCTC", "sew", WAV2VEC2 | {"squeeze_factor": 2}, ctc),
    # state-space
    Arch("mamba", "MambaForCausalLM", "mamba", MAMBA, lm, TOL32),
    Arch(
        "mamba2",
        "Mamba2ForCausalLM",
        "mamba2",
        MAMBA | {"num_heads": 8, "head_dim": 8, "n_groups": 1},
        lm,
        TOL32,
    ),
    Arch("falcon-mamba", "FalconMambaForCausalLM", "falcon_mamba", MAMBA, lm, TOL32),
    _text(
        "jamba",
        "JambaForCausalLM",
        num_experts=2,
        attn_layer_period=2,
        attn_layer_offset=1,
        mamba_d_state=8,
        mamba_dt_rank=8,
        use_mamba_kernels=False,
        experts_implementation="eager",
        tol=TOL32,
    ),
    _text(
        "reformer",
        "ReformerModelWithLMHead",
        attn_layers=["local", "local"],
        is_decoder=True,
        attention_head_size=16,
        num_attention_heads=2,
        axial_pos_shape=[2, 4],
        axial_pos_embds_dim=[16, 16],
        feed_forward_size=37,
        local_attn_chunk_length=4,
        max_position_embeddings=SEQ,
    ),
    # multimodal
    Arch(
        "llava",
        "LlavaForConditionalGeneration",
        "llava",
        {
            "vision_config": CLIP_VISION | {"model_type": "clip_vision_model"},
            "text_config": TEXT | {"model_type": "llama"},
        }
        | {"image_token_index": 3, "vision_feature_select_strategy": "default", "vision_feature_layer": -1},
        llava,
    ),
]

# Outputs the wrapper rightly refuses: the architecture and a regex of the error's message.
REFUSED = [
    (
        Arch("clip", "CLIPModel", "clip", {"text_config": CLIP_TEXT, "vision_config": CLIP_VISION}, image_text),
        r"output\['logits_per_image'\]: .*in every dimension but 0",
    ),
    (
        Arch("siglip", "SiglipModel", "siglip", {"text_config": CLIP_TEXT, "vision_config": CLIP_VISION}, image_text),
        r"output\['logits_per_image'\]: .*in every dimension but 0",
    ),
    (
        Arch(
            "xlnet",
            "XLNetLMHeadModel",
            "xlnet",
            {"vocab_size": VOCAB, "d_model": 32, "n_layer": 2, "n_head": 4, "d_inner": 37, "mem_len": 4}
            | {"use_mems_train": True},  # mems in training mode too
            xlnet,
        ),
        r"output\['mems'\]\[0\]: .*in every dimension but 0",
    ),
]

# ---------------------------------------------------------------------------
# The test body
# ---------------------------------------------------------------------------

_PROBABILITY = re.compile(r"drop|mask_.*prob")


# transformers' losses upcast the logits to float32 (transformers/loss/loss_utils.py, loss_ctc.py): these are
# the same losses in the logits' own dtype, so that float64 runs compare to 1e-10. Extra positional arguments
# (vocab_size, config) are not needed.
def _token_loss(
    logits: torch.Tensor, labels: torch.Tensor, *_: Any, ignore_index: int = -100, **__: Any
) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, -2), labels.flatten().to(logits.device), ignore_index=ignore_index)


def _causal_lm_loss(
    logits: torch.Tensor, labels: torch.Tensor, *_: Any, ignore_index: int = -100, **__: Any
) -> torch.Tensor:
    return _token_loss(logits[..., :-1, :], labels[..., 1:], ignore_index=ignore_index)


def _ctc_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    logit_lengths: torch.Tensor,
    blank_token_id: int,
    reduction: str = "mean",
    zero_infinity: bool = False,
    ignore_index: int = -100,
    **_: Any,
) -> torch.Tensor:
    keep = (labels != ignore_index) & (labels != blank_token_id)
    log_probs = logits.log_softmax(-1).transpose(0, 1)
    return F.ctc_loss(log_probs, labels[keep], logit_lengths, keep.sum(-1), blank_token_id, reduction, zero_infinity)


_LOSSES = {
    "ForCausalLM": _causal_lm_loss,
    "ForConditionalGeneration": _causal_lm_loss,
    "ForMaskedLM": _token_loss,
    "ForTokenClassification": _token_loss,
    "ForCTC": _ctc_loss,
}


def _build(arch: Arch) -> tuple[nn.Module, Any]:
    """The model in float64, seeded, in training mode with every dropout and masking probability set to 0."""
    config = transformers.AutoConfig.for_model(arch.kind, **arch.fields)
    for key, value in config.to_dict().items():
        if _PROBABILITY.search(key) and isinstance(value, float):
            setattr(config, key, 0.0)
    torch.manual_seed(0)
    model = getattr(transformers, arch.cls)(config).double().train()
    loss_type = model.loss_type or "ForCausalLM"  # transformers' default (PreTrainedModel.loss_function)
    if loss_type in _LOSSES:
        model.loss_function = _LOSSES[loss_type]
    return model, config


def _has_batchnorm(model: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


def assert_same(got: Any, want: Any, tol: Mapping[str, float], path: str = "output") -> None:
    """`got` equals `want`: tensors within `tol`, containers and other objects walked field by field."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), f"{path}: expected a tensor, got {type(got).__name__}"
        torch.testing.assert_close(got, want, **tol, msg=lambda m: f"{path}: {m}")
        return
    assert type(got) is type(want), f"{path}: expected {type(want).__name__}, got {type(got).__name__}"
    if isinstance(want, Mapping):
        assert list(got) == list(want), f"{path}: keys {list(got)} != {list(want)}"
        for key in want:
            assert_same(got[key], want[key], tol, f"{path}[{key!r}]")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), f"{path}: length {len(got)} != {len(want)}"
        for i, (a, b) in enumerate(zip(got, want)):
            assert_same(a, b, tol, f"{path}[{i}]")
    elif hasattr(want, "__dict__") and not isinstance(want, (nn.Module, transformers.PretrainedConfig)):
        assert_same(vars(got), vars(want), tol, f"{path}.__dict__")
    else:
        assert got == want, f"{path}: {got!r} != {want!r}"


def _assert_same_grads(model: nn.Module, reference: nn.Module, tol: Mapping[str, float]) -> None:
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        if q.grad is None:
            assert p.grad is None, f"{name}: has a gradient, but none on one device"
        else:
            assert p.grad is not None, f"{name}: no gradient, but one on one device"
            torch.testing.assert_close(p.grad, q.grad, **tol, msg=lambda m, n=name: f"grad of {n}: {m}")
    for (name, b), c in zip(model.named_buffers(), reference.buffers()):
        torch.testing.assert_close(b, c, **tol, msg=lambda m, n=name: f"buffer {n}: {m}")


@pytest.fixture(autouse=True)
def _one_intra_op_thread() -> Any:
    """Tiny models on a shared 2-core machine: intra-op threads only spin (4x the time of one thread)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


_LOSS_INPUTS = ("labels", "start_positions", "end_positions", "return_loss")


def _inference_inputs(inputs: dict[str, Any], config: Any) -> dict[str, Any]:
    """`inputs` without what makes a loss; an encoder-decoder's labels become its decoder's inputs."""
    out = {k: v for k, v in inputs.items() if k not in _LOSS_INPUTS}
    if config.is_encoder_decoder and "labels" in inputs:
        out["decoder_input_ids"] = inputs["labels"]
    return out


@pytest.mark.parametrize("k", [2, 3])
@pytest.mark.parametrize("arch", ZOO, ids=[a.name for a in ZOO])
def test_as_on_one_device(arch: Arch, k: int) -> None:
    """An inference forward (eval mode, no labels, the model's caches) and a training call (labels, backward)
    through the wrapper equal the bare model's on one device."""
    model, config = _build(arch)
    reference = copy.deepcopy(model)
    dp = dpcore.DataParallel(model, device_ids=["cpu"] * k, model_loss="rows", sync_batchnorm=_has_batchnorm(model))

    def fresh() -> dict[str, Any]:  # the same inputs again (a model may write them in place)
        return arch.inputs(config, torch.Generator().manual_seed(1))

    dp.eval(), reference.eval()
    with torch.no_grad():
        assert_same(dp(**_inference_inputs(fresh(), config)), reference(**_inference_inputs(fresh(), config)), arch.tol)

    dp.train(), reference.train()
    out, expected = dp(**fresh()), reference(**fresh())
    assert_same(out, expected, arch.tol)
    out.loss.backward()
    expected.loss.backward()
    _assert_same_grads(model, reference, arch.tol)


@pytest.mark.parametrize("k", [2, 3])
@pytest.mark.parametrize(("arch", "message"), REFUSED, ids=[a.name for a, _ in REFUSED])
def test_refused(arch: Arch, message: str, k: int) -> None:
    """Outputs that mix the rows of several replicas (batch x batch logits) or hold the batch in another
    dimension than 0 cannot be gathered: the call raises an error naming the output, in eval and training
    mode."""
    model, config = _build(arch)
    dp = dpcore.DataParallel(model, device_ids=["cpu"] * k, model_loss="rows")
    for training in (False, True):
        dp.train(training)
        with pytest.raises(RuntimeError, match=message):
            dp(**arch.inputs(config, torch.Generator().manual_seed(1)))


def test_walk_sees_inside_caches() -> None:
    """assert_same walks a cache to its tensors: one changed value, or a list in its place, is caught."""
    cache = transformers.DynamicCache()
    cache.update(torch.randn(2, 1, 3, 4, dtype=torch.float64), torch.randn(2, 1, 3, 4, dtype=torch.float64), 0)
    changed = copy.deepcopy(cache)
    changed.layers[0].values[1, 0, 2, 3] += 1e-8
    with pytest.raises(AssertionError, match=r"output.__dict__\['layers'\]\[0\].__dict__\['values'\]"):
        assert_same(changed, cache, TOL)
    with pytest.raises(AssertionError, match="expected DynamicCache, got list"):
        assert_same([cache, cache], cache, TOL)


def test_zoo_is_large() -> None:
    """The zoo covers at least 40 architectures (issue 39)."""
    assert len({a.cls for a in ZOO}) >= 40
