"""The bound forward pass (``engine/models/layer_program.py``) computes exactly what calling the
backend's methods one by one computes: every hidden state of a prefill and of the decode steps
after it is bit for bit the same, for float and GGUF-quantized weights, a float32 or bfloat16
KV cache, on the C++ CPU kernels and on the torch reference.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from corefleet.engine import LLM, SamplingParams
from corefleet.engine.models.llama import LlamaForCausalLM
from corefleet.kernels import reference
from corefleet.kernels.metadata import AttentionMetadata
from tests.fixtures_models import write_tiny_gguf, write_tiny_model

PROMPTS = ["def add(a, b):", "hello world, hello"]
STEPS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def method_by_method(
    model: LlamaForCausalLM,
    input_ids: torch.Tensor,  # [T]
    positions: torch.Tensor,  # [T]
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    meta: AttentionMetadata,
) -> torch.Tensor:  # [T, H]
    """The decoder as the modules and backend methods compute it, no binding."""
    hidden = model.embed_tokens(input_ids)
    cos_sin_cache: torch.Tensor = model.cos_sin_cache  # type: ignore[assignment]
    cos, sin = reference.rotary_cos_sin(positions, cos_sin_cache, hidden.dtype)
    residual = None
    for layer, (k_cache, v_cache) in zip(model.layers, kv_caches, strict=True):
        attn, mlp = layer.self_attn, layer.mlp
        backend = attn.backend
        x, residual = layer.input_layernorm(hidden, residual)
        q, k, v = attn.qkv_proj(x).split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        q = q.view(-1, attn.num_heads, attn.head_dim)
        k = k.view(-1, attn.num_kv_heads, attn.head_dim)
        v = v.view(-1, attn.num_kv_heads, attn.head_dim)
        q, k = backend.apply_rotary(q, k, cos, sin)
        q, k, v = (t.to(k_cache.dtype) for t in (q, k, v))
        backend.write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        out = backend.paged_attention(q, k, v, k_cache, v_cache, meta, attn.scale)
        x = attn.o_proj(out.reshape(-1, attn.q_size).to(x.dtype))
        x, residual = layer.post_attention_layernorm(x, residual)
        hidden = mlp.down_proj(backend.silu_and_mul(mlp.gate_up_proj(x)))
    hidden, _ = model.norm(hidden, residual)
    return hidden


@pytest.mark.parametrize(
    ("backend", "weights", "kv_cache_dtype"),
    [
        ("cpu", "gguf", "bfloat16"),
        ("cpu", "gguf", "float32"),
        ("cpu", "float", "float32"),
        ("torch", "gguf", "float32"),
        ("torch", "float", "bfloat16"),
    ],
)
def test_the_bound_forward_is_the_method_by_method_forward(
    tmp_path: Path, backend: str, weights: str, kv_cache_dtype: str
) -> None:
    folder = write_tiny_model(tmp_path / "hf", hidden_size=256, intermediate_size=512, seed=5)
    quant = {kind: "Q4_1" for kind in ("attn_q", "attn_k", "attn_v", "attn_output")}
    quant |= {"ffn_gate": "Q8_0", "ffn_up": "Q8_0", "ffn_down": "Q4_0", "token_embd": "Q8_0"}
    gguf = write_tiny_gguf(tmp_path / "m.gguf", folder, quant=quant)
    path = gguf if weights == "gguf" else folder
    llm = LLM(
        str(path),
        multiprocess=False,
        attention_backend=backend,
        kv_cache_dtype=kv_cache_dtype,
        kv_cache_memory=16 << 20,
    )
    try:
        model: LlamaForCausalLM = llm.engine_client.engine.executor.runner.model  # type: ignore[attr-defined]
        bound_forward = model.forward
        compared: list[int] = []

        def both(*args: Any) -> torch.Tensor:
            # The bound pass runs first: its KV writes are what the method-by-method pass then
            # writes again (the same values) and reads.
            bound = bound_forward(*args)
            assert torch.equal(bound, method_by_method(model, *args))
            compared.append(args[0].shape[0])
            return bound

        model.forward = both  # type: ignore[method-assign]
        outputs = llm.generate(PROMPTS, STEPS, use_tqdm=False)
    finally:
        llm.shutdown()
    assert all(len(o.outputs[0].token_ids) == 4 for o in outputs)
    assert compared[0] > 2 and compared[-1] == 2  # a prefill, then decode steps of both prompts
