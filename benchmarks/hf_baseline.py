"""Hugging Face transformers on the same model: the baseline every engine figure is set against.

transformers loads the same GGUF file (``gguf_file=``) and dequantizes it, so both sides run
identical weights.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch


def load_hf_model(model_path: str, dtype: torch.dtype):  # type: ignore[no-untyped-def]
    """(model, tokenizer) from transformers for a GGUF file or an HF folder, offline."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(model_path)
    if path.suffix == ".gguf":
        kwargs = {"gguf_file": path.name}
        folder = str(path.parent)
    else:
        kwargs, folder = {}, str(path)
    tokenizer = AutoTokenizer.from_pretrained(folder, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **kwargs).eval()
    return model, tokenizer


@torch.inference_mode()
def hf_generate_batch(
    model,
    prompts: list[list[int]],
    max_new_tokens: int,  # type: ignore[no-untyped-def]
    pad_id: int,
) -> torch.Tensor:
    """Greedy generation of exactly ``max_new_tokens`` for a left-padded batch."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        pad_token_id=pad_id,
        eos_token_id=None,
    )
    return out[:, width:]


def hf_throughput(
    model,
    prompts: list[list[int]],
    output_lens: list[int],  # type: ignore[no-untyped-def]
    batch_size: int,
    pad_id: int,
) -> tuple[float, float]:
    """(useful output tokens/s, elapsed s). Each batch runs to its longest requested output;
    only the tokens each request asked for count as useful."""
    started = time.perf_counter()
    useful = 0
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start : start + batch_size]
        lens = output_lens[start : start + batch_size]
        hf_generate_batch(model, chunk, max(lens), pad_id)
        useful += sum(lens)
    elapsed = time.perf_counter() - started
    return useful / elapsed, elapsed
