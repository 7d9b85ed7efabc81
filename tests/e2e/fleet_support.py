"""Observers for the fleet scenarios: a streaming load, the status history, the coordinator.

`StreamingLoad` keeps `clients` streaming chat completions going through the official `openai`
client (no retries: a request that fails is counted, not hidden) and records each one's outcome.
`StatusRecorder` samples the InferenceEngine's status in the background, so a test can assert
the stages and conditions it passed through, not just where it ended.

Importing this module loads no part of the harness (the cluster is only a type here), so a load
run as a process of its own (`dns_load.py`) imports it cheaply.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Self

import httpx
import openai

if TYPE_CHECKING:
    from cluster import LocalCluster

PROMPTS = [
    "Write a short poem about the sea.",
    "List three facts about the Moon.",
    "Explain what a hash table is, briefly.",
    "Give me a recipe for pancakes.",
]


@dataclasses.dataclass
class Outcome:
    """One streamed request: how it ended, and when."""

    started: float
    ended: float
    finish_reason: str | None
    text: str
    error: str | None
    server: str | None = None  # the address that served it, once its response began
    port: int | None = None  # the client's port: the same one again is a kept-alive connection


class StreamingLoad:
    """`clients` threads, each sending streaming chat requests back to back until stopped.

    Each client has a connection pool of its own. The sync client closes a stream's connection
    once it has read `[DONE]` (it leaves the end of the chunked body unread), so every request
    opens a new one; with `keep_alive` the clients are `AsyncOpenAI`, which reads each stream to
    its end and sends the next request on the same connection, as long-lived applications do.
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        clients: int = 3,
        max_tokens: int = 48,
        ignore_eos: bool = False,
        keep_alive: bool = False,
    ) -> None:
        self.base_url, self.model, self.max_tokens = base_url, model, max_tokens
        self.keep_alive = keep_alive
        # ignore_eos: every request runs to max_tokens, so a rank never idles between the model's
        # early stops (a test that needs work in flight at a given moment depends on it)
        self.extra_body = {"ignore_eos": True} if ignore_eos else None
        self.outcomes: list[Outcome] = []
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(clients)
        ]

    def __enter__(self) -> StreamingLoad:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(120)

    def clients_running(self) -> int:
        """Client threads still running: after the block, those stuck in a request."""
        return sum(thread.is_alive() for thread in self._threads)

    def _client(self, index: int) -> None:
        if self.keep_alive:
            asyncio.run(self._async_client(index))
            return
        client = openai.OpenAI(base_url=self.base_url, api_key="unused", max_retries=0, timeout=120)
        n = index
        while not self._stop.is_set():
            self.outcomes.append(self._one(client, PROMPTS[n % len(PROMPTS)]))
            n += 1

    def _one(self, client: openai.OpenAI, prompt: str) -> Outcome:
        started, text, finish, server, port = time.monotonic(), "", None, None, None
        try:
            stream = client.chat.completions.create(
                model=self.model,
                messages=[{"role": "user", "content": prompt}],
                max_tokens=self.max_tokens,
                temperature=0.0,
                stream=True,
                extra_body=self.extra_body,
            )
            server, port = _addresses(stream.response)
            for chunk in stream:
                for choice in chunk.choices:
                    text += choice.delta.content or ""
                    finish = choice.finish_reason or finish
        # A stream cut mid-way (its server died) raises httpx's error, not the client's own.
        except (openai.OpenAIError, httpx.HTTPError) as exc:
            error = f"{type(exc).__name__}: {exc}"
            return Outcome(started, time.monotonic(), finish, text, error, server, port)
        return Outcome(started, time.monotonic(), finish, text, None, server, port)

    async def _async_client(self, index: int) -> None:
        client = openai.AsyncOpenAI(
            base_url=self.base_url, api_key="unused", max_retries=0, timeout=120
        )
        async with client:
            n = index
            while not self._stop.is_set():
                self.outcomes.append(await self._async_one(client, PROMPTS[n % len(PROMPTS)]))
                n += 1

    async def _async_one(self, client: openai.AsyncOpenAI, prompt: str) -> Outcome:
        """`_one` with the async client."""
        started, text, finish, server, port = time.monotonic(), "", None, None, None
        try:
            stream = await client.chat.completions.create(
                model=self.model,
                messages=[{"role": "user", "content": prompt}],
                max_tokens=self.max_tokens,
                temperature=0.0,
                stream=True,
                extra_body=self.extra_body,
            )
            server, port = _addresses(stream.response)
            async for chunk in stream:
                for choice in chunk.choices:
                    text += choice.delta.content or ""
                    finish = choice.finish_reason or finish
        except (openai.OpenAIError, httpx.HTTPError) as exc:
            error = f"{type(exc).__name__}: {exc}"
            return Outcome(started, time.monotonic(), finish, text, error, server, port)
        return Outcome(started, time.monotonic(), finish, text, None, server, port)

    def wait_completed(self, count: int, timeout: float) -> None:
        """Block until at least `count` requests have ended."""
        deadline = time.monotonic() + timeout
        while len(self.outcomes) < count:
            if time.monotonic() > deadline:
                raise AssertionError(f"only {len(self.outcomes)}/{count} requests ended in time")
            time.sleep(0.1)

    def failures(self) -> list[Outcome]:
        """Requests that raised or did not end with `stop` or `length`."""
        return [o for o in self.outcomes if o.error or o.finish_reason not in ("stop", "length")]


def _addresses(response: httpx.Response) -> tuple[str | None, int | None]:
    """(server IP, client port) of the response's connection (httpcore's stream knows them).

    A client that resolves a Service name cannot tell otherwise which pod answered it.
    """
    stream = response.extensions.get("network_stream")
    if stream is None:
        return None, None
    peer, own = stream.get_extra_info("server_addr"), stream.get_extra_info("client_addr")
    return (str(peer[0]) if peer else None), (int(own[1]) if own else None)


class Sampler:
    """A daemon thread that runs `_run` from the start of a `with` block to its end; `_run`
    returns once `_stop` is set."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        raise NotImplementedError


class StatusRecorder(Sampler):
    """Samples `status` of an InferenceEngine from the API server every `interval` seconds."""

    def __init__(self, cluster: LocalCluster, name: str, interval: float = 0.2) -> None:
        self.cluster, self.name, self.interval = cluster, name, interval
        self.samples: list[dict[str, Any]] = []
        super().__init__()

    def _run(self) -> None:
        while not self._stop.is_set():
            obj = self.cluster.api.obj(
                "corefleet.dev/v1alpha1/inferenceengines", "default", self.name
            )
            status = json.loads(json.dumps((obj or {}).get("status") or {}))
            if not self.samples or self.samples[-1] != status:
                self.samples.append(status)
            time.sleep(self.interval)

    def stages(self, rank: int) -> list[str]:
        """The distinct successive stages a rank was reported in ('gone' when absent)."""
        seen: list[str] = []
        for status in self.samples:
            entry = next((r for r in status.get("ranks") or () if r.get("rank") == rank), None)
            stage = entry["stage"] if entry else "gone"
            if not seen or seen[-1] != stage:
                seen.append(stage)
        return seen

    def conditions(self, kind: str) -> Iterator[tuple[str, str]]:
        """(status, reason) of a condition, each change once, in order."""
        last = None
        for status in self.samples:
            cond = next((c for c in status.get("conditions") or () if c["type"] == kind), None)
            now = (cond["status"], cond.get("reason", "")) if cond else None
            if now is not None and now != last:
                yield now
            last = now


def admin_engines(base_url: str) -> list[dict[str, Any]]:
    """The coordinator's `/admin/engines` (base_url without /v1)."""
    with urllib.request.urlopen(f"{base_url}/admin/engines", timeout=5) as resp:
        return list(json.load(resp))


def counter(base_url: str, name: str) -> float:
    """A counter's value from the coordinator's `/metrics` (`name` without `_total`)."""
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    for line in text.splitlines():
        if line.startswith(f"{name}_total "):
            return float(line.split()[1])
    raise AssertionError(f"no counter {name} in /metrics")
