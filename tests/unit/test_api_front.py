"""The API's front door (``engine/openai/front.py``) over ASGI: the key check comes first, the
generation routes' POSTs skip FastAPI, a handler that raises answers 500 in OpenAI's error
shape and the next request is served, and everything else reaches FastAPI."""

from __future__ import annotations

import asyncio

import httpx
from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from corefleet.engine.openai.admission import ApiKeys
from corefleet.engine.openai.front import ApiFront


def _front(keys: list[str]) -> tuple[ApiFront, list[str]]:
    seen: list[str] = []
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict[str, str]:
        return {"from": "fastapi"}

    async def generate(request: Request) -> Response:
        body = await request.json()
        seen.append(str(request.state.key_id))
        if body.get("boom"):
            raise RuntimeError("a bug in a handler")
        return JSONResponse({"echo": body})

    return ApiFront(app, ApiKeys(keys), {"/v1/completions": generate}), seen


def _post(front: ApiFront, path: str, body: object, **headers: str) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=front)
        async with httpx.AsyncClient(transport=transport, base_url="http://api") as client:
            if body is None:
                return await client.get(path, headers=headers)
            return await client.post(path, json=body, headers=headers)

    return asyncio.run(go())


def test_a_handler_that_raises_answers_500_and_the_next_request_is_served() -> None:
    front, seen = _front([])
    failed = _post(front, "/v1/completions", {"boom": True})
    assert failed.status_code == 500
    assert failed.json()["error"]["type"] == "server_error"
    assert _post(front, "/v1/completions", {"x": 1}).json() == {"echo": {"x": 1}}
    assert seen == ["None", "None"]  # no keys configured: the key id is None


def test_the_key_is_checked_before_any_handler_runs() -> None:
    front, seen = _front(["secret"])
    refused = _post(front, "/v1/completions", {"x": 1})
    assert refused.status_code == 401 and refused.json()["error"]["type"] == "invalid_api_key"
    assert _post(front, "/v1/models", None).status_code == 401  # FastAPI's routes too
    assert seen == []
    ok = _post(front, "/v1/completions", {"x": 1}, authorization="Bearer secret")
    assert ok.status_code == 200 and len(seen) == 1 and seen[0] != "None"


def test_other_methods_and_routes_reach_fastapi() -> None:
    front, seen = _front([])
    assert _post(front, "/v1/models", None).json() == {"from": "fastapi"}
    assert _post(front, "/v1/completions", None).status_code in (404, 405)  # a GET
    assert seen == []
