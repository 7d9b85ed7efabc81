"""Operator configuration: the environment read once, and the `@kopf.on.startup` hook.

Every environment variable the operator reads is declared in `OperatorConfig.from_env`. The
startup hook tunes kopf (why each value, next to it) and puts the shared `Runtime` into the
operator-wide memo, from where every handler reaches it; nothing is global.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping
from typing import Any

import kopf

from corefleet.operator.controller import Runtime
from corefleet.operator.reconcile import Policy

PREFIX = "operator.corefleet.dev"  # kopf's progress/diff-base annotations and finalizer


def _float(env: Mapping[str, str], key: str, default: float) -> float:
    raw = env.get(key)
    if raw is None or raw == "":
        return default
    value = float(raw)
    if value <= 0:
        raise ValueError(f"{key} must be > 0, got {raw!r}")
    return value


@dataclasses.dataclass(frozen=True)
class OperatorConfig:
    """Knobs of the operator process (not of any InferenceEngine)."""

    timer_seconds: float = 10.0  # COREFLEET_OPERATOR_TIMER_SECONDS: level-based re-check period
    failed_backoff_seconds: float = 10.0  # COREFLEET_OPERATOR_FAILED_BACKOFF_SECONDS
    failed_backoff_max_seconds: float = 300.0
    request_timeout_seconds: float = 10.0  # COREFLEET_OPERATOR_REQUEST_TIMEOUT_SECONDS
    admin_probe: bool = True  # COREFLEET_OPERATOR_ADMIN_PROBE=0 turns off /admin/engines reads
    admin_timeout_seconds: float = 1.0  # COREFLEET_OPERATOR_ADMIN_TIMEOUT_SECONDS
    resync_seconds: float = 60.0  # COREFLEET_OPERATOR_RESYNC_SECONDS: indexes checked by a list

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> OperatorConfig:
        """Read the COREFLEET_OPERATOR_* variables (defaults for absent ones)."""
        env = os.environ if env is None else env
        return cls(
            timer_seconds=_float(env, "COREFLEET_OPERATOR_TIMER_SECONDS", 10.0),
            failed_backoff_seconds=_float(env, "COREFLEET_OPERATOR_FAILED_BACKOFF_SECONDS", 10.0),
            request_timeout_seconds=_float(env, "COREFLEET_OPERATOR_REQUEST_TIMEOUT_SECONDS", 10.0),
            admin_probe=env.get("COREFLEET_OPERATOR_ADMIN_PROBE", "1") not in ("0", "false"),
            admin_timeout_seconds=_float(env, "COREFLEET_OPERATOR_ADMIN_TIMEOUT_SECONDS", 1.0),
            resync_seconds=_float(env, "COREFLEET_OPERATOR_RESYNC_SECONDS", 60.0),
        )

    @property
    def policy(self) -> Policy:
        """The reconcile's timing policy."""
        return Policy(
            failed_backoff_seconds=self.failed_backoff_seconds,
            failed_backoff_max_seconds=self.failed_backoff_max_seconds,
        )


def configure(settings: kopf.OperatorSettings) -> None:
    """Apply corefleet's kopf settings (separate from the hook so tests can call it)."""
    # Our own prefix for kopf's bookkeeping, and no kopf state in .status (handlers return None).
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=PREFIX, key="last-handled-configuration"
    )
    settings.persistence.finalizer = f"{PREFIX}/finalizer"
    # Events we post ourselves (kopf.event) are kept; log lines are not mirrored as Events.
    settings.posting.loggers = False
    settings.posting.level = logging.INFO
    settings.posting.reporting_component = "corefleet-operator"
    settings.posting.event_name_prefix = "corefleet-"
    # API servers close watches after 5-10 minutes anyway; asking for 4 makes reconnects regular
    # and a silently dead connection (load balancers drop idle TCP) is noticed within 5.
    settings.watching.server_timeout = 240
    settings.watching.client_timeout = 300
    settings.watching.connect_timeout = 30
    # Leader election: a replica is presumed dead once its peering entry is this old, and live
    # ones renew theirs every 10-15 s (kopf: lifetime less 5-10 s). kopf's 60 s default meant a
    # SIGKILLed leader (no goodbye) left the fleet unmanaged for up to a minute; 20 s bounds the
    # takeover by the standby replica to about that.
    settings.peering.lifetime = 20
    # kopf's default request timeout is 5 minutes; a hung write should fail and retry sooner.
    settings.networking.request_timeout = 60
    settings.networking.connect_timeout = 10


@kopf.on.startup()
async def startup(
    settings: kopf.OperatorSettings, memo: kopf.Memo, logger: kopf.Logger, **_: Any
) -> None:
    """Configure kopf and create the shared runtime before any handler runs."""
    configure(settings)
    config = OperatorConfig.from_env()
    memo["runtime"] = Runtime(
        policy=config.policy,
        request_timeout=config.request_timeout_seconds,
        admin_probe=config.admin_probe,
        admin_timeout=config.admin_timeout_seconds,
        admin_interval=config.timer_seconds,
        resync_seconds=config.resync_seconds,
    )
    logger.info("corefleet operator configured: %s", config)
