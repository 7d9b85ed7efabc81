"""The images `make images` builds, for the tests that run them.

Tests that need them skip when no Docker engine answers or an image is missing, and fail instead
when COREFLEET_REQUIRE_IMAGES=1 (`make test` sets it after building them), so CI cannot pass
without running them.
"""

from __future__ import annotations

import os
import subprocess

import pytest
import tomllib
from docker_images import DOCKER, docker_available
from e2e_support import REPO

VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
ENGINE_IMAGE = f"ghcr.io/corefleet/corefleet:{VERSION}"
OPERATOR_IMAGE = f"ghcr.io/corefleet/corefleet-operator:{VERSION}"


def missing_images() -> str | None:
    """None when both images are here, else why not."""
    why = docker_available()
    if why is not None:
        return why
    for image in (ENGINE_IMAGE, OPERATOR_IMAGE):
        done = subprocess.run([DOCKER, "image", "inspect", image], capture_output=True, timeout=60)
        if done.returncode != 0:
            return f"image {image} is not built (make images)"
    return None


def require_images() -> None:
    """Skip (or, with COREFLEET_REQUIRE_IMAGES=1, fail) a test when the images are missing."""
    why = missing_images()
    if why is None:
        return
    if os.environ.get("COREFLEET_REQUIRE_IMAGES") == "1":
        pytest.fail(f"COREFLEET_REQUIRE_IMAGES=1 but {why}")
    pytest.skip(why)
