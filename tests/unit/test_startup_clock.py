"""The rank's start-up breakdown: phases in order, from the process's own start."""

from __future__ import annotations

import logging
import subprocess
import sys
import time

import pytest

from corefleet.engine.engine_core.startup import StartupClock, process_age_s


def test_process_age_counts_from_the_process_start() -> None:
    # A child that sleeps before asking: its age includes the interpreter start and the sleep.
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import time; time.sleep(0.5); "
            "from corefleet.engine.engine_core.startup import process_age_s; "
            "print(process_age_s())",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    assert float(out) >= 0.5
    assert process_age_s() > 0.0  # this test process started before it


def test_phases_are_logged_in_order_with_their_total(caplog: pytest.LogCaptureFixture) -> None:
    clock = StartupClock()
    time.sleep(0.02)
    clock.phase("handshake")
    clock.phase("model (kernels and weights)")
    names = [name for name, _ in clock.phases]
    assert names == ["imports", "handshake", "model (kernels and weights)"]
    assert clock.phases[1][1] >= 0.02
    assert clock.total_s == pytest.approx(sum(s for _, s in clock.phases))
    with caplog.at_level(logging.INFO, logger="corefleet.engine.engine_core.startup"):
        clock.report(3)
    (line,) = caplog.messages
    assert line.startswith("rank 3: ready ") and "imports " in line and "handshake " in line
