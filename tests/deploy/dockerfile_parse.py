"""The Dockerfile read as Docker reads it: instructions (continuations joined), global ARGs and
stages; for the static checks of tests/deploy/test_dockerfile.py and test_dockerignore.py."""

from __future__ import annotations

import re
from dataclasses import dataclass, field


@dataclass
class Instruction:
    line: int  # 1-based line of the keyword
    keyword: str  # upper case
    args: str  # continuation lines joined, comment lines inside them dropped


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[Instruction] = field(default_factory=list)

    def of(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]


def parse_instructions(text: str) -> list[Instruction]:
    """Instructions in order, with `\\` continuations joined as Docker joins them."""
    out: list[Instruction] = []
    pending: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), start=1):
        stripped = raw.strip()
        if stripped.startswith("#") or not stripped:
            # Comment lines (directives included) and blank lines; inside a continuation Docker
            # drops them too.
            continue
        if not pending:
            start = number
        if stripped.endswith("\\"):
            pending.append(stripped[:-1].strip())
            continue
        pending.append(stripped)
        joined = " ".join(pending)
        pending = []
        keyword, _, args = joined.partition(" ")
        out.append(Instruction(start, keyword.upper(), args.strip()))
    assert not pending, "the Dockerfile ends inside a line continuation"
    return out


def parse(text: str) -> tuple[dict[str, str | None], list[Stage]]:
    """Global ARGs (before the first FROM) with their defaults, and the stages."""
    global_args: dict[str, str | None] = {}
    stages: list[Stage] = []
    for inst in parse_instructions(text):
        if inst.keyword == "FROM":
            words = [w for w in inst.args.split() if not w.startswith("--")]
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
            assert len(words) in (1, 3), f"line {inst.line}: cannot read FROM {inst.args!r}"
            stages.append(Stage(base=words[0], name=name))
        elif not stages:
            assert inst.keyword == "ARG", f"line {inst.line}: only ARG may precede the first FROM"
            arg_name, eq, default = inst.args.partition("=")
            global_args[arg_name.strip()] = default.strip().strip("\"'") if eq else None
        else:
            stages[-1].instructions.append(inst)
    return global_args, stages


def commands(stage: Stage) -> list[str]:
    """Each shell command of the stage's RUN lines (split on && ; and ||)."""
    out: list[str] = []
    for inst in stage.of("RUN"):
        body = re.sub(r"--mount=\S+", "", inst.args)
        out += [c.strip() for c in re.split(r"&&|\|\||;", body) if c.strip()]
    return out


def pip_installs(stage: Stage) -> list[str]:
    return [c for c in commands(stage) if re.search(r"\bpip3?\s+install\b", c)]
