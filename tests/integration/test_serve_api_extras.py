"""vLLM's answer-shaping fields and flags through ``corefleet serve`` on SmolLM2, with the
official client and raw HTTP: token ids in answers, tokens named by id, usage in every chunk,
any 64-bit seed, logprobs as vLLM writes them, and fields refused rather than dropped."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import openai
import pytest

from corefleet.engine.frontend.tokenizer import Tokenizer
from tests.serve_support import running_serve

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name a colour."}]
FLAGS = (
    *("--dtype", "float32", "--kv-cache-memory", str(256 << 20), "--max-model-len", "512"),
    *("--return-tokens-as-token-ids", "--enable-force-include-usage"),
    "--enable-prompt-tokens-details",
    *("--max-logprobs", "-1"),
)


@pytest.fixture(scope="module")
def base() -> Iterator[str]:
    with running_serve(*FLAGS) as url:
        yield url


@pytest.fixture(scope="module")
def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="x", timeout=120)


@pytest.fixture(scope="module")
def tokenizer(smollm2_path: str) -> Tokenizer:
    return Tokenizer.from_model_path(smollm2_path)


def _post(base: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{base}{path}", json=body, timeout=120)


def _events(base: str, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{base}{path}", json=body, timeout=120) as reply:
        assert reply.status_code == 200, reply.read()
        lines = [line for line in reply.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[6:]) for line in lines[:-1]]


def test_any_64_bit_seed_is_accepted_and_reproducible(client: openai.OpenAI, base: str) -> None:
    def sample(seed: int) -> str:
        reply = client.completions.create(
            model="SmolLM2-135M-Instruct", prompt=PROMPT, max_tokens=8, temperature=1.0, seed=seed
        )
        return reply.choices[0].text

    assert sample(-1) == sample(-1)
    assert sample(-(2**63)) == sample(-(2**63))
    refused = _post(base, "/v1/completions", {"prompt": PROMPT, "seed": 2**63})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "seed"


def test_completion_token_ids_and_logprobs(client: openai.OpenAI, tokenizer: Tokenizer) -> None:
    reply = client.completions.create(
        model="SmolLM2-135M-Instruct",
        prompt=PROMPT,
        max_tokens=8,
        temperature=0.0,
        logprobs=0,
        extra_body={"return_token_ids": True, "return_tokens_as_token_ids": False},
    )
    choice = reply.model_dump()["choices"][0]
    assert choice["prompt_token_ids"] == tokenizer.encode(PROMPT)
    assert tokenizer.decode(choice["token_ids"]).startswith(choice["text"])
    logprobs = choice["logprobs"]
    # logprobs: 0 still names the sampled token (vLLM), and offsets never decrease.
    assert [list(top) for top in logprobs["top_logprobs"]] == [[t] for t in logprobs["tokens"]]
    assert logprobs["text_offset"] == sorted(logprobs["text_offset"])
    assert "".join(logprobs["tokens"]) == choice["text"]


def test_the_server_flag_names_tokens_by_id(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=CHAT,  # type: ignore[arg-type]
        max_tokens=6,
        temperature=0.0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"return_token_ids": True},
    )
    data = reply.model_dump()
    choice = data["choices"][0]
    content = choice["logprobs"]["content"]
    assert [c["token"] for c in content] == [f"token_id:{t}" for t in choice["token_ids"]]
    assert all(t["token"].startswith("token_id:") for c in content for t in c["top_logprobs"])
    assert data["prompt_token_ids"] and data["usage"]["prompt_tokens"] == len(
        data["prompt_token_ids"]
    )


def test_streams_carry_token_ids_and_usage_in_every_chunk(base: str, tokenizer: Tokenizer) -> None:
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0.0, "stream": True}
    chunks = _events(base, "/v1/completions", body | {"return_token_ids": True})
    *content, final = chunks
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 8
    assert content[0]["choices"][0]["prompt_token_ids"] == tokenizer.encode(PROMPT)
    assert all("prompt_token_ids" not in c["choices"][0] for c in content[1:])
    ids = [t for c in content for t in c["choices"][0]["token_ids"]]
    assert len(ids) == 8
    # --enable-force-include-usage: every chunk carries its choice's usage so far.
    so_far = [c["usage"]["completion_tokens"] for c in content]
    assert so_far == sorted(so_far) and so_far[-1] == 8
    chat = _events(
        base, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 5, "stream": True}
    )
    assert chat[-1]["usage"]["completion_tokens"] == 5 and chat[-1]["choices"] == []
    assert all(c["usage"]["prompt_tokens"] == chat[-1]["usage"]["prompt_tokens"] for c in chat)


def test_prompt_embeds_are_refused_not_dropped(base: str) -> None:
    reply = _post(base, "/v1/completions", {"prompt": PROMPT, "prompt_embeds": "AAAA"})
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == "prompt_embeds"


def test_truncate_prompt_tokens_keeps_the_last_tokens(base: str, tokenizer: Tokenizer) -> None:
    long = "one two three four five six seven eight nine ten " * 10
    ids = tokenizer.encode(long)
    body = {"prompt": long, "max_tokens": 1, "return_token_ids": True}
    left = _post(base, "/v1/completions", body | {"truncate_prompt_tokens": 7}).json()
    assert left["choices"][0]["prompt_token_ids"] == ids[-7:]
    assert left["usage"]["prompt_tokens"] == 7
    right = _post(
        base, "/v1/completions", body | {"truncate_prompt_tokens": 7, "truncation_side": "right"}
    ).json()
    assert right["choices"][0]["prompt_token_ids"] == ids[:7]
    # Longer than the context: refused as it is, kept to the context's size with -1.
    huge = {"prompt": long * 10, "max_tokens": 1}
    refused = _post(base, "/v1/completions", huge)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt"
    kept = _post(base, "/v1/completions", huge | {"truncate_prompt_tokens": -1}).json()
    assert kept["usage"]["prompt_tokens"] == 511
    chat = {"messages": [{"role": "user", "content": long}], "max_tokens": 1}
    cut = _post(base, "/v1/chat/completions", chat | {"truncate_prompt_tokens": 9}).json()
    assert cut["usage"]["prompt_tokens"] == 9
    for bad in (0, -2, 512, 2**70):
        reply = _post(base, "/v1/completions", body | {"truncate_prompt_tokens": bad})
        assert reply.status_code == 400
        assert reply.json()["error"]["param"] == "truncate_prompt_tokens"


def test_cache_salt_separates_cached_prefixes(base: str) -> None:
    prompt = "Salted prefixes are cached apart. " * 20

    def cached(salt: str | None) -> int:
        body = {"prompt": prompt, "max_tokens": 1} | ({"cache_salt": salt} if salt else {})
        usage = _post(base, "/v1/completions", body).json()["usage"]
        # As vLLM: the details are left out when nothing was cached.
        return (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)

    cached("tenant-a")
    assert cached("tenant-a") > 0  # the same salt shares the blocks
    assert cached("tenant-b") == 0  # another salt does not
    assert cached(None) == 0  # nor does no salt
    for bad in ("", "x" * 1025):
        reply = _post(base, "/v1/completions", {"prompt": prompt, "cache_salt": bad})
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "cache_salt"


def test_priority_needs_priority_scheduling(base: str) -> None:
    ok = _post(base, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1, "priority": 0})
    assert ok.status_code == 200
    refused = _post(base, "/v1/completions", {"prompt": PROMPT, "priority": -3})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "priority"
    assert "--scheduling-policy priority" in refused.json()["error"]["message"]


def test_return_prompt_text_is_the_rendered_prompt(base: str, tokenizer: Tokenizer) -> None:
    body = {"messages": CHAT, "max_tokens": 2, "return_prompt_text": True, "return_token_ids": True}
    whole = _post(base, "/v1/chat/completions", body).json()
    assert (
        tokenizer.encode(whole["prompt_text"], add_special_tokens=False)
        == (whole["prompt_token_ids"])
    )
    assert whole["prompt_text"].rstrip().endswith("assistant")
    chunks = _events(base, "/v1/chat/completions", body | {"stream": True})
    assert chunks[0]["prompt_text"] == whole["prompt_text"]
    assert all("prompt_text" not in c for c in chunks[1:])


def test_top_logprobs_minus_one_is_the_whole_vocabulary(base: str, tokenizer: Tokenizer) -> None:
    body = {"messages": CHAT, "max_tokens": 2, "logprobs": True, "top_logprobs": -1}
    whole = _post(base, "/v1/chat/completions", body | {"return_tokens_as_token_ids": True})
    content = whole.json()["choices"][0]["logprobs"]["content"]
    vocab = {f"token_id:{i}" for i in range(tokenizer.vocab_size)}
    assert all({t["token"] for t in c["top_logprobs"]} == vocab for c in content)
    ranked = [t["logprob"] for t in content[0]["top_logprobs"]]
    assert ranked == sorted(ranked, reverse=True)
    reply = _post(base, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1, "logprobs": -1})
    assert len(reply.json()["choices"][0]["logprobs"]["top_logprobs"][0]) > 1000
    for field, value in (("top_logprobs", -2), ("top_logprobs", 10**6)):
        refused = _post(base, "/v1/chat/completions", body | {field: value})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == field
