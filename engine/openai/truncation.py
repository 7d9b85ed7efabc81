"""vLLM's ``truncate_prompt_tokens``: a prompt longer than that keeps only its last tokens (its
first with ``truncation_side: "right"``) instead of being refused; ``-1`` means as many as the
context holds. The generation endpoints and the pooling ones share the rule."""

from __future__ import annotations

from typing import Any

from corefleet.engine.frontend.tokenizer import Tokenizer
from corefleet.engine.openai.errors import RequestError


def longest_prompt(truncate: int | None, max_model_len: int) -> int | None:
    """How many tokens ``truncate_prompt_tokens`` keeps (None: no truncation).

    Raises:
        RequestError: a value outside ``-1`` and ``[1, max_model_len - 1]``.
    """
    if truncate is None:
        return None
    most = max_model_len - 1  # one position stays free for what the request generates
    if truncate == -1:
        return most
    if not 1 <= truncate <= most:
        raise RequestError(
            f"truncate_prompt_tokens={truncate} must be -1 or in [1, {most}] (max_model_len "
            f"is {max_model_len})",
            param="truncate_prompt_tokens",
        )
    return truncate


def truncated(
    tokenizer: Tokenizer, prompt: str | dict[str, Any], keep: int, side: str | None
) -> dict[str, Any]:
    """``prompt`` (text, or a mapping with ``prompt_token_ids``) as at most ``keep`` token ids.
    A prompt that was cut loses its text (an echo then shows the kept tokens decoded)."""
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt)
        text: str | None = prompt
    else:
        ids, text = list(prompt["prompt_token_ids"]), prompt.get("prompt")
    if len(ids) <= keep:
        return {"prompt": text, "prompt_token_ids": ids}
    kept = ids[:keep] if side == "right" else ids[-keep:]
    return {"prompt_token_ids": kept}
