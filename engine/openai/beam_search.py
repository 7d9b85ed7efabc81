"""Beam search (``use_beam_search``) as vLLM implements it: on top of the engine, one token at a
time, each step a one-token request per live beam.

Each step asks the ranks for the ``2 × width`` most likely next tokens of every live beam (the
raw logprobs, as vLLM's), extends each beam by each of them, and keeps the ``width`` best
extensions by cumulative logprob. An extension ending in the end-of-sequence token is complete
(unless ``ignore_eos``). After ``max_tokens`` steps the complete and the live beams are ranked
by vLLM's score, ``cumulative logprob / len(prompt + tokens) ** length_penalty``, and the
``width`` best are the answer's choices, best first. The beams' prompts share their prefix,
so each step's requests are mostly prefix-cache hits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from corefleet.engine.coordinator.fleet_client import FleetClient
from corefleet.engine.frontend.input_processor import InputProcessor, ProcessedPrompt
from corefleet.engine.frontend.tokenizer import Tokenizer
from corefleet.engine.messages import SamplingParams
from corefleet.engine.openai.errors import RequestError
from corefleet.engine.openai.serving import Generation

# Candidates per beam and step: 2 × width, within the engine's default 20 logprobs (a larger
# --max-logprobs does not widen it: a beam search's cost grows with the width squared).
MAX_BEAM_WIDTH = 10


@dataclass(frozen=True)
class BeamOptions:
    """What a request asks of its beam search."""

    width: int  # the request's n
    max_tokens: int
    length_penalty: float = 1.0
    ignore_eos: bool = False


@dataclass
class Beam:
    """One hypothesis: the tokens it adds to the prompt and their summed logprob."""

    tokens: list[int] = field(default_factory=list)
    logprob: float = 0.0
    finished: bool = False  # ended with the end-of-sequence token

    def score(self, prompt_len: int, length_penalty: float) -> float:
        """vLLM's ranking: the EOS token does not count toward the length."""
        length = prompt_len + len(self.tokens) - (1 if self.finished else 0)
        return self.logprob / (max(length, 1) ** length_penalty)


async def beam_search(
    fleet: FleetClient,
    tokenizer: Tokenizer,
    inputs: InputProcessor,
    prompt: ProcessedPrompt,
    options: BeamOptions,
) -> list[Beam]:
    """The ``options.width`` best beams after ``prompt``, best first."""
    eos = None if options.ignore_eos else tokenizer.eos_token_id
    room = inputs.max_model_len - len(prompt.prompt_token_ids)
    live, done = [Beam()], []
    for _ in range(min(options.max_tokens, room)):
        rows = await _next_tokens(fleet, tokenizer, inputs, prompt, live, 2 * options.width)
        extended = [
            Beam([*beam.tokens, token], beam.logprob + logprob, token == eos)
            for beam, row in zip(live, rows, strict=True)
            for token, logprob in row
        ]
        extended.sort(key=lambda b: b.logprob, reverse=True)
        best = extended[: options.width]
        done += [b for b in best if b.finished]
        live = [b for b in best if not b.finished]
        if not live:
            break
    ranked = sorted(
        done + live,
        key=lambda b: b.score(len(prompt.prompt_token_ids), options.length_penalty),
        reverse=True,
    )
    return ranked[: options.width]


async def _next_tokens(
    fleet: FleetClient,
    tokenizer: Tokenizer,
    inputs: InputProcessor,
    prompt: ProcessedPrompt,
    beams: Sequence[Beam],
    k: int,
) -> list[list[tuple[int, float]]]:
    """Per beam, the ``k`` most likely next tokens and their logprobs, best first."""
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=k, ignore_eos=True)
    prompts = [{"prompt_token_ids": prompt.prompt_token_ids + b.tokens} for b in beams]
    step = Generation(fleet, tokenizer, inputs, prompts, params, Generation.new_id())
    rows: dict[int, list[tuple[int, float]]] = {}
    async for delta in step.deltas():
        for row in delta.logprobs:
            ranked = sorted(
                (e.rank or 0, token, e.logprob)
                for token, e in row.items()
                if e.rank is not None and e.rank <= k
            )
            rows[delta.index] = [(token, logprob) for _, token, logprob in ranked]
    if len(rows) < len(beams):  # a step ended without its token: the fleet lost it
        raise RequestError(
            "beam search lost a step (no rank could finish it); retry",
            status=503,
            type="server_error",
        )
    return [rows[i] for i in range(len(beams))]
