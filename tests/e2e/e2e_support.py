"""Small helpers of the end-to-end tests: polling, kubectl's tables, the repository's paths."""

from __future__ import annotations

import pathlib
import re
import time
from collections.abc import Callable
from typing import TypeVar

REPO = pathlib.Path(__file__).resolve().parents[2]
CRD_FILE = REPO / "crds" / "inferenceengines.corefleet.dev.yaml"
T = TypeVar("T")


def wait_until(
    check: Callable[[], T | None], timeout: float = 10.0, interval: float = 0.05, what: str = ""
) -> T:
    """Poll `check` until it returns something truthy (returned); AssertionError after timeout."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or check}")
        time.sleep(interval)


def parse_table(output: str) -> list[dict[str, str]]:
    """kubectl's table output as one dict per row, keyed by the header names ("NAME", "READY").

    Columns are cut at the header's word positions, so empty cells read as "" and cells with
    single spaces ("3 (5s ago)", "NOMINATED NODE") stay whole.
    """
    lines = [line for line in output.splitlines() if line.strip()]
    if not lines:
        return []
    heads = list(re.finditer(r"\S+(?: \S+)*", lines[0]))
    bounds = [h.start() for h in heads] + [None]
    return [
        {h.group(): line[bounds[i] : bounds[i + 1]].strip() for i, h in enumerate(heads)}
        for line in lines[1:]
    ]
