"""`corefleet-operator` with a stopwatch on each reconcile (benchmarks/operator_scale.py runs it).

    python benchmarks/operator_timing.py RECORDS.jsonl -- --all-namespaces --standalone ...

Runs exactly what the `corefleet-operator` console script runs (`corefleet.operator.cli.cli`
with the arguments after `--`), after wrapping two functions of the installed package, which
is not changed on disk:
- `controller._reconcile_locked`, the body of one reconcile of one InferenceEngine (what
  `reconcile_engine` runs once it holds the engine's lock; calls that were coalesced into a
  waiting one never get there), timed with `time.perf_counter`;
- `KubeClient._request`, to count the requests that reconcile made through the operator's own
  client (kopf's watches, its annotation patches and Events are not counted here: the audit
  log of benchmarks/operator_scale.py counts every request of the operator's user).
Each reconcile appends one JSON line to RECORDS.jsonl: {"t": wall-clock start (Unix seconds),
"s": seconds, "ns", "engine", "requests", "error": the exception's class name or null}. A
reconcile that raises (kopf.TemporaryError on a 409, say) is recorded too. The operator logs
nothing that times a reconcile, hence this wrapper.
"""

from __future__ import annotations

import contextvars
import functools
import json
import sys
import threading
import time
from typing import Any

_requests: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar(
    "requests", default=None
)


def install(path: str) -> None:
    """Wrap the reconcile and the client's requests; records go to `path` (appended)."""
    from corefleet.operator import controller, kube

    out = open(path, "a", buffering=1)  # noqa: SIM115 - open for the process's lifetime
    lock = threading.Lock()
    reconcile = controller._reconcile_locked
    request = kube.KubeClient._request

    @functools.wraps(reconcile)
    async def timed(body: Any, key: tuple[str, str], *args: Any, **kwargs: Any) -> Any:
        counter = [0]
        token = _requests.set(counter)
        error: str | None = None
        started, wall = time.perf_counter(), time.time()
        try:
            return await reconcile(body, key, *args, **kwargs)
        except BaseException as exc:
            error = type(exc).__name__
            raise
        finally:
            seconds = time.perf_counter() - started
            _requests.reset(token)
            record = {
                "t": round(wall, 6),
                "s": round(seconds, 6),
                "ns": key[0],
                "engine": key[1],
                "requests": counter[0],
                "error": error,
            }
            with lock:
                out.write(json.dumps(record) + "\n")

    @functools.wraps(request)
    async def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        counter = _requests.get()
        if counter is not None:
            counter[0] += 1
        return await request(self, *args, **kwargs)

    controller._reconcile_locked = timed
    kube.KubeClient._request = counted


def main() -> None:
    """`RECORDS.jsonl -- ARGS...`: install the wrappers, then run the operator's CLI."""
    argv = sys.argv[1:]
    if len(argv) < 2 or argv[1] != "--" or argv[0] in ("-h", "--help"):
        print(__doc__)
        raise SystemExit(0 if argv[:1] in (["-h"], ["--help"]) else 2)
    install(argv[0])
    from corefleet.operator.cli import cli

    sys.argv = ["corefleet-operator", *argv[2:]]
    cli(argv[2:])


if __name__ == "__main__":
    main()
