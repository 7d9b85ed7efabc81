"""controller: creations checked against the API when the indexes may lag (a resumed standby).

A fake API client stands in for `KubeClient`: it lists what it was given and answers creates of
names it holds with None (the real client's 409 AlreadyExists).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any, cast

import aiohttp
import kopf
import pytest
from operator_fixtures import OWNER, spec

from corefleet.operator import controller
from corefleet.operator.controller import Runtime
from corefleet.operator.kube import KubeClient
from corefleet.operator.reconcile import Action
from corefleet.operator.resources import build_engine_pod

KEY = ("default", "llama")


class FakeClient:
    """`list_labelled` and `create` of a server holding `objects` (kind -> manifests)."""

    def __init__(self, **objects: list[dict[str, Any]]) -> None:
        self.objects = objects
        self.lists: list[tuple[str, str]] = []
        self.created: list[str] = []

    async def list_labelled(self, kind: str, namespace: str, selector: str) -> list[dict[str, Any]]:
        self.lists.append((kind, selector))
        return self.objects.get(kind, [])

    async def create(self, manifest: Mapping[str, Any]) -> dict[str, Any] | None:
        name = manifest["metadata"]["name"]
        if any(o["metadata"]["name"] == name for o in self.objects.get(manifest["kind"], [])):
            return None
        self.created.append(name)
        return dict(manifest)


def _create_rank(rank: int) -> Action:
    body = build_engine_pod(OWNER, spec(3), rank)
    return Action("create", "Pod", body["metadata"]["name"], body, "RankCreated", f"rank {rank}")


def _already_there(client: FakeClient, actions: list[Action]) -> list[str]:
    found = controller._already_there(cast(KubeClient, client), KEY, actions)
    return asyncio.run(found)


def test_creates_of_objects_the_api_has_are_reported_by_kind_and_name():
    client = FakeClient(Pod=[build_engine_pod(OWNER, spec(3), r) for r in (0, 1)])
    actions = [_create_rank(r) for r in range(3)]
    assert _already_there(client, actions) == ["Pod/llama-engine-0", "Pod/llama-engine-1"]
    assert client.lists == [("Pod", "corefleet.dev/engine=llama")]  # one list per created kind


def test_no_create_no_list():
    client = FakeClient()
    delete = Action("delete", "Pod", "llama-engine-2", None, "RankScaledDown", "rank 2")
    assert _already_there(client, [delete]) == []
    assert client.lists == []


def test_an_object_the_indexes_do_not_select_does_not_count():
    foreign = build_engine_pod(OWNER, spec(3), 0)
    labels = dict(foreign["metadata"]["labels"])
    labels.pop("app.kubernetes.io/managed-by")  # not ours: kopf's index never shows it
    client = FakeClient(Pod=[{**foreign, "metadata": {**foreign["metadata"], "labels": labels}}])
    assert _already_there(client, [_create_rank(0)]) == []


def test_a_create_answered_409_posts_no_event(monkeypatch):
    posted: list[str] = []
    monkeypatch.setattr(controller, "_post", lambda _b, _t, reason, msg: posted.append(msg))
    client = FakeClient(Pod=[build_engine_pod(OWNER, spec(3), 0)])
    runtime = Runtime(client=cast(KubeClient, client))
    logger = logging.getLogger("test")
    actions = [_create_rank(0), _create_rank(1)]
    asyncio.run(controller._execute(runtime, KEY, actions, {}, {}, cast(Any, logger)))
    assert client.created == ["llama-engine-1"]
    assert posted == ["rank 1"]


def test_an_api_that_does_not_answer_is_retried_soon_as_a_5xx(monkeypatch):
    # A request past the client's timeout (or a failed connection) must not fall through to
    # kopf's default 60 s back-off for a plain exception.
    for failure in (TimeoutError(), aiohttp.ClientConnectionError("refused")):

        async def unanswered(*_args: Any, failure: Exception = failure) -> None:
            raise failure

        monkeypatch.setattr(controller, "_reconcile_locked", unanswered)
        runtime = Runtime()
        runtime.last_status[KEY] = {"stale": True}
        body = {"metadata": {"namespace": KEY[0], "name": KEY[1]}}
        logger = cast(Any, logging.getLogger("test"))
        with pytest.raises(kopf.TemporaryError) as raised:
            asyncio.run(controller.reconcile_engine(body, runtime, cast(Any, {}), logger))
        assert raised.value.delay == controller.TRANSIENT_RETRY
        assert KEY not in runtime.last_status
