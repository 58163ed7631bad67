"""``python -m gradaccum``: the same as the ``gradaccum`` command."""

from gradaccum.cli.main import main

raise SystemExit(main())
