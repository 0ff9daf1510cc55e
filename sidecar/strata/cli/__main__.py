"""``python -m strata.cli``: the ``strata`` console script."""

import sys

from strata.cli import main

sys.exit(main())
