"""Where a rank's model runs: its device and its share of the CPU."""

from __future__ import annotations

import contextlib
import logging

import torch

from corefleet.engine import envs
from corefleet.engine.worker.cpu_allowance import read_allowance

logger = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def set_cpu_threads(workers: int = 1) -> None:
    """Size torch's thread pool (which the C++ CPU ops' parallel loops use too) to this process's
    CPU allowance, not the node: a thread per node core on a share of them stalls every parallel
    region behind the threads that wait for a core. ``workers`` processes of one rank (tensor
    parallelism) share it."""
    allowance = read_allowance(envs.cpu_threads(), envs.cpu_request_millicores())
    torch.set_num_threads(max(1, allowance.threads // workers))
    # The engine runs no inter-op parallel work (no torch.jit.fork); one inter-op thread keeps a
    # stray one from adding a second pool. torch allows setting it only once per process, before
    # any such work: a second executor in the same process (offline tests) keeps the first value.
    with contextlib.suppress(RuntimeError):
        torch.set_num_interop_threads(1)
    logger.debug("CPU threads: %s", allowance.describe())
