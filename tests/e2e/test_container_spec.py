"""The local kubelet's downward API for resources, against the real kubelet's rules: the
quantity over the divisor, rounded up (cpu first to millicores), an unset request taken from
the limit (the API server's defaulting) or 0, an unset cpu limit the node's cores."""

from __future__ import annotations

import asyncio
import os
from typing import Any

import pytest
from container_spec import ContainerConfigError, Image, image_env, parse_quantity, resolve_env

pytestmark = pytest.mark.e2e
IMAGE = Image("corefleet:*", {}, "/usr/bin:/bin")


def _env(resources: dict[str, Any], resource: str, divisor: str | None = None) -> str:
    ref: dict[str, Any] = {"resource": resource}
    if divisor is not None:
        ref["divisor"] = divisor
    container = {
        "name": "main",
        "resources": resources,
        "env": [{"name": "X", "valueFrom": {"resourceFieldRef": ref}}],
    }
    pod = {"metadata": {"name": "p", "namespace": "default"}, "spec": {"containers": [container]}}

    async def no_fetch(*_: str) -> None:
        return None

    env = asyncio.run(
        resolve_env(pod, container, image_env(IMAGE, pod), "10.0.0.2", "10.0.0.1", no_fetch)
    )
    return env["X"]


@pytest.mark.parametrize(
    ("resources", "resource", "divisor", "value"),
    [
        ({"requests": {"cpu": "500m"}}, "requests.cpu", "1m", "500"),
        ({"requests": {"cpu": "2"}}, "requests.cpu", "1m", "2000"),
        ({"requests": {"cpu": "1500m"}}, "requests.cpu", None, "2"),  # rounded up
        ({"requests": {"cpu": "0.1"}}, "requests.cpu", "1", "1"),
        ({"limits": {"cpu": "3"}}, "requests.cpu", "1m", "3000"),  # defaulted from the limit
        ({}, "requests.cpu", "1m", "0"),
        ({"limits": {"memory": "1Gi"}}, "limits.memory", "1Mi", "1024"),
        ({"requests": {"memory": "1500k"}}, "requests.memory", "1M", "2"),
    ],
)
def test_resource_fields_follow_the_kubelet(
    resources: dict[str, Any], resource: str, divisor: str | None, value: str
) -> None:
    assert _env(resources, resource, divisor) == value


def test_an_unset_cpu_limit_is_the_nodes_cores() -> None:
    assert _env({}, "limits.cpu") == str(os.cpu_count() or 1)


def test_unsupported_fields_cannot_create_the_container() -> None:
    with pytest.raises(ContainerConfigError):
        _env({}, "requests.gpu")


def test_quantities() -> None:
    assert parse_quantity("250m") * 4 == 1
    assert parse_quantity("2Ki") == 2048 and parse_quantity("1e3") == 1000
    with pytest.raises(ValueError):
        parse_quantity("lots")
