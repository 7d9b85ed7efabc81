"""Structured outputs: what constraining every request to a JSON schema costs (issue 21).

One engine (the embedded SmolLM2, in process), 32 requests at once, greedy, the same prompts
twice: each constrained to a JSON schema (eight shapes, strict objects), then unconstrained.
Each unconstrained request generates exactly as many tokens as its constrained answer had
(``ignore_eos``), so both batches shrink alike and only the grammar differs.
Per run: output tokens/s of each, their ratio (target: constrained >= 0.9x unconstrained), and
the engine's own accounting of a constrained step:

- **mask**: the time to fill the batch's grammar masks, which ``EngineCore.step`` does while
  the forward pass runs on the executor thread;
- **exposed**: how long the step still waited for the forward after the masks were done;
  when it is > 0 the mask's time was hidden behind the forward.

Grammar compile times (cache off: a fresh manager per schema) are reported as p50/p99 over all
schemas and runs.

    python benchmarks/structured.py --runs 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from corefleet.engine import LLM, SamplingParams
from corefleet.engine.engine_core.core import EngineCore
from corefleet.engine.messages import StructuredOutputsParams
from corefleet.engine.structured_output.manager import StructuredOutputManager

_STR = {"type": "string", "maxLength": 24}
_INT = {"type": "integer", "minimum": 0, "maximum": 999}


def _obj(props: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": props,
        "required": list(props),
        "additionalProperties": False,
    }


SCHEMAS: list[dict[str, Any]] = [
    _obj({"name": _STR, "age": _INT}),
    _obj({"tags": {"type": "array", "items": _STR, "minItems": 1, "maxItems": 4}}),
    _obj({"color": {"enum": ["red", "green", "blue"]}, "count": _INT}),
    _obj({"a": _obj({"b": _obj({"c": {"type": "boolean"}})})}),
    _obj({"id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}}),
    _obj({"v": {"anyOf": [_INT, _STR]}}),
    _obj({"points": {"type": "array", "items": _obj({"x": _INT, "y": _INT}), "maxItems": 4}}),
    _obj({"city": _STR, "country": _STR, "population": _INT}),
]
TOPICS = ["a person", "a city", "a book", "a product", "a planet", "a recipe", "a car", "a song"]


class _StepTimer:
    """Wraps ``EngineCore.step``'s two halves: the mask fill, and the wait for the forward."""

    def __init__(self, core: EngineCore) -> None:
        self.mask_s: list[float] = []
        self.exposed_s: list[float] = []
        inner = core._grammar_bitmask
        executor = core.executor
        execute = executor.execute_model
        timer = self

        def grammar_bitmask(so: Any) -> Any:
            started = time.perf_counter()
            result = inner(so)
            if result is not None:
                timer.mask_s.append(time.perf_counter() - started)
                timer._pending_since = time.perf_counter()
            return result

        def execute_model(so: Any, non_block: bool = False) -> Any:
            future = execute(so, non_block)
            result = future.result
            if so.structured_output_req_ids:

                def waited() -> Any:
                    value = result()
                    timer.exposed_s.append(time.perf_counter() - timer._pending_since)
                    return value

                future.result = waited  # type: ignore[method-assign]
            return future

        self._pending_since = 0.0
        core._grammar_bitmask = grammar_bitmask  # type: ignore[method-assign]
        executor.execute_model = execute_model  # type: ignore[method-assign]


def _params(max_tokens: int, schema: dict[str, Any] | None) -> SamplingParams:
    if schema is None:  # exactly max_tokens tokens: the constrained answer's length
        return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    constraint = StructuredOutputsParams(json=json.dumps(schema))
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, structured_outputs=constraint)


def _generate(
    llm: LLM, prompts: list[str], params: list[SamplingParams]
) -> tuple[float, list[int]]:
    """Output tokens/s, and each answer's length; every prompt is prefilled (no cache hit)."""
    assert llm.reset_prefix_cache()
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - started
    lengths = [len(o.outputs[0].token_ids) for o in outputs]
    return sum(lengths) / elapsed, lengths


def _compile_times(llm: LLM, core: EngineCore) -> list[float]:
    tokenizer_json = llm.get_tokenizer().backend.to_str()
    times = []
    for schema in SCHEMAS:
        manager = StructuredOutputManager(
            lambda: tokenizer_json, core.vocab_size, core.eos_token_id
        )
        manager.grammar_init(StructuredOutputsParams(regex="a")).result()  # loads the tokenizer
        started = time.perf_counter()
        manager.grammar_init(StructuredOutputsParams(json=json.dumps(schema))).result()
        times.append(time.perf_counter() - started)
        manager.shutdown()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()

    llm = LLM(multiprocess=False, kv_cache_memory=512 << 20)
    core: EngineCore = llm.engine_client.engine  # type: ignore[attr-defined]
    timer = _StepTimer(core)
    tokenizer = llm.get_tokenizer()
    schemas = [SCHEMAS[i % len(SCHEMAS)] for i in range(args.requests)]
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Describe {TOPICS[i % len(TOPICS)]} as JSON."}],
            add_generation_prompt=True,
        )
        for i in range(args.requests)
    ]
    constrained = [_params(args.max_tokens, s) for s in schemas]
    _generate(llm, prompts[:4], constrained[:4])  # warm-up

    ratios, compile_s = [], []
    for run in range(1, args.runs + 1):
        timer.mask_s.clear()
        timer.exposed_s.clear()
        with_schema, lengths = _generate(llm, prompts, constrained)
        # The same prompts, each generating exactly as many tokens as its constrained answer,
        # so both runs have the same batch at every step and only the grammar differs.
        free = [_params(n, None) for n in lengths]
        unconstrained, _ = _generate(llm, prompts, free)
        ratios.append(with_schema / unconstrained)
        compile_s += _compile_times(llm, core)
        mask_ms = statistics.median(timer.mask_s) * 1e3
        exposed_ms = statistics.median(timer.exposed_s) * 1e3
        print(
            f"run {run}: unconstrained {unconstrained:.1f} tok/s, constrained {with_schema:.1f} "
            f"tok/s, ratio {ratios[-1]:.2f}; per constrained step: mask {mask_ms:.2f} ms "
            f"(median), forward still running after it {exposed_ms:.2f} ms (median), "
            f"{sum(t > 0 for t in timer.exposed_s)}/{len(timer.exposed_s)} steps hid the mask"
        )
    compile_s.sort()
    p99 = compile_s[min(len(compile_s) - 1, int(0.99 * len(compile_s)))]
    print(
        f"median ratio {statistics.median(ratios):.2f} over {args.runs} runs; grammar compile "
        f"p50 {statistics.median(compile_s) * 1e3:.2f} ms, p99 {p99 * 1e3:.2f} ms "
        f"({len(compile_s)} compiles)"
    )
    llm.shutdown()


if __name__ == "__main__":
    main()
