"""``python -m gradaccum``: the same as the ``gradaccum`` command."""

from gradaccum.cli.main import entry

entry()
