"""Where one single-stream decode step's time goes, on an in-process engine.

One request decodes ``--tokens`` tokens (random prompt, greedy, ``ignore_eos``) under
``torch.profiler``. The engine's own methods are wrapped in named scopes from here (the step,
batch preparation, the forward pass, the LM head, the sampler), and every kernel call is a torch
op the profiler times (``corefleet_cpu::gguf_linear`` and its peers), so a step splits into:

- each projection's quantized linear (identified by its weight's shape), with the weight bytes
  it streams and the rate it reached;
- attention (rotary + cache write, paged attention), norms, SiLU, the embedding lookup, and any
  other torch op in the forward pass;
- Python between the kernels of the forward pass (the forward scope minus its ops);
- the LM head, sampling (the sampler), the rest of sampling's Python;
- batch preparation and what remains of the step: the scheduler, output processing, Python.

The prefill step is left out; the figures are means over the decode steps, in ms. The profiler
adds a few microseconds per op: the same decode is also timed without it, for comparison.

    python benchmarks/step_breakdown.py --shape 1b --format Q4_0
    python benchmarks/step_breakdown.py --model path/to/model.gguf
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import torch
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, os.path.dirname(__file__))
import gguf_shapes

from corefleet.engine import LLM, SamplingParams
from corefleet.engine.models.quant_layers import QuantLinear

# Scopes (record_function names) this script wraps around the runner's methods, which run on
# the executor's thread (the step itself runs on the caller's and is timed apart).
EXECUTE, PREPARE, FORWARD, SAMPLE, LM_HEAD, SAMPLER = (
    "execute_model",
    "prepare_step",
    "forward",
    "sample",
    "lm_head",
    "sampler",
)
SCOPES = (EXECUTE, PREPARE, FORWARD, SAMPLE, LM_HEAD, SAMPLER)
# Kernel ops by what they do (the rest are listed under their own names).
OP_KINDS = {
    "corefleet_cpu::paged_attention": "attention",
    "corefleet_cpu::rotary_to_cache": "attention",
    "corefleet_cpu::write_kv_cache_": "attention",
    "corefleet_cpu::rotary_": "attention",
    "corefleet_cpu::rms_norm": "norms",
    "corefleet_cpu::silu_and_mul": "SiLU and multiply",
    "corefleet_cpu::quant_embedding": "embedding lookup",
    "corefleet_cpu::gguf_embedding": "embedding lookup",
}
LINEAR_OPS = ("corefleet_cpu::gguf_linear", "corefleet_cpu::small_linear", "aten::linear")


def scoped(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with record_function(name):
            return fn(*args, **kwargs)

    return wrapper


def timed_steps(times: list[float], step: Callable[[], Any]) -> Callable[[], Any]:
    """``EngineCore.step``, recording the µs of each step that ran the model."""

    def wrapper() -> Any:
        started = time.perf_counter()
        outputs, model_ran = step()
        if model_ran:
            times.append((time.perf_counter() - started) * 1e6)
        return outputs, model_ran

    return wrapper


@contextlib.contextmanager
def instrumented(llm: LLM, step_times: list[float]) -> Iterator[Any]:
    """Profile the executor's thread (where the runner works: the profiler sees only the
    thread that starts it) with the runner's phases and the LM head in named scopes, and time
    each engine step (µs, into ``step_times``) on this thread. The wrappers are instance
    attributes shadowing the methods, removed on exit."""
    engine = llm.engine_client.engine  # type: ignore[attr-defined]
    runner = engine.executor.runner
    targets = [
        (runner, "execute_model", EXECUTE),
        (runner, "prepare_step", PREPARE),
        (runner, "_forward", FORWARD),
        (runner, "_sample", SAMPLE),
        (runner.model, "compute_logits", LM_HEAD),
        (runner, "sampler", SAMPLER),
    ]
    for obj, attr, name in targets:
        obj.__dict__[attr] = scoped(name, getattr(obj, attr))
    engine.__dict__["step"] = timed_steps(step_times, engine.step)
    prof = profile(activities=[ProfilerActivity.CPU], record_shapes=True)
    pool = engine.executor._pool  # the executor's one thread
    pool.submit(prof.start).result()
    try:
        yield prof
    finally:
        pool.submit(prof.stop).result()
        del engine.__dict__["step"]
        for obj, attr, _ in targets:
            del obj.__dict__[attr]


def linear_names(model: torch.nn.Module) -> dict[tuple[int, int], tuple[str, int]]:
    """(rows, in_features) of each quantized weight buffer -> (projection, bytes per layer):
    how a ``gguf_linear`` call's shapes name the projection it computes."""
    names: dict[tuple[int, int], tuple[str, int]] = {}
    for module_name, module in model.named_modules():
        if not isinstance(module, QuantLinear):
            continue
        projection = module_name.rsplit(".", 1)[-1]
        for buffer in module.buffers():
            key = (int(buffer.shape[0]), module.in_features)
            names.setdefault(key, (projection, buffer.numel()))
    return names


def op_category(event: Any, names: dict[tuple[int, int], tuple[str, int]]) -> tuple[str, int]:
    """(category, weight bytes read) of one top-level op."""
    if event.name in LINEAR_OPS and len(event.input_shapes) >= 2:
        x, weight = event.input_shapes[0], event.input_shapes[1]
        if len(x) == 2 and len(weight) == 2:
            projection, nbytes = names.get((weight[0], x[1]), (f"linear {weight}", 0))
            return f"linear: {projection}", nbytes
    return OP_KINDS.get(event.name, f"other op: {event.name}"), 0


def scope_of(event: Any) -> Any:
    parent = event.cpu_parent
    while parent is not None and parent.name not in SCOPES:
        parent = parent.cpu_parent
    return parent


def is_top_op(event: Any) -> bool:
    """An op called from Python (its parents are scopes only), not from inside another op."""
    parent = event.cpu_parent
    while parent is not None:
        if parent.name not in SCOPES:
            return False
        parent = parent.cpu_parent
    return event.name not in SCOPES


def breakdown(
    events: Any, step_times: list[float], model: torch.nn.Module
) -> tuple[dict[str, float], dict[str, int], int]:
    """Total µs per category over the decode steps, weight bytes per category, and the number
    of decode steps."""
    names = linear_names(model)
    executes = sorted((e for e in events if e.name == EXECUTE), key=lambda e: e.time_range.start)
    decode = executes[1:]  # the first step is the prompt's prefill
    decode_steps = step_times[1 : 1 + len(decode)]
    if not decode or len(decode_steps) != len(decode):
        raise RuntimeError(f"{len(executes)} executed steps profiled, {len(step_times)} timed")
    window = (decode[0].time_range.start, decode[-1].time_range.end)
    inside = [e for e in events if window[0] <= e.time_range.start <= window[1]]
    totals: dict[str, float] = defaultdict(float)
    weight_bytes: dict[str, int] = defaultdict(int)
    scope_time: dict[str, float] = defaultdict(float)
    op_time_in: dict[str, float] = defaultdict(float)  # ops and sub-scopes inside each scope
    for e in inside:
        if e.name in SCOPES:
            scope_time[e.name] += e.cpu_time_total
            parent = scope_of(e)
            if parent is not None:
                op_time_in[parent.name] += e.cpu_time_total
        elif is_top_op(e):
            parent = scope_of(e)
            where = parent.name if parent is not None else "outside"
            op_time_in[where] += e.cpu_time_total
            category, nbytes = op_category(e, names)
            if where == LM_HEAD:
                category = "LM head"
            elif where == SAMPLER:
                category = "sampling (sampler ops)"
            elif where != FORWARD:
                category = f"{category} (in {where})"
            totals[category] += e.cpu_time_total
            weight_bytes[category] += nbytes
    totals["Python between kernels in the forward"] = scope_time[FORWARD] - op_time_in[FORWARD]
    totals["sampling (sampler Python)"] = scope_time[SAMPLER] - op_time_in[SAMPLER]
    totals["LM head (Python)"] = scope_time[LM_HEAD] - op_time_in[LM_HEAD]
    totals["sampling bookkeeping (rest of _sample)"] = scope_time[SAMPLE] - op_time_in[SAMPLE]
    totals["batch preparation (prepare_step)"] = scope_time[PREPARE] - op_time_in[PREPARE]
    totals["runner, rest of execute_model"] = scope_time[EXECUTE] - op_time_in[EXECUTE]
    totals["scheduler, outputs, Python (engine step less execute_model)"] = (
        sum(decode_steps) - scope_time[EXECUTE]
    )
    totals["whole step"] = sum(decode_steps)
    return dict(totals), dict(weight_bytes), len(decode)


def table(totals: dict[str, float], weight_bytes: dict[str, int], steps: int) -> str:
    """Markdown, ms per decode step; ops under 1 % of the step are summed in one row."""
    step_us = totals["whole step"]
    small = {k: v for k, v in totals.items() if k.startswith("other op") and v < 0.01 * step_us}
    shown = {k: v for k, v in totals.items() if k not in small and k != "whole step"}
    if small:
        shown[f"other ops ({len(small)} kinds, each under 1 %)"] = sum(small.values())
    lines = [
        "| part of a decode step | ms | share | weights read a step | GB/s |",
        "|---|---|---|---|---|",
    ]
    for key in [*sorted(shown, key=lambda k: -shown[k]), "whole step"]:
        us = totals[key] if key == "whole step" else shown[key]
        nbytes = weight_bytes.get(key, 0)
        mib = f"{nbytes / steps / 2**20:.0f} MiB" if nbytes else ""
        rate = f"{nbytes / us / 1000:.1f}" if nbytes and us else ""
        lines.append(
            f"| {key} | {us / steps / 1000:.2f} | {100 * us / step_us:.1f} % | {mib} | {rate} |"
        )
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shape", choices=sorted(gguf_shapes.SHAPES), default="1b")
    p.add_argument("--format", choices=sorted(gguf_shapes.LAYOUTS), default="Q4_0")
    p.add_argument("--model", type=Path, help="a GGUF file instead of a shape")
    p.add_argument("--cache-dir", type=Path, default=gguf_shapes.DEFAULT_CACHE)
    p.add_argument("--tokens", type=int, default=64, help="decode steps profiled (64)")
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens (64)")
    p.add_argument("--timed-runs", type=int, default=3, help="unprofiled runs timed (3)")
    p.add_argument(
        "--engine-args",
        default="kv_cache_dtype=bfloat16",
        help="engine arguments, comma-separated k=v (default: kv_cache_dtype=bfloat16, as the "
        "peer benchmark's corefleet serve)",
    )
    args = p.parse_args()
    model = args.model or gguf_shapes.ensure_model(args.shape, args.format, args.cache_dir)
    engine_args: dict[str, Any] = dict(kv.split("=", 1) for kv in args.engine_args.split(",") if kv)
    engine_args.setdefault("max_model_len", 1024)
    engine_args.setdefault("num_gpu_blocks_override", 129)
    llm = LLM(str(model), multiprocess=False, **engine_args)
    runner = llm.engine_client.engine.executor.runner  # type: ignore[attr-defined]
    rng = random.Random(0)

    def generate() -> float:
        prompt = [rng.randrange(100, 49000) for _ in range(args.prompt)]
        params = SamplingParams(max_tokens=args.tokens + 1, temperature=0.0, ignore_eos=True)
        started = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        return time.perf_counter() - started

    try:
        generate()  # warm-up
        machine_before, own_before = sum(psutil.cpu_times()[:3]), time.process_time()
        walls = [generate() for _ in range(args.timed_runs)]
        busy = sum(psutil.cpu_times()[:3]) - machine_before - (time.process_time() - own_before)
        other_cores = busy / sum(walls)
        step_times: list[float] = []
        with instrumented(llm, step_times) as prof:
            generate()
        totals, weight_bytes, steps = breakdown(prof.events(), step_times, runner.model)
    finally:
        llm.shutdown()
    print(f"model {model}; {torch.get_num_threads()} torch threads; engine args {engine_args}")
    print(f"other processes' CPU during the timed runs: {other_cores:.2f} cores")
    print(
        f"{steps} decode steps profiled: {totals['whole step'] / steps / 1000:.2f} ms a step; "
        f"unprofiled, whole generate of {args.tokens + 1} tokens (prefill included): "
        f"{statistics.median(walls) * 1000 / (args.tokens + 1):.2f} ms a token "
        f"(median of {len(walls)}: {', '.join(f'{w:.2f}' for w in walls)} s)\n"
    )
    print(table(totals, weight_bytes, steps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
