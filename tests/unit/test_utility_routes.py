"""The pieces of vLLM's utility routes that need no server: ``--root-path`` (its rule, its
check, the key check under it), the ``/tokenize`` form a body selects, ``/tokenizer_info``
from a model folder, and what the OpenAPI document says of the routes.
(``tests/integration/test_serve_utility_routes.py`` runs them all through ``corefleet serve``.)"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI

from corefleet.engine.cli import parse_args
from corefleet.engine.frontend.tokenizer import Tokenizer
from corefleet.engine.openai.admission import ApiKeys, InFlightLimiter
from corefleet.engine.openai.errors import RequestError
from corefleet.engine.openai.front import ApiFront
from corefleet.engine.openai.openapi import openapi_document
from corefleet.engine.openai.server_options import (
    ServerOptions,
    route_path,
    server_options_from_args,
)
from corefleet.engine.openai.tokenize_api import _tokenize_request, tokenizer_info
from corefleet.engine.openai.tokenize_protocol import (
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from tests.fixtures_models import TINY_CHAT_TEMPLATE, write_tiny_tokenizer


@pytest.mark.parametrize(
    ("path", "root", "routed"),
    [
        ("/v1/models", "", "/v1/models"),
        ("/v1/models", "/llm", "/v1/models"),  # the proxy stripped the prefix
        ("/llm/v1/models", "/llm", "/v1/models"),  # the proxy kept it
        ("/llm", "/llm", ""),  # the prefix alone routes nowhere (Starlette's rule)
        ("/llmx/v1/models", "/llm", "/llmx/v1/models"),  # not under the prefix: whole segments
        ("/a/b/tokenize", "/a/b", "/tokenize"),
    ],
)
def test_route_path_is_starlettes_rule(path: str, root: str, routed: str) -> None:
    assert route_path(path, root) == routed
    starlette = pytest.importorskip("starlette._utils")
    assert starlette.get_route_path({"path": path, "root_path": root}) == routed


def test_root_path_flag_is_checked_and_normalised() -> None:
    args = parse_args(["serve", "--root-path", "/team/llm/"])
    assert server_options_from_args(args).root_path == "/team/llm"
    assert server_options_from_args(parse_args(["serve"])) == ServerOptions()
    for bad in ("llm", "/a b", "/a?x=1", "/a/../b", "/" + "a" * 300, "/a#b"):
        with pytest.raises(ValueError, match="--root-path"):
            ServerOptions(root_path=bad)
    flags = parse_args(
        ["coordinator", "--enable-tokenizer-info-endpoint", "--enable-server-load-tracking"]
    )
    options = server_options_from_args(flags)
    assert options.enable_tokenizer_info_endpoint and options.enable_server_load_tracking


def _get(front: ApiFront, method: str, path: str, **headers: str) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=front)
        async with httpx.AsyncClient(transport=transport, base_url="http://api") as client:
            return await client.request(method, path, headers=headers)

    return asyncio.run(go())


def test_the_key_check_reads_paths_under_the_root_path() -> None:
    app = FastAPI()
    app.root_path = "/llm"  # as build_app sets it
    for path in ("/v1/models", "/tokenize", "/tokenizer_info", "/version"):
        app.add_api_route(path, lambda: {"ok": True}, methods=["GET", "POST"])
    front = ApiFront(app, ApiKeys(["k"]), {}, root_path="/llm")
    key = {"authorization": "Bearer k"}
    for path in ("/v1/models", "/llm/v1/models", "/llm/tokenize", "/tokenizer_info"):
        assert _get(front, "GET", path).status_code == 401, path
        assert _get(front, "GET", path, **key).json() == {"ok": True}, path
    for path in ("/version", "/llm/version"):  # open, as vLLM's
        assert _get(front, "GET", path).json() == {"ok": True}
    assert _get(front, "GET", "/llmx/v1/models", **key).status_code == 404


def test_a_body_with_messages_is_the_chat_form() -> None:
    chat = _tokenize_request(b'{"messages": [{"role": "user", "content": "hi"}], "prompt": "x"}')
    assert isinstance(chat, TokenizeChatRequest)
    assert (chat.add_generation_prompt, chat.add_special_tokens) == (True, False)  # vLLM's
    prompt = _tokenize_request(b'{"prompt": "hi"}')
    assert isinstance(prompt, TokenizeCompletionRequest) and prompt.add_special_tokens is True
    for raw, param in (
        (b"[1]", None),
        (b"{", None),
        (b'{"prompt": 1}', "prompt"),
        (b'{"prompt": "x", "add_special_tokens": 1}', "add_special_tokens"),
        (b'{"messages": "hi"}', "messages"),
        (b'{"messages": []}', "messages"),
    ):
        with pytest.raises(RequestError) as info:
            _tokenize_request(raw)
        assert (info.value.status, info.value.param) == (400, param), raw


def test_tokenizer_info_is_the_models_config(tmp_path: Path) -> None:
    write_tiny_tokenizer(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["added_tokens_decoder"] = {"0": {"content": "<s>", "special": True, "lstrip": False}}
    config["vocab_file"] = "/somewhere/vocab.json"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = Tokenizer.from_model_path(tmp_path)
    info = tokenizer_info(tokenizer, str(tmp_path))
    assert info["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert info["chat_template"] == TINY_CHAT_TEMPLATE
    assert info["added_tokens_decoder"] == {"0": "<s>"}  # as vLLM: the token's text
    assert (info["bos_token"], info["eos_token"]) == (config["bos_token"], config["eos_token"])
    assert "vocab_file" not in info and info["model_max_length"] == 256
    json.dumps(info)  # all of it is JSON
    bare = tokenizer_info(tokenizer, str(tmp_path / "missing"))  # a GGUF file has no config
    assert bare["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert bare["chat_template"] == TINY_CHAT_TEMPLATE and "model_max_length" not in bare


def test_load_counts_admitted_requests_until_answered() -> None:
    limiter = InFlightLimiter(lambda: 8, None)
    first, second = limiter.admit(None, 4), limiter.admit(None, 1)
    assert (limiter.requests, limiter.in_flight) == (2, 5)  # requests, not completions
    first.release()
    first.release()  # idempotent
    assert limiter.requests == 1
    second.release()
    assert limiter.requests == 0


def test_the_document_describes_the_utility_routes() -> None:
    plain = openapi_document("m", auth=True, max_n=4, max_model_len=64, vocab_size=320)
    assert "/tokenizer_info" not in plain["paths"]  # not served without the flag
    with_info = openapi_document(
        "m", auth=True, max_n=4, max_model_len=64, vocab_size=320, tokenizer_info=True
    )
    paths = with_info["paths"]
    protected = (("/tokenize", "post"), ("/detokenize", "post"), ("/tokenizer_info", "get"))
    for path, method in protected:
        operation = paths[path][method]
        assert operation["security"] == [{"bearer": []}] and "401" in operation["responses"]
    for path in ("/version", "/load"):
        assert "security" not in paths[path]["get"]
    assert paths["/v1/models/{model}"]["get"]["responses"]["404"]
    schemas = with_info["components"]["schemas"]
    ids = schemas["DetokenizeRequest"]["properties"]["tokens"]["items"]
    assert (ids["minimum"], ids["maximum"]) == (0, 319)
    assert schemas["TokenizeCompletionRequest"]["not"] == {"required": ["messages"]}
    assert schemas["TokenizeChatRequest"]["properties"]["model"]["enum"] == ["m", None]
    assert set(schemas["ModelCard"]["required"]) >= {"root", "parent", "permission"}
