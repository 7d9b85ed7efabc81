"""Reading the coordinator's /admin/engines: shapes, and tolerance of absence."""

from __future__ import annotations

import asyncio
import socket

import aiohttp.web
import pytest

from corefleet.operator.admin import fetch_engines, parse_engines


@pytest.mark.parametrize(
    ("payload", "expected"),
    [
        (
            {"engines": [{"rank": 0, "state": "ready"}, {"rank": 1, "state": "HELLO"}]},
            {0: "ready", 1: "handshaking"},
        ),
        (
            [
                {"engine_index": 2, "status": "loading"},
                {"index": 3, "state": "ready", "draining": True},
            ],
            {2: "loading", 3: "draining"},
        ),
        ([{"rank": "zero", "state": "ready"}, {"state": "ready"}, "junk"], {}),
        ({"unexpected": 1}, None),
        ("text", None),
    ],
)
def test_parse_engines(payload, expected):
    assert parse_engines(payload) == expected


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def _with_server(handler, check):
    app = aiohttp.web.Application()
    app.router.add_get("/admin/engines", handler)
    runner = aiohttp.web.AppRunner(app)
    await runner.setup()
    port = _free_port()
    site = aiohttp.web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    try:
        return await check(f"http://127.0.0.1:{port}/admin/engines")
    finally:
        await runner.cleanup()


def test_fetch_reads_a_live_coordinator():
    async def ok(_request):
        return aiohttp.web.json_response({"engines": [{"rank": 0, "state": "ready"}]})

    found = asyncio.run(_with_server(ok, lambda url: fetch_engines(url, 2.0)))
    assert found == {0: "ready"}


def test_fetch_tolerates_errors_silence_and_absence():
    async def broken(_request):
        return aiohttp.web.Response(status=500)

    assert asyncio.run(_with_server(broken, lambda url: fetch_engines(url, 2.0))) is None

    async def silent_scenario():
        release = asyncio.Event()

        async def silent(_request):
            await release.wait()
            return aiohttp.web.json_response([])

        async def check(url):
            try:  # the 0.2 s timeout must answer long before this 5 s bound
                return await asyncio.wait_for(fetch_engines(url, 0.2), 5)
            finally:
                release.set()

        return await _with_server(silent, check)

    assert asyncio.run(silent_scenario()) is None
    closed = f"http://127.0.0.1:{_free_port()}/admin/engines"
    assert asyncio.run(fetch_engines(closed, 1.0)) is None


def test_fetch_sends_the_api_key_the_coordinator_requires():
    async def guarded(request):
        if request.headers.get("Authorization") != "Bearer s3cret":
            return aiohttp.web.json_response({"error": "invalid or missing API key"}, status=401)
        return aiohttp.web.json_response([{"rank": 1, "state": "draining"}])

    async def both(url):
        return await fetch_engines(url, 2.0), await fetch_engines(url, 2.0, "s3cret")

    without, with_key = asyncio.run(_with_server(guarded, both))
    assert without is None  # refused: the status falls back to what the pods say
    assert with_key == {1: "draining"}
