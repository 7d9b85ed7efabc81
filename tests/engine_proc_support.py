"""Helpers for tests that run real engine processes on the tiny model."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from corefleet.engine.client import EngineCoreClient, InprocClient
from corefleet.engine.config import EngineConfig
from corefleet.engine.protocol import EngineCoreRequest, FinishReason, SamplingParams

TESTS_DIR = Path(__file__).resolve().parent


def child_env(folder: Path) -> tuple[tuple[str, str], ...]:
    """Environment for an engine process that must import ``tests.engine_faults``.

    Only ``tests`` goes on its path (through a link in ``folder``): the repository root itself
    would let its ``operator/`` folder shadow the standard library's ``operator``.
    """
    link = folder / "tests"
    if not link.exists():
        link.symlink_to(TESTS_DIR, target_is_directory=True)
    return (("PYTHONPATH", str(folder)),)


PROMPTS = [[5 + (i * 11 + j * 7) % 300 for j in range(n)] for i, n in enumerate([3, 9, 17, 33])]


def tiny_config(model: Path, **kwargs: object) -> EngineConfig:
    return EngineConfig.from_kwargs(
        model=str(model), dtype="float32", kv_cache_memory=8 << 20, block_size=4, **kwargs
    )


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


@dataclass
class Finished:
    tokens: list[int] = field(default_factory=list)
    reason: FinishReason | None = None
    message: str | int | None = None


def collect(client: EngineCoreClient, ids: set[str], timeout: float = 60.0) -> dict[str, Finished]:
    """Read outputs until every request in ``ids`` finished; other ids are ignored."""
    results = {i: Finished() for i in ids}
    pending = set(ids)
    deadline = time.monotonic() + timeout
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"requests {sorted(pending)} did not finish in {timeout} s")
        for out in client.get_output(timeout=left).outputs:
            if out.request_id not in results:
                continue
            result = results[out.request_id]
            result.tokens += out.new_token_ids
            if out.finished:
                result.reason, result.message = out.finish_reason, out.stop_reason
                pending.discard(out.request_id)
    return results


def generate(
    client: EngineCoreClient, prompts: list[list[int]], max_tokens: int
) -> list[list[int]]:
    """Greedy tokens for each prompt, through any client."""
    ids = [f"gen-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts, strict=True):
        client.add_request(EngineCoreRequest(request_id, prompt, greedy(max_tokens)))
    results = collect(client, set(ids))
    return [results[i].tokens for i in ids]


def reference_tokens(model: Path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """The same engine in this process: what every multiprocess client must reproduce."""
    client = InprocClient(tiny_config(model))
    try:
        return generate(client, prompts, max_tokens)
    finally:
        client.shutdown()
