"""Wire types shared by the engine, its clients and the coordinator (msgspec Structs).

Field order of the ``array_like`` structs is part of the wire contract: new fields are only ever
appended, with defaults, so older peers keep decoding newer messages.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from typing import Annotated, Any

import msgspec

from corefleet.engine.params import (  # noqa: F401 (re-exported: the wire carries them)
    DEFAULT_MAX_LOGPROBS,
    PoolingParams,
    PoolingType,
    SamplingParams,
    StructuredOutputsParams,
    validate_prompt,
    validate_prompt_length,
)

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
