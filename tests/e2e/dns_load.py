"""A streaming load that reaches the API by its Service name, as a client in the cluster would.

The test process cannot resolve `<svc>.<ns>.svc.cluster.local`: the cluster's DNS is the node's
hosts file, which only processes started through `LocalCluster.with_node_dns` see as their
/etc/hosts. `DnsLoad` starts this file as such a process; it runs two
`fleet_support.StreamingLoad`s (the official client, no retries) against the URL until SIGTERM:
clients that open a connection per stream (the sync client) and clients that keep theirs alive
(the async one). It keeps their outcomes in a JSON file (rewritten every 0.2 s and once more at
the end), which `DnsLoad` reads back.

Each new connection resolves the name afresh (Python caches no lookups), so the load follows
the Service's endpoints as they change; a kept-alive connection stays with its pod until that
pod closes it.

    python dns_load.py BASE_URL MODEL OUT_JSON CLIENTS KEPT_ALIVE_CLIENTS MAX_TOKENS
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time
from types import FrameType, TracebackType
from typing import TYPE_CHECKING

from fleet_support import Outcome, StreamingLoad

if TYPE_CHECKING:
    from cluster import LocalCluster

HERE = pathlib.Path(__file__).resolve().parent


def _write(path: pathlib.Path, loads: list[StreamingLoad]) -> None:
    outcomes = sorted((o for load in loads for o in list(load.outcomes)), key=lambda o: o.started)
    # Written aside and renamed, so the reader never sees half a file.
    part = path.with_suffix(".part")
    part.write_text(json.dumps([dataclasses.asdict(o) for o in outcomes]))
    os.replace(part, path)


def main(argv: list[str]) -> int:
    """Stream until SIGTERM, recording outcomes in the JSON file."""
    base_url, model, out, clients, kept_alive, max_tokens = argv
    path, stop = pathlib.Path(out), threading.Event()

    def on_signal(_sig: int, _frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    loads = [
        StreamingLoad(base_url, model, int(clients), int(max_tokens), ignore_eos=True),
        StreamingLoad(
            base_url, model, int(kept_alive), int(max_tokens), ignore_eos=True, keep_alive=True
        ),
    ]
    with loads[0], loads[1]:
        while not stop.wait(0.2):
            _write(path, loads)
    # Leaving the blocks waited for the requests under way: they are in the last write.
    _write(path, loads)
    return 0


class DnsLoad:
    """This file as a process with the cluster's DNS, from the test's side."""

    def __init__(
        self,
        cluster: LocalCluster,
        base_url: str,
        model: str,
        folder: pathlib.Path,
        clients: int = 2,
        kept_alive: int = 2,
        max_tokens: int = 64,
    ) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.out, self.log = folder / "outcomes.json", folder / "load.log"
        script = [sys.executable, str(HERE / "dns_load.py"), base_url, model, str(self.out)]
        counts = [str(clients), str(kept_alive), str(max_tokens)]
        self.argv = cluster.with_node_dns([*script, *counts])
        self.process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> DnsLoad:
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT)
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def stop(self) -> None:
        """SIGTERM, and wait for the requests under way to end (the last write has them)."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(150)  # a client thread waits at most 120 s for its request
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)
            raise AssertionError(f"the load did not stop: {self.log.read_text()[-2000:]}") from None
        if self.process.returncode != 0:
            raise AssertionError(f"the load failed: {self.log.read_text()[-2000:]}")

    def outcomes(self) -> list[Outcome]:
        """The outcomes written so far (all of them once stopped)."""
        if not self.out.exists():
            return []
        return [Outcome(**o) for o in json.loads(self.out.read_text())]

    def wait_completed(self, count: int, timeout: float) -> list[Outcome]:
        """Block until at least `count` requests have ended; their outcomes."""
        deadline = time.monotonic() + timeout
        while len(done := self.outcomes()) < count:
            if self.process is not None and self.process.poll() is not None:
                raise AssertionError(f"the load exited: {self.log.read_text()[-2000:]}")
            if time.monotonic() > deadline:
                raise AssertionError(f"only {len(done)}/{count} requests ended in time")
            time.sleep(0.2)
        return done


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
