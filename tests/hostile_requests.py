"""Requests a hostile client sends: one or more absurd values of every field it controls.

Each entry is ``(path, body, status, param)``: the answer the server must give (a 4xx naming
the field) under the limits of ``tests/integration/test_hostile_clients.py``, whose body limit
is :data:`BODY_LIMIT`. ``benchmarks/absurd_requests.py`` times the same requests.
"""

from __future__ import annotations

from typing import Any

BODY_LIMIT = 1 << 20
HUGE = 2**70

C, CHAT = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]
ABSURD: list[tuple[str, Any, int, str | None]] = [
    (C, {"prompt": "Hi", "max_tokens": 4, "n": 2**31}, 400, "n"),
    (C, {"prompt": "Hi", "n": HUGE}, 400, "n"),
    (C, {"prompt": "Hi", "n": 2**31, "best_of": 2**31}, 400, "n"),
    (C, {"prompt": "Hi", "best_of": 2**31}, 400, "best_of"),
    (C, {"prompt": "Hi", "logprobs": 10**9}, 400, "logprobs"),
    (CHAT, {"messages": MSG, "logprobs": True, "top_logprobs": 10**9}, 400, "top_logprobs"),
    (C, {"prompt": "Hi", "stop": ["x"] * 100_000}, 400, "stop"),
    (C, {"prompt": "Hi", "stop": "x" * 500_000}, 400, "stop"),
    (C, {"prompt": "Hi", "stop_token_ids": [1] * 100_000}, 400, "stop_token_ids"),
    (C, {"prompt": "Hi", "stop_token_ids": [HUGE]}, 400, "stop_token_ids"),
    (C, {"prompt": list(range(1, 100_001))}, 400, "prompt"),
    (C, {"prompt": ["Hi"] * 10_000}, 400, "prompt"),
    (C, {"prompt": [[1, 2]] * 10_000}, 400, "prompt"),
    (C, {"prompt": "word " * 150_000}, 400, "prompt"),
    (C, {"prompt": [HUGE]}, 400, "prompt"),
    (C, {"prompt": "Hi", "seed": 2**64}, 400, "seed"),
    (C, {"prompt": "Hi", "seed": -(2**63) - 1}, 400, "seed"),
    (C, {"prompt": "Hi", "max_tokens": HUGE}, 400, "max_tokens"),
    (C, {"prompt": "Hi", "max_tokens": 2**40}, 400, "max_tokens"),
    (C, {"prompt": "Hi", "max_tokens": None, "min_tokens": HUGE}, 400, "min_tokens"),
    (C, {"prompt": "Hi", "top_k": HUGE}, 400, "top_k"),
    (C, {"prompt": "Hi", "temperature": 1e308 * 10}, 400, "temperature"),
    (C, {"prompt": "Hi", "model": "m" * 500_000}, 404, "model"),
    (C, {"prompt": "Hi", "logit_bias": {str(i): 1.0 for i in range(20_000)}}, 400, "logit_bias"),
    (C, {"prompt": "Hi", "logit_bias": {str(HUGE): 1.0}}, 400, "logit_bias"),
    (C, {"prompt": "Hi", "allowed_token_ids": [1] * 300_000}, 400, "allowed_token_ids"),
    (CHAT, {"messages": MSG, "allowed_token_ids": [HUGE]}, 400, "allowed_token_ids"),
    (C, {"prompt": "Hi", "bad_words": ["x"] * 100_000}, 400, "bad_words"),
    (C, {"prompt": "Hi", "logprobs": 1, "logprob_token_ids": [1] * 9999}, 400, "logprob_token_ids"),
    (CHAT, {"messages": MSG * 5000}, 400, "messages"),
    (CHAT, {"messages": [{"role": "user", "content": "word " * 150_000}]}, 400, "messages"),
    (CHAT, {"messages": MSG, "tools": [{"type": "function"}] * 10_000}, 400, "tools"),
    (CHAT, {"messages": MSG, "n": 2**31}, 400, "n"),
    (CHAT, {"messages": MSG, "max_completion_tokens": HUGE}, 400, "max_completion_tokens"),
    (C, {"prompt": "x" * (2 * BODY_LIMIT)}, 413, None),
    (CHAT, {"messages": [{"role": "user", "content": "x" * (2 * BODY_LIMIT)}]}, 413, None),
    # vLLM's tokenizer routes (utility_api.py).
    ("/tokenize", {"prompt": "x" * (2 * BODY_LIMIT)}, 413, None),
    ("/tokenize", {"messages": MSG * 5000}, 400, "messages"),
    ("/tokenize", {"prompt": "Hi", "model": "m" * 500_000}, 404, "model"),
    ("/detokenize", {"tokens": [HUGE]}, 400, "tokens"),
    ("/detokenize", {"tokens": [10**9]}, 400, "tokens"),
    ("/detokenize", {"tokens": [1] * 1_000_000}, 413, None),
]
