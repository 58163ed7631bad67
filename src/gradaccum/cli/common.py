"""What the subcommands share, in one place to import from: exit codes
(:mod:`~gradaccum.cli.exitcodes`), the console, tables and findings (:mod:`~gradaccum.cli.console`),
argument types and shared options (:mod:`~gradaccum.cli.options`), and memory checks and the launcher
(:mod:`~gradaccum.cli.launching`). Nothing imported here loads torch, so ``gradaccum --help``,
``gradaccum CMD --help`` and ``gradaccum plan`` start without importing torch.
"""

from __future__ import annotations

from gradaccum.cli import console as _console
from gradaccum.cli import exitcodes as _exitcodes
from gradaccum.cli import launching as _launching
from gradaccum.cli import options as _options
from gradaccum.cli.console import *  # noqa: F403  (re-exported: each module's __all__ is the list)
from gradaccum.cli.exitcodes import *  # noqa: F403
from gradaccum.cli.launching import *  # noqa: F403
from gradaccum.cli.options import *  # noqa: F403
from gradaccum.names import DEFAULT_WORKLOAD

__all__ = ["DEFAULT_WORKLOAD"]
__all__ += _console.__all__
__all__ += _exitcodes.__all__
__all__ += _launching.__all__
__all__ += _options.__all__
