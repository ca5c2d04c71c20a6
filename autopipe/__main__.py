"""``python -m autopipe``: runs the command line (see :mod:`autopipe.cli`)."""

from autopipe.cli import main

raise SystemExit(main())
