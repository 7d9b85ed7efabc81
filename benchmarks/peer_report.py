"""Markdown tables of ``peer_llamacpp.py``'s figures: one per model, and a summary of all.

Every cell is the median over the runs (the runs in brackets); every ratio is corefleet /
llama-server, the median of the per-run ratios, so a machine that drifts between runs moves
both sides of a ratio together.
"""

from __future__ import annotations

import statistics

from peer_load import Figures, LoadPlan

Run = dict[str, Figures]  # server name -> its figures in one run

# (key, label, format); ratios are corefleet / llama-server
ROWS: list[tuple[str, str, str]] = [
    ("single_tok_s", "single-stream decode tok/s ({single} tokens)", "{:.1f}"),
    ("single_ttft", "single-stream TTFT ms ({input_len}-token prompt)", "{:.0f}"),
]
PREFILL_ROWS = [
    ("prefill_ttft", "TTFT ms, {ttft}-token prompt alone", "{:.0f}"),
    ("prefill_tok_s", "prefill tok/s ({ttft} tokens / TTFT)", "{:.0f}"),
]
STREAM_ROWS = [
    ("tok_s", "{n} streams: output tok/s", "{:.1f}"),
    ("ttft_p50", "{n} streams: TTFT p50 ms", "{:.0f}"),
    ("ttft_p99", "{n} streams: TTFT p99 ms", "{:.0f}"),
    ("itl_p50", "{n} streams: ITL p50 ms", "{:.1f}"),
    ("itl_p99", "{n} streams: ITL p99 ms", "{:.1f}"),
]
TAIL_ROWS = [
    ("pss_load", "PSS once ready, MiB (process tree)", "{:.0f}"),
    ("rss_load", "RSS once ready, MiB (process tree)", "{:.0f}"),
    ("pss_after", "PSS after the load, MiB", "{:.0f}"),
    ("rss_after", "RSS after the load, MiB", "{:.0f}"),
    ("procs", "processes", "{:.0f}"),
    ("ready_s", "start to ready, s", "{:.1f}"),
    ("other_cores", "other processes' CPU during the test, cores", "{:.2f}"),
    ("failed", "failed requests", "{:.0f}"),
]
NO_RATIO = ("procs", "other_cores", "failed")
SERVERS = ("corefleet", "llama-server")


def cell(values: list[float], fmt: str) -> str:
    med = fmt.format(statistics.median(values))
    return med if len(values) == 1 else f"{med} ({' / '.join(fmt.format(v) for v in values)})"


def ratio(runs: list[Run], key: str) -> float:
    ratios = [r["corefleet"][key] / r["llama-server"][key] for r in runs if r["llama-server"][key]]
    return statistics.median(ratios) if ratios else float("nan")


def model_table(runs: list[Run], plan: LoadPlan) -> str:
    """Every figure of one model, both servers side by side."""
    names = {"single": plan.single_tokens, "input_len": plan.input_len, "ttft": plan.ttft_prompt}
    rows = [(k, label.format(**names), f) for k, label, f in ROWS]
    if plan.ttft_prompt:
        rows += [(k, label.format(**names), f) for k, label, f in PREFILL_ROWS]
    for n in plan.streams:
        rows += [(f"s{n}_{k}", label.format(n=n), f) for k, label, f in STREAM_ROWS]
    rows += TAIL_ROWS
    lines = [
        f"median of {len(runs)} run(s) (runs in brackets); ratio: corefleet / llama-server, "
        "median of the per-run ratios",
        "",
        "| | corefleet | llama-server | ratio |",
        "|---|---|---|---|",
    ]
    for key, label, fmt in rows:
        cf, ll = ([r[name][key] for r in runs] for name in SERVERS)
        shown = "" if key in NO_RATIO else f"{ratio(runs, key):.2f}"
        lines.append(f"| {label} | {cell(cf, fmt)} | {cell(ll, fmt)} | {shown} |")
    return "\n".join(lines)


def summary_table(models: dict[str, list[Run]], plan: LoadPlan) -> str:
    """One line per model: the issue's headline figures, corefleet / llama-server (ratio)."""
    columns = [("single_tok_s", "one stream tok/s", "{:.1f}")]
    if plan.ttft_prompt:
        columns.append(("prefill_ttft", f"TTFT {plan.ttft_prompt}-token prompt, s", "{:.2f}"))
    columns += [(f"s{n}_tok_s", f"{n} streams tok/s", "{:.1f}") for n in plan.streams]
    columns += [("pss_load", "PSS once ready, MiB", "{:.0f}")]
    columns += [("pss_after", "PSS after the load, MiB", "{:.0f}")]
    lines = [
        "each cell: corefleet / llama-server (ratio, median of the per-run ratios); "
        "other processes' CPU is the most seen in any measurement of that model",
        "",
        "| model | runs | "
        + " | ".join(label for _, label, _ in columns)
        + " | other CPU, cores |",
        "|---" * (len(columns) + 3) + "|",
    ]
    for model, runs in models.items():
        cells = []
        for key, _, fmt in columns:
            cf, ll = (statistics.median(r[name][key] for r in runs) for name in SERVERS)
            if key == "prefill_ttft":  # ms in the figures, seconds here
                cf, ll = cf / 1000, ll / 1000
            cells.append(f"{fmt.format(cf)} / {fmt.format(ll)} (**{ratio(runs, key):.2f}**)")
        busiest = max(r[name]["other_cores"] for r in runs for name in SERVERS)
        lines.append(f"| {model} | {len(runs)} | " + " | ".join(cells) + f" | {busiest:.2f} |")
    return "\n".join(lines)
