"""`python -m specdec.cli ARGS`: the `specdec` command."""

import sys

from . import main

sys.exit(main())
