"""The benchmarks' random-weight GGUF files (``benchmarks/gguf_shapes.py``) load into corefleet.

A tiny shape in each format is written as the real sizes are; corefleet's GGUF reader must see
every tensor with the planned shape and block format, keep the quantized ones quantized, and
one generation step must give finite log-probabilities (random blocks with sane scales, not
garbage). ``intermediate`` is no multiple of 256, so Q4_K_M's fallback for ``ffn_down`` rows
(Q4_K -> Q4_0, Q6_K -> Q8_0) is exercised too.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from corefleet.engine import LLM, SamplingParams
from corefleet.engine.models.gguf_metadata import open_gguf, read_gguf_arch_config
from corefleet.engine.models.gguf_weights import hf_name, quantized_weight_formats
from corefleet.engine.models.quant_layers import QuantEmbedding, QuantLinear

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import gguf_shapes  # a benchmark module (benchmarks/ is no package)

TINY = gguf_shapes.Shape("tiny", hidden=256, layers=2, intermediate=640, heads=4, kv_heads=2)


@pytest.mark.parametrize("fmt", sorted(gguf_shapes.LAYOUTS))
def test_a_random_shape_loads_and_runs(tmp_path: Path, fmt: str) -> None:
    path = gguf_shapes.write_model(TINY, fmt, tmp_path / f"tiny-{fmt}.gguf")
    planned = {t.name: t for t in gguf_shapes.plan(TINY, fmt)}

    tensors = {t.name: t for t in open_gguf(path).tensors}
    assert set(tensors) == set(planned)
    for name, t in planned.items():
        assert [int(d) for d in tensors[name].shape] == (
            [t.cols] if t.fmt is None else [t.cols, t.rows]
        )
        expected_type = "F32" if t.fmt is None else t.fmt.name
        assert tensors[name].tensor_type.name == expected_type
    kept = {name: f.name for name, f in quantized_weight_formats(str(path)).items()}
    assert kept == {hf_name(n): t.fmt.name for n, t in planned.items() if t.fmt is not None}
    if fmt == "Q4_K_M":  # the mix and its fallbacks are there
        assert set(kept.values()) == {"Q4_K", "Q6_K", "Q4_0", "Q8_0"}

    arch = read_gguf_arch_config(str(path))
    assert (arch.hidden_size, arch.num_hidden_layers, arch.vocab_size) == (256, 2, 49152)
    assert arch.tie_word_embeddings

    llm = LLM(str(path), multiprocess=False, kv_cache_memory=16 << 20, max_model_len=256)
    try:
        model = llm.engine_client.engine.executor.runner.model  # type: ignore[attr-defined]
        assert isinstance(model.embed_tokens, QuantEmbedding)
        assert isinstance(model.layers[0].self_attn.qkv_proj, QuantLinear)
        params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, logprobs=0)
        (out,) = llm.generate([{"prompt_token_ids": [5, 17, 300, 4000]}], params, use_tqdm=False)
    finally:
        llm.shutdown()
    steps = out.outputs[0].logprobs
    assert steps is not None and len(steps) == 2
    assert all(math.isfinite(lp.logprob) for step in steps for lp in step.values())
