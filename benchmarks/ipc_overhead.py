"""What the process hop costs: SyncMPClient (engine in a child process, ZMQ) vs InprocClient.

Both clients drive the same engine with the null executor (no model: each step "samples" one
fixed token per due request), so only the engine itself and the IPC path are measured. Per run
and concurrency C the two modes are measured back to back (inproc, then multiprocess); figures
are medians over runs, because this machine's speed drifts and only same-run pairs compare.

1. Short requests/s: an 8-token prompt and 1 output token (``max_tokens=1``, ``ignore_eos``).
   C requests are kept in flight (each finished one is replaced at once) until ``--requests``
   have finished; requests/s = finished / wall time from the first add to the last finish.
2. Microseconds per step: C requests with an 8-token prompt decode ``--decode-tokens`` tokens
   together; µs/step = wall time from the first add to the last output received, divided by
   the tokens per request (= the steps of a batch of C; in-process that is exactly the steps).
   This is the throughput a consumer sees: with a process hop the engine may step ahead of the
   output path, or admit the C requests over several steps. Added µs/step = multiprocess -
   in-process. Diagnostics: engine steps (the engine's step counter), the engine's own µs/step
   (its timestamps over its step counter) and the median delivery lag (engine timestamp to
   ``get_output()`` return).

Targets: >= 20,000 short requests/s through one EngineCoreProc; <= 100 µs added per step.
Run it on an otherwise idle machine: another process competing for the CPUs changes the
multiprocess figures (it preempts the engine's busy loop; see benchmarks/README.md).

    python benchmarks/ipc_overhead.py --runs 3 --concurrency 1 64 256
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from dataclasses import dataclass, field

from corefleet.engine.client.base import EngineCoreClient
from corefleet.engine.client.factory import make_client
from corefleet.engine.client.inproc import InprocClient
from corefleet.engine.config import EngineConfig
from corefleet.engine.messages import EngineCoreRequest, SamplingParams

NULL_EXECUTOR = "corefleet.engine.worker.null_executor:NullExecutor"
PROMPT_LEN = 8
TARGET_REQ_PER_S = 20_000.0
TARGET_ADDED_US = 100.0
MODES = ("inproc", "mp")

_ids = itertools.count()


def new_request(params: SamplingParams) -> EngineCoreRequest:
    """A request with a unique id and its own 8-token prompt (less than a block: no hashing)."""
    n = next(_ids)
    prompt = [(n * 7919 + j * 131) % 40_000 + 100 for j in range(PROMPT_LEN)]
    return EngineCoreRequest(f"req-{n}", prompt, params)


@dataclass
class ShortResult:
    req_per_s: float
    req_per_step: float  # finished requests per output message (= per engine step)


@dataclass
class DecodeResult:
    us_per_step: float  # wall time (first add -> last output received) / decode tokens
    steps: int  # output messages (= engine steps with tokens); > tokens when admission spreads
    engine_us_per_step: float  # engine clock per engine step (nan: fewer than 2 steps)
    delivery_us: float  # median engine timestamp -> get_output() return (nan: no full batch)


def run_short(client: EngineCoreClient, concurrency: int, total: int) -> ShortResult:
    params = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0)
    issued = finished = messages = 0
    start = time.perf_counter()
    while issued < min(concurrency, total):
        client.add_request(new_request(params))
        issued += 1
    while finished < total:
        outputs = client.get_output().outputs
        if outputs:
            messages += 1
        for output in outputs:
            if output.finished:
                finished += 1
                if issued < total:
                    client.add_request(new_request(params))
                    issued += 1
    elapsed = time.perf_counter() - start
    return ShortResult(total / elapsed, total / max(messages, 1))


def run_decode(client: EngineCoreClient, concurrency: int, tokens: int) -> DecodeResult:
    params = SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0.0)
    start = time.monotonic()
    for _ in range(concurrency):
        client.add_request(new_request(params))
    received: list[float] = []  # client clock (time.monotonic) at get_output() return
    stamped: list[float] = []  # the message's timestamp (time.monotonic in the engine)
    # (engine timestamp, engine step counter) of messages carrying scheduler stats. A message
    # may fold several steps when the engine runs ahead of its output thread, so steps come
    # from the engine's counter, not from counting messages.
    clock: list[tuple[float, int]] = []
    remaining = concurrency
    while remaining:
        out = client.get_output()
        now = time.monotonic()
        if len(out.outputs) >= concurrency:
            received.append(now)
            stamped.append(out.timestamp)
        if out.scheduler_stats is not None:
            clock.append((out.timestamp, out.scheduler_stats.step_counter))
        remaining -= sum(o.finished for o in out.outputs)
    wall = time.monotonic() - start
    nan = float("nan")
    steps = clock[-1][1] - clock[0][1] + 1 if clock else 0
    span = clock[-1][0] - clock[0][0] if clock else 0.0
    engine = span / (steps - 1) if steps > 1 else nan
    lags = [r - s for r, s in zip(received, stamped, strict=True)]
    return DecodeResult(
        wall / tokens * 1e6, steps, engine * 1e6, statistics.median(lags) * 1e6 if lags else nan
    )


@dataclass
class Cell:
    """All runs of one (concurrency, mode)."""

    short: list[ShortResult] = field(default_factory=list)
    decode: list[DecodeResult] = field(default_factory=list)

    def med(self, attr: str) -> float:
        items = self.short if attr in ShortResult.__dataclass_fields__ else self.decode
        values = [v for x in items if (v := getattr(x, attr)) == v]  # v != v: nan
        return statistics.median(values) if values else float("nan")

    def all(self, attr: str, fmt: str) -> str:
        items = self.short if attr in ShortResult.__dataclass_fields__ else self.decode
        return " / ".join(format(getattr(x, attr), fmt) for x in items)


def make_config(max_num_seqs: int, decode_tokens: int, model: str | None) -> EngineConfig:
    # Enough KV blocks for every decode request to run to the end (the null executor allocates
    # nothing; the pool only sizes the KV manager's bookkeeping).
    blocks_per_request = -(-(PROMPT_LEN + decode_tokens + 1) // 16)
    return EngineConfig.from_kwargs(
        model=model,
        distributed_executor_backend=NULL_EXECUTOR,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=8192,
        num_blocks_override=max_num_seqs * blocks_per_request + 64,
    )


def warm_up(client: EngineCoreClient) -> None:
    run_short(client, 64, 1000)
    run_decode(client, 16, 20)


def report(args: argparse.Namespace, cells: dict[tuple[int, str], Cell]) -> None:
    print(
        f"\n### median of {args.runs} runs; short = {PROMPT_LEN}-token prompt, 1 output token, "
        f"{args.requests} requests; decode = {args.decode_tokens} tokens\n"
    )
    print(
        "| concurrency | inproc req/s | MP req/s | inproc µs/step | MP µs/step | added µs/step "
        "| added, engine side |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    added: dict[int, float] = {}
    for c in args.concurrency:
        ip, mp = cells[c, "inproc"], cells[c, "mp"]
        added[c] = mp.med("us_per_step") - ip.med("us_per_step")
        engine_side = mp.med("engine_us_per_step") - ip.med("engine_us_per_step")
        print(
            f"| {c} | {ip.med('req_per_s'):,.0f} | {mp.med('req_per_s'):,.0f} | "
            f"{ip.med('us_per_step'):.0f} | {mp.med('us_per_step'):.0f} | {added[c]:+.0f} | "
            f"{engine_side:+.0f} |"
        )
    print(
        "\nµs/step: wall time / tokens per request (a consumer's view); engine side: the engine's "
        "own\nclock per step of its step counter (the busy loop's step cost)."
    )
    print("\nDetails (medians; per-run figures in brackets, in run order):\n")
    print(
        "| C | mode | req/s (runs) | req/step | µs/step (runs) | steps | engine µs/step "
        "| delivery µs |"
    )
    print("|---:|---|---|---:|---|---:|---:|---:|")
    for c in args.concurrency:
        for mode in MODES:
            cell = cells[c, mode]
            print(
                f"| {c} | {mode} | [{cell.all('req_per_s', ',.0f')}] | "
                f"{cell.med('req_per_step'):.1f} | [{cell.all('us_per_step', '.0f')}] | "
                f"{cell.med('steps'):.0f} | {cell.med('engine_us_per_step'):.0f} | "
                f"{cell.med('delivery_us'):,.0f} |"
            )
    best = max(cells[c, "mp"].med("req_per_s") for c in args.concurrency)
    met = "met" if best >= TARGET_REQ_PER_S else "NOT met"
    print(f"\nTarget >= {TARGET_REQ_PER_S:,.0f} short req/s (MP, best C): {best:,.0f} -> {met}")
    for c in args.concurrency:
        met = "met" if added[c] <= TARGET_ADDED_US else "NOT met"
        limit = f"{TARGET_ADDED_US:.0f} µs added per step at C={c}"
        print(f"Target <= {limit}: {added[c]:+.0f} -> {met}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--runs", type=int, default=3, help="runs; figures are medians")
    parser.add_argument(
        "--concurrency", type=int, nargs="+", default=[1, 64, 256], help="requests in flight"
    )
    parser.add_argument(
        "--requests", type=int, default=20_000, help="short requests per (run, concurrency, mode)"
    )
    parser.add_argument(
        "--decode-tokens", type=int, default=2000, help="output tokens per decode request"
    )
    parser.add_argument(
        "--model", default=None, help="model for the arch config only (default: embedded SmolLM2)"
    )
    args = parser.parse_args()

    config = make_config(max(256, *args.concurrency), args.decode_tokens, args.model)
    cells = {(c, m): Cell() for c in args.concurrency for m in MODES}
    clients: dict[str, EngineCoreClient] = {}
    try:
        clients["inproc"] = InprocClient(config)
        mp_client = make_client(config, multiprocess=True)
        assert isinstance(mp_client, EngineCoreClient)
        clients["mp"] = mp_client
        for client in clients.values():
            warm_up(client)
        for run in range(args.runs):
            for c in args.concurrency:
                for mode in MODES:  # interleaved: the pair shares this moment's machine speed
                    cell, client = cells[c, mode], clients[mode]
                    cell.short.append(run_short(client, c, args.requests))
                    cell.decode.append(run_decode(client, c, args.decode_tokens))
                    s, d = cell.short[-1], cell.decode[-1]
                    print(
                        f"run {run + 1} C={c:<4} {mode:<6} {s.req_per_s:>9,.0f} req/s "
                        f"({s.req_per_step:5.1f} req/step)  {d.us_per_step:6.0f} µs/step "
                        f"({d.steps} steps; engine {d.engine_us_per_step:.0f} µs/step, "
                        f"delivery {d.delivery_us:,.0f} µs)",
                        flush=True,
                    )
        report(args, cells)
    finally:
        for client in clients.values():
            client.shutdown()


if __name__ == "__main__":
    main()
