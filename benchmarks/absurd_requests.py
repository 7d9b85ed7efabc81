"""How fast, and at what memory cost, a real ``corefleet serve`` refuses absurd requests.

Sends every request of ``tests/hostile_requests.py`` (an absurd value of each field a client
controls) ``--runs`` times to a server started with the default model and the same limits as
the test, and reports per request the status, the median and worst latency, and the
coordinator's RSS before and after. The issue's bar: every refusal within a second, no memory
growth.

    .venv/bin/python benchmarks/absurd_requests.py --runs 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.hostile_requests import ABSURD, BODY_LIMIT
from tests.serve_support import serve_process

KEY = "bench-key"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="times each request is sent")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = parser.parse_args()
    flags = ("--api-key", KEY, "--max-request-body-bytes", str(BODY_LIMIT))
    flags += ("--max-model-len", "2048")
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    rows = []
    with serve_process(*flags, timeout=300) as (serve, base), httpx.Client(timeout=120) as client:
        proc = psutil.Process(serve.pid)
        rss_before = proc.memory_info().rss
        for path, body, expected, param in ABSURD:
            content = json.dumps(body).encode()
            times, statuses = [], set()
            for _ in range(args.runs):
                started = time.perf_counter()
                response = client.post(f"{base}{path}", content=content, headers=headers)
                times.append(time.perf_counter() - started)
                statuses.add(response.status_code)
            rows.append(
                {
                    "request": f"{'chat' if 'chat' in path else 'completions'} {param or 'body'} "
                    f"({len(content)} B)",
                    "statuses": sorted(statuses),
                    "expected": expected,
                    "median_ms": 1000 * statistics.median(times),
                    "max_ms": 1000 * max(times),
                }
            )
        rss_after = proc.memory_info().rss
    print(f"{'request':48} {'status':>8} {'median ms':>10} {'max ms':>8}")
    for row in rows:
        status = ",".join(map(str, row["statuses"]))
        print(f"{row['request']:48} {status:>8} {row['median_ms']:10.1f} {row['max_ms']:8.1f}")
    growth = (rss_after - rss_before) / 2**20
    print(
        f"coordinator RSS {rss_before / 2**20:.0f} MiB -> {rss_after / 2**20:.0f} MiB "
        f"({growth:+.1f} MiB) over {args.runs * len(ABSURD)} refused requests"
    )
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "rss_growth_mib": growth}, indent=2))
    wrong = [r for r in rows if r["statuses"] != [r["expected"]]]
    slow = [r for r in rows if r["max_ms"] >= 1000]
    print("PASS" if not wrong and not slow else f"FAIL: wrong status {wrong}, slow {slow}")
    return 1 if wrong or slow else 0


if __name__ == "__main__":
    sys.exit(main())
