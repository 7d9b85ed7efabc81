"""``GET /openapi.json`` is true: schemathesis fuzzes a real ``corefleet serve`` against it.

The server (a tiny model, ``--max-model-len 64``, ``--max-num-seqs 4``, an API key) serves its
own document; schemathesis draws requests from it (valid and invalid ones, deterministic seed)
and checks every answer: no server error, no undocumented status or content type, every body
(and every streamed event) as documented, and no schema-valid request refused, except a 400
whose ``code`` the document lists as beyond JSON Schema (a prompt too long in tokens, ...).
``tools/fuzz_api.py`` runs the same checks for longer, by hand.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from schemathesis.checks import not_a_server_error
from schemathesis.core.transport import Response as StResponse
from schemathesis.openapi.checks import RejectedPositiveData
from schemathesis.specs.openapi import checks as st_checks

from corefleet.engine.frontend.input_processor import ContextLengthExceeded, EmptyPrompt
from corefleet.engine.frontend.tokenizer import ChatTemplateRefused
from corefleet.engine.messages import DEFAULT_MAX_LOGPROBS
from corefleet.engine.openai.errors import (
    CHAT_TEMPLATE_REFUSED,
    CONTEXT_LENGTH_EXCEEDED,
    EMPTY_PROMPT,
    MIN_TOKENS_ABOVE_MAX_TOKENS,
    PROMPT_LOGPROBS_WITH_STREAM,
    SCHEMA_VALID_REFUSALS,
    ZERO_MAX_TOKENS_WITHOUT_ECHO,
)
from corefleet.engine.openai.openapi import openapi_document
from tests.fixtures_models import TINY_VOCAB, write_tiny_llama
from tests.serve_support import running_serve

pytestmark = pytest.mark.slow

API_KEY = "openapi-test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_MODEL_LEN, MAX_NUM_SEQS = 64, 4
SERVE_FLAGS = (
    *("--api-key", API_KEY, "--max-model-len", str(MAX_MODEL_LEN)),
    *("--max-num-seqs", str(MAX_NUM_SEQS), "--dtype", "float32"),
    *("--kv-cache-memory", str(8 << 20), "--block-size", "4"),
)
# A short deterministic run: the coverage phase's boundary cases and this many random cases per
# operation, about 20 s on two idle cores (the long run is tools/fuzz_api.py).
EXAMPLES_PER_OPERATION = 60
SEED = 20240611


def accepts_schema_valid_data(ctx: Any, response: StResponse, case: schemathesis.Case) -> Any:
    """schemathesis' ``positive_data_acceptance``, but for the documented refusals that no
    JSON Schema can rule out: a 400 whose ``error.code`` is one of SCHEMA_VALID_REFUSALS."""
    try:
        return st_checks.positive_data_acceptance(ctx, response, case)
    except RejectedPositiveData:
        if response.status_code == 400 and error_code(response) in SCHEMA_VALID_REFUSALS:
            return None
        raise


def error_code(response: StResponse) -> Any:
    try:
        return response.json()["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None


CHECKS = [
    not_a_server_error,
    st_checks.status_code_conformance,
    st_checks.content_type_conformance,
    st_checks.response_schema_conformance,
    accepts_schema_valid_data,
]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    model = write_tiny_llama(tmp_path_factory.mktemp("tiny") / "m")
    with running_serve("--model", str(model), *SERVE_FLAGS) as base:
        yield base


@pytest.fixture(scope="module")
def document(server: str) -> dict[str, Any]:
    response = httpx.get(f"{server}/openapi.json", timeout=30)
    assert response.status_code == 200
    return dict(response.json())


# The document the server below serves (test_the_served_document_is_the_fuzzed_one): built
# here, since pytest collects one test per operation before any server runs.
DOCUMENT = openapi_document(
    "m",
    auth=True,
    max_n=MAX_NUM_SEQS,
    max_model_len=MAX_MODEL_LEN,
    vocab_size=TINY_VOCAB,
    max_logprobs=DEFAULT_MAX_LOGPROBS,
)
CONFIG = schemathesis.Config.from_dict(
    {
        "seed": SEED,
        "generation": {
            "mode": "all",
            "max-examples": EXAMPLES_PER_OPERATION,
            "deterministic": True,
            "database": "none",
        },
        "phases": {"stateful": {"enabled": False}},
        "request-timeout": 60,
        "auth": {"openapi": {"bearer": {"bearer": API_KEY}}},
        "suppress-health-check": ["all"],
        # The token counts are what failures are about: show them (the key is a test one).
        "output": {"sanitization": {"enabled": False}},
    }
)
schema = schemathesis.openapi.from_dict(json.loads(json.dumps(DOCUMENT)), config=CONFIG)


@schema.parametrize()
def test_the_server_does_what_its_openapi_document_says(
    server: str, case: schemathesis.Case
) -> None:
    case.call_and_validate(base_url=server, checks=CHECKS)


def test_the_served_document_is_the_fuzzed_one(document: dict[str, Any]) -> None:
    assert document == json.loads(json.dumps(DOCUMENT))


def test_the_document_carries_the_served_bounds(document: dict[str, Any]) -> None:
    schemas = document["components"]["schemas"]
    completion = schemas["CompletionRequest"]["properties"]
    assert completion["model"]["enum"] == ["m", None]
    assert {"type": "integer", "minimum": 1, "maximum": MAX_NUM_SEQS} in completion["n"]["anyOf"]
    token = {"type": "integer", "minimum": 0, "maximum": TINY_VOCAB - 1}
    assert {"type": "array", "items": token, "minItems": 1, "maxItems": MAX_MODEL_LEN - 1} in (
        completion["prompt"]["anyOf"]
    )
    max_tokens = [b for b in completion["max_tokens"]["anyOf"] if b.get("type") == "integer"]
    # 0 answers the prompt alone, with echo (the zero_max_tokens_without_echo code otherwise).
    assert (max_tokens[0]["minimum"], max_tokens[0]["maximum"]) == (0, MAX_MODEL_LEN - 1)
    # --max-logprobs (20 here, below the vocabulary: no -1), fcfs ranks (priority 0 only).
    chat = schemas["ChatCompletionRequest"]["properties"]
    top = {"type": "integer", "minimum": 0, "maximum": DEFAULT_MAX_LOGPROBS}
    assert top in chat["top_logprobs"]["anyOf"] and top in completion["logprobs"]["anyOf"]
    assert chat["priority"]["anyOf"] == [{"const": 0}, {"const": None}]
    raw = json.dumps(document)
    for keyword in ("ge", "gt", "le", "lt"):  # a pydantic bound it could not put in JSON Schema
        assert f'"{keyword}":' not in raw
    paths = document["paths"]
    assert document["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
    protected = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/admin/engines")
    for path in (*protected, "/v1/models/{model}", "/tokenize", "/detokenize"):
        (operation,) = paths[path].values()
        assert operation["security"] == [{"bearer": []}] and "401" in operation["responses"]
    assert "security" not in paths["/health"]["get"]
    assert list(paths["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain"]
    ok = paths["/v1/completions"]["post"]["responses"]["200"]["content"]
    assert set(ok) == {"application/json", "text/event-stream"}
    responses = document["components"]["responses"]
    assert responses["TooManyRequests"]["headers"]["Retry-After"]["required"] is True
    for code in SCHEMA_VALID_REFUSALS:
        assert f"`{code}`" in responses["BadRequest"]["description"]


@pytest.mark.parametrize(
    ("path", "body", "code"),
    [
        ("completions", {"prompt": "hello " * 80, "max_tokens": 1}, CONTEXT_LENGTH_EXCEEDED),
        ("completions", {"prompt": [5] * 60, "max_tokens": 8}, CONTEXT_LENGTH_EXCEEDED),
        (
            "completions",
            {"prompt": [5] * 60, "max_tokens": None, "min_tokens": 8},
            CONTEXT_LENGTH_EXCEEDED,
        ),
        (
            "completions",
            {"prompt": "hi", "max_tokens": 2, "min_tokens": 3},
            MIN_TOKENS_ABOVE_MAX_TOKENS,
        ),
        ("completions", {"prompt": "hi", "max_tokens": 0}, ZERO_MAX_TOKENS_WITHOUT_ECHO),
        (
            "chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "prompt_logprobs": 1, "stream": True},
            PROMPT_LOGPROBS_WITH_STREAM,
        ),
        # The tiny model's template knows no "tool" role (its raise_exception).
        (
            "chat/completions",
            {"messages": [{"role": "tool", "content": "x"}]},
            CHAT_TEMPLATE_REFUSED,
        ),
        # Any role is schema-valid: the template decides (this one refuses it).
        (
            "chat/completions",
            {"messages": [{"role": "narrator", "content": "x"}]},
            CHAT_TEMPLATE_REFUSED,
        ),
        # A request's own template, on a server started without --trust-request-chat-template.
        (
            "chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ messages }}"},
            CHAT_TEMPLATE_REFUSED,
        ),
    ],
)
def test_refusals_beyond_json_schema_carry_their_documented_code(
    server: str, path: str, body: dict[str, Any], code: str
) -> None:
    response = httpx.post(f"{server}/v1/{path}", json=body, headers=AUTH, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == code


def test_the_frontend_refusals_carry_the_documented_codes() -> None:
    assert ContextLengthExceeded.code == CONTEXT_LENGTH_EXCEEDED
    assert EmptyPrompt.code == EMPTY_PROMPT
    assert ChatTemplateRefused.code == CHAT_TEMPLATE_REFUSED
