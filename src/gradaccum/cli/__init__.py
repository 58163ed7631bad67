"""The command line: one module per subcommand (``cmd_*.py``), the only code that prints."""
