"""The operator reads the coordinator's API key from the Secret the spec names (for the
coordinator's /admin/engines, which the key guards), through the real client and a real API
server, as the chart's ServiceAccount (`get` on Secrets)."""

from __future__ import annotations

import base64

from operator_harness import run
from real_cluster import real_cluster

from corefleet.operator.controller import Runtime, _api_key
from corefleet.operator.kube import login
from corefleet.operator.spec import parse_spec

SPEC = {"image": "corefleet:test", "model": {"path": "/models/m"}}


def test_api_key_comes_from_the_referenced_secret(tmp_path):
    async def scenario():
        async with real_cluster(tmp_path) as c:
            secret = {
                "metadata": {"name": "llm-key"},
                "data": {"key": base64.b64encode(b"s3cret\n").decode()},
            }
            await c.request("POST", "/api/v1/namespaces/default/secrets", secret)
            info = login()  # KUBECONFIG: the operator's
            assert info is not None and info.token
            runtime = Runtime()
            runtime.connect(info)
            ref = {"apiKeySecretRef": {"name": "llm-key", "key": "key"}}
            with_key = parse_spec({**SPEC, "coordinator": ref})
            missing = parse_spec(
                {**SPEC, "coordinator": {"apiKeySecretRef": {"name": "nope", "key": "key"}}}
            )
            try:
                return (
                    await _api_key(runtime, "default", with_key),
                    await _api_key(runtime, "default", missing),
                    await _api_key(runtime, "default", parse_spec(SPEC)),
                )
            finally:
                assert runtime.client is not None
                await runtime.client.close()

    assert run(scenario()) == ("s3cret", None, None)
