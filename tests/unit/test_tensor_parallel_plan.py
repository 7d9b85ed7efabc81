"""Which slice of each Hugging Face tensor a tensor-parallel worker holds (``ShardPlan``)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from corefleet.engine.messages import ENGINE_CORE_DEAD, death_message
from corefleet.engine.models.arch import ArchConfig
from corefleet.engine.models.tensor_parallel import ShardPlan, TensorParallel

ARCH = ArchConfig(
    architecture="LlamaForCausalLM",
    vocab_size=10,
    hidden_size=8,
    intermediate_size=12,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=2,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    max_position_embeddings=64,
    tie_word_embeddings=False,
)


def _numbered(*shape: int) -> torch.Tensor:
    return torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)


def _plan(rank: int, size: int, **arch: int) -> ShardPlan:
    return ShardPlan(replace(ARCH, **arch), TensorParallel(rank, size))


def test_column_parallel_layers_take_their_heads_and_rows() -> None:
    q = _numbered(8, 8)  # 4 heads of 2
    assert torch.equal(_plan(1, 2).shard("model.layers.0.self_attn.q_proj.weight", q), q[4:8])
    k = _numbered(4, 8)  # 2 KV heads of 2
    assert torch.equal(_plan(1, 2).shard("model.layers.0.self_attn.k_proj.weight", k), k[2:4])
    bias = torch.arange(4.0)
    assert torch.equal(_plan(0, 2).shard("model.layers.0.self_attn.v_proj.bias", bias), bias[:2])
    up = _numbered(12, 8)
    assert torch.equal(_plan(1, 2).shard("model.layers.0.mlp.up_proj.weight", up), up[6:12])


def test_row_parallel_layers_take_their_columns() -> None:
    o = _numbered(8, 8)
    assert torch.equal(_plan(1, 2).shard("model.layers.0.self_attn.o_proj.weight", o), o[:, 4:])
    down = _numbered(8, 12)
    held = _plan(0, 2).shard("model.layers.0.mlp.down_proj.weight", down)
    assert torch.equal(held, down[:, :6])
    norm = torch.ones(8)
    assert _plan(1, 2).shard("model.layers.0.input_layernorm.weight", norm) is norm


def test_fewer_kv_heads_than_workers_replicates_each_to_the_workers_that_read_it() -> None:
    k = _numbered(4, 8)  # 2 KV heads; 4 workers: workers 0, 1 read head 0, workers 2, 3 head 1
    held = [_plan(r, 4).shard("model.layers.0.self_attn.k_proj.weight", k) for r in range(4)]
    assert [h[0, 0].item() for h in held] == [0.0, 0.0, 16.0, 16.0]
    assert _plan(3, 4).local_arch.num_key_value_heads == 1
    assert _plan(3, 4).local_arch.num_attention_heads == 1


def test_the_vocabulary_is_padded_to_the_workers() -> None:
    table = _numbered(10, 8)  # 10 rows over 4 workers: 3 each, the last holds 1 and 2 zeros
    last = _plan(3, 4, intermediate_size=12).shard("model.embed_tokens.weight", table)
    assert last.shape == (3, 8)
    assert torch.equal(last[0], table[9]) and not last[1:].any()
    assert _plan(3, 4).local_arch.vocab_size == 3


@pytest.mark.parametrize(
    ("size", "arch", "named"),
    [
        (3, {}, "4 attention heads"),
        (4, {"num_key_value_heads": 3, "num_attention_heads": 12}, "3 key/value heads"),
        (2, {"intermediate_size": 11}, "intermediate size of 11"),
    ],
)
def test_a_shape_the_workers_cannot_split_is_named(
    size: int, arch: dict[str, int], named: str
) -> None:
    with pytest.raises(ValueError, match=named):
        _plan(0, size, **arch)


def test_a_death_s_reason_travels_with_engine_core_dead() -> None:
    assert death_message([ENGINE_CORE_DEAD, b"\x00\x00"]).endswith("(ENGINE_CORE_DEAD)")
    said = death_message([ENGINE_CORE_DEAD, b"\x00\x00", "worker 1 was killed ✗".encode()])
    assert said.endswith(": worker 1 was killed ✗")
    assert len(death_message([ENGINE_CORE_DEAD, b"", b"\xff" * 10**6])) < 1200
