"""User-facing results of the offline API (vLLM's ``RequestOutput`` shape)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TokenLogprob:
    """Log-probability of one candidate token."""

    logprob: float
    rank: int | None  # 1 = most likely; None when not known
    decoded_token: str


@dataclass
class CompletionOutput:
    """One generated sequence (``n`` of them per request)."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    # One dict per generated token: token id -> its logprob (the sampled token and the top-N).
    logprobs: list[dict[int, TokenLogprob]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """Everything known about one request: its prompt and its completions so far."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # With ``prompt_logprobs``: one dict per prompt token (the prompt token and the top-N), the
    # first None (nothing predicts the first token); set with the first output.
    prompt_logprobs: list[dict[int, TokenLogprob] | None] | None = None
