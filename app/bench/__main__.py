"""`python -m app.bench`: the bench command without the rest of the CLI."""

import sys

from . import main

sys.exit(main())
