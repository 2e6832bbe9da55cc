"""The command line's one error: bad input, reported by :func:`.cli.main` as ``error: ...`` on
stderr with exit code 2."""


class CliError(Exception):
    """Bad command-line or config-file input (reported as exit code 2)."""
