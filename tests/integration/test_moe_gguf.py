"""Mixture-of-experts GGUF files (converted from tiny transformers-written folders the way
llama.cpp's converter does): Mixtral (a ``llama`` file with experts), Qwen2-MoE with its shared
expert and a dense layer, Qwen3-MoE and OLMoE read into the weights and greedy tokens of their
Hugging Face folders; quantized ones run as they run dequantized; what the model code cannot
run is refused before any weight is read."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from corefleet.engine import LLM, SamplingParams
from corefleet.engine.models.gguf_weights import iter_gguf_weights, quantized_weight_formats
from corefleet.engine.models.loader import load_arch_config
from corefleet.engine.models.quant_layers import QuantLinear
from tests.fixtures_models import hf_state_dict
from tests.fixtures_moe import MOE_ARCHITECTURES, write_tiny_moe
from tests.fixtures_moe_gguf import expert_tensor_shapes, write_moe_gguf
from tests.integration.test_tiny_model_parity import _engine_outputs, _hf_outputs

# Mixtral's checkpoint names -> the names every GGUF file's experts and router come out under.
_MIXTRAL = [
    (r"\.block_sparse_moe\.", ".mlp."),
    (r"\.w1\.weight$", ".gate_proj.weight"),
    (r"\.w3\.weight$", ".up_proj.weight"),
    (r"\.w2\.weight$", ".down_proj.weight"),
]
Q8 = "Q8_0"
# Every kind the tiny MoEs have whose rows are whole Q8_0 blocks (64 or 96 wide): attention,
# routers, the experts' gate and up, the shared expert's gate and up, a dense layer's MLP.
QUANT = dict.fromkeys(
    (
        "attn_q",
        "attn_k",
        "attn_v",
        "attn_output",
        "ffn_gate_inp",
        "ffn_gate_exps",
        "ffn_up_exps",
        "ffn_gate_shexp",
        "ffn_up_shexp",
        "ffn_gate",
        "ffn_up",
        "ffn_down",
        "token_embd",
        "output",
    ),
    Q8,
)


def _pair(tmp_path: Path, architecture: str, **gguf_args: object) -> tuple[Path, Path]:
    folder = write_tiny_moe(tmp_path / "hf", architecture=architecture)
    return folder, write_moe_gguf(tmp_path / "m.gguf", folder, **gguf_args)  # type: ignore[arg-type]


def _hf_named(folder: Path) -> dict[str, torch.Tensor]:
    state = {}
    for name, tensor in hf_state_dict(folder).items():
        for pattern, replacement in _MIXTRAL:
            name = re.sub(pattern, replacement, name)
        state[name] = tensor
    return state


@pytest.mark.parametrize("architecture", MOE_ARCHITECTURES)
def test_greedy_equals_the_folder_and_transformers(tmp_path: Path, architecture: str) -> None:
    folder, path = _pair(tmp_path, architecture)
    got = _engine_outputs(path)
    assert got == _engine_outputs(folder)
    assert got == _hf_outputs(folder)


@pytest.mark.parametrize("architecture", MOE_ARCHITECTURES)
def test_weights_and_architecture_equal_the_folders(tmp_path: Path, architecture: str) -> None:
    folder, path = _pair(tmp_path, architecture)
    # llama.cpp's layout: the experts stacked, dimensions fastest-first ([H, I, E], [I, H, E]).
    shapes = expert_tensor_shapes(path)
    size = 96 if architecture == "mixtral" else 48
    assert shapes["blk.0.ffn_gate_exps.weight"] == (64, size, 8)
    assert shapes["blk.0.ffn_down_exps.weight"] == (size, 64, 8)

    got = dict(iter_gguf_weights(str(path), torch.float32))
    expected = _hf_named(folder)
    assert sorted(got) == sorted(expected)
    for name, tensor in expected.items():  # Mixtral's q/k rows un-permuted too
        assert torch.equal(got[name], tensor), name

    arch, hf_arch = load_arch_config(path), load_arch_config(folder)
    assert arch.architecture == hf_arch.architecture
    assert (arch.moe, arch.qk_norm, arch.clip_qkv) == (hf_arch.moe, hf_arch.qk_norm, None)
    if architecture == "qwen2_moe":  # the shared expert and mlp_only_layers=[1]
        assert arch.moe is not None and arch.moe.shared_expert_intermediate_size == 80
        assert arch.moe.dense_layers == (1,)


def test_olmoe_clamp_kqv_is_its_clip_qkv(tmp_path: Path) -> None:
    import json

    folder = write_tiny_moe(tmp_path / "hf", architecture="olmoe", top_k=1, num_experts=4)
    config = json.loads((folder / "config.json").read_text())
    config["clip_qkv"] = 0.05  # small enough to clamp many of the random projections
    (folder / "config.json").write_text(json.dumps(config))
    # llama.cpp's converter writes no clamp for OLMoE; a file that states one gets it.
    path = write_moe_gguf(tmp_path / "m.gguf", folder, extra_metadata={"attention.clamp_kqv": 0.05})
    assert load_arch_config(path).clip_qkv == pytest.approx(0.05)
    assert _engine_outputs(path) == _hf_outputs(folder)


def test_old_mixtral_files_with_one_tensor_per_expert(tmp_path: Path) -> None:
    folder, path = _pair(tmp_path, "mixtral", legacy_experts=True)
    assert not expert_tensor_shapes(path)
    got = dict(iter_gguf_weights(str(path), torch.float32))
    expected = _hf_named(folder)
    assert sorted(got) == sorted(expected)
    assert all(torch.equal(got[name], tensor) for name, tensor in expected.items())
    assert load_arch_config(path).architecture == "MixtralForCausalLM"


def _generate(path: Path, quantization: str) -> tuple[torch.nn.Module, list]:  # type: ignore[type-arg]
    llm = LLM(
        str(path),
        multiprocess=False,
        dtype="float32",
        kv_cache_dtype="float32",
        kv_cache_memory=16 << 20,
        quantization=quantization,
    )
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)
    try:
        model = llm.engine_client.engine.executor.runner.model  # type: ignore[attr-defined]
        outs = llm.generate(["def add(a, b):", "hello world"], params, use_tqdm=False)
    finally:
        llm.shutdown()
    return model, [o.outputs[0] for o in outs]


@pytest.mark.parametrize("architecture", ["qwen2_moe", "mixtral"])
def test_quantized_moe_runs_as_it_runs_dequantized(tmp_path: Path, architecture: str) -> None:
    _, path = _pair(tmp_path, architecture, quant=QUANT)
    formats = quantized_weight_formats(str(path))
    # Kept in blocks: the 2-D weights of quantized layers; never the experts or the routers.
    assert formats["model.layers.0.self_attn.q_proj.weight"].name == Q8
    assert not [n for n in formats if ".experts." in n or n.endswith(".mlp.gate.weight")]
    model, quantized = _generate(path, "gguf")
    _, dequantized = _generate(path, "none")
    layer = model.layers[0]  # type: ignore[index]
    assert isinstance(layer.self_attn.qkv_proj, QuantLinear)
    if architecture == "qwen2_moe":
        assert isinstance(layer.mlp.shared_expert.gate_up_proj, QuantLinear)
        assert isinstance(model.layers[1].mlp.gate_up_proj, QuantLinear)  # type: ignore[index]
    # Same weights on both sides; only where dequantization happens (and sum order) differs.
    for q, d in zip(quantized, dequantized, strict=True):
        assert q.token_ids == d.token_ids
        for q_step, d_step in zip(q.logprobs, d.logprobs, strict=True):
            token = next(iter(d_step))
            assert q_step[token].logprob == pytest.approx(d_step[token].logprob, abs=2e-3)


@pytest.mark.parametrize(
    ("gguf_args", "message"),
    [
        # What used to fail mid-load: a llama file with experts it does not declare.
        ({"omit_metadata": ("expert_count",)}, r"expert tensors .*no llama\.expert_count"),
        ({"extra_metadata": {"expert_gating_func": 2}}, r"gating function 2 .*softmax"),
        ({"extra_metadata": {"expert_weights_scale": 2.5}}, r"scaled expert weights \(2\.5\)"),
        ({"omit_metadata": ("expert_used_count",)}, r"expert_used_count <= it.*8 and 0"),
    ],
)
def test_what_the_model_cannot_run_is_refused_before_loading(
    tmp_path: Path, gguf_args: dict[str, object], message: str
) -> None:
    _, path = _pair(tmp_path, "mixtral", **gguf_args)
    with pytest.raises(ValueError, match=message) as info:
        load_arch_config(path)
    assert "m.gguf" in str(info.value)
