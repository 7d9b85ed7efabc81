"""Operator integration tests: kopf's settings for a fast, deterministic run.

The operator reads these once (the timer interval when `corefleet.operator.main` is imported),
so they are set before any test imports it. The coordinator's /admin/engines is not probed: no
coordinator runs here (tests/unit/operator/test_operator_admin.py covers that client).
"""

import os

os.environ.setdefault("COREFLEET_OPERATOR_TIMER_SECONDS", "1")
os.environ.setdefault("COREFLEET_OPERATOR_ADMIN_PROBE", "0")
os.environ.setdefault("COREFLEET_OPERATOR_FAILED_BACKOFF_SECONDS", "1")
