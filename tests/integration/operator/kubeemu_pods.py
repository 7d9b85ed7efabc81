"""What only pods have: `pods/binding` (a scheduler's write) and `pods/log` (`kubectl logs`).

`PodEndpoints` is mixed into `kubeemu.KubeEmu`. The emulator runs no containers, so logs come from
whoever does: `KubeEmu(pod_logs=fn)` (or setting `emu.pod_logs` later), where
`fn(namespace, pod, container or None)` returns the log text, or None when there is none; it is
called on the emulator's thread. `follow=true` answers what there is now and ends.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import aiohttp.web
import kmock
from kubeemu_model import get_path, now_rfc3339
from kubeemu_request import StatusError, json_body

Key = tuple[str, str, str]  # as in kubeemu_lifecycle
PodLogs = Callable[[str, str, "str | None"], "str | None"]


class PodEndpoints:
    """pods/binding and pods/log over `KubeEmu`'s store."""

    # KubeEmu's fields and (from kubeemu_lifecycle) methods; annotations only, nothing shadowed
    objects: dict[Key, dict[str, Any]]
    pod_logs: PodLogs | None
    _next_rv: Callable[[], str]
    _emit: Callable[[str, str, dict[str, Any]], None]

    def _bind(self, request: kmock.Request, key: Key) -> aiohttp.web.Response:
        """POST pods/NAME/binding: what a scheduler does to put a pod on a node."""
        body = json_body(request.body, {})
        node = ((body.get("target") if isinstance(body, dict) else None) or {}).get("name")
        if not node:
            raise StatusError(400, "BadRequest", "a Binding needs target.name (the node)")
        pod = json.loads(json.dumps(self.objects[key]))
        if get_path(pod, ".spec.nodeName"):
            why = f'pod {key[2]} is already assigned to node "{pod["spec"]["nodeName"]}"'
            message = f'Operation cannot be fulfilled on pods/binding "{key[2]}": {why}'
            details = {"name": key[2], "kind": "pods/binding"}
            raise StatusError(409, "Conflict", message, details)
        pod.setdefault("spec", {})["nodeName"] = node
        conditions = [
            c
            for c in (pod.setdefault("status", {}).get("conditions") or [])
            if c.get("type") != "PodScheduled"
        ]
        scheduled = {"type": "PodScheduled", "status": "True", "lastTransitionTime": now_rfc3339()}
        pod["status"]["conditions"] = [*conditions, scheduled]
        pod["metadata"]["resourceVersion"] = self._next_rv()
        self.objects[key] = pod
        self._emit(key[0], "MODIFIED", pod)
        success = {"apiVersion": "v1", "kind": "Status", "metadata": {}, "status": "Success"}
        success["code"] = 201
        return aiohttp.web.json_response(success, status=201)

    def _log(self, request: kmock.Request, key: Key) -> aiohttp.web.Response:
        """GET pods/NAME/log: the text the `pod_logs` hook returns."""
        text = None
        if self.pod_logs is not None:
            text = self.pod_logs(key[1], key[2], request.params.get("container"))
        if text is None:
            why = "no logs: the emulator runs no containers and no pod_logs hook has them"
            raise StatusError(404, "NotFound", f"pod {key[2]!r}: {why}")
        tail = request.params.get("tailLines")
        if tail and tail.isdigit():
            text = "".join(text.splitlines(keepends=True)[-int(tail) :]) if int(tail) else ""
        return aiohttp.web.Response(text=text, content_type="text/plain")
