"""Golden manifests of every builder, and the properties the reconcile relies on."""

from __future__ import annotations

import os
import pathlib

import pytest
import yaml

from corefleet.operator import resources
from corefleet.operator.curve import CurveKeyPair, CurveKeys
from corefleet.operator.flags import engine_args, termination_grace_seconds
from corefleet.operator.naming import Owner, spec_hash
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
BUILDERS = {
    "engine-pod": lambda: resources.build_engine_pod(OWNER, SPEC, 1),
    "coordinator-deployment": lambda: resources.build_coordinator_deployment(OWNER, SPEC),
    "coordinator-service": lambda: resources.build_coordinator_service(OWNER, SPEC),
    "engine-service": lambda: resources.build_engine_service(OWNER),
    "args-configmap": lambda: resources.build_args_configmap(OWNER, SPEC),
    "pod-disruption-budget": lambda: resources.build_pod_disruption_budget(OWNER),
    "network-policy": lambda: resources.build_network_policy(OWNER),
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
        "Service",
        "PodDisruptionBudget",
        "NetworkPolicy",
        "Deployment",
    ]
    assert resources.build_children(OWNER, SPEC, KEYS)[0]["kind"] == "Secret"


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


def test_ranks_reach_a_coordinator_that_is_not_ready_yet():
    # The coordinator is Ready only once a rank is; ranks dial its Service to become ready.
    service = resources.build_coordinator_service(OWNER, SPEC)
    assert service["spec"]["publishNotReadyAddresses"] is True
    assert "handshake" in [p["name"] for p in service["spec"]["ports"]]
