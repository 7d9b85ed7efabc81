"""Golden manifests of every builder, and the properties the reconcile relies on."""

from __future__ import annotations

import os
import pathlib

import pytest
import yaml

from corefleet.operator import coordinator_resources as coord
from corefleet.operator import resources
from corefleet.operator.curve import CurveKeyPair, CurveKeys
from corefleet.operator.flags import engine_args, termination_grace_seconds
from corefleet.operator.naming import Owner, coordinator_discovery_name, spec_hash
from corefleet.operator.spec import InvalidSpec, parse_spec

GOLDEN = pathlib.Path(__file__).parent / "golden"
OWNER = Owner(name="llama", namespace="prod", uid="0b1c2d3e-uid")
SPEC = parse_spec(
    {
        "image": "ghcr.io/corefleet/corefleet:0.1.0",
        "model": {
            "path": "/models/llama-3-8b",
            "servedModelName": "llama3",
            "dtype": "bfloat16",
            "maxModelLen": 8192,
            "volume": {"persistentVolumeClaim": {"claimName": "weights"}},
        },
        "resources": {"limits": {"nvidia.com/gpu": 1, "memory": "64Gi"}},
        "nodeSelector": {"nvidia.com/gpu.product": "H100"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "env": [{"name": "HF_HUB_OFFLINE", "value": "1"}],
        "dataParallelSize": 4,
        "engine": {"maxNumSeqs": 128, "maxNumBatchedTokens": 8192, "enableChunkedPrefill": False},
        "shutdown": {"mode": "Drain", "drainTimeoutSeconds": 120},
        "coordinator": {
            "routing": "PrefixAware",
            "replicas": 2,
            "service": {"type": "NodePort", "nodePort": 30080},
            "resources": {"limits": {"cpu": "2"}},
            "apiKeySecretRef": {"name": "api"},
        },
    }
)
KEYS = CurveKeys(
    server=CurveKeyPair(public="S" * 40, secret="s" * 40),
    client=CurveKeyPair(public="C" * 40, secret="c" * 40),
)
AUTOSCALED = parse_spec(
    {
        "image": "i",
        "model": {"path": "/m"},
        "coordinator": {
            "replicas": 3,  # not used: the HPA owns the count
            "autoscaling": {"minReplicas": 2, "maxReplicas": 6},
            "resources": {"requests": {"cpu": "500m"}},
        },
    }
)
BUILDERS = {
    "engine-pod": lambda: resources.build_engine_pod(OWNER, SPEC, 1),
    "coordinator-deployment": lambda: coord.build_coordinator_deployment(OWNER, SPEC),
    "coordinator-service": lambda: coord.build_coordinator_service(OWNER, SPEC),
    "coordinator-discovery-service": lambda: coord.build_coordinator_discovery_service(OWNER),
    "coordinator-disruption-budget": lambda: coord.build_coordinator_disruption_budget(OWNER),
    "coordinator-autoscaler": lambda: coord.build_coordinator_autoscaler(OWNER, AUTOSCALED),
    "engine-service": lambda: resources.build_engine_service(OWNER),
    "args-configmap": lambda: resources.build_args_configmap(OWNER, SPEC),
    "pod-disruption-budget": lambda: resources.build_pod_disruption_budget(OWNER),
    "network-policy": lambda: coord.build_network_policy(OWNER),
    "curve-secret": lambda: resources.build_curve_secret(OWNER, KEYS),
}


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_builder_matches_its_golden_manifest(name):
    built = BUILDERS[name]()
    path = GOLDEN / f"{name}.yaml"
    if os.environ.get("COREFLEET_REGEN_GOLDEN") == "1":  # after a deliberate change; review diff
        path.write_text(yaml.safe_dump(built, sort_keys=False, width=100))
    assert built == yaml.safe_load(path.read_text())


def test_build_children_lists_every_kind_and_the_secret_only_with_keys():
    kinds = [c["kind"] for c in resources.build_children(OWNER, SPEC)]
    assert kinds == [
        "ConfigMap",
        "Service",
        "PodDisruptionBudget",
        "Service",
        "Service",
        "PodDisruptionBudget",
        "NetworkPolicy",
        "Deployment",
    ]
    assert resources.build_children(OWNER, SPEC, KEYS)[0]["kind"] == "Secret"
    # The HPA comes only with autoscaling, after the Deployment it scales.
    autoscaled = [c["kind"] for c in resources.build_children(OWNER, AUTOSCALED)]
    assert autoscaled == [*kinds, "HorizontalPodAutoscaler"]
    # Names are unique per kind: the reconcile keys children by (kind, name).
    children = resources.build_children(OWNER, AUTOSCALED, KEYS)
    keys = [(c["kind"], c["metadata"]["name"]) for c in children]
    assert len(set(keys)) == len(keys)


def test_engine_flags_follow_the_spec():
    minimal = parse_spec({"image": "i", "model": {"path": "/m"}})
    assert engine_args(minimal) == [
        "--model",
        "/m",
        "--dtype",
        "auto",
        "--tensor-parallel-size",
        "1",
        "--max-num-seqs",
        "256",
        "--block-size",
        "16",
        "--gpu-memory-utilization",
        "0.9",
        "--enable-prefix-caching",
        "--enable-chunked-prefill",
        "--shutdown-mode",
        "drain",
        "--shutdown-timeout",
        "30",
    ]
    abort = parse_spec(
        {
            "image": "i",
            "model": {"path": "/m"},
            "shutdown": {"mode": "Abort"},
            "engine": {"enablePrefixCaching": False},
        }
    )
    flags = engine_args(abort)
    assert flags[-2:] == ["--shutdown-mode", "abort"] and "--no-enable-prefix-caching" in flags
    assert "--data-parallel-size" not in flags


def test_quantization_and_kv_cache_dtype_reach_the_ranks_only_when_set():
    quantized = parse_spec(
        {
            "image": "i",
            "model": {"path": "/m.gguf", "quantization": "none"},
            "engine": {"kvCacheDtype": "float32"},
        }
    )
    flags = engine_args(quantized)
    assert flags[flags.index("--quantization") + 1] == "none"
    assert flags[flags.index("--kv-cache-dtype") + 1] == "float32"
    defaults = engine_args(parse_spec({"image": "i", "model": {"path": "/m.gguf"}}))
    assert "--quantization" not in defaults and "--kv-cache-dtype" not in defaults
    with pytest.raises(InvalidSpec, match="quantization"):
        parse_spec({"image": "i", "model": {"path": "/m", "quantization": "awq"}})
    with pytest.raises(InvalidSpec, match="kvCacheDtype"):
        parse_spec({"image": "i", "model": {"path": "/m"}, "engine": {"kvCacheDtype": "int8"}})
    fp8 = parse_spec({"image": "i", "model": {"path": "/m"}, "engine": {"kvCacheDtype": "fp8"}})
    assert engine_args(fp8)[engine_args(fp8).index("--kv-cache-dtype") + 1] == "fp8"


def test_grace_period_is_the_drain_timeout_plus_a_margin():
    assert termination_grace_seconds(SPEC) == 120 + 15
    abort = parse_spec({"image": "i", "model": {"path": "/m"}, "shutdown": {"mode": "Abort"}})
    assert termination_grace_seconds(abort) == 15


def test_pod_hash_ignores_the_rank_count_but_not_the_engine_flags():
    template = resources.engine_pod_template("llama", parse_spec(_raw()))
    scaled = parse_spec({**_raw(), "dataParallelSize": 9})
    changed = parse_spec({**_raw(), "engine": {"maxNumSeqs": 64}})
    assert spec_hash(resources.engine_pod_template("llama", scaled)) == spec_hash(template)
    assert spec_hash(resources.engine_pod_template("llama", changed)) != spec_hash(template)
    pods = [resources.build_engine_pod(OWNER, SPEC, r) for r in (0, 3)]
    assert pods[0]["metadata"]["annotations"] == pods[1]["metadata"]["annotations"]
    assert pods[1]["spec"]["containers"][0]["args"][3:5] == ["--rank", "3"]


def _raw():
    return {"image": "i", "model": {"path": "/m"}}


def test_ranks_dial_the_headless_service_of_every_coordinator_ready_or_not():
    # A coordinator is Ready only once a rank has joined it: ranks must resolve it before.
    discovery = coord.build_coordinator_discovery_service(OWNER)
    name = discovery["metadata"]["name"]
    assert name == coordinator_discovery_name("llama") == "llama-coordinators"
    assert discovery["spec"]["clusterIP"] == "None"
    assert discovery["spec"]["publishNotReadyAddresses"] is True
    assert (
        discovery["spec"]["selector"]
        == coord.build_coordinator_deployment(OWNER, SPEC)["spec"]["selector"]["matchLabels"]
    )
    assert [p["port"] for p in discovery["spec"]["ports"]] == [5570]
    pod_args = resources.build_engine_pod(OWNER, SPEC, 0)["spec"]["containers"][0]["args"]
    assert pod_args[pod_args.index("--coordinator") + 1] == f"{name}:5570"
    assert resources.build_args_configmap(OWNER, SPEC)["data"]["coordinator"] == f"{name}:5570"


def test_clients_reach_only_ready_coordinators_and_only_the_api_port():
    service = coord.build_coordinator_service(OWNER, SPEC)["spec"]
    # False, not absent: a merge patch must turn off what earlier operators turned on.
    assert service["publishNotReadyAddresses"] is False
    assert [p["name"] for p in service["ports"]] == ["http"]


def test_the_longest_engine_name_gives_service_names_dns_accepts():
    # The CRD allows 50 characters; Service names are DNS-1035 labels of at most 63.
    owner = Owner(name="x" * 50, namespace="prod", uid="u")
    for child in resources.build_children(owner, AUTOSCALED, KEYS):
        if child["kind"] == "Service":
            assert len(child["metadata"]["name"]) <= 63, child["metadata"]["name"]


def test_coordinator_replicas_and_rollout_never_drop_below_the_count():
    deployment = coord.build_coordinator_deployment(OWNER, SPEC)["spec"]
    assert deployment["replicas"] == 2
    assert deployment["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1},
    }
    budget = coord.build_coordinator_disruption_budget(OWNER)
    assert budget["metadata"]["name"] == "llama-coordinator"
    assert budget["spec"] == {"maxUnavailable": 1, "selector": deployment["selector"]}
    assert (
        budget["metadata"]["name"]
        != resources.build_pod_disruption_budget(OWNER)["metadata"]["name"]
    )


def test_with_autoscaling_the_hpa_owns_replicas_and_targets_the_deployment():
    deployment = coord.build_coordinator_deployment(OWNER, AUTOSCALED)
    # No replicas at all: a merge patch of this spec leaves the HPA's count alone.
    assert "replicas" not in deployment["spec"]
    hpa = coord.build_coordinator_autoscaler(OWNER, AUTOSCALED)
    assert hpa is not None
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": deployment["metadata"]["name"],
    }
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 6)
    (metric,) = hpa["spec"]["metrics"]
    assert metric["resource"] == {
        "name": "cpu",
        "target": {"type": "Utilization", "averageUtilization": 80},
    }
    assert coord.build_coordinator_autoscaler(OWNER, SPEC) is None
    # Turning autoscaling on or off changes the Deployment's hash, so the reconcile patches it.
    fixed = coord.build_coordinator_deployment(OWNER, SPEC)["metadata"]["annotations"]
    assert deployment["metadata"]["annotations"] != fixed


def test_network_policy_admits_the_ranks_to_every_zmq_port_of_every_coordinator():
    policy = coord.build_network_policy(OWNER)["spec"]
    deployment = coord.build_coordinator_deployment(OWNER, SPEC)["spec"]
    assert policy["podSelector"]["matchLabels"] == deployment["selector"]["matchLabels"]
    ranks, http = policy["ingress"]
    assert sorted(p["port"] for p in ranks["ports"]) == [5570, 5571, 5572]
    assert ranks["from"] == [
        {"podSelector": {"matchLabels": resources.build_engine_service(OWNER)["spec"]["selector"]}}
    ]
    assert http == {"ports": [{"protocol": "TCP", "port": 8000}]}


def test_prefix_hash_routing_reaches_the_coordinator_flag():
    spec = parse_spec({**_raw(), "coordinator": {"routing": "PrefixHash"}})
    args = coord.build_coordinator_deployment(OWNER, spec)["spec"]["template"]["spec"][
        "containers"
    ][0]["args"]
    assert args[args.index("--routing") + 1] == "prefix-hash"
