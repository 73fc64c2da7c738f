"""`python -m areno.cli`."""

import sys

from areno.cli import main

sys.exit(main())
