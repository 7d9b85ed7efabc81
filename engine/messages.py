"""Wire types shared by the engine, its clients and the coordinator (msgspec Structs).

Field order of the ``array_like`` structs is part of the wire contract: new fields are only ever
appended, with defaults, so older peers keep decoding newer messages.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from typing import Annotated, Any, Literal, NoReturn

import msgspec

from corefleet.engine.token_controls import validate_token_controls

# vLLM's --max-logprobs default: the most logprobs per token a request may ask for.
DEFAULT_MAX_LOGPROBS = 20

# Bumped whenever a message changes incompatibly; a HELLO with another version is refused.
PROTOCOL_VERSION = 1

# The largest data-parallel wave number: waves travel in int64 tensors (the group's
# all-reduce), so a frame may not push a rank past what they hold.
MAX_WAVE = 2**53

# The first frame of the last message an engine sends on a fatal error; the second frame is
# the rank (2 bytes, little endian), so a coordinator with many ranks knows which one died.
ENGINE_CORE_DEAD = b"ENGINE_CORE_DEAD"


def death_message(frames: Sequence[Any]) -> str:
    """What a client says of ``[ENGINE_CORE_DEAD, rank, reason]`` (ZMQ frames or bytes); the
    reason (a bounded UTF-8 text) is optional: older engines sent none."""
    message = "the engine core hit a fatal error (ENGINE_CORE_DEAD)"
    if len(frames) < 3:
        return message
    raw = frames[2].bytes if hasattr(frames[2], "bytes") else bytes(frames[2])
    return f"{message}: {raw[:1000].decode('utf-8', 'replace')}"


class RequestType(bytes, enum.Enum):
    """One-byte type prefix of every client->engine frame.

    Only what a client may send: the engine's own queue markers live apart (``EngineSignal``
    in ``engine_core``), so no byte a client sends can turn into one of them.
    """

    ADD = b"\x00"
    ABORT = b"\x01"
    START_DP_WAVE = b"\x02"  # coordinator -> the ranks of an MoE group: run wave N (vLLM's byte)
    UTILITY = b"\x03"


class FinishReason(enum.IntEnum):
    """Why a request finished. ``str()`` gives the OpenAI-style lower-case name."""

    STOP = 0
    LENGTH = 1
    ABORT = 2
    ERROR = 3
    # The engine is shutting down (drain) and refused to start this request. Never user-visible
    # through the coordinator, which re-routes it to another rank.
    REJECTED = 4

    def __str__(self) -> str:
        return self.name.lower()


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


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A request as the engine receives it: already tokenized and validated."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = 0.0
    priority: int = 0
    cache_salt: str | None = None
    client_index: int = 0
    # The data-parallel wave the sender believed current (vLLM's ADD ``request_wave``); only
    # the ranks of an MoE group read it (``engine_core/waves.py``).
    current_wave: int = 0
    # A pooling request (``--runner pooling``): it computes its prompt and finishes with the
    # pooled vector; ``sampling_params`` is then unused (max_tokens 1, nothing is sampled).
    pooling_params: PoolingParams | None = None


class StartDPWave(msgspec.Struct, array_like=True, gc=False):
    """Payload of START_DP_WAVE: the ranks of an MoE group run wave ``new_wave`` (idempotent:
    a rank already running it, or past it, ignores it). ``exclude_rank`` (-1: none) already
    runs it: the rank whose own start this relays."""

    new_wave: Annotated[int, msgspec.Meta(ge=0, le=MAX_WAVE)]
    exclude_rank: Annotated[int, msgspec.Meta(ge=-1, lt=1 << 16)] = -1


class Logprobs(msgspec.Struct, array_like=True, gc=False):
    """Logprobs of the newly generated tokens of one request.

    Row ``i`` describes new token ``i``: column 0 is the sampled token, then the top-N.
    """

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    sampled_ranks: list[int]  # rank of the sampled token in the full distribution (1 = best)


class EngineCoreEventType(enum.IntEnum):
    """vLLM's request lifecycle events, which the per-request latency metrics are made of."""

    QUEUED = 1
    SCHEDULED = 2
    PREEMPTED = 3


class EngineCoreEvent(msgspec.Struct, array_like=True, gc=False):
    """One event of a request, at the engine's ``time.monotonic()``: comparable only with the
    same rank's other timestamps (its events and the ``timestamp`` of its outputs)."""

    type: EngineCoreEventType
    timestamp: float


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """New tokens of one request in one step (or its finish)."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: Logprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the stop token id, or a message for ERROR
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # A pooling request's result, on its finishing output: the vector as float32 bytes
    # (little-endian, what numpy's "<f4" reads).
    pooling_output: bytes | None = None
    # What happened to the request since its last output (queued, scheduled, preempted), for
    # the per-request metrics (vLLM's ``events``); None on most outputs.
    events: list[EngineCoreEvent] | None = None
    # With the first output of a request with ``prompt_logprobs``: row ``i`` is prompt token
    # ``i + 1`` (the first prompt token has no logprob), column 0 that token, then the top-N.
    new_prompt_logprobs: Logprobs | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class SchedulerStats(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Load and cache figures the scheduler reports after each step."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0  # prompt tokens looked up, cumulative
    prefix_cache_hits: int = 0  # of which found in the cache, cumulative
    num_preemptions: int = 0  # cumulative
    step_counter: int = 0


class UtilityOutput(msgspec.Struct, array_like=True, gc=False):
    """Reply to a UTILITY call; ``failure_message`` set means it failed."""

    call_id: int
    failure_message: str | None = None
    result: Any = None  # any msgpack-native value; arrays and tensors travel as aux frames


class EngineStats(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """An engine's load, sent at least every 500 ms; it doubles as the engine's heartbeat."""

    rank: int = 0
    num_waiting_reqs: int = 0
    num_running_reqs: int = 0
    kv_cache_usage: float = 0.0  # fraction of KV blocks in use, 0..1
    prefix_cache_hit_rate: float = 0.0  # cumulative hits / queries, 0..1
    draining: bool = False  # shutting down: send no new requests
    step_counter: int = 0  # steps taken; in an MoE group, forward passes, dummy ones included
    exiting: bool = False  # the last message of a clean shutdown: the rank has left
    # An MoE group's data-parallel wave (``engine_core/waves.py``): its number, whether this
    # rank runs it, and the dummy forward passes it ran (cumulative) to keep the group in step.
    current_wave: int = 0
    wave_running: bool = False
    dummy_steps: int = 0
    # Cumulative counters for /metrics (vLLM's prefix_cache_queries/hits, in tokens, and
    # num_preemptions), and the tokens each step scheduled as histogram bucket counts
    # (``core/step_stats.py``'s bounds, the last bucket +Inf) with their sum.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    iteration_token_counts: list[int] = msgspec.field(default_factory=list)
    iteration_tokens_sum: int = 0


class PoolerInfo(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A pooling rank's defaults and sizes, for the coordinator to check requests against."""

    pooling_type: str
    use_activation: bool
    hidden_size: int  # the length of a vector before any ``dimensions`` truncation
    is_matryoshka: bool = False  # whether ``dimensions`` may shorten a vector
    matryoshka_dimensions: list[int] | None = None  # the sizes allowed (None: any up to it)


class ReadyResponse(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """The engine's first message on its input socket: what it can serve.

    It must come first because a ROUTER cannot address a DEALER until the DEALER has spoken.
    """

    rank: int
    max_model_len: int
    num_gpu_blocks: int  # KV blocks, the reserved block 0 included (on CPU too)
    block_size: int
    kv_cache_size_tokens: int
    vocab_size: int
    model_name: str
    pid: int = 0
    max_num_seqs: int = 0  # the most requests in one batch (0: an older rank did not say)
    # Ranks 0 .. dp_size - 1 form one MoE group that steps in waves; 1: an independent rank.
    dp_size: int = 1
    # ``--runner pooling``: what the rank's vectors are (None: a generating rank).
    pooler: PoolerInfo | None = None
    # Cache settings for /metrics' vllm:cache_config_info ("": an older rank did not say).
    cache_dtype: str = ""
    enable_prefix_caching: bool = False
    # How the rank orders waiting requests: "fcfs", or "priority" (a request's priority counts).
    scheduling_policy: str = "fcfs"
    # The most logprobs per token a request may ask for (--max-logprobs; -1 resolved to the
    # vocabulary's size).
    max_logprobs: int = DEFAULT_MAX_LOGPROBS


class Hello(msgspec.Struct, tag="hello", omit_defaults=True, gc=False):
    """Engine -> handshake server: a rank is up and wants its addresses."""

    rank: int
    protocol_version: int
    pod_name: str = ""
    pid: int = 0
    config_hash: str = ""  # of the engine arguments; lets a server spot mismatched ranks


class Init(msgspec.Struct, tag="init", omit_defaults=True, gc=False):
    """Handshake server -> engine: where to connect for requests and outputs."""

    input_address: str
    output_address: str
    engine_index: int


class Ready(msgspec.Struct, tag="ready", omit_defaults=True, gc=False):
    """Engine -> handshake server: loaded, KV cache allocated, warmed up, ReadyResponse sent."""

    rank: int


class Refused(msgspec.Struct, tag="refused", gc=False):
    """Handshake server -> engine: the HELLO was not accepted (the engine exits non-zero)."""

    reason: str


HandshakeMessage = Hello | Init | Ready | Refused


class UtilityCall(msgspec.Struct, array_like=True, gc=False):
    """Payload of a UTILITY frame: call ``method(*args)`` on the engine."""

    client_index: int
    call_id: int
    method: str
    args: list[Any] = msgspec.field(default_factory=list)


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Everything one engine sends to one client after a step."""

    engine_index: int = 0
    outputs: list[EngineCoreOutput] = msgspec.field(default_factory=list)
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0
    utility_output: UtilityOutput | None = None
    finished_requests: list[str] | None = None
    engine_stats: EngineStats | None = None
    # MoE group waves, rank -> every coordinator: rank 0's "wave N ended, the group is idle"
    # and a rank's "start wave N" (it got a request while the group was idle).
    wave_complete: int | None = None
    start_wave: int | None = None

    def __post_init__(self) -> None:
        if self.timestamp == 0.0:
            self.timestamp = time.monotonic()
