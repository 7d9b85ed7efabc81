"""The operator process: its CLI, its configuration, its imports (never torch)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from corefleet.operator import peering
from corefleet.operator.cli import LIVENESS, kopf_args
from corefleet.operator.kube import KubeClient, _decode
from corefleet.operator.settings import OperatorConfig


def test_cli_defaults_serve_all_namespaces_with_peering_and_liveness():
    args = kopf_args([])
    assert args[:6] == [
        "run",
        "-m",
        "corefleet.operator.main",
        "--all-namespaces",
        "--liveness",
        LIVENESS,
    ]
    assert args[6:8] == ["--peering", "corefleet-operator"] and args[8] == "--priority"
    assert 1 <= int(args[9]) <= 10_000


def test_cli_namespaces_standalone_and_explicit_priority():
    assert kopf_args(["-n", "a", "--namespace", "b", "--standalone", "--liveness", ""]) == [
        "run",
        "-m",
        "corefleet.operator.main",
        "--namespace",
        "a",
        "--namespace",
        "b",
        "--standalone",
    ]
    assert kopf_args(["--priority", "7", "--peering", "p", "-v"])[-5:] == [
        "--peering",
        "p",
        "--priority",
        "7",
        "--verbose",
    ]
    with pytest.raises(SystemExit):
        kopf_args(["-n", "a", "-A"])


def test_config_reads_the_environment_once():
    assert OperatorConfig.from_env({}) == OperatorConfig()
    config = OperatorConfig.from_env(
        {"COREFLEET_OPERATOR_TIMER_SECONDS": "2.5", "COREFLEET_OPERATOR_ADMIN_PROBE": "0"}
    )
    assert config.timer_seconds == 2.5 and config.admin_probe is False
    assert config.policy.failed_backoff_seconds == 10.0
    with pytest.raises(ValueError, match="COREFLEET_OPERATOR_TIMER_SECONDS"):
        OperatorConfig.from_env({"COREFLEET_OPERATOR_TIMER_SECONDS": "0"})


def test_api_client_urls_and_credentials():
    import kopf

    client = KubeClient(kopf.ConnectionInfo(server="http://127.0.0.1:1/", token="t0k"))
    assert client.url("Pod", "ns") == "http://127.0.0.1:1/api/v1/namespaces/ns/pods"
    assert client.url("InferenceEngine", "ns", "x", "status") == (
        "http://127.0.0.1:1/apis/corefleet.dev/v1alpha1/namespaces/ns/inferenceengines/x/status"
    )
    assert client._headers["Authorization"] == "Bearer t0k"
    assert _decode("LS0tLS1CRUdJTg==") == b"-----BEGIN"
    assert _decode("-----BEGIN CERT") == b"-----BEGIN CERT"


def test_cli_runs_standalone_when_the_preflight_finds_no_peering():
    assert kopf_args(["-n", "a", "--liveness", ""], peered=False) == [
        "run",
        "-m",
        "corefleet.operator.main",
        "--namespace",
        "a",
        "--standalone",
    ]
    assert "--standalone" not in kopf_args(["--require-peering"])  # kopf has no such flag
    with pytest.raises(SystemExit):
        kopf_args(["--standalone", "--require-peering"])


def test_peering_objects_per_scope_with_the_command_that_creates_each():
    cluster, *_ = peering.peering_objects([], "p")
    assert str(cluster) == "ClusterKopfPeering 'p'"
    assert cluster.path == "apis/kopf.dev/v1/clusterkopfpeerings/p"
    assert cluster.create_command == (
        'echo \'{"apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering", "metadata":'
        ' {"name": "p"}}\' | kubectl apply -f -'
    )
    spaced = peering.peering_objects(["a", "b", "a"], "p")
    assert [str(o) for o in spaced] == [
        "KopfPeering 'p' in namespace 'a'",
        "KopfPeering 'p' in namespace 'b'",
    ]
    assert spaced[1].path == "apis/kopf.dev/v1/namespaces/b/kopfpeerings/p"
    assert '"namespace": "b"' in spaced[1].create_command
    assert [peering.is_pattern(n) for n in ("team-*", "!x", "a,b", "ab?", "plain")] == [
        True,
        True,
        True,
        True,
        False,
    ]


def test_peering_decision_logs_standalone_or_refuses_to_start(caplog):
    caplog.set_level(logging.INFO, logger="corefleet.operator.peering")
    assert peering.decide([], required=True) is True
    assert (
        peering.decide(["KopfPeering 'p' in namespace 'a' does not exist"], required=False) is False
    )
    warning = caplog.records[-1]
    assert warning.levelno == logging.WARNING and "running standalone" in warning.getMessage()
    with pytest.raises(SystemExit) as exit_info:
        peering.decide(["KopfPeering 'p' in namespace 'a' does not exist"], required=True)
    assert exit_info.value.code != 0
    assert caplog.records[-1].levelno == logging.ERROR
    assert "KopfPeering 'p' in namespace 'a'" in caplog.records[-1].getMessage()


def test_namespace_patterns_are_never_peered():
    check = peering.Preflight(namespaces=("team-*",), name="p")
    (problem,) = asyncio.run(check.problems())  # decided before any credentials are read
    assert "'team-*'" in problem and "--all-namespaces" in problem
