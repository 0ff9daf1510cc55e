"""``python -m strata_operator.kubectl``: the ``kubectl-strata`` plugin."""

import sys

from strata_operator.kubectl import main

sys.exit(main())
