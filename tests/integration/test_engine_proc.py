"""The engine in its own process, over real ZMQ sockets: generation, utilities, aborts, bad input.

Shutdown, crashes, start-up failures and CURVE are in test_engine_proc_failures.py.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from corefleet.engine.client.base import MPClientOptions
from corefleet.engine.client.mp import AsyncMPClient, SyncMPClient
from corefleet.engine.messages import (
    EngineCoreRequest,
    FinishReason,
    RequestType,
    SamplingParams,
    SchedulerStats,
    StartDPWave,
    UtilityCall,
)
from corefleet.engine.transport.serial import MsgpackEncoder
from tests.engine_proc_support import (
    PROMPTS,
    collect,
    generate,
    greedy,
    reference_tokens,
    tiny_config,
)
from tests.fixtures_models import write_tiny_llama

pytestmark = pytest.mark.slow

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "m")


@pytest.fixture(scope="module")
def expected(tiny: Path) -> list[list[int]]:
    return reference_tokens(tiny, PROMPTS, MAX_TOKENS)


@pytest.fixture(scope="module")
def client(tiny: Path) -> Iterator[SyncMPClient]:
    client = SyncMPClient(tiny_config(tiny), MPClientOptions(shutdown_timeout_s=5))
    yield client
    client.shutdown()
    assert client.resources.process is not None
    assert client.resources.process.returncode == 0  # a clean SIGTERM shutdown


def test_sync_client_generates_what_the_inprocess_engine_does(
    client: SyncMPClient, expected: list[list[int]]
) -> None:
    assert client.engine_info.max_model_len == 256 and client.engine_info.vocab_size == 320
    assert generate(client, PROMPTS, MAX_TOKENS) == expected


def test_async_client_generates_what_the_inprocess_engine_does(
    tiny: Path, expected: list[list[int]]
) -> None:
    async def run(client: AsyncMPClient) -> list[list[int]]:
        ids = [f"async-{i}" for i in range(len(PROMPTS))]
        for request_id, prompt in zip(ids, PROMPTS, strict=True):
            await client.add_request_async(EngineCoreRequest(request_id, prompt, greedy(12)))
        tokens: dict[str, list[int]] = {i: [] for i in ids}
        pending = set(ids)
        while pending:
            outputs = await asyncio.wait_for(client.get_output_async(), timeout=60)
            for out in outputs.outputs:
                tokens[out.request_id] += out.new_token_ids
                if out.finished:
                    assert out.finish_reason is FinishReason.LENGTH
                    pending.discard(out.request_id)
        assert await client.call_utility_async("get_num_unfinished_requests") == 0
        return [tokens[i] for i in ids]

    client = AsyncMPClient(tiny_config(tiny), MPClientOptions(shutdown_timeout_s=5))
    try:
        assert asyncio.run(run(client)) == expected
    finally:
        client.shutdown()


def test_engine_stats_keep_arriving_while_idle(client: SyncMPClient) -> None:
    # An idle engine still reports (every 0.5 s; how often is a figure, not this test's
    # business): each time the last report is cleared, a new one comes.
    for _ in range(4):
        client.engine_stats = None
        deadline = time.monotonic() + 30.0
        while client.engine_stats is None and time.monotonic() < deadline:
            time.sleep(0.01)
        stats = client.engine_stats
        assert stats is not None, "no EngineStats within 30 s"
        assert not stats.draining
        assert stats.num_running_reqs == 0 and stats.num_waiting_reqs == 0


def test_utility_returns_a_value(client: SyncMPClient) -> None:
    assert client.call_utility("get_num_unfinished_requests") == 0
    assert client.call_utility("reset_prefix_cache") is True
    stats = msgspec.convert(client.call_utility("get_scheduler_stats"), SchedulerStats)
    assert stats.step_counter > 0


def test_utility_failure_comes_back_as_an_error(client: SyncMPClient) -> None:
    with pytest.raises(RuntimeError, match=r"call to reset_prefix_cache failed: .*argument"):
        client.call_utility("reset_prefix_cache", 1, 2, 3)
    for name in ("no_such_method", "shutdown", "_abort_all", "run_busy_loop"):
        with pytest.raises(RuntimeError, match="unknown utility method"):
            client.call_utility(name)
    assert client.call_utility("get_num_unfinished_requests") == 0  # still serving


def test_utility_returning_a_future_replies_when_it_completes(client: SyncMPClient) -> None:
    client.add_request(EngineCoreRequest("slow", PROMPTS[0], greedy(120)))
    assert client.call_utility("wait_until_idle") is None  # blocks until "slow" finished
    # The reply came after the request's last output, which is therefore already queued.
    finished = collect(client, {"slow"}, timeout=1.0)["slow"]
    assert finished.reason is FinishReason.LENGTH and len(finished.tokens) == 120


def test_abort_mid_generation(client: SyncMPClient) -> None:
    client.add_request(EngineCoreRequest("victim", PROMPTS[1], greedy(200)))
    client.add_request(EngineCoreRequest("bystander", PROMPTS[2], greedy(60)))
    tokens: dict[str, list[int]] = {"victim": [], "bystander": []}
    while len(tokens["victim"]) < 3:
        for out in client.get_output(10).outputs:
            tokens[out.request_id] += out.new_token_ids
            assert not out.finished
    client.abort_requests(["victim"])
    result = collect(client, {"bystander"})  # (a victim output sent before the abort is ignored)
    assert result["bystander"].reason is FinishReason.LENGTH
    assert len(tokens["bystander"] + result["bystander"].tokens) == 60
    assert client.call_utility("get_num_unfinished_requests") == 0  # the victim is gone too


def test_bad_requests_fail_alone_and_the_engine_serves_on(
    client: SyncMPClient, expected: list[list[int]]
) -> None:
    bad = {
        "too-long": EngineCoreRequest("too-long", list(range(5, 300)), greedy(4)),
        "bad-token": EngineCoreRequest("bad-token", [5, 99999], greedy(4)),
        "bad-param": EngineCoreRequest("bad-param", [5, 6], SamplingParams(temperature=-1.0)),
        "empty": EngineCoreRequest("empty", [], greedy(4)),
    }
    for request in bad.values():
        client.add_request(request)
    results = collect(client, set(bad), timeout=10)
    assert all(r.reason is FinishReason.ERROR and r.tokens == [] for r in results.values())
    assert "max_model_len" in str(results["too-long"].message)
    assert "vocabulary" in str(results["bad-token"].message)
    assert "temperature" in str(results["bad-param"].message)
    # A duplicate of a running request's id fails; the running one is untouched.
    client.add_request(EngineCoreRequest("dup", PROMPTS[3], greedy(40)))
    client.add_request(EngineCoreRequest("dup", PROMPTS[0], greedy(40)))
    first = collect(client, {"dup"}, timeout=10)["dup"]
    assert first.reason is FinishReason.ERROR and "duplicate" in str(first.message)
    assert client.call_utility("wait_until_idle") is None
    assert generate(client, PROMPTS, MAX_TOKENS) == expected


def _fuzz_frames(rng: random.Random) -> Iterator[list[bytes]]:
    """Random garbage, wrong type bytes, and byte-flipped versions of valid messages."""
    encoder = MsgpackEncoder()
    valid = [
        (RequestType.ADD.value, encoder.encode(EngineCoreRequest("f", [5, 6, 7], greedy(3)))[0]),
        (RequestType.ABORT.value, encoder.encode(["a", "b"])[0]),
        (RequestType.UTILITY.value, encoder.encode(UtilityCall(0, 1, "reset_prefix_cache"))[0]),
        # An MoE group's wake-up, to a rank outside any group: ignored, mutated or not.
        (RequestType.START_DP_WAVE.value, encoder.encode(StartDPWave(3, exclude_rank=1))[0]),
        (RequestType.ABORT.value, encoder.encode({"not": "a list"})[0]),  # wrong fields
        (RequestType.ADD.value, encoder.encode(UtilityCall(0, 1, "x"))[0]),  # wrong struct
    ]
    for i in range(10_000):
        kind = i % 4
        if kind == 0:  # pure garbage, 0-3 frames
            yield [rng.randbytes(rng.randint(0, 40)) for _ in range(rng.randint(0, 3))]
        elif kind == 1:  # any type byte (internal ones included) with a random payload
            yield [bytes([rng.randint(0, 8)]), rng.randbytes(rng.randint(0, 40))]
        else:  # a valid message with some bytes changed, sometimes with stray aux frames
            type_byte, payload = rng.choice(valid)
            mutated = bytearray(payload)
            for _ in range(rng.randint(1, 4)):
                mutated[rng.randrange(len(mutated))] = rng.randint(0, 255)
            extra = [rng.randbytes(8)] if rng.random() < 0.2 else []
            yield [type_byte, bytes(mutated), *extra]


def test_fuzzed_frames_are_dropped_and_the_engine_serves_on(
    client: SyncMPClient, expected: list[list[int]]
) -> None:
    rng = random.Random(1234)
    for frames in _fuzz_frames(rng):
        client.input_socket.send_multipart([client.identity, *frames])
    # Some mutations are valid requests and run; wait for them, ignoring their outputs.
    assert client.call_utility("wait_until_idle") is None
    assert client.dead is None
    assert client.resources.process is not None and client.resources.process.poll() is None
    assert generate(client, PROMPTS, MAX_TOKENS) == expected
