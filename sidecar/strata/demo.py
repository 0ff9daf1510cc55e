"""``python -m strata.demo``: the demo lives in :mod:`strata.testing.demo` (demo support, off
the runtime import path); this module only keeps the documented command working."""

from __future__ import annotations

if __name__ == "__main__":
    import sys

    from strata.testing.demo import main

    sys.exit(main())
