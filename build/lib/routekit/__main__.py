"""`python -m routekit`: the same command line as the `routekit` script."""

import sys

from .cli import main

sys.exit(main())
