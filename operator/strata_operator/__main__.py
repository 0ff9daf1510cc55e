"""``python -m strata_operator [flags]``: run the operator (see ``strata_operator.main``)."""

from strata_operator.main import run

raise SystemExit(run())
