"""Every environment variable corefleet reads, in one place, read when asked for."""

from __future__ import annotations

import os


def _int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError as exc:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from exc


def log_level() -> str:
    """COREFLEET_LOG_LEVEL: logging level name for corefleet loggers (default INFO)."""
    return os.environ.get("COREFLEET_LOG_LEVEL", "INFO").upper()


def cpu_threads() -> int:
    """COREFLEET_CPU_THREADS: torch intra-op threads on CPU (0 = torch's default)."""
    return _int("COREFLEET_CPU_THREADS", 0)


def pod_ip() -> str | None:
    """POD_IP: the pod's address from the downward API (advertised by the coordinator)."""
    return os.environ.get("POD_IP") or None


def pod_name() -> str | None:
    """POD_NAME: the pod's name from the downward API."""
    return os.environ.get("POD_NAME") or None
