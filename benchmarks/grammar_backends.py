"""The grammar backend for structured outputs, chosen by measurement (issue 21, item 1).

For each candidate, on SmolLM2's own tokenizer (the embedded GGUF's), with the JSON schemas of
eight shapes (flat, arrays with bounds, enums, nesting, a pattern, ``anyOf``, an array of
objects, a format): the tokenizer set-up, the compile time of each schema (cache off), and the
time to fill one request's token bitmask at every step of a valid answer. Whitespace is
flexible in both, so the same answers are valid for both.

Neither backend is a dependency of the project yet; install both to run this:

    pip install llguidance==1.9.1 xgrammar==0.2.9
    python benchmarks/grammar_backends.py --runs 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from corefleet.engine.frontend.tokenizer import Tokenizer
from corefleet.engine.models.default_model import default_model_path

# (schema, an answer it accepts)
CASES: list[tuple[dict[str, Any], str]] = [
    (
        {
            "type": "object",
            "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
            "required": ["name", "age"],
        },
        '{"name": "Ann", "age": 31}',
    ),
    (
        {
            "type": "object",
            "properties": {
                "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 4}
            },
            "required": ["tags"],
        },
        '{"tags": ["a", "bb"]}',
    ),
    (
        {
            "type": "object",
            "properties": {"color": {"enum": ["red", "green", "blue"]}, "n": {"type": "number"}},
            "required": ["color"],
        },
        '{"color": "red", "n": 1.5}',
    ),
    (
        {
            "type": "object",
            "properties": {
                "a": {
                    "type": "object",
                    "properties": {
                        "b": {
                            "type": "object",
                            "properties": {"c": {"type": "boolean"}},
                            "required": ["c"],
                        }
                    },
                    "required": ["b"],
                }
            },
            "required": ["a"],
        },
        '{"a": {"b": {"c": true}}}',
    ),
    (
        {
            "type": "object",
            "properties": {"id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}},
            "required": ["id"],
        },
        '{"id": "ABC-1234"}',
    ),
    (
        {
            "type": "object",
            "properties": {"v": {"anyOf": [{"type": "integer"}, {"type": "string"}]}},
            "required": ["v"],
        },
        '{"v": 7}',
    ),
    (
        {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
                "required": ["x", "y"],
            },
            "maxItems": 8,
        },
        '[{"x": 1, "y": 2}, {"x": 3, "y": 4}]',
    ),
    (
        {
            "type": "object",
            "properties": {"email": {"type": "string", "format": "email"}},
            "required": ["email"],
        },
        '{"email": "a@b.co"}',
    ),
]


@dataclass
class Timings:
    setup_s: float
    compile_s: list[float]
    mask_s: list[float]  # one per token of every answer


def _hf_tokenizer(tokenizer: Tokenizer) -> Any:
    """The same tokenizer as transformers' fast tokenizer: what both backends read."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend, eos_token="<|im_end|>")


def llguidance_timings(tokenizer: Tokenizer) -> Timings:
    import llguidance
    import llguidance.hf
    import llguidance.numpy

    started = time.perf_counter()
    ll_tokenizer = llguidance.hf.from_tokenizer(_hf_tokenizer(tokenizer))
    timings = Timings(time.perf_counter() - started, [], [])
    for schema, answer in CASES:
        started = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            json.dumps(schema), defaults={"whitespace_flexible": True}
        )
        matcher = llguidance.LLMatcher(ll_tokenizer, grammar)
        timings.compile_s.append(time.perf_counter() - started)
        assert not matcher.is_error(), matcher.get_error()
        bitmask = llguidance.numpy.allocate_token_bitmask(1, ll_tokenizer.vocab_size)
        for token in tokenizer.encode(answer, add_special_tokens=False):
            started = time.perf_counter()
            llguidance.numpy.fill_next_token_bitmask(matcher, bitmask, 0)
            timings.mask_s.append(time.perf_counter() - started)
            assert matcher.consume_token(token), matcher.get_error()
    return timings


def xgrammar_timings(tokenizer: Tokenizer) -> Timings:
    import xgrammar

    started = time.perf_counter()
    vocab_size = tokenizer.backend.get_vocab_size(with_added_tokens=True)
    info = xgrammar.TokenizerInfo.from_huggingface(_hf_tokenizer(tokenizer), vocab_size=vocab_size)
    compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    timings = Timings(time.perf_counter() - started, [], [])
    for schema, answer in CASES:
        started = time.perf_counter()
        compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=True)
        matcher = xgrammar.GrammarMatcher(compiled)
        timings.compile_s.append(time.perf_counter() - started)
        bitmask = xgrammar.allocate_token_bitmask(1, info.vocab_size)
        for token in tokenizer.encode(answer, add_special_tokens=False):
            started = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask, 0)
            timings.mask_s.append(time.perf_counter() - started)
            assert matcher.accept_token(token), answer
    return timings


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[round(q * (len(ordered) - 1))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="each backend, alternating")
    args = parser.parse_args()
    tokenizer = Tokenizer.from_model_path(default_model_path())
    backends: dict[str, Callable[[Tokenizer], Timings]] = {
        "llguidance": llguidance_timings,
        "xgrammar": xgrammar_timings,
    }
    print("| run | backend | tokenizer set-up | compile p50 / max | bitmask p50 / p99 |")
    print("|---|---|---|---|---|")
    for run in range(1, args.runs + 1):
        for name, measure in backends.items():
            t = measure(tokenizer)
            compile_ms = statistics.median(t.compile_s) * 1e3, max(t.compile_s) * 1e3
            mask_us = _quantile(t.mask_s, 0.5) * 1e6, _quantile(t.mask_s, 0.99) * 1e6
            print(
                f"| {run} | {name} | {t.setup_s * 1e3:.0f} ms "
                f"| {compile_ms[0]:.1f} / {compile_ms[1]:.1f} ms "
                f"| {mask_us[0]:.0f} / {mask_us[1]:.0f} µs ({len(t.mask_s)} tokens) |",
                flush=True,
            )


if __name__ == "__main__":
    main()
