"""The ``corefleet`` command as a user runs it: a real subprocess on a tiny model."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures_models import write_tiny_llama

CLI = [sys.executable, "-m", "corefleet.engine.cli"]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("cli") / "m")


def _run(*args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, *args], input=stdin, capture_output=True, text=True, timeout=120, check=False
    )


def test_help_lists_vllm_flag_names() -> None:
    out = _run("generate", "--help")
    assert out.returncode == 0
    for flag in (
        "--max-num-seqs",
        "--max-model-len",
        "--dtype",
        "--kv-cache-memory",
        "--gpu-memory-utilization",
        "--enable-prefix-caching",
        "--max-tokens",
    ):
        assert flag in out.stdout


def test_generate_prints_the_completion(tiny_model: Path) -> None:
    args = ("--model", str(tiny_model), "--kv-cache-memory", str(8 << 20))
    out = _run("generate", "--prompt", "hello", "--max-tokens", "5", *args)
    assert out.returncode == 0, out.stderr
    assert "[5 tokens, finish_reason=length]" in out.stderr
    again = _run("generate", "--prompt", "hello", "--max-tokens", "5", *args)
    assert again.stdout == out.stdout  # greedy by default: deterministic


def test_chat_reads_stdin_until_eof(tiny_model: Path) -> None:
    args = ("--model", str(tiny_model), "--kv-cache-memory", str(8 << 20), "--max-tokens", "4")
    out = _run("chat", *args, stdin="hi there\nand again\n")
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("\n") >= 2  # one reply per user line


def test_bad_arguments_are_clear_errors(tiny_model: Path, tmp_path: Path) -> None:
    missing = _run("generate", "--prompt", "x", "--model", str(tmp_path / "nope"))
    assert missing.returncode == 2
    assert "nope" in missing.stderr and "Traceback" not in missing.stderr
    too_long = _run(
        "generate",
        "--prompt",
        "x " * 400,
        "--model",
        str(tiny_model),
        "--kv-cache-memory",
        str(8 << 20),
    )
    assert too_long.returncode == 2
    assert "maximum context length" in too_long.stderr
    bad_temp = _run(
        "generate",
        "--prompt",
        "x",
        "--temperature",
        "-1",
        "--model",
        str(tiny_model),
        "--kv-cache-memory",
        str(8 << 20),
    )
    assert bad_temp.returncode == 2 and "temperature" in bad_temp.stderr
