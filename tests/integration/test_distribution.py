"""The package a user installs: built as `make dist` builds it, installed into a fresh venv.

Strata is published as ``strata-checkpoint`` because ``strata`` on PyPI is an unrelated project;
the import name stays ``strata``. These tests build the wheel and sdist from this tree (no
network: ``--no-isolation`` uses the venv's setuptools), install the wheel into a new venv with
``--no-deps --no-index`` (its runtime dependencies come from this venv's site-packages through a
``.pth`` line, appended after the venv's own site-packages), and run the console scripts there,
so a wrong distribution name, a missing entry point or a module left out of the wheel fails.
"""

from __future__ import annotations

import email.parser
import os
import re
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path

import pytest

import strata

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
DIST_NAME = "strata-checkpoint"


def _clean_env() -> dict[str, str]:
    """The environment without PYTHONPATH (which would point at this source tree)."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}


@pytest.fixture(scope="module")
def dist_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    # The same command as `make dist`.
    subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(ROOT)],
        check=True,
        capture_output=True,
        cwd=ROOT,
        env=_clean_env(),
        timeout=300,
    )
    return out


def _wheel(dist_dir: Path) -> Path:
    wheels = sorted(dist_dir.glob("*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def test_the_distribution_is_named_strata_checkpoint_and_versions_agree(dist_dir: Path) -> None:
    wheel = _wheel(dist_dir)
    assert wheel.name == f"strata_checkpoint-{strata.__version__}-py3-none-any.whl"
    sdists = sorted(dist_dir.glob("*.tar.gz"))
    assert [s.name for s in sdists] == [f"strata_checkpoint-{strata.__version__}.tar.gz"]
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        meta_name = next(n for n in names if n.endswith(".dist-info/METADATA"))
        meta = email.parser.Parser().parsestr(z.read(meta_name).decode())
        top = next(n for n in names if n.endswith(".dist-info/top_level.txt"))
        top_level = set(z.read(top).decode().split())
    assert meta["Name"] == DIST_NAME
    assert meta["Version"] == strata.__version__
    assert meta["License-Expression"] == "Apache-2.0"
    # The import names: strata (trainer, sidecar, CLI) and strata_operator; nothing else.
    assert top_level == {"strata", "strata_operator"}
    # Every subpackage ships, the integrations included.
    assert "strata/integrations/__init__.py" in names
    assert "strata/dcp/storage.py" in names
    # One version for the package, pyproject and the chart's appVersion.
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert pyproject["project"]["name"] == DIST_NAME
    assert pyproject["project"]["version"] == strata.__version__
    chart = (ROOT / "charts/strata/Chart.yaml").read_text()
    app = re.search(r'^appVersion:\s*"?([^"\s]+)"?', chart, re.M)
    assert app is not None and app.group(1) == strata.__version__


def test_the_dev_extra_and_docs_name_the_new_distribution() -> None:
    """`pip install strata[...]` would install the unrelated PyPI project: no doc may say it."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    dev = pyproject["project"]["optional-dependencies"]["dev"]
    assert any(d.startswith(f"{DIST_NAME}[") for d in dev)
    offenders = []
    docs = [ROOT / "README.md", ROOT / "examples/Dockerfile", *sorted(ROOT.glob("docs/*.md"))]
    # Error messages that tell the user what to install, too.
    for path in [*docs, *sorted((ROOT / "sidecar" / "strata").rglob("*.py"))]:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"pip install[^\n`]*[\s'\"`]strata(\[|\s|$|['\"`])", line):
                offenders.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not offenders, offenders


def test_the_wheel_installs_into_a_fresh_venv_and_its_cli_runs(
    dist_dir: Path, tmp_path: Path
) -> None:
    venv = tmp_path / "venv"
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120
    )
    py = venv / "bin" / "python"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(py),
            "install",
            "-q",
            "--no-deps",
            "--no-index",
            str(_wheel(dist_dir)),
        ],
        check=True,
        env=_clean_env(),
        timeout=300,
    )
    # Runtime dependencies (pydantic, google-crc32c, ...) from this venv, after the wheel's own.
    site = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
        env=_clean_env(),
    ).stdout.strip()
    (Path(site) / "zz_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")

    env = _clean_env()
    help_out = subprocess.run(
        [str(venv / "bin" / "strata"), "--help"],
        check=True,
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    ).stdout
    assert "sidecar" in help_out and "version" in help_out
    version = subprocess.run(
        [str(venv / "bin" / "strata"), "version"],
        check=True,
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    ).stdout
    assert version.strip() == f"strata {strata.__version__}"
    # The import name `strata` resolves to this wheel (not a source tree, not PyPI's `strata`),
    # and the installed distribution that provides it is strata-checkpoint.
    probe = subprocess.run(
        [
            str(py),
            "-c",
            "import importlib.metadata as md, strata, strata.integrations; "
            "print(strata.__file__); print(md.packages_distributions()['strata']); "
            "print(md.version('strata-checkpoint'))",
        ],
        check=True,
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    ).stdout.splitlines()
    assert Path(probe[0]).is_relative_to(venv), probe
    # (The dependency path may also hold a development install of this tree: listed after it.)
    assert probe[1].startswith("['strata-checkpoint'"), probe
    assert probe[2] == strata.__version__
