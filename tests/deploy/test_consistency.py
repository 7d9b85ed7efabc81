"""The chart and the image agree on what the other assumes."""

from __future__ import annotations

import re

import yaml

from tests.deploy.tools import CHART, REPO


def _stage_user(stage: str) -> str:
    """The last ``USER`` of a Dockerfile stage, e.g. ``10001:10001``."""
    text = (REPO / "Dockerfile").read_text()
    body = re.split(r"^FROM .* AS " + re.escape(stage) + r"\s*$", text, flags=re.M)[1]
    body = re.split(r"^FROM ", body, flags=re.M)[0]
    users = re.findall(r"^USER\s+(\S+)", body, flags=re.M)
    assert users, f"stage {stage} sets no USER"
    return users[-1]


def test_the_chart_runs_the_operator_as_the_user_its_image_creates() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    pod = values["podSecurityContext"]
    assert _stage_user("operator") == f"{pod['runAsUser']}:{pod['runAsGroup']}"
