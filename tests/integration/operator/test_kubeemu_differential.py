"""The emulator against the real kube-apiserver: the same requests to both, and no difference.

Each test is a scenario (`differential.Recorder`): it runs once against the emulator and once
against a real API server (v1.36, `ControlPlane` without controllers; the session's
`differential_servers` fixture), each in a namespace of its own, and
`differential.differences` compares the two transcripts: HTTP status, Status reason and message,
body shape and values (volatile ones blanked), watch event sequences. This file: custom
resources (InferenceEngines, CRDs, groups nothing serves); `test_kubeemu_differential_builtin.py`:
the built-in kinds the operator writes, finalizers and watches. Where the two must differ, the
reason is in `differential.KNOWN` or `differential.KNOWN_GAPS`, and nowhere else.
"""

from __future__ import annotations

import copy
from typing import Any

from differential import (
    CRDS,
    IE_CRD,
    JSON_PATCH,
    MERGE,
    STRATEGIC,
    Recorder,
    compare,
    engine,
    ies,
)

# --- InferenceEngines: create, read, list, write, errors


def test_engines_create_get_list(differential_servers) -> None:
    def scenario(api: Recorder, ns: str) -> None:
        api.call("create", "POST", ies(ns), engine())
        api.call("create again", "POST", ies(ns), engine())
        api.call("get", "GET", f"{ies(ns)}/llama")
        api.call("get missing", "GET", f"{ies(ns)}/nope")
        labelled = engine("other")
        labelled["metadata"]["labels"] = {"tier": "a"}
        api.call("create labelled", "POST", ies(ns), labelled)
        api.call("list by label", "GET", f"{ies(ns)}?labelSelector=tier%3Da")
        api.call("list not by label", "GET", f"{ies(ns)}?labelSelector=tier%21%3Da")
        nameless = engine()
        nameless["metadata"] = {}
        api.call("create without a name", "POST", ies(ns), nameless)
        api.call("create a bad name", "POST", ies(ns), engine("Bad_Name"))
        generated = engine()
        generated["metadata"] = {"generateName": "gen-"}
        api.call("create by generateName", "POST", ies(ns), generated)

    compare(differential_servers, scenario)


def test_engine_patches_and_updates(differential_servers) -> None:
    def scenario(api: Recorder, ns: str) -> None:
        obj = engine()
        obj["metadata"]["labels"] = {"a": "1", "b": "2"}
        created = api.call("create", "POST", ies(ns), obj)
        url = f"{ies(ns)}/llama"
        api.call("merge: null deletes", "PATCH", url, {"metadata": {"labels": {"a": None}}}, MERGE)
        ops = [{"op": "replace", "path": "/spec/dataParallelSize", "value": 4}]
        api.call("json patch", "PATCH", url, ops, JSON_PATCH)
        failed = [{"op": "test", "path": "/spec/dataParallelSize", "value": 9}]
        api.call("json patch, failed test", "PATCH", url, failed, JSON_PATCH)
        api.call("strategic on a CR", "PATCH", url, {"spec": {}}, STRATEGIC)
        api.call("PUT stale", "PUT", url, created)
        current = api.call("get", "GET", url)
        stale = {"metadata": {"resourceVersion": created["metadata"]["resourceVersion"]}}
        api.call("merge stale", "PATCH", url, {**stale, "spec": {"dataParallelSize": 2}}, MERGE)
        blind = copy.deepcopy(current)
        del blind["metadata"]["resourceVersion"]
        api.call("PUT without resourceVersion", "PUT", url, blind)
        current["spec"]["dataParallelSize"] = 3
        api.call("PUT current", "PUT", url, current)

    compare(differential_servers, scenario)


def test_engine_status_and_scale_subresources(differential_servers) -> None:
    def scenario(api: Recorder, ns: str) -> None:
        url = f"{ies(ns)}/llama"
        api.call("create with a status", "POST", ies(ns), {**engine(), "status": {"x": 1}})
        body = {"metadata": {"labels": {"x": "y"}}, "spec": {"dataParallelSize": 5}}
        status = {"rankSummary": "0/1", "replicas": 1, "selector": "a=b"}
        api.call("status write", "PATCH", f"{url}/status", {**body, "status": status}, MERGE)
        api.call("main write of status", "PATCH", url, {"status": {"rankSummary": "9"}}, MERGE)
        api.call("label write", "PATCH", url, {"metadata": {"labels": {"a": "b"}}}, MERGE)
        api.call("get", "GET", url)
        scale = api.call("get scale", "GET", f"{url}/scale")
        stale = {"metadata": {"resourceVersion": "1"}, "spec": {"replicas": 3}}
        api.call("scale stale", "PATCH", f"{url}/scale", stale, MERGE)
        api.call("scale -1", "PATCH", f"{url}/scale", {"spec": {"replicas": -1}}, MERGE)
        api.call("scale 3", "PATCH", f"{url}/scale", {"spec": {"replicas": 3}}, MERGE)
        scale["spec"]["replicas"] = 2
        api.call("PUT scale, stale", "PUT", f"{url}/scale", scale)
        api.call("get after", "GET", url)
        api.call("missing subresource", "GET", f"{url}/nope")

    compare(differential_servers, scenario)


def test_engine_validation(differential_servers) -> None:
    """The CRD's schema and CEL rules, with the real server's messages."""

    def scenario(api: Recorder, ns: str) -> None:
        bad = {
            "minimum": engine(dataParallelSize=-1),
            "maximum": engine(tensorParallelSize=9),
            "type": engine(dataParallelSize="two"),
            "required": engine(image=None),
            "enum": engine(shutdown={"mode": "Later"}),
            "cel": engine(shutdown={"mode": "Abort", "drainTimeoutSeconds": 10}),
            "cel across fields": engine(engine={"maxNumSeqs": 64, "maxNumBatchedTokens": 32}),
            "name too long for the rule": engine("x" * 51),
            "two errors": engine(dataParallelSize=-1, tensorParallelSize=9),
        }
        for label, obj in bad.items():
            obj["spec"] = {k: v for k, v in obj["spec"].items() if v is not None}
            api.call(label, "POST", ies(ns), obj)
        api.call("create", "POST", ies(ns), engine())
        url = f"{ies(ns)}/llama"
        shutdown = {"spec": {"shutdown": {"mode": "Abort", "drainTimeoutSeconds": 5}}}
        api.call("cel on update", "PATCH", url, shutdown, MERGE)
        api.call("unknown fields are pruned", "PATCH", url, {"spec": {"bogus": 1}}, MERGE)
        api.call("unknown status fields too", "PATCH", f"{url}/status", {"status": {"x": 1}}, MERGE)

    compare(differential_servers, scenario)


# --- CRDs and API groups


def _crd(group: str, plural: str, kind: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{group}"},
        "spec": {
            "group": group,
            "scope": "Namespaced",
            "names": {"kind": kind, "plural": plural},
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": schema},
                }
            ],
        },
    }


def test_crd_structure_is_checked(differential_servers) -> None:
    """What the real server refused of our CRD (issue 35): anything on the root `metadata`
    but its type, and properties other than name and generateName there."""

    def scenario(api: Recorder, ns: str) -> None:
        described = {"type": "object", "description": "Standard object metadata."}
        schema = {"type": "object", "properties": {"metadata": described}}
        api.call("description on metadata", "POST", CRDS, _crd("a.dev", "as", "A", schema))
        labels = {"type": "object", "properties": {"labels": {"type": "object"}}}
        schema = {"type": "object", "properties": {"metadata": labels}}
        api.call("labels under metadata", "POST", CRDS, _crd("b.dev", "bs", "B", schema))
        name = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}}}
        schema = {"type": "object", "properties": {"metadata": name}}
        api.call("name under metadata", "POST", CRDS, _crd("c.dev", "cs", "C", schema))
        api.call(
            "wrong name",
            "POST",
            CRDS,
            {**_crd("d.dev", "ds", "D", {"type": "object"}), "metadata": {"name": "x.d.dev"}},
        )
        ours = copy.deepcopy(IE_CRD)
        ours["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["metadata"] = (
            described
        )
        ours["metadata"]["name"] = "inferenceengines.other.dev"
        ours["spec"]["group"] = "other.dev"
        api.call("our CRD as it was", "POST", CRDS, ours)

    compare(differential_servers, scenario)


def test_unserved_groups_and_kinds(differential_servers) -> None:
    def scenario(api: Recorder, ns: str) -> None:
        peerings = "/apis/kopf.dev/v1/clusterkopfpeerings"
        api.call("unserved group", "GET", "/apis/kopf.dev/v1")
        api.call("unserved group's kind", "GET", f"{peerings}/corefleet-operator")
        api.call("unserved kind in a served group", "GET", "/apis/apps/v1/namespaces/x/foos")
        api.call("unserved core kind", "GET", f"/api/v1/namespaces/{ns}/foos")

    compare(differential_servers, scenario)
