"""``corefleet serve --runner pooling`` on the embedded SmolLM2: ``/v1/embeddings`` through the
official client (float and base64) and ``/pooling`` over raw HTTP give transformers' vectors
(the final hidden state of the last token, L2-normalised), for a batch, a chat and an input
longer than the token budget (chunked prefill); bad and absurd requests get a 400."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import torch

from corefleet.engine.frontend.tokenizer import Tokenizer
from corefleet.engine.models.loader import resolve_model_path
from tests.serve_support import running_serve

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
BUDGET = 64  # --max-num-batched-tokens: LONG takes several steps
FLAGS = (
    *("--runner", "pooling", "--dtype", "float32", "--kv-cache-memory", str(256 << 20)),
    # The GGUF's weights dequantized at load, as transformers dequantizes them.
    *("--quantization", "none"),
    *("--max-num-batched-tokens", str(BUDGET)),
)
TEXTS = ["The capital of France is Paris.", "def add(a, b): return a + b", "Bonjour"]
LONG = " ".join(f"Sentence number {i} talks about the weather in a quiet town." for i in range(30))
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def base() -> Iterator[str]:
    with running_serve(*FLAGS) as url:
        yield url


@pytest.fixture(scope="module")
def reference(hf_smollm2: Any) -> Any:
    """transformers' embedding of token ids (its model built from the same GGUF file, float32):
    the base model's last hidden state (after the final norm) at the last token,
    L2-normalised."""

    def embed(ids: list[int]) -> np.ndarray:
        with torch.no_grad():
            hidden = hf_smollm2.model(torch.tensor([ids])).last_hidden_state[0, -1]
        return torch.nn.functional.normalize(hidden, dim=-1).numpy()

    return embed


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_model_path(resolve_model_path(None))


def _close(got: Any, want: np.ndarray) -> None:
    got = np.asarray(got, dtype=np.float32)
    assert got.shape == want.shape == (576,)
    cosine = float(got @ want / (np.linalg.norm(got) * np.linalg.norm(want)))
    assert cosine > 0.9999
    np.testing.assert_allclose(got, want, atol=1e-4)


def test_embeddings_through_the_official_client(base, reference, tokenizer) -> None:  # type: ignore[no-untyped-def]
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", timeout=120, max_retries=0)
    inputs = [*TEXTS, LONG]
    ids = [tokenizer.encode(t) for t in inputs]
    assert len(ids[-1]) > 3 * BUDGET  # computed over several steps
    floats = client.embeddings.create(model=MODEL, input=inputs, encoding_format="float")
    assert floats.object == "list" and floats.model == MODEL and floats.id.startswith("embd-")
    assert [d.index for d in floats.data] == [0, 1, 2, 3]
    assert all(d.object == "embedding" for d in floats.data)
    for item, prompt in zip(floats.data, ids, strict=True):
        _close(item.embedding, reference(prompt))
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == sum(map(len, ids))
    # Without encoding_format the client asks for base64 and decodes it itself.
    decoded = client.embeddings.create(model=MODEL, input=TEXTS[0])
    _close(decoded.data[0].embedding, reference(ids[0]))
    raw = client.embeddings.create(model=MODEL, input=[ids[1]], encoding_format="base64")
    vector = np.frombuffer(base64.b64decode(raw.data[0].embedding), dtype=np.float32)  # type: ignore[arg-type]
    _close(vector, reference(ids[1]))


def test_pooling_and_the_chat_form_over_http(base, reference, tokenizer) -> None:  # type: ignore[no-untyped-def]
    answer = httpx.post(f"{base}/pooling", json={"input": TEXTS[:2]}, timeout=120)
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["object"] == "list" and body["id"].startswith("pool-")
    assert [d["object"] for d in body["data"]] == ["pooling", "pooling"]
    for item, text in zip(body["data"], TEXTS[:2], strict=True):
        _close(item["data"], reference(tokenizer.encode(text)))
    assert body["usage"]["completion_tokens"] == 0

    chat = httpx.post(f"{base}/v1/embeddings", json={"messages": CHAT}, timeout=120).json()
    rendered = tokenizer.apply_chat_template(CHAT, add_generation_prompt=False)
    expected_ids = tokenizer.encode(rendered, add_special_tokens=False)
    _close(chat["data"][0]["embedding"], reference(expected_ids))
    assert chat["usage"]["prompt_tokens"] == len(expected_ids)

    # truncate_prompt_tokens keeps the last tokens, as vLLM's.
    cut = httpx.post(
        f"{base}/v1/embeddings", json={"input": LONG, "truncate_prompt_tokens": 10}, timeout=120
    ).json()
    _close(cut["data"][0]["embedding"], reference(tokenizer.encode(LONG)[-10:]))


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/v1/embeddings", {"input": ["x"] * 100_000}, 400, "input"),
        ("/v1/embeddings", {"input": "hi", "dimensions": 64}, 400, "dimensions"),
        ("/v1/embeddings", {"input": [1, 10**9]}, 400, "input"),
        ("/v1/embeddings", {"input": "word " * 200_000}, 400, "input"),
        ("/pooling", {"input": ""}, 400, "input"),
        ("/v1/completions", {"prompt": "hi"}, 404, None),
        ("/v1/chat/completions", {"messages": CHAT}, 404, None),
    ],
)
def test_refusals(base: str, path: str, body: dict[str, Any], status: int, param: str) -> None:
    answer = httpx.post(f"{base}{path}", json=body, timeout=120)
    assert answer.status_code == status, answer.text
    assert answer.json()["error"]["param"] == param
    # The server keeps serving.
    assert httpx.post(f"{base}/pooling", json={"input": "ok"}, timeout=120).status_code == 200


def test_openapi_describes_the_pooling_routes(base: str) -> None:
    document = httpx.get(f"{base}/openapi.json", timeout=60).json()
    paths, schemas = document["paths"], document["components"]["schemas"]
    assert "/v1/embeddings" in paths and "/pooling" in paths
    assert "/v1/completions" not in paths and "/v1/chat/completions" not in paths
    body = paths["/v1/embeddings"]["post"]["requestBody"]["content"]["application/json"]
    assert body["schema"]["$ref"] == "#/components/schemas/PoolingRequest"
    fields = schemas["PoolingRequest"]["properties"]
    assert {"input", "messages", "encoding_format", "dimensions"} <= set(fields)
    ok = paths["/pooling"]["post"]["responses"]["200"]["content"]["application/json"]
    assert ok["schema"]["$ref"] == "#/components/schemas/PoolingResponse"
    assert {"EmbeddingResponse", "PoolingData", "ChatMessage"} <= set(schemas)


def _metric(base: str, name: str, **labels: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{base}/metrics", timeout=30).text
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name and labels.items() <= s.labels.items()
    )


def test_pooling_requests_count_in_vllms_request_metrics(base: str) -> None:
    """As vLLM: a pooling request counts as a finished request with its prompt and no
    generated token."""
    names = (
        ("vllm:request_success_total", {"finished_reason": "stop"}),
        ("vllm:prompt_tokens_total", {}),
        ("vllm:generation_tokens_total", {}),
        ("vllm:request_prompt_tokens_count", {}),
        ("vllm:request_prefill_time_seconds_count", {}),
        ("vllm:request_params_n_count", {}),
    )
    before = [_metric(base, name, **labels) for name, labels in names]
    reply = httpx.post(f"{base}/v1/embeddings", json={"input": TEXTS[:2]}, timeout=120)
    assert reply.status_code == 200
    prompt_tokens = reply.json()["usage"]["prompt_tokens"]
    after = [_metric(base, name, **labels) for name, labels in names]
    assert [a - b for a, b in zip(after, before, strict=True)] == [2, prompt_tokens, 0, 2, 2, 0]
