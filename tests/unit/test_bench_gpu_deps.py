"""bench/gpu_deps.py: the dependency list the venv-less GPU run installs is exactly what Strata's
client imports beyond the stdlib and torch, and a wheel of each is carried for Python 3.10-3.12."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from bench import gpu_deps

REPO = Path(__file__).resolve().parents[2]

# What importing torch (and its distributed/DTensor parts) brings, lazily or not.
TORCH_BRINGS = {"torch", "numpy", "sympy", "mpmath", "triton", "bench", "strata"}

PROBE = """
import sys
import torch, torch.distributed, torch.distributed.checkpoint, torch.distributed.tensor
before = set(sys.modules)
from bench import gpu
gpu.main(["--cpu-smoke"])
import strata.client
mods = {m.split(".")[0] for m in set(sys.modules) - before}
print("MODS", " ".join(sorted(m for m in mods - set(sys.stdlib_module_names)
                              if not m.startswith("_cython"))))
"""


def test_the_list_is_what_the_client_and_a_round_trip_import() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    line = next(x for x in proc.stdout.splitlines() if x.startswith("MODS "))
    imported = set(line.split()[1:]) - TORCH_BRINGS
    # typing_extensions is imported by torch already, so it never shows up as new; pydantic
    # needs a recent one
    assert imported == set(gpu_deps.DEPS) - {"typing_extensions"}


def test_a_wheel_of_every_dependency_is_carried_for_each_python() -> None:
    wheels = REPO / "bench" / "wheels"
    for minor in (10, 11, 12):
        tag = f"-cp3{minor}-"
        for mod, (prefix, _) in gpu_deps.DEPS.items():
            found = [
                w.name
                for w in wheels.glob(f"{prefix}-*.whl")
                if tag in w.name or "-py3-none-any" in w.name
            ]
            assert len(found) == 1, (mod, minor, found)


def test_the_carried_wheels_stay_small() -> None:
    total = sum(w.stat().st_size for w in (REPO / "bench" / "wheels").glob("*.whl"))
    assert total < 15 * 2**20, total
