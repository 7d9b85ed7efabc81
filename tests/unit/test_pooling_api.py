"""The pooling endpoints' checks before anything reaches a rank: the runner (404 both ways),
bounded inputs, ``dimensions``, the request's forms; and the response encodings."""

from __future__ import annotations

import asyncio
import base64
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from corefleet.engine.frontend.tokenizer import Tokenizer
from corefleet.engine.messages import PoolerInfo, ReadyResponse
from corefleet.engine.openai.admission import ApiKeys
from corefleet.engine.openai.errors import parse_request
from corefleet.engine.openai.generation_api import GenerationApi
from corefleet.engine.openai.metrics import ServingMetrics
from corefleet.engine.openai.pooling_api import _encode
from corefleet.engine.openai.pooling_protocol import PoolingRequest
from corefleet.engine.openai.server_state import ServerState
from tests.fixtures_models import write_tiny_tokenizer

POOLER = PoolerInfo(pooling_type="LAST", use_activation=True, hidden_size=64)


def _state(tmp_path: Path, pooler: PoolerInfo | None) -> ServerState:
    """A server whose one ready rank says ``pooler``; its fleet runs nothing (every request
    here must be refused before one would)."""
    write_tiny_tokenizer(tmp_path / "tok")
    info = ReadyResponse(
        rank=0,
        max_model_len=128,
        num_gpu_blocks=10,
        block_size=16,
        kv_cache_size_tokens=144,
        vocab_size=320,
        model_name="m",
        max_num_seqs=8,
        pooler=pooler,
    )

    def generate(request: Any) -> Any:
        raise AssertionError(f"request {request.request_id} reached the fleet")

    membership = SimpleNamespace(accepting=lambda: [SimpleNamespace(info=info)])
    fleet: Any = SimpleNamespace(membership=membership, generate=generate)
    return ServerState(
        fleet=fleet,
        tokenizer=Tokenizer.from_model_path(tmp_path / "tok"),
        model_name="m",
        api_keys=ApiKeys([]),
        metrics=ServingMetrics(fleet, "m"),
    )


def _post(state: ServerState, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    reply: Any = asyncio.run(GenerationApi(state).serve(path, json.dumps(body).encode(), None))
    return reply.status, json.loads(reply.body)


@pytest.mark.parametrize("path", ["/v1/embeddings", "/pooling"])
def test_a_generating_server_answers_the_pooling_endpoints_404(tmp_path: Path, path: str) -> None:
    status, body = _post(_state(tmp_path, None), path, {"input": "hello"})
    assert status == 404
    assert "--runner pooling" in body["error"]["message"]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": "hello"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ],
)
def test_a_pooling_server_answers_generation_404(tmp_path: Path, path: str, body: Any) -> None:
    status, answer = _post(_state(tmp_path, POOLER), path, body)
    assert status == 404
    assert "--runner pooling" in answer["error"]["message"]


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"input": ["x"] * 100_000}, "input", "at most 8"),
        ({"input": [[5]] * 100_000}, "input", "at most 8"),
        ({"input": "hello", "dimensions": 8}, "dimensions", "matryoshka"),
        ({"input": "hello", "dimensions": 0}, "dimensions", "greater than or equal to 1"),
        ({"input": "hello", "encoding_format": "bytes"}, "encoding_format", "float"),
        ({"input": "hello", "embed_dtype": "fp8_e4m3"}, "embed_dtype", "float32"),
        ({"input": "hello", "truncate_prompt_tokens": 10**6}, "truncate_prompt_tokens", "127"),
        ({"input": "hello", "truncate_prompt_tokens": 10**30}, "truncate_prompt_tokens", ""),
        ({"input": "hello", "truncate_prompt_tokens": -2}, "truncate_prompt_tokens", ""),
        ({"input": [5, 99999]}, "input", "outside the vocabulary"),
        ({"input": list(range(5, 300))}, "input", "maximum context length"),
        ({"input": "x" * 100_000}, "input", "characters"),
        ({"input": []}, "input", "at least one"),
        ({"input": ["a", []]}, "input", ""),
        ({}, None, "exactly one of input"),
        ({"input": "a", "messages": [{"role": "user", "content": "hi"}]}, None, "exactly one"),
        ({"input": "hello", "model": "other"}, "model", "does not exist"),
        (
            {"messages": [{"role": "user", "content": "hi"}], "chat_template": "{{ 1 }}"},
            "chat_template",
            "--trust-request-chat-template",
        ),
        (
            {
                "messages": [{"role": "user", "content": "hi"}],
                "chat_template_kwargs": {"messages": []},
            },
            "chat_template_kwargs",
            "cannot be set there",
        ),
        ({"input": "hello", "task": "classify"}, "task", "embed"),
        (
            {
                "messages": [{"role": "user", "content": "hi"}],
                "add_generation_prompt": True,
                "continue_final_message": True,
            },
            "continue_final_message",
            "",
        ),
        ({"input": "hello", "documents": [{"t": "x"}] * 10_000}, "documents", ""),
    ],
)
def test_bad_requests_are_refused_before_a_rank(
    tmp_path: Path, body: dict[str, Any], param: str | None, message: str
) -> None:
    status, answer = _post(_state(tmp_path, POOLER), "/v1/embeddings", body)
    expected = 404 if param == "model" else 400
    assert status == expected, answer
    assert answer["error"]["param"] == param
    assert message in answer["error"]["message"]


def test_input_forms() -> None:
    def inputs(value: Any) -> Any:
        return parse_request(PoolingRequest, {"input": value}).prompt_inputs()

    assert inputs("a") == ["a"]
    assert inputs(["a", "b"]) == ["a", "b"]
    assert inputs([1, 2]) == [{"prompt_token_ids": [1, 2]}]
    assert inputs([[1], [2, 3]]) == [{"prompt_token_ids": [1]}, {"prompt_token_ids": [2, 3]}]


@pytest.mark.parametrize(
    ("fields", "dtype"),
    [
        ({}, "=f4"),
        ({"embed_dtype": "float16"}, "=f2"),
        ({"endianness": "big"}, ">f4"),
        ({"endianness": "little", "embed_dtype": "float16"}, "<f2"),
    ],
)
def test_base64_is_the_vector_bytes(fields: dict[str, Any], dtype: str) -> None:
    vector = np.array([0.5, -1.25, 3.0], dtype="<f4")
    body = parse_request(PoolingRequest, {"input": "a", "encoding_format": "base64", **fields})
    decoded = np.frombuffer(base64.b64decode(_encode(vector, body)), dtype=dtype)
    np.testing.assert_array_equal(decoded, vector)
    plain = parse_request(PoolingRequest, {"input": "a"})
    assert _encode(vector, plain) == [0.5, -1.25, 3.0]
