"""bench/gpu_run.sh on a machine like the device machine: a Python that has torch (and what torch
requires) but none of Strata's own dependencies, no venv of the project, only the working tree.

The stand-in is a fresh venv whose site-packages hold links to torch's distributions from this
project's environment and nothing else; the script must install the carried wheels it lacks into
a temporary ``--target`` directory, import the client and pass the bit-exact round trip on CPU
(with the DTensor case on a 1-rank gloo mesh), leaving the interpreter's own site-packages
untouched."""

from __future__ import annotations

import importlib.metadata as md
import os
import subprocess
import venv
from pathlib import Path

import pytest
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[2]


def _torch_closure() -> list[md.Distribution]:
    """torch's distribution and every distribution it requires on this platform, recursively
    (markers evaluated, extras not taken)."""
    seen: dict[str, md.Distribution] = {}
    todo = ["torch"]
    while todo:
        name = todo.pop()
        key = name.lower().replace("_", "-")
        if key in seen:
            continue
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue  # an optional requirement this environment does not have
        seen[key] = dist
        for spec in dist.requires or []:
            req = Requirement(spec)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return list(seen.values())


def _device_like_python(root: Path) -> Path:
    """A venv at ``root`` whose site-packages link torch's closure and nothing more."""
    venv.EnvBuilder(with_pip=True, symlinks=True).create(root)
    site = next((root / "lib").glob("python3*/site-packages"))
    for dist in _torch_closure():
        tops = {Path(str(f)).parts[0] for f in dist.files or []}
        for top in tops:
            src = Path(str(dist.locate_file(top)))
            dst = site / top
            if top.endswith(".pth") or top == ".." or dst.exists() or not src.exists():
                continue
            dst.symlink_to(src)
    return root / "bin" / "python"


@pytest.mark.timeout(900)
def test_the_one_call_script_runs_on_a_python_with_torch_and_nothing_else(
    tmp_path: Path,
) -> None:
    python = _device_like_python(tmp_path / "py")
    lacks = subprocess.run(
        [python, "-c", "import pydantic"], capture_output=True, text=True, timeout=60
    )
    assert lacks.returncode != 0, "the stand-in must lack Strata's dependencies"
    has = subprocess.run(
        [
            python,
            "-c",
            "import torch, torch.distributed; print(torch.distributed.is_gloo_available())",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert has.returncode == 0 and has.stdout.strip() == "True", has.stderr

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(PYTHON=str(python), TMPDIR=str(tmp_path))
    proc = subprocess.run(
        ["bash", "bench/gpu_run.sh", "--cpu-smoke"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=800,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "installing into" in out and "pydantic" in out, out[-4000:]
    assert '"ok": true' in out and '"dtensor": true' in out, out[-4000:]
    # nothing went into the interpreter's own site-packages, and the temporary target is gone
    after = subprocess.run(
        [python, "-c", "import pydantic"], capture_output=True, text=True, timeout=60
    )
    assert after.returncode != 0
    assert not list(tmp_path.glob("strata-gpu-site.*"))
