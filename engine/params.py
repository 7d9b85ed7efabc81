"""What a request asks of the engine besides its prompt: how to sample and when to stop
(``SamplingParams``), a grammar to follow (``StructuredOutputsParams``), or a vector to return
instead of tokens (``PoolingParams``); vLLM's names and defaults. Each validates itself, so the
frontends and the engine refuse the same requests with the same message.

``messages`` re-exports them: they travel inside ``EngineCoreRequest``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, NoReturn

import msgspec

from corefleet.engine.token_controls import validate_token_controls

# vLLM's --max-logprobs default: the most logprobs per token a request may ask for.
DEFAULT_MAX_LOGPROBS = 20


class StructuredOutputsParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """Constrain the output to a grammar: exactly one of the fields, as vLLM's.

    ``json`` is a JSON schema, serialised (a dict is serialised on construction, so the wire
    type stays a string); ``json_object`` asks for any JSON object; ``regex``, ``choice`` (one
    of these strings), ``grammar`` (Lark or GBNF/EBNF) and ``structural_tag`` (llguidance's
    structural tag JSON) as their names say.

    ``disable_additional_properties`` (vLLM's option, not a constraint): a ``json`` schema's
    objects allow only the properties they declare unless they say ``additionalProperties``,
    as vLLM's default backend (xgrammar, strict mode) compiles them. None: the default, True.
    """

    json: str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_additional_properties: bool | None = None

    def __post_init__(self) -> None:
        # A caller may pass the schema as a dict (as vLLM allows): the wire carries a string.
        schema: object = self.json
        if isinstance(schema, dict):
            self.json = msgspec.json.encode(schema).decode()

    def kind(self) -> tuple[str, str]:
        """``(field, its text)`` of the one field set; ``ValueError`` unless exactly one is."""
        chosen = [
            (name, value)
            for name, value in (
                ("json", self.json),
                ("regex", self.regex),
                ("choice", self.choice),
                ("grammar", self.grammar),
                ("json_object", self.json_object or None),
                ("structural_tag", self.structural_tag),
            )
            if value is not None
        ]
        if len(chosen) != 1:
            names = ", ".join(name for name, _ in chosen) or "none"
            raise ValueError(
                "invalid sampling parameter structured_outputs: set exactly one of json, regex, "
                f"choice, grammar, json_object, structural_tag (got {names})"
            )
        name, value = chosen[0]
        if name == "choice":
            assert isinstance(value, list)
            if not value or not all(isinstance(c, str) for c in value):
                raise ValueError(
                    "invalid sampling parameter structured_outputs.choice: a non-empty list of "
                    "strings is required"
                )
            return name, msgspec.json.encode(value).decode()
        if name == "json_object":
            return name, "{}"
        assert isinstance(value, str)
        return name, value


class SamplingParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """How to pick tokens and when to stop; vLLM's names and defaults.

    Call :meth:`validate` (the frontends do) to get a ``ValueError`` naming the bad field.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16  # None: up to the context length
    min_tokens: int = 0
    stop: list[str] = msgspec.field(default_factory=list)
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs per generated token
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None
    # Logprobs of each prompt token and its top-N (vLLM's); the request then skips reading the
    # prefix cache, since cached positions produce no logits.
    prompt_logprobs: int | None = None
    # Token-level controls (vLLM's; rules in token_controls.py): bias added to a token's logit,
    # the only tokens that may be sampled, words that may not be generated (tokenized by the
    # frontend into bad_words_token_ids), and the tokens whose logprobs are reported.
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] = msgspec.field(default_factory=list)
    bad_words_token_ids: list[list[int]] | None = None
    logprob_token_ids: list[int] | None = None

    def validate(
        self, vocab_size: int | None = None, max_logprobs: int = DEFAULT_MAX_LOGPROBS
    ) -> None:
        """Raise ``ValueError`` naming the first out-of-range parameter. ``max_logprobs``: the
        engine's ``--max-logprobs``, resolved (the vocabulary size for -1)."""
        # Each rule is a plain test; the message is built only for a failure (this runs for
        # every request, twice on the coordinator).
        if not self.n >= 1:
            _fail("n", self.n, "must be at least 1")
        if not self.temperature >= 0.0:
            _fail("temperature", self.temperature, "must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            _fail("top_p", self.top_p, "must be in (0, 1]")
        if not self.top_k >= -1:
            _fail("top_k", self.top_k, "must be -1, 0 (off) or positive")
        if not 0.0 <= self.min_p <= 1.0:
            _fail("min_p", self.min_p, "must be in [0, 1]")
        if not -2.0 <= self.presence_penalty <= 2.0:
            _fail("presence_penalty", self.presence_penalty, "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            _fail("frequency_penalty", self.frequency_penalty, "must be in [-2, 2]")
        if not 0.0 < self.repetition_penalty <= 2.0:
            _fail("repetition_penalty", self.repetition_penalty, "must be in (0, 2]")
        if self.max_tokens is not None:
            if not self.max_tokens >= 1:
                _fail("max_tokens", self.max_tokens, "must be at least 1")
            if not self.min_tokens <= self.max_tokens:
                rule = f"must not exceed max_tokens ({self.max_tokens})"
                _fail("min_tokens", self.min_tokens, rule)
        if not self.min_tokens >= 0:
            _fail("min_tokens", self.min_tokens, "must be >= 0")
        if self.logprobs is not None and not 0 <= self.logprobs <= max_logprobs:
            _fail("logprobs", self.logprobs, f"must be in [0, {max_logprobs}] (--max-logprobs)")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= max_logprobs:
            rule = f"must be in [0, {max_logprobs}] (--max-logprobs)"
            _fail("prompt_logprobs", self.prompt_logprobs, rule)
        if self.stop and not all(isinstance(s, str) and s for s in self.stop):
            _fail("stop", self.stop, "must be non-empty strings")
        # Any 64-bit integer, as OpenAI and vLLM accept (``-1`` included): torch's generators
        # take the signed range too.
        if self.seed is not None and not -(2**63) <= self.seed < 2**63:
            _fail("seed", self.seed, "must be a 64-bit integer")
        if vocab_size is not None and self.stop_token_ids:
            bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
            if bad:
                _fail("stop_token_ids", bad, f"must be token ids below {vocab_size}")
        if self.structured_outputs is not None:
            self._validate_structured()
        if (
            self.logit_bias
            or self.allowed_token_ids is not None
            or self.bad_words
            or (self.bad_words_token_ids or self.logprob_token_ids is not None)
        ):
            validate_token_controls(self, vocab_size)

    def _validate_structured(self) -> None:
        assert self.structured_outputs is not None
        self.structured_outputs.kind()
        # A grammar ends by allowing only EOS: without EOS as a stop the request could not end
        # there, and min_tokens would ban the one token the grammar allows.
        if self.ignore_eos:
            _fail("ignore_eos", True, "cannot be combined with structured_outputs")
        if self.min_tokens:
            _fail("min_tokens", self.min_tokens, "must be 0 with structured_outputs")


PoolingType = Literal["LAST", "MEAN", "CLS"]


class PoolingParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """What a pooling request (``--runner pooling``: embeddings) returns in place of tokens:
    its prompt's final hidden states pooled into one vector (vLLM's ``PoolingParams``, task
    ``embed``). The engine fills unset fields from ``--pooler-config``.

    ``dimensions`` keeps the first N values (Matryoshka models only), before the L2
    normalisation that ``use_activation`` asks for.
    """

    dimensions: int | None = None
    use_activation: bool | None = None
    pooling_type: PoolingType | None = None  # None: the server's (--pooler-config)


def _fail(field: str, value: object, rule: str) -> NoReturn:
    raise ValueError(f"invalid sampling parameter {field}={value!r}: {rule}")


def validate_prompt_length(num_prompt_tokens: int, max_model_len: int) -> None:
    """Raise ``ValueError`` when a prompt of this length cannot be served (empty, or no room)."""
    if num_prompt_tokens == 0:
        raise ValueError("the prompt is empty: at least one token is required")
    if num_prompt_tokens >= max_model_len:  # equal: the sampled token would have no position left
        raise ValueError(
            f"the prompt has {num_prompt_tokens} tokens but the model's maximum context length "
            f"(max_model_len) is {max_model_len}: a prompt may have at most "
            f"{max_model_len - 1} tokens, to leave room for the output"
        )


def validate_prompt(prompt_token_ids: Sequence[int], max_model_len: int, vocab_size: int) -> None:
    """Raise ``ValueError`` when an engine cannot serve this prompt, with one message per fault.

    The frontends call it to refuse a prompt before anything is queued; the engine calls it
    again on every request it receives, because a wire client need not have gone through one.
    """
    validate_prompt_length(len(prompt_token_ids), max_model_len)
    bad = [t for t in prompt_token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(
            f"prompt token ids {bad[:5]} are outside the vocabulary (size {vocab_size})"
        )
