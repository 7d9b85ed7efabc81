"""GGUF weights kept in their blocks (``--quantization gguf``, the default for a .gguf file) give
what the same file dequantized at load gives (``--quantization none``).

Every format is tested on a small random GGUF written by the ``gguf`` package; the real SmolLM2
file (Q4_1 layers, Q8_0 embedding and tied LM head) is tested token for token on ten prompts.
Activations and KV cache are float32 on both sides, so the only difference left is where the
dequantization happens (and the order of a dot product's sums).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch

from corefleet.engine import LLM, SamplingParams
from corefleet.engine.models.quant_layers import QuantEmbedding, QuantLinear
from corefleet.kernels import envs
from corefleet.kernels.gguf_quant import FORMATS
from tests.fixtures_models import write_tiny_gguf, write_tiny_model


@pytest.fixture(autouse=True)
def float_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The float kernels (Q4_0/Q4_1/Q8_0 would otherwise be repacked for the integer linear,
    which quantizes activations: tests/integration/test_gguf_packed.py compares that path)."""
    monkeypatch.setenv(envs.GGUF_PACKED, "0")


LAYER_KINDS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
PROMPTS = ["def add(a, b):", "hello world", "the quick brown fox jumps"]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)


def _tiny_gguf(tmp_path: Path, quant: dict[str, str]) -> Path:
    # hidden and intermediate multiples of 256: every format's block fits every matrix.
    folder = write_tiny_model(tmp_path / "hf", hidden_size=256, intermediate_size=512, seed=3)
    return write_tiny_gguf(tmp_path / "model.gguf", folder, quant=quant)


def _llm(path: Path | str, quantization: str) -> LLM:
    return LLM(
        str(path),
        multiprocess=False,
        dtype="float32",
        kv_cache_dtype="float32",
        kv_cache_memory=32 << 20,
        quantization=quantization,
    )


def _greedy(path: Path | str, quantization: str, prompts: list[str], params: SamplingParams):  # type: ignore[no-untyped-def]
    llm = _llm(path, quantization)
    try:
        model = llm.engine_client.engine.executor.runner.model  # type: ignore[attr-defined]
        outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.shutdown()
    return model, [o.outputs[0] for o in outs]


def _assert_same_generation(quantized, dequantized) -> None:  # type: ignore[no-untyped-def]
    for q, d in zip(quantized, dequantized, strict=True):
        assert q.token_ids == d.token_ids
        for q_step, d_step in zip(q.logprobs, d.logprobs, strict=True):
            token = next(iter(d_step))
            assert q_step[token].logprob == pytest.approx(d_step[token].logprob, abs=2e-3)


@pytest.mark.parametrize("fmt", sorted(f.name for f in FORMATS.values()))
def test_every_format_runs_quantized_as_it_runs_dequantized(tmp_path: Path, fmt: str) -> None:
    path = _tiny_gguf(
        tmp_path, {**dict.fromkeys(LAYER_KINDS, fmt), "token_embd": fmt, "output": fmt}
    )
    model, quantized = _greedy(path, "gguf", PROMPTS, GREEDY)
    _, dequantized = _greedy(path, "none", PROMPTS, GREEDY)
    qkv = model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, QuantLinear) and [f.name for f in qkv.formats] == [fmt]
    assert isinstance(model.embed_tokens, QuantEmbedding) and isinstance(model.lm_head, QuantLinear)
    _assert_same_generation(quantized, dequantized)


def test_a_fused_layer_may_mix_formats(tmp_path: Path) -> None:
    # As in Q4_K_M files: v and down in Q6_K next to Q4_K; gate and up differ too.
    quant = {
        "attn_q": "Q4_K",
        "attn_k": "Q4_K",
        "attn_v": "Q6_K",
        "attn_output": "Q5_K",
        "ffn_gate": "Q4_0",
        "ffn_up": "Q8_0",
        "ffn_down": "Q6_K",
        "token_embd": "Q4_1",
    }
    path = _tiny_gguf(tmp_path, quant)
    model, quantized = _greedy(path, "auto", PROMPTS, GREEDY)  # auto: gguf for a .gguf file
    _, dequantized = _greedy(path, "none", PROMPTS, GREEDY)
    layer = model.layers[1]
    assert [f.name for f in layer.self_attn.qkv_proj.formats] == ["Q4_K", "Q6_K"]
    assert [f.name for f in layer.mlp.gate_up_proj.formats] == ["Q4_0", "Q8_0"]
    assert not isinstance(model.lm_head, QuantLinear)  # output.weight was left float32
    _assert_same_generation(quantized, dequantized)


def test_a_type_without_kernels_is_dequantized_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = _tiny_gguf(tmp_path, {**dict.fromkeys(LAYER_KINDS, "Q8_0"), "ffn_down": "Q5_0"})
    with caplog.at_level(logging.WARNING, logger="corefleet.engine.models.gguf_weights"):
        model, quantized = _greedy(path, "gguf", PROMPTS, GREEDY)
    assert "2 weight(s) of type Q5_0 dequantized" in caplog.text
    assert not isinstance(model.layers[0].mlp.down_proj, QuantLinear)
    assert isinstance(model.layers[0].mlp.gate_up_proj, QuantLinear)
    _, dequantized = _greedy(path, "none", PROMPTS, GREEDY)
    _assert_same_generation(quantized, dequantized)


def test_quantization_gguf_refuses_a_folder(tmp_path: Path) -> None:
    folder = write_tiny_model(tmp_path / "hf")
    with pytest.raises(ValueError, match=r"quantization='gguf'.*is not a \.gguf file"):
        _llm(folder, "gguf")


@pytest.mark.slow
def test_smollm2_quantized_equals_dequantized_for_ten_prompts(smollm2_path: str) -> None:
    from tests.integration.test_smollm2_parity import PROMPTS as TEN_PROMPTS

    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=0)
    model, quantized = _greedy(smollm2_path, "gguf", TEN_PROMPTS, params)
    _, dequantized = _greedy(smollm2_path, "none", TEN_PROMPTS, params)
    assert len(TEN_PROMPTS) == 10 and all(len(q.token_ids) == 24 for q in quantized)
    _assert_same_generation(quantized, dequantized)
    # The weights' memory is the file's blocks, not their float32 values (5x more).
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    tensors.pop(id(model.cos_sin_cache))
    weight_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    assert weight_bytes <= 1.2 * os.path.getsize(smollm2_path), weight_bytes
    assert all(
        isinstance(m, QuantLinear) for name, m in model.named_modules() if name.endswith("_proj")
    )
    assert isinstance(model.embed_tokens, QuantEmbedding)
    assert model.lm_head.get_buffer("qweight0").data_ptr() == model.embed_tokens.qweight.data_ptr()


def test_bfloat16_kv_cache_under_float32_activations(tmp_path: Path) -> None:
    path = _tiny_gguf(tmp_path, dict.fromkeys(LAYER_KINDS, "Q8_0"))
    llm = LLM(
        str(path),
        multiprocess=False,
        dtype="float32",
        kv_cache_dtype="bfloat16",
        kv_cache_memory=32 << 20,
    )
    try:
        runner = llm.engine_client.engine.executor.runner  # type: ignore[attr-defined]
        assert runner.kv_caches[0][0].dtype == torch.bfloat16
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    _, float32_cache = _greedy(path, "gguf", PROMPTS, GREEDY)
    # bf16 keys and values move the logprobs a little, not the distribution.
    for q, d in zip((o.outputs[0] for o in outs), float32_cache, strict=True):
        first = next(iter(d.logprobs[0]))
        assert q.token_ids[0] == d.token_ids[0]
        assert q.logprobs[0][first].logprob == pytest.approx(d.logprobs[0][first].logprob, abs=0.05)
