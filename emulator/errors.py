"""The one error type the CLI turns into a one-line message and exit code 2."""


class UsageError(ValueError):
    """Bad user input: a flag, a config value, a file, a dataset path."""
