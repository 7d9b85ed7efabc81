"""The model's dtype (``--dtype``) and the KV cache's (``--kv-cache-dtype``), and why.

vLLM's meanings: ``--kv-cache-dtype auto`` is the model's dtype, whatever the device, so that a
float32 model keeps float32 keys and values and equals transformers in float32; a smaller cache
is asked for by name. ``--dtype auto`` on GPU is the checkpoint's half-precision type (a float32
or unstated checkpoint: bfloat16, as vLLM downcasts float32 models to the platform's first
dtype). On CPU it stays float32 here, where vLLM picks bfloat16 on x86: weights and activations
in bfloat16 change every greedy output against a float32 reference, so the faster setting is
the explicit ``--dtype bfloat16`` (which then gets a bfloat16 cache).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class DtypeChoice:
    """A resolved dtype and the reason, for the start-up log."""

    dtype: torch.dtype
    why: str

    @property
    def name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


def choose_dtype(requested: str, checkpoint_dtype: str | None, device: torch.device) -> DtypeChoice:
    """``--dtype``: an explicit name is honoured everywhere. ``auto``: on GPU the checkpoint's
    half-precision type (bfloat16 for a float32 or unstated one), float32 on CPU."""
    if requested != "auto":
        return DtypeChoice(TORCH_DTYPES[requested], f"--dtype {requested}")
    if device.type != "cuda":
        return DtypeChoice(torch.float32, f"--dtype auto on {device.type.upper()}: float32")
    if checkpoint_dtype in ("bfloat16", "float16"):
        return DtypeChoice(
            TORCH_DTYPES[checkpoint_dtype],
            f"--dtype auto on GPU: the checkpoint's {checkpoint_dtype}",
        )
    stated = checkpoint_dtype or "dtype-less"
    return DtypeChoice(torch.bfloat16, f"--dtype auto on GPU: bfloat16 for a {stated} checkpoint")


def resolve_dtype(
    requested: str, checkpoint_dtype: str | None, device: torch.device
) -> torch.dtype:
    return choose_dtype(requested, checkpoint_dtype, device).dtype


def choose_kv_cache_dtype(requested: str, dtype: torch.dtype, backend: str) -> DtypeChoice:
    """``--kv-cache-dtype``. ``auto``: the model's dtype ``dtype``, as in vLLM. ``fp8`` (float8
    e4m3, unscaled, as vLLM's default scale of 1.0): the Triton backend only. Any other name:
    that dtype (attention computes in the model's dtype and the cache write rounds to it).

    Raises:
        ValueError: fp8 on a backend without float8 kernels.
    """
    if requested == "fp8":
        if backend != "triton":
            raise ValueError(
                f"--kv-cache-dtype fp8 needs the triton attention backend (a GPU, "
                f"--attention-backend triton or auto on CUDA); the {backend} backend has no "
                "float8 kernels"
            )
        return DtypeChoice(torch.float8_e4m3fn, "--kv-cache-dtype fp8: float8 e4m3")
    if requested != "auto":
        return DtypeChoice(TORCH_DTYPES[requested], f"--kv-cache-dtype {requested}")
    return DtypeChoice(dtype, "--kv-cache-dtype auto: the model's dtype")


def resolve_kv_cache_dtype(requested: str, dtype: torch.dtype, backend: str) -> torch.dtype:
    return choose_kv_cache_dtype(requested, dtype, backend).dtype


def describe_dtypes(model: DtypeChoice, kv_cache: DtypeChoice) -> str:
    """The start-up log line: ``dtype float32 (--dtype auto on CPU: float32), KV cache dtype
    float32 (--kv-cache-dtype auto: the model's dtype)``."""
    return f"dtype {model.name} ({model.why}), KV cache dtype {kv_cache.name} ({kv_cache.why})"
