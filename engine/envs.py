"""Every environment variable the engine reads, in one place, read when asked for.

The kernels, which never import the engine, read theirs in ``kernels/envs.py``
(``COREFLEET_CPU_OPS``: which build of the C++ CPU ops to load).
"""

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


CPU_THREADS = "COREFLEET_CPU_THREADS"  # also set by ``corefleet serve`` for ranks sharing cores


def cpu_threads() -> int:
    """COREFLEET_CPU_THREADS: torch intra-op threads on CPU (0 = one per core of the process's
    allowance, ``worker/cpu_allowance.py``); more than the allowance is refused at start."""
    value = _int(CPU_THREADS, 0)
    if value < 0:
        raise ValueError(f"environment variable {CPU_THREADS}={value} must be >= 0")
    return value


RANK_MEMORY = "COREFLEET_RANK_MEMORY"  # set by ``corefleet serve`` for its local ranks


def rank_memory() -> int | None:
    """COREFLEET_RANK_MEMORY: bytes of memory a rank may use (weights, KV cache and working
    memory of all its workers), set by ``corefleet serve``: the free memory it found at start,
    split among its local ranks. Unset: the rank reads its own at start
    (``worker/kv_budget.py``)."""
    value = _int(RANK_MEMORY, 0)
    if value < 0:
        raise ValueError(f"environment variable {RANK_MEMORY}={value} must be >= 0")
    return value or None


def openmp_wait_passive() -> str:
    """OMP_WAIT_POLICY: set to PASSIVE in a rank unless the user chose a policy; returns the
    policy in force. Must run before torch is imported (libgomp reads it once, at load).

    Why: an idle OpenMP thread otherwise spins for a long while after every parallel region of
    torch's. Alone on its cores that costs nothing, but on a shared node the spinning is taken
    from the engine's own CPU share (the kernel weighs a process's threads together) and from
    the neighbour's. The C++ ops have their own pool with a short spin (kernels/cpu/csrc/
    parallel.h), so only torch's own regions (large GEMMs, sampling) pay a futex wake-up.
    """
    return os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def cpu_request_millicores() -> int:
    """COREFLEET_CPU_REQUEST_MILLICORES: the pod's CPU request in millicores (the operator sets
    it from the downward API, ``requests.cpu`` with divisor ``1m``; 0 or unset = no request).
    Caps the CPU threads at the whole cores it promises."""
    value = _int("COREFLEET_CPU_REQUEST_MILLICORES", 0)
    if value < 0:
        raise ValueError(f"environment variable COREFLEET_CPU_REQUEST_MILLICORES={value} is < 0")
    return value


def pod_ip() -> str | None:
    """POD_IP: the pod's address from the downward API (advertised by the coordinator)."""
    return os.environ.get("POD_IP") or None


def pod_name() -> str | None:
    """POD_NAME: the pod's name from the downward API."""
    return os.environ.get("POD_NAME") or None


def curve_server_key() -> str | None:
    """COREFLEET_CURVE_SERVER_KEY: on a rank, the coordinator's public CURVE key (Z85)."""
    return os.environ.get("COREFLEET_CURVE_SERVER_KEY") or None


def curve_public_key() -> str | None:
    """COREFLEET_CURVE_PUBLIC_KEY: this process's own public CURVE key (Z85)."""
    return os.environ.get("COREFLEET_CURVE_PUBLIC_KEY") or None


def curve_secret_key() -> str | None:
    """COREFLEET_CURVE_SECRET_KEY: this process's own secret CURVE key (Z85)."""
    return os.environ.get("COREFLEET_CURVE_SECRET_KEY") or None


def curve_client_key() -> str | None:
    """COREFLEET_CURVE_CLIENT_KEY: on the coordinator, the one rank public key it accepts."""
    return os.environ.get("COREFLEET_CURVE_CLIENT_KEY") or None


def engine_heartbeat_timeout_s() -> float:
    """COREFLEET_ENGINE_HEARTBEAT_TIMEOUT_S: silence after which a client declares its engine
    dead (default 10; engines send stats at least every 0.5 s)."""
    raw = os.environ.get("COREFLEET_ENGINE_HEARTBEAT_TIMEOUT_S")
    if not raw:
        return 10.0
    try:
        value = float(raw)
    except ValueError as exc:
        raise ValueError(
            f"environment variable COREFLEET_ENGINE_HEARTBEAT_TIMEOUT_S={raw!r} is not a number"
        ) from exc
    if value <= 0:
        raise ValueError("COREFLEET_ENGINE_HEARTBEAT_TIMEOUT_S must be positive")
    return value


def api_keys() -> tuple[str, ...]:
    """COREFLEET_API_KEY: the coordinator's API keys, comma-separated, when no --api-key is
    given (empty: the API is open)."""
    raw = os.environ.get("COREFLEET_API_KEY") or ""
    return tuple(key.strip() for key in raw.split(",") if key.strip())


def termination_log() -> str:
    """COREFLEET_TERMINATION_LOG: where a rank that cannot start writes why, for Kubernetes to
    show as its container's termination message (default ``/dev/termination-log``, the
    kubelet's; written only where that file exists)."""
    return os.environ.get("COREFLEET_TERMINATION_LOG") or "/dev/termination-log"


def _positive_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError as exc:
        raise ValueError(f"environment variable {name}={raw!r} is not a number") from exc
    if not value > 0:
        raise ValueError(f"environment variable {name}={raw!r} must be positive")
    return value


def dp_collective_timeout_s() -> float:
    """COREFLEET_DP_COLLECTIVE_TIMEOUT_S: how long a rank of an MoE group waits in a collective
    for a peer that does not come (hung; a dead one fails it at once); then the rank exits
    (default 300: a peer may be in a long step)."""
    return _positive_float("COREFLEET_DP_COLLECTIVE_TIMEOUT_S", 300.0)


def dp_formation_timeout_s() -> float:
    """COREFLEET_DP_FORMATION_TIMEOUT_S: how long a rank of an MoE group waits for every rank to
    join before it gives up and exits (default 600: pods may start minutes apart)."""
    return _positive_float("COREFLEET_DP_FORMATION_TIMEOUT_S", 600.0)


def dp_peer_timeout_s() -> float:
    """COREFLEET_DP_PEER_TIMEOUT_S: silence after which a rank of an idle MoE group declares a
    peer lost and exits so that the group forms again (default 15; peers beat every 0.5 s)."""
    return _positive_float("COREFLEET_DP_PEER_TIMEOUT_S", 15.0)
