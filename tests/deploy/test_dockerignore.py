"""The build context: .dockerignore keeps local state out, and every file the Dockerfile reads
from the context is in the repository and not ignored."""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

from tests.deploy.dockerfile_parse import parse
from tests.deploy.tools import REPO

DOCKERIGNORE = REPO / ".dockerignore"


def dockerignore_patterns() -> list[str]:
    lines = [ln.strip() for ln in DOCKERIGNORE.read_text().splitlines()]
    return [ln for ln in lines if ln and not ln.startswith("#")]


def ignored_by_dockerignore(path: str, patterns: list[str]) -> bool:
    """Close enough to Docker's matcher for this file: the last matching pattern wins, a pattern
    that matches a folder excludes everything below it, and `**/x` matches x at any depth."""
    parts = Path(path).parts
    prefixes = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    excluded = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        glob = pattern.lstrip("!").strip("/")
        if glob.startswith("**/"):
            tail = glob.removeprefix("**/")
            hit = any(fnmatch.fnmatchcase(part, tail) for part in parts)
        else:
            hit = any(fnmatch.fnmatchcase(prefix, glob) for prefix in prefixes)
        if hit:
            excluded = not negate
    return excluded


def test_dockerignore_excludes_local_state():
    patterns = dockerignore_patterns()
    local = (".venv", ".git", ".venv/bin/python", ".mypy_cache", "engine/__pycache__", "build")
    # An in-place build of the C++ CPU ops (editable install): the builder compiles its own.
    for path in (*local, "kernels/cpu/_ops_avx2_0123456789.so"):
        assert ignored_by_dockerignore(path, patterns), f"{path} would be sent to the builder"


def test_context_files_the_dockerfile_reads_exist_and_are_not_ignored():
    _, all_stages = parse((REPO / "Dockerfile").read_text())
    sources: list[str] = []
    for stage in all_stages:
        for inst in stage.of("COPY") + stage.of("ADD"):
            words = [w for w in inst.args.split() if not w.startswith("--")]
            if "--from=" not in inst.args:
                sources += words[:-1]
        for inst in stage.of("RUN"):
            for mount in re.findall(r"--mount=(\S+)", inst.args):
                opts = dict(kv.partition("=")[::2] for kv in mount.split(","))
                if opts.get("type") == "bind" and "from" not in opts:
                    sources.append(opts["source"])
    assert sources
    patterns = dockerignore_patterns()
    for source in sources:
        path = source.rstrip("/")
        assert (REPO / path).exists(), f"{source} is not in the repository"
        assert not ignored_by_dockerignore(path, patterns), f".dockerignore drops {source}"
