"""The CRD: its schema and CEL rules refuse bad manifests and accept good ones."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from crdcheck import CRD, SCHEMA, VERSION, defaulted, errors, rules

from corefleet.operator.spec import InvalidSpec, parse_spec

BASE: dict[str, Any] = {
    "apiVersion": "corefleet.dev/v1alpha1",
    "kind": "InferenceEngine",
    "metadata": {"name": "llama", "namespace": "default"},
    "spec": {"image": "ghcr.io/corefleet/corefleet:0.1.0", "model": {"path": "/models/smollm2"}},
}


def manifest(**spec: Any) -> dict[str, Any]:
    """BASE with top-level spec fields replaced (None deletes)."""
    out = copy.deepcopy(BASE)
    for key, value in spec.items():
        if value is None:
            out["spec"].pop(key, None)
        else:
            out["spec"][key] = value
    return out


PVC = {"persistentVolumeClaim": {"claimName": "weights"}}
VALID = {
    "minimal": manifest(),
    "everything": manifest(
        model={
            "path": "/models/llama-3-8b",
            "volume": PVC,
            "servedModelName": "llama3",
            "dtype": "bfloat16",
            "maxModelLen": 8192,
        },
        imagePullPolicy="Always",
        resources={"limits": {"nvidia.com/gpu": 2, "memory": "64Gi"}, "requests": {"cpu": "8"}},
        nodeSelector={"nvidia.com/gpu.product": "H100"},
        tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        affinity={"nodeAffinity": {}},
        env=[
            {"name": "HF_HOME", "value": "/tmp"},
            {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}},
        ],
        dataParallelSize=8,
        tensorParallelSize=2,
        progressDeadlineSeconds=1200,
        engine={
            "maxNumSeqs": 128,
            "maxNumBatchedTokens": 16384,
            "blockSize": 32,
            "gpuMemoryUtilization": 0.85,
            "enablePrefixCaching": False,
            "enableChunkedPrefill": False,
        },
        shutdown={"mode": "Drain", "drainTimeoutSeconds": 120},
        coordinator={
            "routing": "PrefixAware",
            "service": {"type": "LoadBalancer", "port": 80},
            "resources": {"limits": {"cpu": "2"}},
            "apiKeySecretRef": {"name": "api", "key": "token"},
            "toolCallParser": "hermes",
        },
    ),
    "abort without timeout": manifest(shutdown={"mode": "Abort"}),
    "node port": manifest(coordinator={"service": {"type": "NodePort", "nodePort": 30080}}),
    "several coordinators": manifest(coordinator={"replicas": 3, "routing": "PrefixHash"}),
    "autoscaled coordinators": manifest(
        coordinator={
            "autoscaling": {
                "minReplicas": 2,
                "maxReplicas": 8,
                "targetCPUUtilizationPercentage": 150,
            },
            "resources": {"requests": {"cpu": "500m"}},
        }
    ),
    "autoscaling at a fixed count": manifest(
        coordinator={"autoscaling": {"minReplicas": 4, "maxReplicas": 4}}
    ),
    "scaled to zero": manifest(dataParallelSize=0),
    "expert-parallel group": manifest(
        enableExpertParallel=True,
        dataParallelSize=4,
        resources={"limits": {"nvidia.com/gpu": 1}},
    ),
    "expert-parallel group, explicit sizes of one": manifest(
        enableExpertParallel=True, tensorParallelSize=1, pipelineParallelSize=1
    ),
    "image volume, path at the mount": manifest(
        model={
            "path": "/weights",
            "mountPath": "/weights",
            "volume": {"image": {"reference": "registry/models/llama:1"}},
        }
    ),
    "no chunked prefill, enough tokens": manifest(
        model={"path": "/m", "maxModelLen": 4096},
        engine={"enableChunkedPrefill": False, "maxNumBatchedTokens": 4096},
    ),
}
LONG_NAME = {**manifest(), "metadata": {"name": "x" * 51, "namespace": "default"}}
INVALID = {  # name -> (manifest, a fragment of the refusal)
    "name too long for rank hostnames": (LONG_NAME, "at most 50 characters"),
    "no image": (manifest(image=None), "'image' is a required property"),
    "no model path": (manifest(model={"dtype": "auto"}), "'path' is a required property"),
    "relative model path": (manifest(model={"path": "models/x"}), "does not match"),
    "negative ranks": (manifest(dataParallelSize=-1), "less than the minimum"),
    "zero tensor parallel": (manifest(tensorParallelSize=0), "less than the minimum"),
    "tensor parallel beyond a node": (manifest(tensorParallelSize=9), "greater than the maximum"),
    "tensor x pipeline beyond a node": (
        manifest(tensorParallelSize=4, pipelineParallelSize=4),
        "at most 8",
    ),
    "expert parallel with tensor parallelism": (
        manifest(enableExpertParallel=True, tensorParallelSize=2),
        "enableExpertParallel needs tensorParallelSize x pipelineParallelSize == 1",
    ),
    "expert parallel with pipeline stages": (
        manifest(enableExpertParallel=True, pipelineParallelSize=2),
        "enableExpertParallel needs tensorParallelSize x pipelineParallelSize == 1",
    ),
    "expert parallel as a string": (manifest(enableExpertParallel="true"), "is not of type"),
    "unknown dtype": (manifest(model={"path": "/m", "dtype": "int8"}), "is not one of"),
    "odd block size": (manifest(engine={"blockSize": 12}), "is not one of"),
    "zero memory share": (manifest(engine={"gpuMemoryUtilization": 0}), "less than or equal"),
    "memory share above 1": (manifest(engine={"gpuMemoryUtilization": 1.5}), "greater than"),
    "unknown shutdown mode": (manifest(shutdown={"mode": "Kill"}), "is not one of"),
    "zero drain timeout": (manifest(shutdown={"drainTimeoutSeconds": 0}), "less than the minimum"),
    "unknown routing": (manifest(coordinator={"routing": "Random"}), "is not one of"),
    "unknown tool call parser": (
        manifest(coordinator={"toolCallParser": "mistral"}),
        "is not one of",
    ),
    "port out of range": (manifest(coordinator={"service": {"port": 70000}}), "greater than"),
    "no coordinator": (manifest(coordinator={"replicas": 0}), "less than the minimum"),
    "absurd coordinator count": (
        manifest(coordinator={"replicas": 2**31}),
        "greater than the maximum",
    ),
    "coordinators as a string": (manifest(coordinator={"replicas": "2"}), "is not of type"),
    "autoscaling without a maximum": (
        manifest(coordinator={"autoscaling": {"minReplicas": 2}}),
        "'maxReplicas' is a required property",
    ),
    "autoscaling above the maximum": (
        manifest(coordinator={"autoscaling": {"maxReplicas": 2**31}}),
        "greater than the maximum",
    ),
    "zero cpu target": (
        manifest(
            coordinator={"autoscaling": {"maxReplicas": 2, "targetCPUUtilizationPercentage": 0}}
        ),
        "less than the minimum",
    ),
    "bad pull policy": (manifest(imagePullPolicy="Sometimes"), "is not one of"),
    "gpu count as a list": (
        manifest(resources={"limits": {"nvidia.com/gpu": [1]}}),
        "is not valid under any",
    ),
    "api key ref without name": (
        manifest(coordinator={"apiKeySecretRef": {"key": "k"}}),
        "'name' is a required property",
    ),
    "drain timeout with Abort": (
        manifest(shutdown={"mode": "Abort", "drainTimeoutSeconds": 5}),
        "only allowed with mode Drain",
    ),
    "batch below model length": (
        manifest(
            model={"path": "/m", "maxModelLen": 8192},
            engine={"enableChunkedPrefill": False, "maxNumBatchedTokens": 4096},
        ),
        "must be >= model.maxModelLen",
    ),
    "batch below max seqs": (
        manifest(engine={"maxNumSeqs": 256, "maxNumBatchedTokens": 128}),
        "must be >= engine.maxNumSeqs",
    ),
    "two volume sources": (
        manifest(model={"path": "/models/m", "volume": {**PVC, "hostPath": {"path": "/data"}}}),
        "exactly one volume source",
    ),
    "empty volume": (
        manifest(model={"path": "/models/m", "volume": {}}),
        "exactly one volume source",
    ),
    "path outside the mount": (
        manifest(model={"path": "/opt/m", "volume": PVC}),
        "must lie under model.mountPath",
    ),
    "node port on ClusterIP": (
        manifest(coordinator={"service": {"nodePort": 30080}}),
        "only allowed with type NodePort",
    ),
    "autoscaling minimum above its maximum": (
        manifest(coordinator={"autoscaling": {"minReplicas": 5, "maxReplicas": 2}}),
        "minReplicas must be <= maxReplicas",
    ),
    "reserved env name": (
        manifest(env=[{"name": "POD_IP", "value": "1.2.3.4"}]),
        "set by the operator",
    ),
    "value and valueFrom": (
        manifest(env=[{"name": "X", "value": "1", "valueFrom": {"fieldRef": {}}}]),
        "mutually exclusive",
    ),
}


def test_there_are_enough_cases():
    assert len(VALID) >= 5 and len(INVALID) >= 15


@pytest.mark.parametrize("name", sorted(VALID))
def test_valid_manifests_are_accepted(name):
    assert errors(VALID[name]) == []
    parse_spec(defaulted(VALID[name])["spec"])  # and the operator can act on them


@pytest.mark.parametrize("name", sorted(INVALID))
def test_invalid_manifests_are_refused(name):
    body, fragment = INVALID[name]
    found = errors(body)
    assert any(fragment in e for e in found), found


CEL_ONLY = [
    "tensor x pipeline beyond a node",
    "expert parallel with tensor parallelism",
    "expert parallel with pipeline stages",
    "drain timeout with Abort",
    "batch below model length",
    "batch below max seqs",
    "two volume sources",
    "empty volume",
    "path outside the mount",
    "node port on ClusterIP",
    "autoscaling minimum above its maximum",
]
# Schema refusals the operator repeats, for a spec that skipped the server's validation: a
# replica count of 2**31 must end as a Degraded engine, never as a Deployment that asks for it.
SCHEMA_MIRRORED = [
    "unknown tool call parser",
    "expert parallel as a string",
    "tensor parallel beyond a node",
    "no coordinator",
    "absurd coordinator count",
    "coordinators as a string",
    "autoscaling without a maximum",
    "autoscaling above the maximum",
    "zero cpu target",
    "negative ranks",
    "port out of range",
]


@pytest.mark.parametrize("name", CEL_ONLY)
def test_the_operator_refuses_what_cel_refuses(name):
    # Defence in depth: a server without CEL (or an old object) still gets InvalidSpec.
    with pytest.raises(InvalidSpec):
        parse_spec(defaulted(INVALID[name][0])["spec"])


@pytest.mark.parametrize("name", SCHEMA_MIRRORED)
def test_the_operator_refuses_what_the_schema_refuses(name):
    with pytest.raises(InvalidSpec, match=r"^spec\."):  # the message names the field
        parse_spec(defaulted(INVALID[name][0])["spec"])


def test_absurd_values_name_the_field_and_its_bounds():
    base = BASE["spec"]
    with pytest.raises(
        InvalidSpec,
        match=r"spec\.coordinator\.replicas must be an integer in 1\.\.100, got 2147483648",
    ):
        parse_spec({**base, "coordinator": {"replicas": 2**31}})
    with pytest.raises(
        InvalidSpec, match=r"spec\.dataParallelSize must be an integer in 0\.\.1024"
    ):
        parse_spec({**base, "dataParallelSize": 2**31})
    with pytest.raises(InvalidSpec, match=r"spec\.coordinator\.replicas .* got True"):
        parse_spec({**base, "coordinator": {"replicas": True}})
    with pytest.raises(InvalidSpec, match="minReplicas must be <= "):
        parse_spec({**base, "coordinator": {"autoscaling": {"minReplicas": 3, "maxReplicas": 2}}})
    with pytest.raises(InvalidSpec, match="autoscaling must be an object"):
        parse_spec({**base, "coordinator": {"autoscaling": 3}})


def test_every_cel_rule_compiles_and_there_are_cross_field_rules():
    assert len(list(rules())) >= 8


def test_defaults_fill_the_spec_and_match_the_operators_defaults():
    spec = defaulted(BASE)["spec"]
    assert spec["dataParallelSize"] == 1 and spec["engine"]["maxNumSeqs"] == 256
    assert spec["shutdown"] == {"mode": "Drain"}
    assert spec["coordinator"]["service"] == {"type": "ClusterIP", "port": 8000}
    assert spec["coordinator"]["replicas"] == 1 and "autoscaling" not in spec["coordinator"]
    scaled = defaulted(manifest(coordinator={"autoscaling": {"maxReplicas": 3}}))["spec"]
    assert scaled["coordinator"]["autoscaling"] == {
        "minReplicas": 1,
        "maxReplicas": 3,
        "targetCPUUtilizationPercentage": 80,
    }
    assert parse_spec(scaled) == parse_spec(
        manifest(coordinator={"autoscaling": {"maxReplicas": 3}})["spec"]
    )
    # The operator repeats the defaults (it never writes spec); both must agree.
    assert parse_spec(spec) == parse_spec(BASE["spec"])


def test_scale_status_and_printer_columns():
    assert CRD["spec"]["names"]["shortNames"] == ["ie"]
    assert CRD["spec"]["scope"] == "Namespaced" and VERSION["name"] == "v1alpha1"
    assert VERSION["subresources"] == {
        "status": {},
        "scale": {
            "specReplicasPath": ".spec.dataParallelSize",
            "statusReplicasPath": ".status.replicas",
            "labelSelectorPath": ".status.selector",
        },
    }
    printed = VERSION["additionalPrinterColumns"]
    columns = {c["name"]: c["jsonPath"] for c in printed}
    # `kubectl get ie` (priority 0): tests/e2e/test_smollm2_fleet.py reads RANKS and READY.
    assert [c["name"] for c in printed if not c.get("priority")] == [
        "Ranks",
        "Ready",
        "Endpoint",
        "Age",
    ]
    # `kubectl get ie -o wide` adds the parallel layout and routing (priority 1).
    assert [c["name"] for c in printed if c.get("priority") == 1] == [
        "DP",
        "TP",
        "PP",
        "EP",
        "Up-To-Date",
        "Routing",
        "Coordinator",
        "Coordinators",
        "Shutdown",
        "Model",
    ]
    for path in columns.values():  # every column reads a field the schema has
        node: Any = SCHEMA
        for part in path.split("[")[0].strip(".").split("."):
            if part == "metadata":
                break  # ObjectMeta: the server's, not in the CRD's schema
            node = node["properties"][part]
    status = SCHEMA["properties"]["status"]["properties"]
    stages = status["ranks"]["items"]["properties"]["stage"]["enum"]
    assert stages == [
        "Pending",
        "Scheduling",
        "Loading",
        "Handshaking",
        "Ready",
        "Draining",
        "Failed",
    ]


def test_status_written_by_the_operator_fits_the_schema():
    import datetime

    from corefleet.operator.status import invalid_spec_status

    status = invalid_spec_status(
        {}, 3, "spec.image is required", datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc)
    )
    body = {**defaulted(BASE), "status": status}
    assert errors(body) == []


@pytest.mark.parametrize(
    "resources",
    [
        {"limits": {"nvidia.com/gpu": 1}},
        {"requests": {"nvidia.com/gpu": "4"}, "limits": {"nvidia.com/gpu": "4"}},
        {"limits": {"nvidia.com/gpu": "two"}},
    ],
)
def test_a_gpu_count_other_than_the_tensor_parallel_size_is_refused(resources):
    with pytest.raises(InvalidSpec, match=r"the rank runs 2 workers .*one per GPU"):
        parse_spec({**BASE["spec"], "tensorParallelSize": 2, "resources": resources})
    both = {"limits": {"nvidia.com/gpu": 2}, "requests": {"nvidia.com/gpu": "2"}}
    assert parse_spec({**BASE["spec"], "tensorParallelSize": 2, "resources": both})
    assert parse_spec({**BASE["spec"], "tensorParallelSize": 2})  # a CPU fleet asks for none


def test_a_gpu_count_follows_tensor_times_pipeline_parallelism():
    layout = {"tensorParallelSize": 2, "pipelineParallelSize": 2}
    four = {"limits": {"nvidia.com/gpu": 4}}
    spec = parse_spec({**BASE["spec"], **layout, "resources": four})
    assert (spec.tensor_parallel_size, spec.pipeline_parallel_size) == (2, 2)
    with pytest.raises(InvalidSpec, match="runs 4 workers"):
        parse_spec({**BASE["spec"], **layout, "resources": {"limits": {"nvidia.com/gpu": 2}}})


def test_expert_parallelism_is_off_by_default_and_refuses_split_ranks_by_name():
    assert defaulted(BASE)["spec"]["enableExpertParallel"] is False
    assert parse_spec(BASE["spec"]).enable_expert_parallel is False
    group = parse_spec({**BASE["spec"], "enableExpertParallel": True, "dataParallelSize": 4})
    assert group.enable_expert_parallel and group.data_parallel_size == 4
    for layout in ({"tensorParallelSize": 2}, {"pipelineParallelSize": 2}):
        with pytest.raises(
            InvalidSpec,
            match=r"^spec\.enableExpertParallel needs tensorParallelSize x "
            r"pipelineParallelSize == 1 \(got \d x \d\)",
        ):
            parse_spec({**BASE["spec"], "enableExpertParallel": True, **layout})
    # The rank runs one process: a GPU count other than 1 is refused as for any such rank.
    with pytest.raises(InvalidSpec, match="runs 1 workers"):
        parse_spec(
            {
                **BASE["spec"],
                "enableExpertParallel": True,
                "resources": {"limits": {"nvidia.com/gpu": 2}},
            }
        )
