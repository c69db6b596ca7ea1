"""`python -m flashtile ...`: see flashtile.cli."""

import sys

from .cli import main

sys.exit(main())
