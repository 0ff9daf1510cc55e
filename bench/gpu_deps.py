"""What the device bench needs beyond the stdlib and torch, and how to get it without a venv.

``python3 -m bench.gpu_deps --wheels bench/wheels --target DIR`` prints the wheel files of
:data:`DEPS` that this interpreter lacks (or has too old), one a line, picked for its Python
version; ``bench/gpu_run.sh`` installs exactly those with ``pip install --no-index --no-deps
--target DIR``. Stdlib only: it runs before any dependency is there.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import re
import sys
from pathlib import Path

DEPS: dict[str, tuple[str, str]] = {
    "pydantic": ("pydantic", "2.7"),
    "pydantic_core": ("pydantic_core", "2.0"),
    "annotated_types": ("annotated_types", "0.6"),
    "typing_inspection": ("typing_inspection", "0.4.4"),
    "typing_extensions": ("typing_extensions", "4.16"),
    "google_crc32c": ("google_crc32c", "1.5"),
    "tenacity": ("tenacity", "8.3"),
}
"""Import name -> (wheel name prefix, lowest version that will do): every third-party module
``import strata.client`` and a save/restore import, beyond torch (and numpy, sympy, triton,
which torch brings). pydantic and pydantic_core are installed as a pair (the carried
pydantic requires its pydantic_core exactly)."""


def _version(s: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", s)[:3])


def missing() -> list[str]:
    """Import names of :data:`DEPS` whose distribution is absent or older than required."""
    out = []
    for mod, (dist, low) in DEPS.items():
        try:
            have = md.version(dist.replace("_", "-"))
        except md.PackageNotFoundError:
            out.append(mod)
            continue
        if _version(have) < _version(low):
            out.append(mod)
    if "pydantic" in out or "pydantic_core" in out:  # a matched pair or nothing
        out = sorted(set(out) | {"pydantic", "pydantic_core"})
    return out


def wheels_for(mods: list[str], wheels: Path) -> list[Path]:
    """The carried wheel of each module, for this Python (cpXY or py3); raises SystemExit
    with a "Strata:" message when one is not carried."""
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    picked = []
    for mod in mods:
        prefix = DEPS[mod][0]
        cands = [
            w
            for w in sorted(wheels.glob(f"{prefix}-*.whl"))
            if f"-{tag}-" in w.name or "-py3-none-any" in w.name
        ]
        if not cands:
            raise SystemExit(
                f"Strata: no wheel of {prefix} for Python {tag} in {wheels}; fetch one with "
                f"pip download --only-binary=:all: --python-version "
                f"{sys.version_info.major}.{sys.version_info.minor} -d {wheels} {prefix}"
            )
        picked.append(cands[-1])
    return picked


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m bench.gpu_deps")
    ap.add_argument("--wheels", type=Path, default=Path(__file__).resolve().parent / "wheels")
    ap.add_argument("--all", action="store_true", help="every dependency, present or not")
    args = ap.parse_args(argv)
    for w in wheels_for(list(DEPS) if args.all else missing(), args.wheels):
        print(w)
    return 0


if __name__ == "__main__":
    sys.exit(main())
