"""The soak benchmark's load: the request mix, one request over httpx, and its outcome.

A :class:`RequestMix` draws each request from a seeded RNG: chat or completions, streaming or
not, a short prompt from :data:`PROMPTS`, a small ``max_tokens``; a fraction of the streaming
clients disconnect after their first one or two content chunks, and a fraction of the bodies are
malformed (cycling through :data:`MALFORMED`) and must be refused with a 4xx. :func:`send` runs
one request with a total timeout and returns an :class:`Outcome`; :func:`tally` counts them.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass
from typing import Any

import httpx

PROMPTS = [
    "Tell me a short fact about the moon.",
    "What is the capital of France?",
    "Write one sentence about rain.",
    "Name three colours.",
    "How many legs does a spider have?",
    "Give me a word that rhymes with cat.",
    "What is two plus two?",
    "Describe a tree in five words.",
    "Why is the sky blue?",
    "Say hello in Spanish.",
    "What do bees make?",
    "List the days of the week.",
    "Suggest a name for a dog.",
    "What is the boiling point of water?",
    "Summarise the plot of Cinderella.",
    "Count from one to five.",
]
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
# Cycled in this order; each must be answered with a 4xx.
MALFORMED = ("invalid_json", "wrong_types", "huge_n", "unknown_model", "not_an_object")


@dataclass
class RequestSpec:
    """One request to send: where, what, and how the client behaves."""

    path: str
    body: bytes
    stream: bool
    malformed: str | None = None  # which malformed kind, None for a well-formed body
    disconnect_after: int = 0  # close the connection after this many content chunks (0: never)


@dataclass
class Outcome:
    """What became of one request. ``status`` is None when no HTTP answer came."""

    spec: RequestSpec
    status: int | None = None
    retry_after: bool = False  # a 429 carried a Retry-After header
    complete: bool = False  # a whole answer: JSON body, or a stream ending in [DONE]
    disconnected: bool = False  # the client closed the stream on purpose
    stream_error: str = ""  # an error event inside a 200 stream
    error: str = ""  # transport error or timeout (exception class)
    ttft: float | None = None  # seconds to the first content chunk (streams)
    e2e: float = 0.0
    tokens: int = 0  # completion tokens (usage, else content chunks)
    finished_at: float = 0.0  # time.monotonic() when the outcome was known

    @property
    def answered_ok(self) -> bool:
        """Malformed: any 4xx. Well-formed: a 429, or a 200 whole (or closed on purpose)."""
        if self.spec.malformed is not None:
            return self.status is not None and 400 <= self.status < 500
        if self.status == 429:
            return True
        ok_200 = self.status == 200 and not self.stream_error
        return ok_200 and (self.complete or self.disconnected)


class RequestMix:
    """Seeded request mix over both endpoints (see the module docstring)."""

    def __init__(
        self,
        seed: int,
        max_tokens: tuple[int, int],
        stream_fraction: float = 0.5,
        disconnect_fraction: float = 0.10,
        malformed_fraction: float = 0.01,
        huge_n: int = 100_000,
        model: str | None = None,
    ) -> None:
        self.rng = random.Random(seed)
        self.max_tokens = max_tokens
        self.disconnect = disconnect_fraction
        self.malformed = malformed_fraction
        # Disconnecting clients stream too: the rest stream with the probability that brings the
        # streaming share of the well-formed requests to stream_fraction.
        rest = 1.0 - disconnect_fraction - malformed_fraction
        self.stream_fraction = stream_fraction
        self.stream_rest = min(1.0, max(0.0, (stream_fraction - disconnect_fraction) / rest))
        self.huge_n = huge_n
        self.model = model
        self.malformed_sent = 0

    def _body(self, path: str, stream: bool) -> dict[str, Any]:
        prompt = self.rng.choice(PROMPTS)
        body: dict[str, Any] = {
            "max_tokens": self.rng.randint(*self.max_tokens),
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": stream,
        }
        if self.model is not None:
            body["model"] = self.model
        if stream:
            body["stream_options"] = {"include_usage": True}
        if path == CHAT:
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        return body

    def well_formed(self, allow_disconnect: bool = True) -> RequestSpec:
        """A well-formed request; with ``allow_disconnect``, possibly a disconnecting one."""
        path = self.rng.choice((CHAT, COMPLETIONS))
        x = self.rng.random() * (1.0 - self.malformed)  # draw in the well-formed range
        if allow_disconnect and x < self.disconnect:
            body = self._body(path, stream=True)
            return RequestSpec(path, json.dumps(body).encode(), True, None, self.rng.randint(1, 2))
        share = self.stream_rest if allow_disconnect else self.stream_fraction
        stream = self.rng.random() < share
        return RequestSpec(path, json.dumps(self._body(path, stream)).encode(), stream)

    def next(self) -> RequestSpec:
        """The next request of the open-loop mix."""
        if self.rng.random() < self.malformed:
            return self.bad(MALFORMED[self.malformed_sent % len(MALFORMED)])
        return self.well_formed()

    def bad(self, kind: str) -> RequestSpec:
        """A malformed request of ``kind`` (one of :data:`MALFORMED`)."""
        self.malformed_sent += 1
        path = self.rng.choice((CHAT, COMPLETIONS))
        good = self._body(path, stream=False)
        if kind == "invalid_json":
            raw = json.dumps(good)[:-7].encode()  # cut off: unterminated
        elif kind == "wrong_types":
            key = "messages" if path == CHAT else "prompt"
            raw = json.dumps({**good, key: 12.5, "max_tokens": "sixteen"}).encode()
        elif kind == "huge_n":
            # Streamed, so that a server that does not refuse it stops when the client leaves.
            body = {**good, "n": self.huge_n, "max_tokens": 1, "stream": True}
            raw = json.dumps(body).encode()
        elif kind == "unknown_model":
            raw = json.dumps({**good, "model": "no-such-model-soak"}).encode()
        elif kind == "not_an_object":
            raw = json.dumps([good]).encode()
        else:
            raise ValueError(f"unknown malformed kind {kind!r}")
        return RequestSpec(path, raw, stream=False, malformed=kind)


def _chunk_text(event: dict[str, Any]) -> str:
    choices = event.get("choices") or []
    if not choices:
        return ""
    c = choices[0]
    return str(c.get("text") or (c.get("delta") or {}).get("content") or "")


async def _exchange(client: httpx.AsyncClient, spec: RequestSpec, out: Outcome) -> None:
    t0 = time.perf_counter()
    headers = {"content-type": "application/json"}
    async with client.stream("POST", spec.path, content=spec.body, headers=headers) as resp:
        out.status = resp.status_code
        out.retry_after = "retry-after" in resp.headers
        if resp.status_code != 200 or not spec.stream:
            data = await resp.aread()
            out.e2e = time.perf_counter() - t0
            if resp.status_code == 200:
                usage = json.loads(data).get("usage") or {}
                out.tokens = int(usage.get("completion_tokens") or 0)
                out.complete = True
            return
        chunks = 0
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                out.complete = True
                break
            event = json.loads(payload)
            if "error" in event:
                out.stream_error = str(event["error"].get("message", event["error"]))[:200]
                break
            if event.get("usage"):
                out.tokens = int(event["usage"].get("completion_tokens") or 0)
            if _chunk_text(event):
                chunks += 1
                if out.ttft is None:
                    out.ttft = time.perf_counter() - t0
                if spec.disconnect_after and chunks >= spec.disconnect_after:
                    out.disconnected = True  # leaving the block unread closes the connection
                    break
        out.tokens = out.tokens or chunks
        out.e2e = time.perf_counter() - t0


async def send(client: httpx.AsyncClient, spec: RequestSpec, timeout: float) -> Outcome:
    """Send ``spec``; every failure is recorded in the outcome, nothing is raised but a cancel."""
    out = Outcome(spec)
    try:
        await asyncio.wait_for(_exchange(client, spec, out), timeout)
    except (httpx.HTTPError, asyncio.TimeoutError, ValueError) as exc:  # ValueError: bad JSON
        out.error = type(exc).__name__
    out.finished_at = time.monotonic()
    return out


def tally(outcomes: list[Outcome]) -> dict[str, dict[str, int]]:
    """Counts per class of answer, for well-formed and malformed requests apart."""
    counts: dict[str, dict[str, int]] = {}
    for side in ("well_formed", "malformed"):
        rows = [o for o in outcomes if (o.spec.malformed is None) == (side == "well_formed")]
        st = [o.status for o in rows]
        counts[side] = {
            "sent": len(rows),
            "2xx": sum(s is not None and 200 <= s < 300 for s in st),
            "429": st.count(429),
            "429_without_retry_after": sum(o.status == 429 and not o.retry_after for o in rows),
            "other_4xx": sum(s is not None and 400 <= s < 500 and s != 429 for s in st),
            "5xx": sum(s is not None and s >= 500 for s in st),
            "transport_errors": sum(s is None for s in st),
            "stream_errors": sum(bool(o.stream_error) for o in rows),
            "incomplete_200": sum(
                o.status == 200 and not (o.complete or o.disconnected) for o in rows
            ),
            "disconnected": sum(o.disconnected for o in rows),
            "not_answered_ok": sum(not o.answered_ok for o in rows),
        }
    return counts
