"""The HTTP server's connection limit fits the process's open-file limit."""

from __future__ import annotations

import subprocess
import sys

SNIPPET = """
import resource, sys
from corefleet.engine.entrypoints.http_server import connection_budget
soft, hard = int(sys.argv[1]), int(sys.argv[2])
resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
print(connection_budget(int(sys.argv[3])), resource.getrlimit(resource.RLIMIT_NOFILE)[0])
"""


def _budget(soft: int, hard: int, wanted: int) -> tuple[int, int]:
    # A child process: lowering a hard limit cannot be undone in this one.
    out = subprocess.run(
        [sys.executable, "-c", SNIPPET, str(soft), str(hard), str(wanted)],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout.split()
    return int(out[0]), int(out[1])


def test_the_soft_limit_is_raised_when_the_hard_one_allows() -> None:
    assert _budget(300, 1024, 600) == (600, 856)


def test_connections_are_capped_below_a_low_hard_limit() -> None:
    assert _budget(512, 512, 4096) == (256, 512)
