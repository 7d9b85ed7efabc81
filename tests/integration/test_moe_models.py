"""Tiny random mixture-of-experts models (written by transformers): the engine's greedy tokens
equal transformers' for Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE, in float32."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fixtures_moe import MOE_ARCHITECTURES, write_tiny_moe
from tests.integration.test_tiny_model_parity import _engine_outputs, _hf_outputs


@pytest.mark.parametrize("architecture", MOE_ARCHITECTURES)
def test_greedy_equals_hf(tmp_path: Path, architecture: str) -> None:
    folder = write_tiny_moe(tmp_path / "m", architecture=architecture)
    assert _engine_outputs(folder) == _hf_outputs(folder)


def test_chunked_prefill_small_blocks_and_preemption_change_nothing(tmp_path: Path) -> None:
    folder = write_tiny_moe(tmp_path / "m", architecture="qwen2_moe")
    expected = _hf_outputs(folder)
    # Blocks of 4 tokens, an 8-token step budget and a pool too small for all eight requests:
    # chunked prefill, partial blocks and preemption by recompute all happen.
    got = _engine_outputs(folder, block_size=4, max_num_batched_tokens=8, num_blocks_override=48)
    assert got == expected


def test_one_expert_per_token_and_olmoe_clip_qkv(tmp_path: Path) -> None:
    import json

    folder = write_tiny_moe(tmp_path / "m", architecture="olmoe", top_k=1, num_experts=4)
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text())
    config["clip_qkv"] = 0.05  # small enough to clamp many of the random projections
    config_path.write_text(json.dumps(config))
    assert _engine_outputs(folder) == _hf_outputs(folder)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("architecture", "tp", "pp"),
    [
        ("qwen2_moe", 2, 1),  # experts, the shared expert and a dense layer split in two
        ("mixtral", 2, 1),  # Mixtral's w1/w3/w2 names
        ("qwen3_moe", 1, 2),  # per-head q/k norms; two stages of one layer each
    ],
)
def test_tensor_and_pipeline_parallel_equal_one_worker(
    tmp_path: Path, architecture: str, tp: int, pp: int
) -> None:
    folder = write_tiny_moe(tmp_path / "m", architecture=architecture)
    layout = {"tensor_parallel_size": tp, "pipeline_parallel_size": pp}
    assert _engine_outputs(folder, **layout) == _engine_outputs(folder)


def test_olmoe_projection_norms_refuse_tensor_parallel_with_the_reason(tmp_path: Path) -> None:
    folder = write_tiny_moe(tmp_path / "m", architecture="olmoe")
    with pytest.raises(ValueError, match=r"q/k norms over the whole projection.*cannot split"):
        _engine_outputs(folder, tensor_parallel_size=2)
