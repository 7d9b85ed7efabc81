"""The emulator against the real kube-apiserver, for the built-in kinds the operator writes
(pods, Services, ConfigMaps, Secrets, Deployments, PodDisruptionBudgets, NetworkPolicies,
HorizontalPodAutoscalers), deletion with finalizers, and watches from a resourceVersion. See
test_kubeemu_differential.py for how a scenario runs and what is compared.
"""

from __future__ import annotations

import copy
from typing import Any

from differential import MERGE, STRATEGIC, Recorder, compare, core, engine, ies

# --- built-in kinds the operator writes


def _pod(name: str, **labels: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "automountServiceAccountToken": False,
            "containers": [{"name": "engine", "image": "corefleet:test", "args": ["a"]}],
        },
    }


def test_pods(differential_servers) -> None:
    def scenario(api: Recorder, ns: str) -> None:
        pods = core(ns, "pods")
        api.call("create", "POST", pods, _pod("p0", rank="0", app="x"))
        api.call("create another", "POST", pods, _pod("p1", rank="1", app="x"))
        api.call("create again", "POST", pods, _pod("p0"))
        api.call("list by label", "GET", f"{pods}?labelSelector=rank%3D1")
        api.call("list by set", "GET", f"{pods}?labelSelector=rank%20in%20%280%2C1%29%2Capp")
        guard = {"metadata": {"annotations": {"karpenter.sh/do-not-disrupt": "true"}}}
        api.call("annotate", "PATCH", f"{pods}/p0", guard, MERGE)
        status = {
            "status": {
                "phase": "Running",
                "conditions": [{"type": "Ready", "status": "True"}],
            }
        }
        api.call("status", "PATCH", f"{pods}/p0/status", status, MERGE)
        image = {"spec": {"containers": [{"name": "engine", "image": "corefleet:new"}]}}
        api.call("strategic merge by name", "PATCH", f"{pods}/p0", image, STRATEGIC)
        api.call("get", "GET", f"{pods}/p0")
        target = {"apiVersion": "v1", "kind": "Node", "name": "node-a"}
        binding = {"apiVersion": "v1", "kind": "Binding", "metadata": {"name": "p0"}}
        api.call("bind", "POST", f"{pods}/p0/binding", {**binding, "target": target})
        api.call("bind again", "POST", f"{pods}/p0/binding", {**binding, "target": target})
        api.call("bound", "GET", f"{pods}/p0")
        api.call("delete bound", "DELETE", f"{pods}/p0")
        api.call("terminating", "GET", f"{pods}/p0")
        api.call("kubelet's delete", "DELETE", f"{pods}/p0?gracePeriodSeconds=0")
        api.call("delete", "DELETE", f"{pods}/p1")
        api.call("get deleted", "GET", f"{pods}/p1")
        api.call("delete missing", "DELETE", f"{pods}/p1")

    compare(differential_servers, scenario)


def test_services_configmaps_secrets(differential_servers) -> None:
    def scenario(api: Recorder, ns: str) -> None:
        port = {"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP"}
        service = {
            "metadata": {"name": "svc", "labels": {"a": "b"}},
            "spec": {"selector": {"a": "b"}, "ports": [port], "publishNotReadyAddresses": True},
        }
        api.call("service", "POST", core(ns, "services"), service)
        headless = copy.deepcopy(service)
        headless["metadata"]["name"] = "headless"
        headless["spec"]["clusterIP"] = "None"
        api.call("headless service", "POST", core(ns, "services"), headless)
        ports = {"spec": {"ports": [{**port, "port": 9000}]}}
        api.call("service merge", "PATCH", f"{core(ns, 'services')}/svc", ports, MERGE)
        config = {"metadata": {"name": "args"}, "data": {"args": "--x 1"}}
        api.call("configmap", "POST", core(ns, "configmaps"), config)
        update = {"data": {"args": "--x 2"}}
        api.call("configmap merge", "PATCH", f"{core(ns, 'configmaps')}/args", update, MERGE)
        secret = {"metadata": {"name": "keys"}, "type": "Opaque", "data": {"k": "YQ=="}}
        api.call("secret", "POST", core(ns, "secrets"), secret)
        api.call("secret get", "GET", f"{core(ns, 'secrets')}/keys")
        api.call("secret list", "GET", core(ns, "secrets"))
        for label, url in [
            ("delete service", f"{core(ns, 'services')}/svc"),
            ("delete secret", f"{core(ns, 'secrets')}/keys"),
        ]:
            api.call(label, "DELETE", url)

    compare(differential_servers, scenario)


def test_deployments_and_budgets(differential_servers) -> None:
    def scenario(api: Recorder, ns: str) -> None:
        deploys = f"/apis/apps/v1/namespaces/{ns}/deployments"
        container = {"name": "coordinator", "image": "corefleet:test"}
        template = {"metadata": {"labels": {"app": "d"}}, "spec": {"containers": [container]}}
        body = {
            "metadata": {"name": "d"},
            "spec": {"selector": {"matchLabels": {"app": "d"}}, "template": template},
        }
        api.call("deployment without replicas", "POST", deploys, body)
        api.call("scale", "GET", f"{deploys}/d/scale")
        api.call("scale to 3", "PATCH", f"{deploys}/d/scale", {"spec": {"replicas": 3}}, MERGE)
        strategy = {"spec": {"strategy": {"type": "RollingUpdate"}}}
        api.call("merge keeps replicas", "PATCH", f"{deploys}/d", strategy, MERGE)
        unset = {"spec": {"replicas": None}}
        api.call("replicas removed: 1", "PATCH", f"{deploys}/d", unset, MERGE)
        status = {"status": {"replicas": 1, "readyReplicas": 1, "availableReplicas": 1}}
        api.call("status", "PATCH", f"{deploys}/d/status", status, MERGE)
        pdbs = f"/apis/policy/v1/namespaces/{ns}/poddisruptionbudgets"
        budget = {
            "metadata": {"name": "b"},
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": {"app": "d"}}},
        }
        api.call("budget", "POST", pdbs, budget)
        api.call("budget merge", "PATCH", f"{pdbs}/b", {"spec": {"maxUnavailable": 0}}, MERGE)
        policies = f"/apis/networking.k8s.io/v1/namespaces/{ns}/networkpolicies"
        ingress = [{"from": [{"podSelector": {"matchLabels": {"app": "e"}}}]}]
        policy = {
            "metadata": {"name": "n"},
            "spec": {"podSelector": {"matchLabels": {"app": "d"}}, "ingress": ingress},
        }
        api.call("network policy", "POST", policies, policy)
        hpas = f"/apis/autoscaling/v2/namespaces/{ns}/horizontalpodautoscalers"
        target = {"apiVersion": "apps/v1", "kind": "Deployment", "name": "d"}
        hpa = {
            "metadata": {"name": "h"},
            "spec": {"scaleTargetRef": target, "minReplicas": 1, "maxReplicas": 4},
        }
        api.call("autoscaler", "POST", hpas, hpa)
        api.call("autoscaler merge", "PATCH", f"{hpas}/h", {"spec": {"maxReplicas": 6}}, MERGE)
        for label, url in [
            ("delete autoscaler", f"{hpas}/h"),
            ("delete policy", f"{policies}/n"),
            ("delete budget", f"{pdbs}/b"),
            ("delete deployment", f"{deploys}/d"),
        ]:
            api.call(label, "DELETE", url)

    compare(differential_servers, scenario)


def test_finalizers_hold_deleted_objects(differential_servers) -> None:
    def scenario(api: Recorder, ns: str) -> None:
        cms = core(ns, "configmaps")
        held = {"metadata": {"name": "held", "finalizers": ["test/a"]}, "data": {"a": "1"}}
        api.call("create held", "POST", cms, held)
        api.call("delete held", "DELETE", f"{cms}/held")
        api.call("still there", "GET", f"{cms}/held")
        more = {"metadata": {"finalizers": ["test/a", "test/b"]}}
        api.call("no new finalizer", "PATCH", f"{cms}/held", more, MERGE)
        api.call("release", "PATCH", f"{cms}/held", {"metadata": {"finalizers": None}}, MERGE)
        api.call("gone", "GET", f"{cms}/held")
        api.call("plain", "POST", cms, {"metadata": {"name": "plain"}})
        api.call("delete plain", "DELETE", f"{cms}/plain")
        obj = engine()
        obj["metadata"]["finalizers"] = ["operator.corefleet.dev/finalizer"]
        api.call("engine with a finalizer", "POST", ies(ns), obj)
        api.call("delete engine", "DELETE", f"{ies(ns)}/llama")
        api.call("engine kept", "GET", f"{ies(ns)}/llama")
        release = {"metadata": {"finalizers": []}}
        api.call("engine released", "PATCH", f"{ies(ns)}/llama", release, MERGE)
        api.call("engine gone", "GET", f"{ies(ns)}/llama")
        api.call("other engine", "POST", ies(ns), engine("other"))
        api.call("delete other", "DELETE", f"{ies(ns)}/other")

    compare(differential_servers, scenario)


def test_watches_from_a_resource_version(differential_servers) -> None:
    def scenario(api: Recorder, ns: str) -> None:
        cms = core(ns, "configmaps")
        start = api.call("list", "GET", cms)["metadata"]["resourceVersion"]
        api.call("create", "POST", cms, {"metadata": {"name": "w"}, "data": {"a": "1"}})
        api.call("patch", "PATCH", f"{cms}/w", {"data": {"a": "2"}}, MERGE)
        api.call("delete", "DELETE", f"{cms}/w")
        api.watch("watch", f"{cms}?resourceVersion={start}")
        api.watch("watch with bookmarks", f"{cms}?resourceVersion={start}&allowWatchBookmarks=true")
        start = api.call("list engines", "GET", ies(ns))["metadata"]["resourceVersion"]
        api.call("create engine", "POST", ies(ns), engine())
        api.call(
            "scale engine", "PATCH", f"{ies(ns)}/llama/scale", {"spec": {"replicas": 2}}, MERGE
        )
        api.call("status", "PATCH", f"{ies(ns)}/llama/status", {"status": {"replicas": 0}}, MERGE)
        api.call("delete engine", "DELETE", f"{ies(ns)}/llama")
        api.watch("watch engines", f"{ies(ns)}?resourceVersion={start}&allowWatchBookmarks=true")

    compare(differential_servers, scenario)
